"""A step's commit for every row in one launch, with its PyTorch reference.

Per row b with n = counts[b] if active[b] else 0 (the row's emitted tokens e[b, :n]):
* tokens[b, committed[b] : committed[b] + n] = [pending[b], e[b, 0], ..., e[b, n - 2]];
* pending[b] = e[b, max(counts[b] - 1, 0)] where active[b] (else unchanged);
* committed[b] += n;
* tokens[b, committed[b]] = pending[b]: the pending token also sits after the committed prefix,
  so a MaG query over tokens[:committed + 1] ends with it.
The last column of `tokens` is scratch (positions clamp there): what lands in it is undefined.

Why a kernel: the reference is ~15 small tensor ops, each a launch that every step graph replays;
here one program per row does it. Shapes only: capturable in a CUDA graph.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _commit_kernel(tokens_ptr, stride_t, committed_ptr, pending_ptr, emitted_ptr, stride_e, counts_ptr, active_ptr,
                   W, M, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(active_ptr + row) != 0
    counts = tl.load(counts_ptr + row)
    n = tl.where(active, counts, 0)
    start = tl.load(committed_ptr + row)
    pending = tl.load(pending_ptr + row)
    col = tl.arange(0, BLOCK)
    # the block [pending, e_0, ..., e_{M-1}]: column c > 0 holds e_{c-1}
    previous = tl.load(emitted_ptr + row * stride_e + col - 1, mask=(col > 0) & (col <= M), other=0)
    block = tl.where(col == 0, pending, previous)
    where = start + col
    tl.store(tokens_ptr + row * stride_t + where, block, mask=(col < n) & (where < W - 1))
    last = tl.load(emitted_ptr + row * stride_e + tl.maximum(counts - 1, 0))
    pending = tl.where(active, last, pending)
    end = start + n
    tl.store(pending_ptr + row, pending)
    tl.store(committed_ptr + row, end)
    tl.store(tokens_ptr + row * stride_t + tl.minimum(end, W - 1), pending)


def check_inputs(tokens, committed, pending, emitted, counts, active) -> None:
    batch = tokens.shape[0]
    for name, t, dtype, dims in (("tokens", tokens, torch.int64, 2), ("committed", committed, torch.int64, 1),
                                 ("pending", pending, torch.int64, 1), ("emitted", emitted, torch.int64, 2),
                                 ("counts", counts, torch.int64, 1), ("active", active, torch.bool, 1)):
        if t.dtype != dtype or t.dim() != dims or t.shape[0] != batch:
            raise ValueError(f"commit: {name} must be {dtype} with {dims} dims and {batch} rows (tokens' batch), "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    if emitted.shape[1] < 1:
        raise ValueError("commit: emitted must hold at least one column (every active row emits >= 1 token)")


def commit(tokens: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor, emitted: torch.Tensor,
           counts: torch.Tensor, active: torch.Tensor) -> None:
    """In place on tokens [B, W] (contiguous rows), committed [B] and pending [B] (contiguous),
    all int64, given emitted [B, M] int64, counts [B] int64 and active [B] bool."""
    check_inputs(tokens, committed, pending, emitted, counts, active)
    if tokens.stride(1) != 1 or not (committed.is_contiguous() and pending.is_contiguous()):
        raise ValueError("commit: tokens needs contiguous rows, committed and pending must be contiguous (written in place)")
    emitted = emitted if emitted.stride(1) == 1 else emitted.contiguous()
    batch, m = emitted.shape
    _commit_kernel[(batch,)](tokens, tokens.stride(0), committed, pending, emitted, emitted.stride(0),
                             counts.contiguous(), active.contiguous().view(torch.uint8), tokens.shape[1], m,
                             BLOCK=triton.next_power_of_2(m + 1))


def commit_ref(tokens: torch.Tensor, committed: torch.Tensor, pending: torch.Tensor, emitted: torch.Tensor,
               counts: torch.Tensor, active: torch.Tensor) -> None:
    """The same in tensor ops (the CPU path)."""
    n = counts * active
    block = torch.cat([pending[:, None], emitted], dim=1)
    width = tokens.shape[1]
    col = torch.arange(block.shape[1], device=block.device)[None, :]
    cols = torch.where(col < n[:, None], committed[:, None] + col, width - 1)  # not kept: the scratch column
    tokens.scatter_(1, cols.clamp(max=width - 1), block)
    last = emitted.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    pending.copy_(torch.where(active, last, pending))
    committed += n
    tokens.scatter_(1, committed[:, None].clamp(max=width - 1), pending[:, None])
