"""Fused chain verification (ALGORITHMS.md sections 1 and 2): one call verifies a whole batch.

Row b has `num_drafts[b] = n <= k` draft tokens x_0..x_{n-1}; `logits[b, j]` gives the
reviewer's p_j for draft j, and position n is the bonus position.

Processed distribution of a sampling row (temperature T > 0): z = logits / T. Top-k keeps
z >= the k-th largest z (ties kept); top-p then keeps z >= t, t the largest kept value whose
kept mass at or above it reaches top_p (ties kept). p_j = softmax over the kept entries.
`threshold` is the smallest kept z, -inf when neither filter is on (top_k = 0 or >= V, top_p = 1).

Sampling rows: accept x_j iff u_j * q_j(x_j) < l * p_j(x_j), u_j = uniform(seed, offset + j, 0),
q_j one-hot (q_j(x_j) = 1) without draft_probs. At the first rejection j emit
argmax_y log r_j(y) + gumbel(seed, offset + j, 1 + y), r_j = max(0, p_j - min(q_j, l p_j)), or a
sample of p_j where r_j vanished in floating point; with all n accepted emit the bonus
argmax_y z_y + gumbel(seed, offset + n, 1 + y) over the kept y.
Greedy rows (T = 0): accept x_j while x_j == argmax logits[b, j] (first index on ties) or, with
l > 1, l * softmax(logits[b, j])[x_j] > q_j(x_j); emit the argmax where that fails or at n.

Kernel: two launches.
* `_position_kernel`, grid (B, k+1): one program per (row, position <= n) sweeps V once with an
  online max / sum / argmax, finds the top-k / top-p cut-off if the row asks for one, and stores
  lse, threshold and the accept test of x_j. At the bonus position of an unfiltered sampling row
  the same sweep also draws the bonus token, so plain sampling (k = 0) reads the logits once.
  Greedy rows stop after that one sweep (their lse costs one exp per entry).
* `_emit_kernel`, grid (B,): the first rejected position from the stored tests, then one more
  sweep over V only where a sampling row needs it (residual at a rejection, filtered bonus).
No [B, k+1, V] probability tensor is ever written.

Cut-off search: the cut-off is always one of the row's z values, so it is searched exactly over
the int32 "ordered keys" of fp32 values (integers whose order is the float order). Each sweep
counts the entries (top-k) or sums their exp(z - max) mass (top-p) at 16 evenly spaced keys of
the current key range, keeps the sub-range where the answer lies and shrinks it to the entries
inside: at most 9 sweeps for the 2^32 keys (a plain bisection needs 32), fewer once the range
holds a single entry. The reference finds the same entry with a partial sort. Their fp32 mass
sums round differently, so a top_p within rounding of 1 may end the nucleus at different tail
entries, whose mass is below that rounding; elsewhere the two agree exactly.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .random import gumbel, gumbel_ref, uniform, uniform_ref

MAX_BLOCK_V = 2048
MAX_SEARCH_BLOCK = 256  # the cut-off search works on [block, NUM_PIVOTS] tiles: they must fit in registers
NUM_PIVOTS = 16


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int32: accepted draft tokens per row (0..num_drafts[b])
    next_token: torch.Tensor  # [B] int64: the correction token (first rejection) or the bonus token
    lse: torch.Tensor  # [B, k+1] float32: log-normaliser of the processed logits (greedy: raw logits)
    threshold: torch.Tensor  # [B, k+1] float32: smallest kept processed logit, -inf when unfiltered
    # lse and threshold hold 0 at positions beyond num_drafts[b]; with the inputs they rebuild p_j.


@triton.jit
def _ordered_key(x):
    # Negative floats get their magnitude bits reversed; the same map turns a key back into bits.
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _key_value(key):
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _load_z(row_ptr, start, V, divisor, BLOCK: tl.constexpr):
    """Processed logits of one block; -inf past the end of the row."""
    offs = start + tl.arange(0, BLOCK)
    in_row = offs < V
    raw = tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32)
    return offs, in_row, tl.math.div_rn(raw, divisor)  # correctly rounded, as torch divides


@triton.jit
def _argmax_update(scores, start, best_score, best_index):
    """Running argmax over blocks; ties go to the first index."""
    block_best, block_index = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
    better = block_best > best_score
    return tl.where(better, block_best, best_score), tl.where(better, start + block_index, best_index)


@triton.jit
def _row_stats(row_ptr, V, divisor, seed, counter, with_sample, BLOCK_V: tl.constexpr):
    """One sweep: max, sum of exp(z - max), min, argmax and, if with_sample, a Gumbel-max sample of softmax(z)."""
    row_max = float("-inf")
    row_sum = 0.0
    row_min = float("inf")
    argmax = 0
    best_noisy = float("-inf")
    sample = 0
    for start in range(0, V, BLOCK_V):
        offs, in_row, z = _load_z(row_ptr, start, V, divisor, BLOCK_V)
        previous_max = row_max
        row_max, argmax = _argmax_update(z, start, row_max, argmax)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)  # keeps exp() away from -inf - -inf
        row_sum = row_sum * tl.exp(previous_max - shift) + tl.sum(tl.exp(z - shift), 0)
        row_min = tl.minimum(row_min, tl.min(tl.where(in_row, z, float("inf")), 0))
        if with_sample:
            best_noisy, sample = _argmax_update(z + gumbel(seed, counter, offs + 1), start, best_noisy, sample)
    return row_max, row_sum, row_min, argmax, sample


@triton.jit
def _cutoff_search(row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo, goal,
                   BY_MASS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The largest entry z whose amount of entries >= z reaches `goal`: their count, or (BY_MASS)
    their mass sum exp(z - row_max). The answer's key lies in [key_lo, key_hi], key_lo is an entry
    that reaches the goal and mass_lo its mass. Returns the answer's key and mass."""
    pivot_ids = tl.arange(0, NUM_PIVOTS)
    while key_lo < key_hi:
        step = (key_hi - key_lo) // NUM_PIVOTS + 1
        pivot_keys = tl.minimum(key_lo + step * pivot_ids, key_hi)
        pivot_values = _key_value(pivot_keys)
        count = tl.zeros([NUM_PIVOTS], tl.float32)
        mass = tl.zeros([NUM_PIVOTS], tl.float32)
        first_above = tl.full([NUM_PIVOTS], float("inf"), tl.float32)  # smallest entry >= each pivot
        last_below = tl.full([NUM_PIVOTS], float("-inf"), tl.float32)  # largest entry < each pivot
        for start in range(0, V, BLOCK):
            offs, in_row, z = _load_z(row_ptr, start, V, divisor, BLOCK)
            above = in_row[:, None] & (z[:, None] >= pivot_values[None, :])
            count += tl.sum(above.to(tl.float32), 0)
            mass += tl.sum(tl.where(above, tl.exp(z - row_max)[:, None], 0.0), 0)
            first_above = tl.minimum(first_above, tl.min(tl.where(above, z[:, None], float("inf")), 0))
            last_below = tl.maximum(last_below, tl.max(tl.where(above, float("-inf"), z[:, None]), 0))
        if BY_MASS:
            amount = mass
        else:
            amount = count
        # The answer lies between the last pivot that reaches the goal (pivot 0 = key_lo always
        # does) and the next; snapping both ends to entries ends the search once one is left.
        # (The max() guards against -0.0 == +0.0 whose keys differ: the range must shrink.)
        best = tl.max(tl.where(amount >= goal, pivot_ids, 0), 0)
        mass_lo = tl.sum(tl.where(pivot_ids == best, mass, 0.0), 0)
        entry_above = _ordered_key(tl.sum(tl.where(pivot_ids == best, first_above, 0.0), 0))
        key_lo = tl.maximum(tl.sum(tl.where(pivot_ids == best, pivot_keys, 0), 0), entry_above)
        below_next = tl.sum(tl.where(pivot_ids == best + 1, last_below, 0.0), 0)
        key_hi = tl.where(best + 1 < NUM_PIVOTS, _ordered_key(below_next), key_hi)
    return key_lo, mass_lo


@triton.jit
def _position_kernel(logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_db, num_drafts_ptr,
                     draft_probs_ptr, stride_qb, stride_qj, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr,
                     offset_ptr, lenience, lse_ptr, threshold_ptr, accepted_ptr, token_ptr, V, K,
                     HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                     NUM_PIVOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1)
    num_drafts = tl.minimum(tl.load(num_drafts_ptr + row).to(tl.int32), K)  # never read past the draft
    if position <= num_drafts:
        temperature = tl.load(temperature_ptr + row)
        sampling = temperature > 0.0
        divisor = tl.where(sampling, temperature, 1.0)
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
        top_p = tl.load(top_p_ptr + row)
        by_count = sampling & (top_k > 0) & (top_k < V)
        by_mass = sampling & (top_p < 1.0)
        filtered = by_count | by_mass
        seed = tl.load(seed_ptr + row)
        counter = tl.load(offset_ptr + row) + position
        row_ptr = logits_ptr + row * stride_lb + position * stride_lj

        fused_bonus = sampling & (position == num_drafts) & ~filtered
        row_max, mass_lo, row_min, argmax, sample = _row_stats(row_ptr, V, divisor, seed, counter, fused_bonus, BLOCK_V)
        key_lo = _ordered_key(row_min)
        if by_count:
            key_lo, mass_lo = _cutoff_search(row_ptr, V, divisor, row_max, key_lo, _ordered_key(row_max), mass_lo,
                                             top_k.to(tl.float32), False, SEARCH_BLOCK, NUM_PIVOTS)
        if by_mass:
            key_lo, mass_lo = _cutoff_search(row_ptr, V, divisor, row_max, key_lo, _ordered_key(row_max), mass_lo,
                                             top_p * mass_lo, True, SEARCH_BLOCK, NUM_PIVOTS)
        threshold = tl.where(filtered, _key_value(key_lo), float("-inf"))
        lse = row_max + tl.log(mass_lo)

        out = row * (K + 1) + position
        tl.store(lse_ptr + out, lse)
        tl.store(threshold_ptr + out, threshold)
        # The token emitted here if no draft before it is rejected; -1: _emit_kernel draws it.
        tl.store(token_ptr + out, tl.where(sampling, tl.where(fused_bonus, sample, -1), argmax))
        if position < num_drafts:
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


@triton.jit
def _sample_emitted(row_ptr, q_row_ptr, V, divisor, lse, threshold, draft_token, is_draft, lenience, seed, counter,
                    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Gumbel-max sample of the residual r at a rejected draft, else (bonus, or r vanished) of p."""
    residual_best = float("-inf")
    residual_token = 0
    plain_best = float("-inf")
    plain_token = 0
    for start in range(0, V, BLOCK_V):
        offs, in_row, z = _load_z(row_ptr, start, V, divisor, BLOCK_V)
        kept = in_row & (z >= threshold)
        noise = gumbel(seed, counter, offs + 1)
        p = tl.where(kept, tl.exp(z - lse), 0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_row_ptr + offs, mask=in_row & is_draft, other=0.0).to(tl.float32)
        else:
            q = (offs == draft_token).to(tl.float32)
        residual = tl.maximum(p - tl.minimum(q, lenience * p), 0.0)
        residual_best, residual_token = _argmax_update(tl.log(residual) + noise, start, residual_best,
                                                       residual_token)  # log 0 = -inf: never chosen
        plain_best, plain_token = _argmax_update(tl.where(kept, z + noise, float("-inf")), start, plain_best,
                                                 plain_token)
    return tl.where(is_draft & (residual_best > float("-inf")), residual_token, plain_token)


@triton.jit
def _emit_kernel(logits_ptr, stride_lb, stride_lj, draft_tokens_ptr, stride_db, num_drafts_ptr,
                 draft_probs_ptr, stride_qb, stride_qj, temperature_ptr, seed_ptr, offset_ptr, lenience, lse_ptr,
                 threshold_ptr, accepted_ptr, token_ptr, num_accepted_ptr, next_token_ptr, V, K,
                 HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, POSITIONS_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    num_drafts = tl.minimum(tl.load(num_drafts_ptr + row).to(tl.int32), K)
    positions = tl.arange(0, POSITIONS_BLOCK)
    in_draft = positions < num_drafts
    accepted = tl.load(accepted_ptr + row * (K + 1) + positions, mask=in_draft, other=1)
    emit_at = tl.min(tl.where(in_draft & (accepted == 0), positions, num_drafts), 0)
    tl.store(num_accepted_ptr + row, emit_at)

    out = row * (K + 1) + emit_at
    next_token = tl.load(token_ptr + out)
    is_draft = emit_at < num_drafts
    temperature = tl.load(temperature_ptr + row)
    if (temperature > 0.0) & (is_draft | (next_token < 0)):
        draft_token = tl.load(draft_tokens_ptr + row * stride_db + emit_at, mask=is_draft, other=-1)
        next_token = _sample_emitted(logits_ptr + row * stride_lb + emit_at * stride_lj,
                                     draft_probs_ptr + row * stride_qb + emit_at * stride_qj, V, temperature,
                                     tl.load(lse_ptr + out), tl.load(threshold_ptr + out), draft_token, is_draft,
                                     lenience, tl.load(seed_ptr + row), tl.load(offset_ptr + row) + emit_at,
                                     HAS_DRAFT_PROBS, BLOCK_V)
    tl.store(next_token_ptr + row, next_token.to(tl.int64))


def _check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience,
                  seed=None, offset=None) -> None:
    """Shapes, dtypes, devices and lenience always; tensor values only on the CPU."""
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
    if not lenience >= 1.0:
        raise ValueError(f"lenience must be a float >= 1 (1 = exact verification), got {lenience}")
    if logits.is_cuda:
        return  # checking the values below would cost a host sync on every decoding step
    if ((num_drafts < 0) | (num_drafts > k)).any():
        raise ValueError(f"num_drafts must be in [0, k={k}], got {num_drafts.tolist()}")
    drafted = torch.arange(k) < num_drafts[:, None]
    if ((draft_tokens < 0) | (draft_tokens >= vocab))[drafted].any():
        raise ValueError(f"draft tokens (positions < num_drafts) must be in [0, V={vocab})")
    if (temperature < 0).any() or (top_k < 0).any() or ((top_p <= 0) | (top_p > 1)).any():
        raise ValueError("need temperature >= 0 (0 = greedy), top_k >= 0 (0 = off), 0 < top_p <= 1 (1 = off)")


def verify(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, offset: torch.Tensor, lenience: float = 1.0) -> VerifyResult:
    """Verify a batch of ragged draft chains in two Triton launches; the rule is in the module docstring.

    logits        [B, k+1, V] float   reviewer logits (any float dtype; fp32 math); k may be 0
    draft_tokens  [B, k]      int     draft j of row b; positions >= num_drafts[b] are ignored
    num_drafts    [B]         int     0 <= n_b <= k
    draft_probs   None (deterministic drafts, q one-hot) or [B, k, V] float: the q_j draft j was drawn from
    temperature   [B] float (0 = greedy), top_k [B] int (0 = off), top_p [B] float (1 = off)
    seed, offset  [B] int64   position j draws from counter offset + j
    lenience      float >= 1, the same for the whole call
    Returns VerifyResult: num_accepted [B] int32, next_token [B] int64, lse / threshold [B, k+1] float32.
    On CUDA only shapes, dtypes and devices are checked (the values would need a host sync).
    """
    _check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience, seed, offset)
    batch, positions, vocab = logits.shape
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if draft_probs is not None and draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    q = logits if draft_probs is None else draft_probs  # never read without draft probs
    draft_tokens = draft_tokens.contiguous()
    row_inputs = (logits, logits.stride(0), logits.stride(1), draft_tokens, draft_tokens.stride(0),
                  num_drafts.contiguous(), q, q.stride(0), q.stride(1), temperature.to(torch.float32).contiguous())
    randomness = (seed.to(torch.int64).contiguous(), offset.to(torch.int64).contiguous(), float(lenience))
    lse = torch.zeros(batch, positions, dtype=torch.float32, device=device)
    threshold = torch.zeros(batch, positions, dtype=torch.float32, device=device)
    accepted = torch.empty(batch, positions, dtype=torch.int8, device=device)
    token = torch.empty(batch, positions, dtype=torch.int32, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int32, device=device)
    next_token = torch.empty(batch, dtype=torch.int64, device=device)
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    num_warps = max(1, min(8, block_v // 256))
    _position_kernel[(batch, positions)](
        *row_inputs, top_k.contiguous(), top_p.to(torch.float32).contiguous(), *randomness, lse, threshold, accepted,
        token, vocab, positions - 1, HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v,
        SEARCH_BLOCK=min(block_v, MAX_SEARCH_BLOCK), NUM_PIVOTS=NUM_PIVOTS, num_warps=num_warps)
    _emit_kernel[(batch,)](
        *row_inputs, *randomness, lse, threshold, accepted, token, num_accepted, next_token, vocab, positions - 1,
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v, POSITIONS_BLOCK=triton.next_power_of_2(positions),
        num_warps=num_warps)
    return VerifyResult(num_accepted, next_token, lse, threshold)


def _cutoffs(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, sampling: torch.Tensor) -> torch.Tensor:
    """[R, V] processed logits -> [R] threshold (module docstring). Only filtered rows are ranked,
    and only as far as needed: a partial sort (topk) that widens until it holds the cut-off is
    many times cheaper than sorting a 150k vocabulary, and nuclei are usually small."""
    vocab = z.shape[-1]
    by_count = sampling & (top_k > 0) & (top_k < vocab)
    by_mass = sampling & (top_p < 1)
    threshold = torch.full(z.shape[:1], float("-inf"), device=z.device)
    rows = (by_count | by_mass).nonzero()[:, 0]
    if rows.numel() == 0:
        return threshold
    z, by_count, by_mass = z[rows], by_count[rows, None], by_mass[rows]
    kth = top_k[rows, None].long().clamp(1, vocab) - 1
    width = min(vocab, max(256, int(torch.where(by_count, kth, 0).max()) + 1))
    ranked = z.topk(width, dim=-1).values
    count_cut = torch.where(by_count, ranked.gather(1, kth.clamp(max=width - 1)), float("-inf"))
    row_max = ranked[:, :1]
    goal = top_p[rows, None] * torch.where(z >= count_cut, torch.exp(z - row_max), 0.0).sum(-1, keepdim=True)
    while True:
        # The first ranked entry whose running kept mass reaches the goal: a tie group's later
        # members only add mass, so its value is the largest one that qualifies.
        reached = torch.where(ranked >= count_cut, torch.exp(ranked - row_max), 0.0).cumsum(-1) >= goal
        if width == vocab or reached[by_mass].any(-1).all():
            break
        width = min(vocab, 8 * width)
        ranked = z.topk(width, dim=-1).values
    # Rounding can leave the goal just out of reach of the whole kept mass: then everything kept stays.
    smallest_kept = torch.maximum(count_cut, ranked[:, -1:])
    mass_cut = torch.where(reached.any(-1, keepdim=True), ranked.gather(1, reached.int().argmax(-1, keepdim=True)),
                           smallest_kept)
    threshold[rows] = torch.where(by_mass[:, None], torch.maximum(count_cut, mass_cut), count_cut)[:, 0]
    return threshold


def _processed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               filtered: bool = True):
    """[R, V] logits of rows with their own settings -> z, threshold, lse (greedy rows: raw logits, no filter).
    filtered=False: the caller knows no row uses top-k / top-p, so the cut-off search (which reads
    the device to find the filtered rows) is skipped."""
    sampling = temperature > 0
    z = logits.float() / torch.where(sampling, temperature.float(), 1.0)[:, None]
    if filtered:
        threshold = _cutoffs(z, top_k, top_p.float(), sampling)
    else:
        threshold = torch.full(z.shape[:1], float("-inf"), device=z.device)
    lse = torch.where(z >= threshold[:, None], z, float("-inf")).logsumexp(-1)
    return z, threshold, lse


def _probs(z: torch.Tensor, threshold: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.where(z >= threshold[:, None], torch.exp(z - lse[:, None]), 0.0)


def _draft_distribution(draft_tokens, draft_probs, rows, position, vocab):
    """q of draft `position` for the given rows: draft_probs, or one-hot at the draft token."""
    if draft_probs is not None:
        return draft_probs[rows, position].float()
    return torch.nn.functional.one_hot(draft_tokens[rows, position], vocab).float()


def _residual(p: torch.Tensor, q: torch.Tensor, lenience: torch.Tensor):
    """min(q, l p), the part of q that is accepted, and the unnormalised residual max(0, p - min(q, l p))."""
    accepted_part = torch.minimum(q, lenience * p)
    return accepted_part, (p - accepted_part).clamp_min(0.0)


def verify_ref(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
               draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seed: torch.Tensor, offset: torch.Tensor, lenience: float = 1.0) -> VerifyResult:
    """PyTorch twin of `verify`: same arguments, semantics and random numbers. Vectorised over
    rows, one loop step per position."""
    _check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience, seed, offset)
    batch, positions, vocab = logits.shape
    device = logits.device
    seed, offset, num_drafts = seed.long(), offset.long(), num_drafts.long()
    lenience_t = torch.tensor(lenience, dtype=torch.float32, device=device)  # fp32, as the kernel sees it
    sampling = temperature > 0
    drafted = torch.arange(positions - 1, device=device) < num_drafts[:, None]
    tokens = torch.where(drafted, draft_tokens.long(), 0)
    every_row = torch.arange(batch, device=device)
    lse = torch.zeros(batch, positions, device=device)
    threshold = torch.zeros(batch, positions, device=device)
    argmax = torch.zeros(batch, positions, dtype=torch.int64, device=device)
    rejected = torch.zeros(batch, positions, dtype=torch.bool, device=device)
    for j in range(positions):
        z, threshold[:, j], lse[:, j] = _processed(logits[:, j], temperature, top_k, top_p)
        argmax[:, j] = z.argmax(-1)
        if j == positions - 1:
            break
        x = tokens[:, j]
        z_x = z.gather(1, x[:, None])[:, 0]
        p_x = torch.where(z_x >= threshold[:, j], torch.exp(z_x - lse[:, j]), 0.0)
        q_x = draft_probs[every_row, j, x].float() if draft_probs is not None else torch.ones_like(p_x)
        u = uniform_ref(seed, offset + j, 0)
        greedy_accept = (x == argmax[:, j]) | ((lenience > 1) & (lenience_t * p_x > q_x))
        accept = torch.where(sampling, u * q_x < lenience_t * p_x, greedy_accept)
        rejected[:, j] = drafted[:, j] & ~accept
    position_ids = torch.arange(positions, device=device)
    num_accepted = torch.where(rejected, position_ids, num_drafts[:, None]).amin(1)
    next_token = argmax[every_row, num_accepted]

    # Sampling rows draw at their emitting position: the bonus (or a vanished residual) samples p,
    # a rejection samples the residual. One Gumbel noise row serves both.
    rows = sampling.nonzero()[:, 0]
    at = num_accepted[rows]
    z = logits[rows, at].float() / temperature[rows, None].float()
    noise = gumbel_ref(seed[rows, None], (offset[rows] + at)[:, None], 1 + torch.arange(vocab, device=device))
    sample = torch.where(z >= threshold[rows, at][:, None], z + noise, float("-inf")).argmax(-1)
    rejecting = at < num_drafts[rows]
    p = _probs(z, threshold[rows, at], lse[rows, at])[rejecting]
    q = _draft_distribution(tokens, draft_probs, rows[rejecting], at[rejecting], vocab)
    _, residual = _residual(p, q, lenience_t)
    residual_sample = (residual.log() + noise[rejecting]).argmax(-1)
    sample[rejecting] = torch.where((residual > 0).any(-1), residual_sample, sample[rejecting])
    next_token[sampling] = sample

    beyond = position_ids > num_drafts[:, None]
    return VerifyResult(num_accepted.int(), next_token, lse.masked_fill(beyond, 0.0),
                        threshold.masked_fill(beyond, 0.0))


def reviewer_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """The reviewer's sampling distribution p: logits [B, ..., V], settings [B] (shared by a row's
    positions) -> [B, ..., V] float32. Greedy rows (T == 0) give the one-hot argmax.
    filtered=False (no row uses top-k / top-p, known on the host) makes it free of host syncs."""
    vocab = logits.shape[-1]
    per_row = logits[0].numel() // vocab
    settings = [s.repeat_interleave(per_row) for s in (temperature, top_k, top_p)]
    z, threshold, lse = _processed(logits.reshape(-1, vocab), *settings, filtered=filtered)
    greedy = (settings[0] == 0)[:, None]
    probs = torch.where(greedy, torch.nn.functional.one_hot(z.argmax(-1), vocab).float(), _probs(z, threshold, lse))
    return probs.reshape(logits.shape)


def emitted_distribution(logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                         draft_probs: torch.Tensor | None, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor, lenience: float, result: VerifyResult) -> torch.Tensor:
    """[B, k+1, V] float32: the distribution of the token `result` emitted at each position j <=
    num_accepted[b] (zeros beyond), the proposal the level above must use for it (ALGORITHMS.md 2).
    Sampling rows: e_j = min(q_j, l p_j) + (1 - sum min(q_j, l p_j)) * norm(r_j) at a draft
    position (p_j where r_j vanished), p_j at the bonus position; p_j is rebuilt from result.lse and
    result.threshold. Greedy rows: one-hot of the emitted token."""
    _check_inputs(logits, draft_tokens, num_drafts, draft_probs, temperature, top_k, top_p, lenience)
    batch, positions, vocab = logits.shape
    device = logits.device
    lenience_t = torch.tensor(lenience, dtype=torch.float32, device=device)
    sampling = temperature > 0
    divisor = torch.where(sampling, temperature.float(), 1.0)[:, None]
    drafted = torch.arange(positions - 1, device=device) < num_drafts[:, None]
    tokens = torch.where(drafted, draft_tokens.long(), 0)
    every_row = torch.arange(batch, device=device)
    emitted = torch.zeros(batch, positions, vocab, device=device)
    for j in range(positions):
        e = _probs(logits[:, j].float() / divisor, result.threshold[:, j], result.lse[:, j])
        emitted_token = result.next_token
        if j < positions - 1:
            accepted_part, residual = _residual(e, _draft_distribution(tokens, draft_probs, every_row, j, vocab),
                                                lenience_t)
            residual_mass = residual.sum(-1, keepdim=True)
            r = torch.where(residual_mass > 0, residual / residual_mass, e)
            e = torch.where(drafted[:, j, None], accepted_part + (1 - accepted_part.sum(-1, keepdim=True)) * r, e)
            emitted_token = torch.where(j < result.num_accepted, tokens[:, j], result.next_token)
        greedy_e = torch.nn.functional.one_hot(emitted_token, vocab).float()
        e = torch.where(sampling[:, None], e, greedy_e)
        emitted[:, j] = torch.where((j <= result.num_accepted)[:, None], e, 0.0)
    return emitted
