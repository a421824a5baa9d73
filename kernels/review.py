"""A cascade review's bookkeeping for every row in one launch, with its PyTorch reference.

After a drafter has verified the tokens [mark, mark + drafted) its sub-cascade proposed and
accepted `accepted` of them (rows not in `need` reviewed nothing: accepted = drafted = 0), per row b:
* end = mark + accepted (the correction / bonus slot), new_mark = end + need;
* the drafter's cache keeps new_mark - 1 slots (it was fed at least that far);
* its review counters add accepted and drafted;
* at = end where need, else `scratch` (a column past any cache, whose content is undefined);
* with `token` given: tokens[b, at] = token[b] (the greedy path, whose accepted drafts are in
  place already).
Returns (new_mark, at), [B] int64 each.

Why a kernel: the reference is 7-8 small tensor ops per review, and a cascade step reviews
several times, each op a launch that its step graph replays. Shapes only: capturable.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _review_kernel(mark_ptr, accepted_ptr, drafted_ptr, need_ptr, cache_ptr, level_accepted_ptr, level_drafted_ptr,
                   token_ptr, tokens_ptr, stride_t, new_mark_ptr, at_ptr, scratch, WRITE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    accepted = tl.load(accepted_ptr + row)
    need = tl.load(need_ptr + row) != 0
    end = tl.load(mark_ptr + row) + accepted
    new_mark = end + need.to(tl.int64)
    tl.store(cache_ptr + row, new_mark - 1)
    tl.store(level_accepted_ptr + row, tl.load(level_accepted_ptr + row) + accepted)
    tl.store(level_drafted_ptr + row, tl.load(level_drafted_ptr + row) + tl.load(drafted_ptr + row))
    at = tl.where(need, end, scratch)
    if WRITE:
        tl.store(tokens_ptr + row * stride_t + at, tl.load(token_ptr + row))
    tl.store(new_mark_ptr + row, new_mark)
    tl.store(at_ptr + row, at)


def _check(scratch, mark, accepted, drafted, need, cache_lengths, level_accepted, level_drafted, token, tokens):
    if isinstance(scratch, bool) or not isinstance(scratch, int):
        raise TypeError(f"review bookkeeping: scratch must be a host int (a column index), got {type(scratch).__name__}")
    batch = mark.shape[0]
    named = (("mark", mark), ("accepted", accepted), ("drafted", drafted), ("cache_lengths", cache_lengths),
             ("level_accepted", level_accepted), ("level_drafted", level_drafted)) + ((("token", token),) if token is not None else ())
    for name, t in named + (("need", need),):
        want = torch.bool if name == "need" else torch.int64
        if t.dtype != want or t.shape != (batch,):
            raise ValueError(f"review bookkeeping: {name} must be {want} of shape ({batch},), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if tokens.dtype != torch.int64 or tokens.dim() != 2 or tokens.shape[0] != batch or tokens.stride(1) != 1:
        raise ValueError(f"review bookkeeping: tokens must be int64 [{batch}, C] with contiguous rows, got "
                         f"{tokens.dtype} {tuple(tokens.shape)} strides {tokens.stride()}")


def review_bookkeeping(mark, accepted, drafted, need, cache_lengths, level_accepted, level_drafted, tokens, scratch: int,
                       token=None):
    """In place on cache_lengths, level_accepted, level_drafted (contiguous [B] int64) and, with
    `token`, tokens [B, C]; returns (new_mark, at)."""
    _check(scratch, mark, accepted, drafted, need, cache_lengths, level_accepted, level_drafted, token, tokens)
    for name, t in (("cache_lengths", cache_lengths), ("level_accepted", level_accepted),
                    ("level_drafted", level_drafted)):
        if not t.is_contiguous():
            raise ValueError(f"review bookkeeping: {name} is written in place and must be contiguous")
    new_mark, at = torch.empty_like(mark), torch.empty_like(mark)
    write = token is not None
    _review_kernel[(mark.shape[0],)](mark.contiguous(), accepted.contiguous(), drafted.contiguous(),
                                     need.contiguous().view(torch.uint8), cache_lengths, level_accepted,
                                     level_drafted, token.contiguous() if write else mark, tokens,
                                     tokens.stride(0), new_mark, at, scratch, WRITE=write)
    return new_mark, at


def review_bookkeeping_ref(mark, accepted, drafted, need, cache_lengths, level_accepted, level_drafted, tokens,
                           scratch: int, token=None):
    """The same in tensor ops (the CPU path)."""
    end = mark + accepted
    new_mark = end + need
    cache_lengths.copy_(new_mark - 1)
    level_accepted.add_(accepted)
    level_drafted.add_(drafted)
    at = torch.where(need, end, scratch)
    if token is not None:
        tokens.scatter_(1, at[:, None], token[:, None])
    return new_mark, at
