"""round_to (kernels/rounding.py) rounds fp32 to bf16 as PyTorch does, bit for bit: ties to even,
carries into the exponent, infinities, and NaNs, including the canonical NaN a GPU makes
(0x7FFFFFFF, whose rounding carry would otherwise turn it into -0.0 and hide an overflow)."""
import torch
import triton
import triton.language as tl

from csd_engine.kernels.rounding import round_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs, mask=offs < n), tl.bfloat16), mask=offs < n)


def test_rounds_to_bfloat16_as_torch_does():
    special = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF,
               0x3F808000, 0x3F818000, 0x3F808001, 0x00000001, 0x80000000]  # NaNs, infs, max, ties, tiny, -0
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in special], dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(500, generator=torch.Generator().manual_seed(0)) * 1e3])
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x.to(DEVICE), y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16)
    got = y.cpu()
    assert torch.equal(got.isnan(), want.isnan()), f"NaNs: {x[got.isnan() != want.isnan()].view(torch.int32)}"
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
