"""Counter-based random numbers shared by every sampling kernel and its PyTorch reference.

A uniform is a pure function of (seed, counter, index): no generator state, so a request's
random numbers depend on its own seed and step counter only, never on which other requests
share the batch, and the Triton kernels and the PyTorch references draw bit-identical values.

Layout used by the verification kernels (one row = one request):
    counter = row_offset + position      position in the draft (0..k)
    index   = 0                          the accept / reject uniform of that position
    index   = 1 + token_id               the Gumbel noise of that vocabulary entry
A caller that needs several independent streams for one request (cascade levels, tree
stages) derives one seed per stream with `stream_seed`.
"""
import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF


@triton.jit
def _mix32(h):
    # "lowbias32" integer hash (C. Wellons): full avalanche in 5 operations on uint32.
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def uniform(seed, counter, index):
    """uint32 seed, counter, index (scalars or blocks) -> float32 uniform in (0, 1).
    23 bits, so `(bits + 0.5) * 2^-23` is exact in fp32 and never rounds to 0 or 1
    (a 1.0 would make the Gumbel noise infinite)."""
    h = _mix32(seed.to(tl.uint32) + 0x9E3779B9)
    h = _mix32(h ^ counter.to(tl.uint32))
    h = _mix32(h ^ index.to(tl.uint32))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def gumbel(seed, counter, index):
    return -tl.log(-tl.log(uniform(seed, counter, index)))


def _mix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & MASK32
    return h ^ (h >> 16)


def uniform_ref(seed, counter, index) -> torch.Tensor:
    """PyTorch twin of `uniform`: int64 tensors (broadcastable) -> float32 in (0, 1)."""
    seed, counter, index = (torch.as_tensor(t, dtype=torch.int64) & MASK32 for t in (seed, counter, index))
    h = _mix32_ref((seed + 0x9E3779B9) & MASK32)
    h = _mix32_ref(h ^ counter)
    h = _mix32_ref(h ^ index)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_ref(seed, counter, index) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_ref(seed, counter, index)))


def fold_seed(seed: int) -> int:
    """A request's seed (up to 64 bits) as the 32-bit seed `uniform` takes: itself below 2**32,
    else its low half mixed with the hash of its high half, so that seeds differing only above
    bit 31 draw different numbers (plain truncation would give 1 and 2**32 + 1 one stream). The
    streams are 32-bit: each 64-bit seed shares its stream with one below 2**32 (and may with
    another seed's derived stream), as any two seeds do with chance 2**-32."""
    low, high = seed & MASK32, seed >> 32
    return low if high == 0 else _mix32_ref(low ^ _mix32_ref((high * 0x85EBCA6B) & MASK32))


def stream_seed(seed: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """An independent seed per (request seed, stream id); stream 0 is the seed itself.
    `stream` is one id for every row or a [B] tensor of per-row ids (a row's own count of
    something, so that its random numbers never depend on the other rows)."""
    if isinstance(stream, int):
        if stream == 0:
            return seed
        stream = torch.full_like(seed, stream, dtype=torch.int64)  # made on seed's device: no copy, no sync
    s = torch.as_tensor(seed, dtype=torch.int64) & MASK32
    mixed = _mix32_ref(s ^ _mix32_ref((stream.to(device=s.device, dtype=torch.int64) * 0x632BE5AB) & MASK32))
    return torch.where(stream.to(s.device) == 0, seed, mixed)
