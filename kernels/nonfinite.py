"""Flag the rows of a forward's logits that hold a NaN or an infinity, in one launch, with its
PyTorch reference.

flags[b] |= any(not isfinite(logits[b, j, v]) for every position j used and token v): so that
the engine can fail a request whose model produced non-finite logits instead of emitting tokens
drawn from them (its step reads the flags with its tokens). Drafters flag every position of a
forward (runners do, per call); the target only the positions its emitted tokens were drawn
from (`positions`, `counts`: the verification helpers), as plain decoding would have computed
them: a rejected draft's continuation or a padding slot with non-finite logits fails nothing.
Only ever sets flags, so programs of one row may store concurrently.

Why a kernel: the reference (isfinite, all, not, or) is four launches and writes a bool copy of
the logits; here (row, position, vocabulary block) programs read the logits once.
"""
import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _nonfinite_kernel(logits_ptr, stride_b, stride_n, flags_ptr, positions_ptr, stride_pb, counts_ptr, V,
                      HAS_POSITIONS: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    used = True
    if HAS_COUNTS:
        used = j < tl.load(counts_ptr + row)
    position = j
    if HAS_POSITIONS:
        position = tl.load(positions_ptr + row * stride_pb + j).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_b + position * stride_n + offs, mask=(offs < V) & used,
                other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    found = tl.max(bad.to(tl.int32), 0)
    tl.store(flags_ptr + row, found.to(tl.uint8), mask=found > 0)


def _check(logits, flags, positions, counts):
    if logits.dim() != 3 or flags.shape != (logits.shape[0],) or flags.dtype != torch.bool:
        raise ValueError(f"flag_nonfinite: logits must be [B, n, V] and flags [B] bool, got logits "
                         f"{tuple(logits.shape)} and flags {flags.dtype} {tuple(flags.shape)}")
    if positions is not None and (positions.dim() != 2 or positions.shape[0] != logits.shape[0]):
        raise ValueError(f"flag_nonfinite: positions must be [B, m], got {tuple(positions.shape)}")
    if counts is not None and counts.shape != (logits.shape[0],):
        raise ValueError(f"flag_nonfinite: counts must be [B], got {tuple(counts.shape)}")


def flag_nonfinite(logits: torch.Tensor, flags: torch.Tensor, positions: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None) -> None:
    """flags [B] bool |= the rows of logits [B, n, V] holding a non-finite value at a position
    used: positions[b, j] ([B, m] int64; default j) for j < counts[b] ([B]; default every j)."""
    _check(logits, flags, positions, counts)
    if not flags.is_contiguous():
        raise ValueError("flag_nonfinite: flags must be contiguous (they are stored to in place)")
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    batch, n, vocab = logits.shape
    m = n if positions is None else positions.shape[1]
    if positions is not None and positions.stride(1) != 1:
        positions = positions.contiguous()
    counts = None if counts is None else counts.contiguous()
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    _nonfinite_kernel[(batch, m, triton.cdiv(vocab, block))](
        logits, logits.stride(0), logits.stride(1), flags.view(torch.uint8),
        flags if positions is None else positions, 0 if positions is None else positions.stride(0),
        flags if counts is None else counts, vocab,
        HAS_POSITIONS=positions is not None, HAS_COUNTS=counts is not None, BLOCK=block)


def flag_nonfinite_ref(logits: torch.Tensor, flags: torch.Tensor, positions: torch.Tensor | None = None,
                       counts: torch.Tensor | None = None) -> None:
    """The same in tensor ops (the CPU path)."""
    _check(logits, flags, positions, counts)
    bad = ~torch.isfinite(logits).all(-1)  # [B, n]
    if positions is not None:
        bad = bad.gather(1, positions)
    if counts is not None:
        bad &= torch.arange(bad.shape[1], device=bad.device)[None, :] < counts[:, None]
    flags |= bad.any(1)
