"""MaG's proposal (drafters/mag.py has the glossary) as one Triton launch, with its PyTorch reference.

Per row b of a token buffer tokens [B, C]: find the longest suffix (<= max_match tokens) of the
query tokens[b, :end[b]] that ends at a position p < history_end[b] - 1 (and p < bound), copy up
to m tokens that followed it (never past the committed history), repeat `copy_passes` times on
the query extended by the copy, then continue with the bigram chain while it is confident, and
pad the proposal with its last real token (the query's last where nothing was proposed).

Why a kernel: the reference is ~3 tensor ops per compared suffix length plus ~8 per bigram
column, ~100-200 launches per call; a cascade step proposes with MaG several times, and on an
H100 those launches cost ~30 ms of host time per step (bench/gpu.py's step split, 2026-11-24).
One program per row walks the searched positions in tiles of POSITIONS buffer positions x the
query's last max_match tokens: each tile is one load and a min-reduction (a match ending at p is
as long as its first mismatch), not max_match dependent loads, which keeps a batch-1 call short
where the GPU waits on it inside a step. Everything depends on the shapes and host ints only, so
a call can be captured in a CUDA graph. Ties between equally long matches go to the leftmost
occurrence (the spec's) or the rightmost, as in the reference.
"""
import functools

import torch
import triton
import triton.language as tl

TOKEN_PAD = -1  # stands before the buffer: no query token equals it
QUERY_PAD = -2  # stands before the query: no buffer token equals it
BLOCK = 128  # searched positions per tile at most (fewer where max_match > 32: see block_positions)
TILE = 4096  # positions x compared tokens per tile: 32 int64 per thread at 4 warps
_TOKEN_PAD, _QUERY_PAD = tl.constexpr(TOKEN_PAD), tl.constexpr(QUERY_PAD)  # as the kernels see them


@triton.jit(do_not_specialize=["bound"])  # bound grows every step: one compiled variant for all
def _mag_kernel(tokens_ptr, stride_t, end_ptr, history_end_ptr, bigram_ptr, bigram_prob_ptr,
                out_tokens_ptr, out_length_ptr, out_match_ptr, cap_ptr, rows_ptr, goal_ptr, out_end_ptr,
                capacity, bound, vocab, min_bigram_prob, min_match,
                M: tl.constexpr, M_BLOCK: tl.constexpr, MAX_MATCH: tl.constexpr, MATCH_BLOCK: tl.constexpr,
                COPY_PASSES: tl.constexpr, LEFTMOST: tl.constexpr, HAS_BIGRAM: tl.constexpr, APPEND: tl.constexpr,
                POSITIONS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens_row = tokens_ptr + row * stride_t
    scratch = out_tokens_ptr + row * M  # the proposal so far, where a later pass's query reads it
    end = tl.minimum(tl.maximum(tl.load(end_ptr + row), 0), capacity)
    history_end = tl.minimum(tl.maximum(tl.load(history_end_ptr + row), 0), end)
    space = tl.minimum(tl.maximum(history_end - 1, 0), bound)  # searched positions: p < space
    cols = tl.arange(0, M_BLOCK).to(tl.int64)
    backs = tl.arange(0, MATCH_BLOCK).to(tl.int64)  # j: the j-th token from the query's end
    compared = backs < MAX_MATCH
    proposal = tl.zeros([M_BLOCK], dtype=tl.int64)
    count = end * 0  # tokens proposed so far (an int64 scalar)
    match = end * 0
    for search in tl.static_range(COPY_PASSES):
        # the query's last MAX_MATCH tokens (query + proposal so far), QUERY_PAD before its start
        at = end + count - 1 - backs
        want = tl.load(tokens_row + tl.minimum(tl.maximum(at, 0), capacity - 1), mask=compared & (at < end),
                       other=_QUERY_PAD)
        if search > 0:
            tl.store(scratch + cols, proposal, mask=cols < M)
            tl.debug_barrier()
            want = tl.where(at >= end, tl.load(scratch + (at - end), mask=compared & (at >= end), other=0), want)
        want = tl.where(at < 0, _QUERY_PAD, want)
        best_length = count * 0
        best_position = count * 0
        for start in range(0, bound, POSITIONS):
            # one tile [POSITIONS, MATCH_BLOCK]: the buffer tokens at p - j against the query's j-th
            # from the end; a match ending at p is as long as its first mismatch's j
            p = start + tl.arange(0, POSITIONS).to(tl.int64)
            searched = p < space
            behind = p[:, None] - backs[None, :]
            have = tl.load(tokens_row + tl.maximum(behind, 0), mask=searched[:, None] & compared[None, :] & (behind >= 0),
                           other=_TOKEN_PAD)
            stop = tl.where(have == want[None, :], MAX_MATCH, backs[None, :])  # columns past MAX_MATCH: >= it
            length = tl.where(searched, tl.min(stop, axis=1), 0)
            block_best = tl.max(length, axis=0)
            if LEFTMOST:
                at_best = tl.min(tl.where(length == block_best, p, capacity + POSITIONS), axis=0)
                better = block_best > best_length
            else:
                at_best = tl.max(tl.where(length == block_best, p, -1), axis=0)
                better = block_best >= best_length
            best_position = tl.where(better, at_best, best_position)
            best_length = tl.where(better, block_best, best_length)
        found = (best_length >= min_match) & (count < M)
        copied = tl.where(found, tl.minimum(M - count, history_end - 1 - best_position), 0)
        copy = (cols >= count) & (cols < count + copied)
        source = tl.minimum(tl.maximum(best_position + 1 - count + cols, 0), capacity - 1)
        proposal = tl.where(copy, tl.load(tokens_row + source, mask=copy, other=0), proposal)
        if search == 0:
            match = tl.where(found, best_length, 0)
        count = count + copied
    last = tl.load(tokens_row + tl.maximum(end - 1, 0))  # the query's last token
    if HAS_BIGRAM:
        alive = (end > 0) | (count > 0)  # the chain has a token to continue from
        filled = count
        previous = last
        for column in tl.static_range(M):
            if column > 0:
                previous = tl.sum(tl.where(cols == column - 1, proposal, 0), axis=0)
            known = (previous >= 0) & (previous < vocab)
            entry = tl.minimum(tl.maximum(previous, 0), vocab - 1)
            confident = known & (tl.load(bigram_prob_ptr + entry).to(tl.float32) >= min_bigram_prob)
            open_ = column >= count
            fill = open_ & alive & confident
            proposal = tl.where((cols == column) & fill, tl.load(bigram_ptr + entry), proposal)
            alive = tl.where(open_, fill, alive)
            filled += fill.to(tl.int64)
        count = filled
    previous = tl.where(count > 0, tl.sum(tl.where(cols == count - 1, proposal, 0), axis=0), last)
    proposal = tl.where(cols < count, proposal, previous)
    tl.store(out_tokens_ptr + row * M + cols, proposal, mask=cols < M)
    tl.store(out_length_ptr + row, count)
    tl.store(out_match_ptr + row, match)
    if APPEND:  # the first min(count, cap) tokens go after the query, in rows short of their goal only
        need = (tl.load(rows_ptr + row) != 0) & (tl.load(end_ptr + row) < tl.load(goal_ptr + row))
        keep = tl.where(need, tl.minimum(count, tl.load(cap_ptr + row)), 0)
        slot = end + cols
        tl.store(tokens_row + slot, proposal, mask=(cols < keep) & (slot < capacity))
        tl.store(out_end_ptr + row, end + keep)


def block_positions(max_match: int) -> int:
    """Searched positions per tile for matches of up to `max_match` tokens."""
    return max(16, min(BLOCK, TILE // triton.next_power_of_2(max_match)))


@functools.cache  # a CPU tensor per call costs host time on a hot path; the pairs seen are few
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (as a comparison with a tensor of that dtype rounds it)."""
    return float(torch.tensor(value, dtype=dtype))


def mag_propose(tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int, bound: int,
                bigram: torch.Tensor | None, bigram_prob: torch.Tensor | None, min_match: int, max_match: int,
                min_bigram_prob: float, leftmost: bool, copy_passes: int):
    """(proposal [B, m] int64, length [B] int64, match [B] int64) in one launch; arguments as
    in `mag_propose_ref` (drafters/mag.py's MaG.propose checks them). The threshold is compared
    in float32 after rounding it to the table's dtype, as the reference's comparison does."""
    return _launch(tokens, end, history_end, m, bound, bigram, bigram_prob, min_match, max_match, min_bigram_prob,
                   leftmost, copy_passes)[:3]


def mag_extend(tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int, bound: int,
               bigram: torch.Tensor | None, bigram_prob: torch.Tensor | None, min_match: int, max_match: int,
               min_bigram_prob: float, leftmost: bool, copy_passes: int, cap: torch.Tensor, rows: torch.Tensor,
               goal: torch.Tensor):
    """`mag_propose`, and in the same launch the proposal's first min(length, cap[b]) tokens
    written into tokens[b, end[b]:] (rows with rows[b] and end[b] < goal[b] only, never past the
    buffer); returns (proposal, length, match, end [B] int64 after the write). Arguments as in
    `mag_extend_ref`."""
    return _launch(tokens, end, history_end, m, bound, bigram, bigram_prob, min_match, max_match, min_bigram_prob,
                   leftmost, copy_passes, cap, rows, goal)


def _launch(tokens, end, history_end, m, bound, bigram, bigram_prob, min_match, max_match, min_bigram_prob, leftmost,
            copy_passes, cap=None, rows=None, goal=None):
    batch, capacity = tokens.shape
    proposal = torch.empty(batch, m, dtype=torch.int64, device=tokens.device)
    length = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    match = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    new_end = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    if batch == 0:
        return proposal, length, match, new_end
    has_bigram, append = bigram is not None, cap is not None
    threshold = _rounded(min_bigram_prob, bigram_prob.dtype) if has_bigram else 0.0
    _mag_kernel[(batch,)](
        tokens, tokens.stride(0), end.contiguous(), history_end.contiguous(),
        bigram if has_bigram else tokens, bigram_prob if has_bigram else tokens,
        proposal, length, match, cap.contiguous() if append else tokens,
        rows.contiguous().view(torch.uint8) if append else tokens,  # bool as bytes (a view)
        goal.contiguous() if append else tokens, new_end,
        capacity, min(bound, capacity), bigram.shape[0] if has_bigram else 1,
        threshold, min_match, M=m, M_BLOCK=triton.next_power_of_2(m), MAX_MATCH=max_match, COPY_PASSES=copy_passes,
        MATCH_BLOCK=triton.next_power_of_2(max_match), LEFTMOST=leftmost, HAS_BIGRAM=has_bigram, APPEND=append,
        POSITIONS=block_positions(max_match))
    return proposal, length, match, new_end


def mag_propose_ref(tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int, bound: int,
                    bigram: torch.Tensor | None, bigram_prob: torch.Tensor | None, min_match: int, max_match: int,
                    min_bigram_prob: float, leftmost: bool, copy_passes: int):
    """The PyTorch reference: fixed-shape tensor ops, no host read (the CPU path of MaG).

    tokens [B, C] int64 (stride 1 along C); end [B] int64 in 0..C; history_end [B] int64 in
    0..end[b]; m >= 1 and bound (only tokens[:, :bound] are searched) host ints. Out-of-range
    values are clamped, never read out of bounds. Cost: max_match compares over [B, bound] per
    pass; on one shared CPU core ~0.6 ms at B=1 (C=2304 or 16384), ~1 ms at B=8, C=2304.
    """
    batch, capacity = tokens.shape
    bound = min(bound, capacity)
    end = end.clamp(0, capacity)
    history_end = torch.minimum(history_end.clamp(min=0), end)
    space = (history_end - 1).clamp(0, bound)  # [B] searched positions
    # [B, bound + max_match - 1]: the searched tokens after a pad, so that a match ending
    # at position p reads padded[:, p + max_match - 1 - j] for its j-th token from the end.
    padded = torch.cat([tokens.new_full((batch, max_match - 1), TOKEN_PAD), tokens[:, :bound]], 1)
    columns = torch.arange(m, device=tokens.device)  # [m]
    proposal = tokens.new_zeros(batch, m)
    count = torch.zeros_like(end)  # [B] tokens proposed so far
    match = torch.zeros_like(end)
    for search in range(copy_passes if bound > 0 else 0):
        window = _query_window(tokens, end, proposal, count, max_match)  # [B, max_match]
        length, position = _longest_match(padded, window, space, max_match, leftmost)
        found = (length >= min_match) & (count < m)
        copied = torch.where(found, torch.minimum(m - count, history_end - 1 - position), 0)
        source = (position + 1 - count)[:, None] + columns  # [B, m]
        copy = (columns >= count[:, None]) & (columns < (count + copied)[:, None])
        proposal = torch.where(copy, tokens.gather(1, source.clamp(0, capacity - 1)), proposal)
        if search == 0:
            match = torch.where(found, length, 0)
        count = count + copied
    last = tokens.gather(1, (end - 1).clamp(min=0)[:, None])[:, 0]  # [B] query's last token
    if bigram is not None:
        proposal, count = _bigram_fill(proposal, count, last, end > 0, bigram, bigram_prob, min_bigram_prob)
    # Padding: the last real token (the query's where nothing was proposed).
    previous = torch.where(count > 0, proposal.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0], last)
    proposal = torch.where(columns < count[:, None], proposal, previous[:, None])
    return proposal, count, match


def mag_extend_ref(tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int, bound: int,
                   bigram: torch.Tensor | None, bigram_prob: torch.Tensor | None, min_match: int, max_match: int,
                   min_bigram_prob: float, leftmost: bool, copy_passes: int, cap: torch.Tensor, rows: torch.Tensor,
                   goal: torch.Tensor):
    """The PyTorch reference of `mag_extend`: `mag_propose_ref`'s arguments, cap [B] int64,
    rows [B] bool and goal [B] int64. Writes tokens[b, end[b] + j] = proposal[b, j] for
    j < min(length[b], cap[b]) where rows[b] and end[b] < goal[b] (and end[b] + j < C), nothing else."""
    need = rows & (end < goal)
    proposal, length, match = mag_propose_ref(tokens, end, history_end, m, bound, bigram, bigram_prob, min_match,
                                              max_match, min_bigram_prob, leftmost, copy_passes)
    capacity = tokens.shape[1]
    end = end.clamp(0, capacity)
    keep = torch.where(need, torch.minimum(length, cap), 0)
    slot = end[:, None] + torch.arange(m, device=tokens.device)
    write = (slot < (end + keep)[:, None]) & (slot < capacity)
    # Entries not written put back the token before the query (end 0: nothing is written), never
    # a written slot: of duplicate indexes, scatter keeps one arbitrarily.
    index = torch.where(write, slot, (end - 1).clamp(min=0)[:, None])
    tokens.scatter_(1, index, torch.where(write, proposal, tokens.gather(1, index)))
    return proposal, length, match, end + keep


def _query_window(tokens, end, proposal, count, max_match) -> torch.Tensor:
    """[B, max_match]: the last max_match tokens of query + proposal[:count], QUERY_PAD
    before the start."""
    offsets = torch.arange(max_match, device=tokens.device) - max_match
    where = (end + count)[:, None] + offsets  # [B, max_match] positions in query + proposal
    in_query = where < end[:, None]
    from_tokens = tokens.gather(1, where.clamp(0, tokens.shape[1] - 1))
    from_proposal = proposal.gather(1, (where - end[:, None]).clamp(0, proposal.shape[1] - 1))
    return torch.where(where < 0, QUERY_PAD, torch.where(in_query, from_tokens, from_proposal))


def _longest_match(padded, window, space, max_match, leftmost) -> tuple[torch.Tensor, torch.Tensor]:
    """(length [B], position [B]): the longest suffix of `window` that ends at a position
    p < space in the buffer, and p (ties: leftmost or rightmost). Length 0 if none."""
    batch, bound = padded.shape[0], padded.shape[1] - max_match + 1
    # lengths[b, p] = how many tokens ending at p equal the window's last ones. One compare
    # per suffix length over [B, bound] keeps memory at B x bound (unfold + cumprod would
    # build B x bound x max_match integers, measured 10-100x slower on a CPU).
    lengths = torch.zeros(batch, bound, dtype=torch.uint8 if max_match < 256 else torch.int32, device=padded.device)
    running = torch.ones(batch, bound, dtype=torch.bool, device=padded.device)
    for back in range(max_match):
        start = max_match - 1 - back
        running &= padded[:, start:start + bound] == window[:, -1 - back, None]
        lengths += running.view(torch.uint8)  # a view: no bool -> uint8 copy per step
    lengths.masked_fill_(torch.arange(bound, device=padded.device) >= space[:, None], 0)
    # max returns the first of equal maxima (documented): leftmost, or rightmost when flipped.
    if leftmost:
        best = lengths.max(dim=1)
        return best.values.long(), best.indices
    best = lengths.flip(1).max(dim=1)
    return best.values.long(), bound - 1 - best.indices


def _bigram_fill(proposal, count, last, has_previous, bigram, bigram_prob, min_bigram_prob):
    """Continue each row's proposal past `count` while the bigram table is confident."""
    vocab_size = bigram.shape[0]
    alive = has_previous | (count > 0)  # the chain has a token to continue from
    filled = count
    for column in range(proposal.shape[1]):
        previous = last if column == 0 else proposal[:, column - 1]
        known = (previous >= 0) & (previous < vocab_size)
        entry = previous.clamp(0, vocab_size - 1)
        confident = known & (bigram_prob[entry] >= min_bigram_prob)
        open_ = column >= count
        fill = open_ & alive & confident
        proposal[:, column] = torch.where(fill, bigram[entry], proposal[:, column])
        alive = torch.where(open_, fill, alive)
        filled = filled + fill
    return proposal, filled
