"""Flag the rows of a forward's logits that hold a NaN or an infinity, in one launch, with its
PyTorch reference.

flags[b] |= any(not isfinite(logits[b, j, v]) for every position j and token v): what the
runners accumulate per forward so that the engine can fail a request whose model produced
non-finite logits instead of emitting tokens drawn from them (its step reads the flags with
its tokens). Only ever sets flags, so programs of one row may store concurrently.

Why a kernel: the reference (isfinite, all, not, or) is four launches and writes a bool copy of
the logits; here (row, position, vocabulary block) programs read the logits once.
"""
import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _nonfinite_kernel(logits_ptr, stride_b, stride_n, flags_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_b + position * stride_n + offs, mask=offs < V, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    found = tl.max(bad.to(tl.int32), 0)
    tl.store(flags_ptr + row, found.to(tl.uint8), mask=found > 0)


def flag_nonfinite(logits: torch.Tensor, flags: torch.Tensor) -> None:
    """flags [B] bool |= the rows of logits [B, n, V] holding a non-finite value."""
    if logits.dim() != 3 or flags.shape != (logits.shape[0],) or flags.dtype != torch.bool:
        raise ValueError(f"flag_nonfinite: logits must be [B, n, V] and flags [B] bool, got logits "
                         f"{tuple(logits.shape)} and flags {flags.dtype} {tuple(flags.shape)}")
    if not flags.is_contiguous():
        raise ValueError("flag_nonfinite: flags must be contiguous (they are stored to in place)")
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    batch, n, vocab = logits.shape
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    _nonfinite_kernel[(batch, n, triton.cdiv(vocab, block))](logits, logits.stride(0), logits.stride(1),
                                                             flags.view(torch.uint8), vocab, BLOCK=block)


def flag_nonfinite_ref(logits: torch.Tensor, flags: torch.Tensor) -> None:
    """The same in tensor ops (the CPU path)."""
    flags |= ~torch.isfinite(logits).flatten(1).all(1)
