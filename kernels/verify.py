"""Fused chain verification (docs/algorithms.md: chain verification, lenience): one call verifies a whole batch.

Row b has `num_drafts[b] = n <= k` draft tokens x_0..x_{n-1}; `logits[b, j]` gives the
reviewer's p_j for draft j, and position n is the bonus position.

Processed distribution of a sampling row (temperature T > 0): z = logits / T. Top-k keeps
z >= the k-th largest z (ties kept); top-p then keeps z >= t, t the largest kept value whose
kept mass at or above it reaches top_p (ties kept). p_j = softmax over the kept entries.
`threshold` is the smallest kept z, -inf when neither filter is on (top_k = 0 or >= V, top_p = 1).
The helpers that compute it, on the device and in PyTorch, live in sampling.py.

Sampling rows: accept x_j iff u_j * q_j(x_j) < l_b * p_j(x_j), u_j = uniform(seed, offset + j, 0),
q_j one-hot (q_j(x_j) = 1) without draft_probs, l_b the row's lenience. At the first rejection j
emit argmax_y log r_j(y) + gumbel(seed, offset + j, 1 + y), r_j = max(0, p_j - min(q_j, l_b p_j)),
or a sample of p_j where r_j vanished in floating point; with all n accepted emit the bonus
argmax_y z_y + gumbel(seed, offset + n, 1 + y) over the kept y.
Greedy rows (T = 0): accept x_j while x_j == argmax logits[b, j] (first index on ties) or, with
l_b > 1, l_b * softmax(logits[b, j])[x_j] > q_j(x_j); emit the argmax where that fails or at n.

Kernel: four launches (three when the caller promises every row greedy), grids from shapes only
(CUDA-graph capturable, no host reads; a float lenience goes as a kernel argument). A split is
one of S contiguous slices of the vocabulary; S is chosen from B * (k+1) so that small batches
still fill the GPU (S = 1 at large batch).
* `_stats_kernel`, grid (B, k+1, S): per split, an online max / sum / min / argmax and, at the
  bonus position of an unfiltered sampling row, the Gumbel-max bonus candidate.
* `_position_kernel`, grid (B, k+1): merges the splits (max, rescaled sums, first-index argmax:
  exactly the whole-row result), finds the top-k / top-p cut-off if the row asks for one (a
  per-row search, only on filtered rows) and stores lse, threshold and the accept test of x_j.
* `_emit_split_kernel`, grid (B, S): the first rejected position from the stored tests, then,
  only where a sampling row needs it (residual at a rejection, filtered bonus), the split's
  candidates of the residual and of p. Not launched with all_greedy.
* `_emit_kernel`, grid (B,): merges those candidates into next_token.
A Gumbel-max over the whole row is the max over the splits' maxima with ties to the earlier
split, so every token is the one a single sweep draws. No [B, k+1, V] tensor is ever written.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .random import gumbel, gumbel_ref, uniform, uniform_ref
from .sampling import (MAX_BLOCK_V, NUM_PIVOTS, block_sizes, check_settings, cutoff_workspace, gumbel_update,
                       lenience_args, lenience_rows, load_p, load_q, merge_argmax, merge_stats, one_hot, probs_ref,
                       processed_ref, residual_parts, residual_ref, resolve_filtered, row_cutoff, row_lenience,
                       row_settings, row_stats)

MIN_SPLIT = 2048  # vocabulary entries per split at least (auto splits): a program's sweep stays worth a launch
PROGRAMS_PER_SM = 4  # auto splits aim at this many programs per SM for the statistics sweep
INTERPRETER_SMS = 132  # an H100's count, for the plan when there is no GPU to ask


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64: accepted draft tokens per row (0..num_drafts[b]), an index as is
    next_token: torch.Tensor  # [B] int64: the correction token (first rejection) or the bonus token
    lse: torch.Tensor  # [B, k+1] float32: log-normaliser of the processed logits (greedy: raw logits)
    threshold: torch.Tensor  # [B, k+1] float32: smallest kept processed logit, -inf when unfiltered
    # lse and threshold hold 0 at positions beyond num_drafts[b]; with the inputs they rebuild p_j.


@triton.jit
def _stats_kernel(logits_ptr, stride_lb, stride_lj, num_drafts_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr,
                  offset_ptr, split_values_ptr, split_indices_ptr, V, K, CHUNK, SPLITS, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1)
    split = tl.program_id(2)
    num_drafts = tl.minimum(tl.load(num_drafts_ptr + row).to(tl.int32), K)  # never read past the draft
    if position <= num_drafts:
        sampling, divisor, _, _, by_count, by_mass = row_settings(temperature_ptr, top_k_ptr, top_p_ptr, row, V)
        fused_bonus = sampling & (position == num_drafts) & ~(by_count | by_mass)
        lo = split * CHUNK
        row_max, row_sum, row_min, argmax, best_noisy, sample = row_stats(
            logits_ptr + row * stride_lb + position * stride_lj, lo, lo + CHUNK, V, divisor, tl.load(seed_ptr + row),
            tl.load(offset_ptr + row) + position, fused_bonus, BLOCK_V)
        values = split_values_ptr + ((row * (K + 1) + position) * 4) * SPLITS + split  # [B, k+1, 4, S]
        tl.store(values, row_max)
        tl.store(values + SPLITS, row_sum)
        tl.store(values + 2 * SPLITS, row_min)
        tl.store(values + 3 * SPLITS, best_noisy)
        indices = split_indices_ptr + ((row * (K + 1) + position) * 2) * SPLITS + split  # [B, k+1, 2, S]
        tl.store(indices, argmax)
        tl.store(indices + SPLITS, sample)


@triton.jit
def _position_kernel(logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_db, num_drafts_ptr,
                     draft_probs_ptr, stride_qb, stride_qj, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr,
                     offset_ptr, lenience_ptr, lenience_value, split_values_ptr, split_indices_ptr, lse_ptr,
                     threshold_ptr, accepted_ptr, token_ptr, scratch_ptr, stride_s, V, K, SPLITS,
                     HAS_DRAFT_PROBS: tl.constexpr, PER_ROW_LENIENCE: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
                     SEARCH_BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1)
    num_drafts = tl.minimum(tl.load(num_drafts_ptr + row).to(tl.int32), K)
    if position <= num_drafts:
        sampling, divisor, top_k, top_p, by_count, by_mass = row_settings(temperature_ptr, top_k_ptr, top_p_ptr,
                                                                          row, V)
        fused_bonus = sampling & (position == num_drafts) & ~(by_count | by_mass)
        seed = tl.load(seed_ptr + row)
        counter = tl.load(offset_ptr + row) + position
        row_ptr = logits_ptr + row * stride_lb + position * stride_lj
        out = row * (K + 1) + position

        splits = tl.arange(0, SPLITS_BLOCK)
        real = splits < SPLITS
        values = split_values_ptr + out * 4 * SPLITS + splits
        indices = split_indices_ptr + out * 2 * SPLITS + splits
        row_max, row_sum, row_min, argmax, _, sample = merge_stats(
            tl.load(values, mask=real, other=float("-inf")), tl.load(values + SPLITS, mask=real, other=0.0),
            tl.load(values + 2 * SPLITS, mask=real, other=float("inf")),
            tl.load(indices, mask=real, other=2147483647),
            tl.load(values + 3 * SPLITS, mask=real, other=float("-inf")),
            tl.load(indices + SPLITS, mask=real, other=2147483647))
        threshold, kept_mass = row_cutoff(row_ptr, V, divisor, row_max, row_sum, row_min, by_count, by_mass, top_k,
                                          top_p, scratch_ptr + out * stride_s, SEARCH_BLOCK, NUM_PIVOTS)
        lse = row_max + tl.log(kept_mass)
        tl.store(lse_ptr + out, lse)
        tl.store(threshold_ptr + out, threshold)
        # The token emitted here if no draft before it is rejected; -1: the emit kernels draw it.
        tl.store(token_ptr + out, tl.where(sampling, tl.where(fused_bonus, sample, -1), argmax))
        if position < num_drafts:
            lenience = row_lenience(lenience_ptr, lenience_value, row, PER_ROW_LENIENCE)
            token = tl.load(draft_tokens_ptr + row * stride_db + position)
            z_token = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), divisor)
            p_token = tl.where(z_token >= threshold, tl.exp(z_token - lse), 0.0)
            q_token = 1.0
            if HAS_DRAFT_PROBS:
                q_token = tl.load(draft_probs_ptr + row * stride_qb + position * stride_qj + token).to(tl.float32)
            u = uniform(seed, counter, tl.zeros((), tl.int32))  # index 0, as a tensor
            sampled_accept = u * q_token < lenience * p_token
            greedy_accept = (token == argmax) | ((lenience > 1.0) & (lenience * p_token > q_token))
            tl.store(accepted_ptr + out, tl.where(sampling, sampled_accept, greedy_accept).to(tl.int8))
    else:  # past the draft: lse and threshold hold 0 (VerifyResult)
        out = row * (K + 1) + position
        tl.store(lse_ptr + out, 0.0)
        tl.store(threshold_ptr + out, 0.0)


@triton.jit
def _emit_position(accepted_ptr, num_drafts_ptr, token_ptr, temperature_ptr, row, K,
                   POSITIONS_BLOCK: tl.constexpr):
    """Where row `row` emits (its first rejected draft, else num_drafts), whether that is a draft
    position, the token stored there and whether a sampling sweep must draw it instead."""
    num_drafts = tl.minimum(tl.load(num_drafts_ptr + row).to(tl.int32), K)
    positions = tl.arange(0, POSITIONS_BLOCK)
    in_draft = positions < num_drafts
    accepted = tl.load(accepted_ptr + row * (K + 1) + positions, mask=in_draft, other=1)
    emit_at = tl.min(tl.where(in_draft & (accepted == 0), positions, num_drafts), 0)
    is_draft = emit_at < num_drafts
    token = tl.load(token_ptr + row * (K + 1) + emit_at)
    must_draw = (tl.load(temperature_ptr + row) > 0.0) & (is_draft | (token < 0))
    return emit_at, is_draft, token, must_draw


@triton.jit
def _emit_split_kernel(logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_db, num_drafts_ptr,
                       draft_probs_ptr, stride_qb, stride_qj, temperature_ptr, seed_ptr, offset_ptr, lenience_ptr,
                       lenience_value, lse_ptr, threshold_ptr, accepted_ptr, token_ptr, emit_values_ptr,
                       emit_indices_ptr, V, K, CHUNK, SPLITS, HAS_DRAFT_PROBS: tl.constexpr,
                       PER_ROW_LENIENCE: tl.constexpr, BLOCK_V: tl.constexpr, POSITIONS_BLOCK: tl.constexpr):
    """Per split: Gumbel-max candidates of the residual r at a rejected draft and of p (the bonus,
    or where r vanished)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    emit_at, is_draft, _, must_draw = _emit_position(accepted_ptr, num_drafts_ptr, token_ptr, temperature_ptr, row,
                                                     K, POSITIONS_BLOCK)
    if must_draw:
        out = row * (K + 1) + emit_at
        row_ptr = logits_ptr + row * stride_lb + emit_at * stride_lj
        q_row_ptr = draft_probs_ptr + row * stride_qb + emit_at * stride_qj
        draft_token = tl.load(draft_tokens_ptr + row * stride_db + emit_at, mask=is_draft, other=-1)
        divisor = tl.load(temperature_ptr + row)
        lse = tl.load(lse_ptr + out)
        threshold = tl.load(threshold_ptr + out)
        lenience = row_lenience(lenience_ptr, lenience_value, row, PER_ROW_LENIENCE)
        seed = tl.load(seed_ptr + row)
        counter = tl.load(offset_ptr + row) + emit_at
        lo = split * CHUNK
        residual_best = float("-inf")
        residual_token = lo
        plain_best = float("-inf")
        plain_token = lo
        for start in range(lo, lo + CHUNK, BLOCK_V):
            offs, in_row, z, kept, p = load_p(row_ptr, start, V, divisor, threshold, lse, BLOCK_V)
            noise = gumbel(seed, counter, offs + 1)
            q = load_q(q_row_ptr, offs, in_row, is_draft, draft_token, HAS_DRAFT_PROBS)
            residual = residual_parts(p, q, lenience)[1]
            residual_best, residual_token = gumbel_update(tl.log(residual), noise, start, residual_best,
                                                          residual_token)
            plain_best, plain_token = gumbel_update(tl.where(kept, z, float("-inf")), noise, start, plain_best,
                                                    plain_token)
        values = emit_values_ptr + row * 2 * SPLITS + split  # [B, 2, S]
        tl.store(values, residual_best)
        tl.store(values + SPLITS, plain_best)
        indices = emit_indices_ptr + row * 2 * SPLITS + split
        tl.store(indices, residual_token)
        tl.store(indices + SPLITS, plain_token)


@triton.jit
def _emit_kernel(num_drafts_ptr, temperature_ptr, accepted_ptr, token_ptr, emit_values_ptr, emit_indices_ptr,
                 num_accepted_ptr, next_token_ptr, K, SPLITS, SPLITS_BLOCK: tl.constexpr,
                 POSITIONS_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    emit_at, is_draft, next_token, must_draw = _emit_position(accepted_ptr, num_drafts_ptr, token_ptr,
                                                              temperature_ptr, row, K, POSITIONS_BLOCK)
    tl.store(num_accepted_ptr + row, emit_at)
    if must_draw:
        splits = tl.arange(0, SPLITS_BLOCK)
        real = splits < SPLITS
        values = emit_values_ptr + row * 2 * SPLITS + splits
        indices = emit_indices_ptr + row * 2 * SPLITS + splits
        residual_best, residual_token = merge_argmax(tl.load(values, mask=real, other=float("-inf")),
                                                     tl.load(indices, mask=real, other=2147483647))
        _, plain_token = merge_argmax(tl.load(values + SPLITS, mask=real, other=float("-inf")),
                                      tl.load(indices + SPLITS, mask=real, other=2147483647))
        next_token = tl.where(is_draft & (residual_best > float("-inf")), residual_token, plain_token)
    tl.store(next_token_ptr + row, next_token.to(tl.int64))


def check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience,
                  seed=None, offset=None, check_values=True, max_top_k=None) -> None:
    """Shapes, dtypes, devices and a float lenience always; tensor values only on the CPU with check_values."""
    if logits.dim() != 3 or min(logits.shape) < 1:
        raise ValueError(f"logits must be [B, k+1, V] with B, k+1, V >= 1, got {list(logits.shape)}")
    batch, positions, vocab = logits.shape
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating dtype, got {logits.dtype}")
    k = positions - 1
    expected = {"draft_tokens": (draft_tokens, (batch, k), False), "num_drafts": (num_drafts, (batch,), False),
                "temperature": (temperature, (batch,), True), "top_k": (top_k, (batch,), False),
                "top_p": (top_p, (batch,), True)}
    optional = {"draft_probs": (draft_probs, (batch, k, vocab), True), "seed": (seed, (batch,), False),
                "offset": (offset, (batch,), False)}
    expected.update({name: spec for name, spec in optional.items() if spec[0] is not None})
    for name, (t, shape, floating) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for logits [B, k+1, V] = {list(logits.shape)}, "
                             f"got {list(t.shape)}")
        if t.is_floating_point() != floating or t.dtype == torch.bool:
            raise TypeError(f"{name} must be {'a floating' if floating else 'an integer'} tensor, got {t.dtype}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}: all inputs must share a device")
    if isinstance(lenience, torch.Tensor):
        if tuple(lenience.shape) != (batch,) or not lenience.is_floating_point() or lenience.device != logits.device:
            raise ValueError(f"lenience must be a float or a [B={batch}] float tensor on {logits.device}, got "
                             f"{lenience.dtype} {list(lenience.shape)} on {lenience.device}")
    elif not lenience >= 1.0:
        raise ValueError(f"lenience must be a float >= 1 (1 = exact verification), got {lenience}")
    if logits.is_cuda or not check_values:
        return  # checking the values below would cost a host sync on every decoding step
    if isinstance(lenience, torch.Tensor) and not (lenience >= 1.0).all():
        raise ValueError(f"lenience must be >= 1 (1 = exact verification), got {lenience.tolist()}")
    if ((num_drafts < 0) | (num_drafts > k)).any():
        raise ValueError(f"num_drafts must be in [0, k={k}], got {num_drafts.tolist()}")
    drafted = torch.arange(k) < num_drafts[:, None]
    if ((draft_tokens < 0) | (draft_tokens >= vocab))[drafted].any():
        raise ValueError(f"draft tokens (positions < num_drafts) must be in [0, V={vocab})")
    check_settings(temperature, top_k, top_p, vocab, max_top_k)


def split_plan(batch: int, positions: int, vocab: int, splits: int | None = None,
               device: torch.device | None = None) -> tuple[int, int, int]:
    """(S, chunk, BLOCK_V) for the split sweeps, from shapes only: S splits of `chunk` entries
    (a multiple of BLOCK_V) cover the vocabulary. splits=None: enough that B * (k+1) * S fills
    the GPU's SMs PROGRAMS_PER_SM times over, each split at least MIN_SPLIT entries; an int forces
    (at most) that many, e.g. 1 for one sweep per row or a few on a small vocabulary in tests."""
    if splits is None:
        sms = INTERPRETER_SMS
        if device is not None and device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = min(triton.cdiv(PROGRAMS_PER_SM * sms, batch * positions), triton.cdiv(vocab, MIN_SPLIT))
    per_split = triton.cdiv(vocab, max(1, min(splits, vocab)))
    block_v = min(triton.next_power_of_2(per_split), MAX_BLOCK_V)
    chunk = triton.cdiv(per_split, block_v) * block_v
    return triton.cdiv(vocab, chunk), chunk, block_v


def verify(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, offset: torch.Tensor, lenience: float | torch.Tensor = 1.0, *,
           splits: int | None = None, all_greedy: bool = False, check_values: bool = True) -> VerifyResult:
    """Verify a batch of ragged draft chains in four Triton launches (three with all_greedy); the
    rule is in the module docstring.

    logits        [B, k+1, V] float   reviewer logits (any float dtype; fp32 math); k may be 0
    draft_tokens  [B, k]      int     draft j of row b; positions >= num_drafts[b] are ignored
    num_drafts    [B]         int     0 <= n_b <= k
    draft_probs   None (deterministic drafts, q one-hot) or [B, k, V] float: the q_j draft j was drawn from
    temperature   [B] float (0 = greedy), top_k [B] int (0 = off), top_p [B] float (1 = off)
    seed, offset  [B] int64   position j draws from counter offset + j
    lenience      float >= 1 for every row, or [B] float (each >= 1), one per row
    splits        vocabulary splits per (row, position): None = from the shapes (split_plan), an int forces it
    all_greedy    host-known promise that every row has temperature 0: the emit-split sweep, which only
                  sampling rows need, is not launched
    check_values  False skips the value checks on CPU tensors (on CUDA they never run: a host sync)
    Returns VerifyResult: num_accepted [B] int64, next_token [B] int64, lse / threshold [B, k+1] float32.
    Grids and workspaces depend on shapes only, so a call can be captured in a CUDA graph.
    """
    check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience, seed, offset,
                  check_values)
    batch, positions, vocab = logits.shape
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if draft_probs is not None and draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    q = logits if draft_probs is None else draft_probs  # never read without draft probs
    draft_tokens = draft_tokens.contiguous()
    num_drafts = num_drafts.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    seed, offset = seed.to(torch.int64).contiguous(), offset.to(torch.int64).contiguous()
    lenience_ptr, lenience_value, per_row_lenience = lenience_args(lenience, temperature)
    num_splits, chunk, block_v = split_plan(batch, positions, vocab, splits, device)
    splits_block = triton.next_power_of_2(num_splits)
    _, search_block, search_warps = block_sizes(vocab)
    sweep_warps = max(1, min(8, block_v // 256))
    split_values = torch.empty(batch, positions, 4, num_splits, dtype=torch.float32, device=device)
    split_indices = torch.empty(batch, positions, 2, num_splits, dtype=torch.int32, device=device)
    lse = torch.empty(batch, positions, dtype=torch.float32, device=device)  # every entry written (0 past the draft)
    threshold = torch.empty(batch, positions, dtype=torch.float32, device=device)
    accepted = torch.empty(batch, positions, dtype=torch.int8, device=device)
    token = torch.empty(batch, positions, dtype=torch.int32, device=device)
    emit_values = torch.empty(batch, 2, num_splits, dtype=torch.float32, device=device)
    emit_indices = torch.empty(batch, 2, num_splits, dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    next_token = torch.empty(batch, dtype=torch.int64, device=device)
    settings = (temperature, top_k.contiguous(), top_p.to(torch.float32).contiguous())
    row_inputs = (logits, logits.stride(0), logits.stride(1), draft_tokens, draft_tokens.stride(0), num_drafts,
                  q, q.stride(0), q.stride(1))
    has_draft_probs = draft_probs is not None
    positions_block = triton.next_power_of_2(positions)
    _stats_kernel[(batch, positions, num_splits)](
        logits, logits.stride(0), logits.stride(1), num_drafts, *settings, seed, offset, split_values, split_indices,
        vocab, positions - 1, chunk, num_splits, BLOCK_V=block_v, num_warps=sweep_warps)
    scratch = cutoff_workspace(batch * positions, vocab, device)
    _position_kernel[(batch, positions)](
        *row_inputs, *settings, seed, offset, lenience_ptr, lenience_value, split_values, split_indices, lse, threshold,
        accepted, token, scratch, scratch.stride(0), vocab, positions - 1, num_splits, HAS_DRAFT_PROBS=has_draft_probs,
        PER_ROW_LENIENCE=per_row_lenience, SPLITS_BLOCK=splits_block, SEARCH_BLOCK=search_block,
        NUM_PIVOTS=NUM_PIVOTS, num_warps=search_warps)
    if not all_greedy:  # greedy rows never draw: _emit_kernel reads no candidate of theirs
        _emit_split_kernel[(batch, num_splits)](
            *row_inputs, temperature, seed, offset, lenience_ptr, lenience_value, lse, threshold, accepted, token,
            emit_values, emit_indices, vocab, positions - 1, chunk, num_splits, HAS_DRAFT_PROBS=has_draft_probs,
            PER_ROW_LENIENCE=per_row_lenience, BLOCK_V=block_v, POSITIONS_BLOCK=positions_block,
            num_warps=sweep_warps)
    _emit_kernel[(batch,)](
        num_drafts, temperature, accepted, token, emit_values, emit_indices, num_accepted, next_token,
        positions - 1, num_splits, SPLITS_BLOCK=splits_block, POSITIONS_BLOCK=positions_block)
    return VerifyResult(num_accepted, next_token, lse, threshold)


def _draft_distribution(draft_tokens, draft_probs, rows, position, vocab):
    """q of draft `position` ([B] or an int) for the given rows: draft_probs, or one-hot at the draft token."""
    if draft_probs is not None:
        return draft_probs[rows, position].float()
    return one_hot(draft_tokens[rows, position], vocab)


def verify_ref(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
               draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seed: torch.Tensor, offset: torch.Tensor, lenience: float | torch.Tensor = 1.0, *,
               filtered: bool | None = None, max_top_k: int | None = None, all_greedy: bool = False,
               check_values: bool = True) -> VerifyResult:
    """PyTorch twin of `verify`: same arguments, semantics and random numbers. Vectorised over
    rows, one loop step per position, fixed shapes throughout: with check_values=False and a
    host-known `filtered` it never reads the device (filtered / max_top_k: see processed_ref).
    all_greedy: host-known promise that every row has temperature 0, so no random number or
    residual is drawn (on a CPU most of a call: 5 positions of a 151936 vocabulary took 11-15 ms
    without it, 4-5 with it)."""
    check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience, seed, offset,
                  check_values, max_top_k)
    batch, positions, vocab = logits.shape
    device = logits.device
    seed, offset, num_drafts = seed.long(), offset.long(), num_drafts.long()
    lenience = lenience_rows(lenience, batch, device)  # fp32, as the kernel sees it
    filtered = resolve_filtered(filtered, temperature, top_k, top_p, vocab)
    sampling = temperature > 0
    drafted = torch.arange(positions - 1, device=device) < num_drafts[:, None]
    tokens = torch.where(drafted, draft_tokens.long(), 0)
    every_row = torch.arange(batch, device=device)
    lse = torch.zeros(batch, positions, device=device)
    threshold = torch.zeros(batch, positions, device=device)
    argmax = torch.zeros(batch, positions, dtype=torch.int64, device=device)
    rejected = torch.zeros(batch, positions, dtype=torch.bool, device=device)
    for j in range(positions):
        z, threshold[:, j], lse[:, j] = processed_ref(logits[:, j], temperature, top_k, top_p, filtered, max_top_k)
        argmax[:, j] = z.argmax(-1)
        if j == positions - 1:
            break
        x = tokens[:, j]
        z_x = z.gather(1, x[:, None])[:, 0]
        p_x = torch.where(z_x >= threshold[:, j], torch.exp(z_x - lse[:, j]), 0.0)
        q_x = draft_probs[every_row, j, x].float() if draft_probs is not None else torch.ones_like(p_x)
        accept = (x == argmax[:, j]) | ((lenience > 1) & (lenience * p_x > q_x))  # greedy rows
        if not all_greedy:
            accept = torch.where(sampling, uniform_ref(seed, offset + j, 0) * q_x < lenience * p_x, accept)
        rejected[:, j] = drafted[:, j] & ~accept
    position_ids = torch.arange(positions, device=device)
    num_accepted = torch.where(rejected, position_ids, num_drafts[:, None]).amin(1)
    beyond = position_ids > num_drafts[:, None]
    lse, threshold = lse.masked_fill(beyond, 0.0), threshold.masked_fill(beyond, 0.0)
    if all_greedy:
        return VerifyResult(num_accepted, argmax[every_row, num_accepted], lse, threshold)

    # Sampling rows draw at their emitting position: the bonus (or a vanished residual) samples p,
    # a rejection samples the residual. One Gumbel noise row serves both. Every row computes it
    # (fixed shapes); greedy rows keep their argmax.
    at = num_accepted
    z = logits[every_row, at].float() / torch.where(sampling, temperature.float(), 1.0)[:, None]
    at_threshold, at_lse = threshold[every_row, at], lse[every_row, at]
    noise = gumbel_ref(seed[:, None], (offset + at)[:, None], 1 + torch.arange(vocab, device=device))
    sample = torch.where(z >= at_threshold[:, None], z + noise, float("-inf")).argmax(-1)
    if positions > 1:
        draft_at = at.clamp(max=positions - 2)  # rows that do not reject: any draft, unused
        q = _draft_distribution(tokens, draft_probs, every_row, draft_at, vocab)
        _, residual = residual_ref(probs_ref(z, at_threshold, at_lse), q, lenience[:, None])
        residual_sample = (residual.log() + noise).argmax(-1)
        sample = torch.where((at < num_drafts) & (residual > 0).any(-1), residual_sample, sample)
    next_token = torch.where(sampling, sample, argmax[every_row, at])
    return VerifyResult(num_accepted, next_token, lse, threshold)


def reviewer_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filtered: bool | None = None, max_top_k: int | None = None) -> torch.Tensor:
    """The reviewer's sampling distribution p: logits [B, ..., V], settings [B] (shared by a row's
    positions) -> [B, ..., V] float32. Greedy rows (T == 0) give the one-hot argmax.
    filtered / max_top_k: host-known hints, see processed_ref; no host reads on a device."""
    vocab = logits.shape[-1]
    per_row = logits[0].numel() // vocab
    settings = [s.repeat_interleave(per_row) for s in (temperature, top_k, top_p)]
    z, threshold, lse = processed_ref(logits.reshape(-1, vocab), *settings, filtered=filtered, max_top_k=max_top_k)
    greedy = (settings[0] == 0)[:, None]
    probs = torch.where(greedy, one_hot(z.argmax(-1), vocab), probs_ref(z, threshold, lse))
    return probs.reshape(logits.shape)


def sampled_distribution(logits: torch.Tensor, temperature: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """[B, V] float32: what a check without drafts (logits [B, V] as its one position) drew its
    token from: p rebuilt from the check's own lse and cut-off (sampling rows), one-hot of the
    token (greedy rows). reviewer_probs' value without searching the top-k / top-p cut-off again
    (~6 ops where that takes ~50, each a kernel launch on a GPU)."""
    divisor = torch.where(temperature > 0, temperature.float(), 1.0)[:, None]
    p = probs_ref(logits.float() / divisor, result.threshold[:, 0], result.lse[:, 0])
    return torch.where((temperature > 0)[:, None], p, one_hot(result.next_token, logits.shape[-1]))
