"""The processed distribution (temperature, top-k, top-p) shared by the verification kernels.

Glossary (ALGORITHMS.md sections 1, 2, 5):
  z          processed logits of a row: logits / temperature; greedy rows (T = 0) keep the raw logits
  threshold  the smallest kept z; -inf when no filter is on (top_k 0 or >= V, top_p 1) and on greedy rows
  lse        log-normaliser of the kept z: p = exp(z - lse) where z >= threshold, else 0
  key        the ordered key of an fp32 value: an integer whose order is the float order
  split      a contiguous slice of the vocabulary that one program sweeps (verify.py at small batch)

Threshold: top-k keeps z >= the k-th largest z (ties kept); top-p then keeps z >= t, t the largest
kept value whose kept mass at or above it reaches top_p times the kept mass (ties kept).

Cut-off search (device): the cut-off is always one of the row's z values, so it is searched exactly
over ordered keys. Each sweep counts the entries (top-k) or sums their exp(z - max) mass (top-p)
at NUM_PIVOTS evenly spaced keys of the current key range, keeps the sub-range where the answer
lies and shrinks it to the entries inside: at most 9 sweeps for the 2^32 keys (a bisection needs
32), fewer once the range holds a single entry. The sweeps run over a row's candidates, not the
whole row, where they fit CANDIDATES: the entries at or above a lower bound of the cut-off,
copied to a workspace in one sweep. The bound: with top-k, the k-th largest maximum of the row's
blocks of BOUND_BLOCK entries (k entries reach it; found by the same search over the maxima);
with top-p alone, max + log((1 - top_p) sum / V) - 1 (the entries below it hold less than
1 - top_p of the mass). A search program thus reads its row twice with top-k (the maxima, the
candidates) or once with top-p alone and then sweeps at most CANDIDATES entries, where a search
over the row reads all of it up to 9 times per filter (one program per row and position runs
it: at small batch, its sweeps are the cut-off's latency). Where the candidates overflow, the
sweeps read the row from the bound. `processed_ref` finds the same entry on a
descending sort (or a partial sort: of a host-known width, or on the CPU one that widens as
needed). Their fp32 mass sums round differently, so a top_p within rounding of 1 may end the
nucleus at different tail entries, whose mass is below that rounding; elsewhere they agree exactly.

This module holds the @triton.jit helpers verify.py and tree_verify.py import, one small kernel
(`processed`: per-row threshold / lse / argmax with those helpers, so tests can compare the device
code with the reference directly) and the PyTorch reference `processed_ref`.
"""
import torch
import triton
import triton.language as tl

from .random import gumbel

MAX_BLOCK_V = 2048
MAX_SEARCH_BLOCK = 256  # the cut-off search works on [block, NUM_PIVOTS] tiles: they must fit in registers
NUM_PIVOTS = 16
BOUND_BLOCK = 32  # entries per block whose maxima bound a top-k cut-off from below (top_k <= V / BOUND_BLOCK)
CANDIDATES = 1024  # the most entries at or above the bound that the search sweeps instead of the row
_BOUND_BLOCK, _CANDIDATES = tl.constexpr(BOUND_BLOCK), tl.constexpr(CANDIDATES)  # as the kernels see them


@triton.jit
def ordered_key(x):
    # Negative floats get their magnitude bits reversed; the same map turns a key back into bits.
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def key_value(key):
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def load_z(row_ptr, start, V, divisor, BLOCK: tl.constexpr):
    """Processed logits of one block; -inf past the end of the row."""
    offs = start + tl.arange(0, BLOCK)
    in_row = offs < V
    raw = tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32)
    return offs, in_row, tl.math.div_rn(raw, divisor)  # correctly rounded, as torch divides


@triton.jit
def load_p(row_ptr, start, V, divisor, threshold, lse, BLOCK: tl.constexpr):
    """One block of a processed distribution, rebuilt from its threshold and lse: (offs, in_row,
    z, kept: z >= threshold in the row, p = exp(z - lse) where kept, else 0)."""
    offs, in_row, z = load_z(row_ptr, start, V, divisor, BLOCK)
    kept = in_row & (z >= threshold)
    return offs, in_row, z, kept, tl.where(kept, tl.exp(z - lse), 0.0)


@triton.jit
def load_q(q_row_ptr, offs, in_row, is_draft, draft_token, HAS_Q: tl.constexpr):
    """One block of a draft's proposal q: its row of draft_probs (HAS_Q; 0 where the position
    holds no draft), else one-hot of draft_token (-1 where none)."""
    if HAS_Q:
        q = tl.load(q_row_ptr + offs, mask=in_row & is_draft, other=0.0).to(tl.float32)
    else:
        q = (offs == draft_token).to(tl.float32)
    return q


@triton.jit
def residual_parts(p, q, lenience):
    """min(q, l p), the part of q a lenient check accepts, and the residual max(0, p - min(q, l p))."""
    accepted_part = tl.minimum(q, lenience * p)
    return accepted_part, tl.maximum(p - accepted_part, 0.0)


@triton.jit
def argmax_update(scores, start, best_score, best_index):
    """Running argmax over blocks; ties go to the first index."""
    block_best, block_index = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
    better = block_best > best_score
    return tl.where(better, block_best, best_score), tl.where(better, start + block_index, best_index)


@triton.jit
def merge_argmax(scores, indices):
    """Best of per-split (score, index) candidates, splits in vocabulary order: the first index
    on ties, so merging split argmaxes gives the argmax of the whole row."""
    best = tl.max(scores, 0)
    return best, tl.min(tl.where(scores == best, indices, 2147483647), 0)


@triton.jit
def gumbel_update(log_weights, noise, start, best_score, best_index):
    """One block of a Gumbel-max sample of exp(log_weights): log 0 = -inf is never chosen."""
    return argmax_update(log_weights + noise, start, best_score, best_index)


@triton.jit
def row_stats(row_ptr, lo, hi, V, divisor, seed, counter, with_sample, BLOCK_V: tl.constexpr):
    """One sweep of z[lo:hi] (lo, hi multiples of BLOCK_V; entries >= V are -inf): max, sum of
    exp(z - max), min, first argmax (lo if none beats -inf) and, if with_sample, the Gumbel-max
    candidate of softmax(z) (best noisy score, its index)."""
    row_max = float("-inf")
    row_sum = 0.0
    row_min = float("inf")
    argmax = lo
    best_noisy = float("-inf")
    sample = lo
    for start in range(lo, hi, BLOCK_V):
        offs, in_row, z = load_z(row_ptr, start, V, divisor, BLOCK_V)
        previous_max = row_max
        row_max, argmax = argmax_update(z, start, row_max, argmax)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)  # keeps exp() away from -inf - -inf
        row_sum = row_sum * tl.exp(previous_max - shift) + tl.sum(tl.exp(z - shift), 0)
        row_min = tl.minimum(row_min, tl.min(tl.where(in_row, z, float("inf")), 0))
        if with_sample:
            best_noisy, sample = gumbel_update(z, gumbel(seed, counter, offs + 1), start, best_noisy, sample)
    return row_max, row_sum, row_min, argmax, best_noisy, sample


@triton.jit
def merge_stats(maxes, sums, mins, argmaxes, noisy, samples):
    """row_stats of the whole row from per-split row_stats (vectors over the splits; padding
    splits hold max -inf, sum 0, min +inf, noisy -inf)."""
    row_max, argmax = merge_argmax(maxes, argmaxes)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(sums * tl.exp(maxes - shift), 0)
    best_noisy, sample = merge_argmax(noisy, samples)
    return row_max, row_sum, tl.min(mins, 0), argmax, best_noisy, sample


@triton.jit
def cutoff_search(row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo, goal,
                  BY_MASS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The largest entry z whose amount of entries >= z reaches `goal`: their count, or (BY_MASS)
    their mass sum exp(z - row_max). The answer's key lies in [key_lo, key_hi], key_lo is an entry
    that reaches the goal and mass_lo its mass. Returns the answer's key and mass."""
    pivot_ids = tl.arange(0, NUM_PIVOTS)
    while key_lo < key_hi:
        step = (key_hi - key_lo) // NUM_PIVOTS + 1
        pivot_keys = tl.minimum(key_lo + step * pivot_ids, key_hi)
        pivot_values = key_value(pivot_keys)
        count = tl.zeros([NUM_PIVOTS], tl.float32)
        mass = tl.zeros([NUM_PIVOTS], tl.float32)
        first_above = tl.full([NUM_PIVOTS], float("inf"), tl.float32)  # smallest entry >= each pivot
        last_below = tl.full([NUM_PIVOTS], float("-inf"), tl.float32)  # largest entry < each pivot
        for start in range(0, V, BLOCK):
            offs, in_row, z = load_z(row_ptr, start, V, divisor, BLOCK)
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
        entry_above = ordered_key(tl.sum(tl.where(pivot_ids == best, first_above, 0.0), 0))
        key_lo = tl.maximum(tl.sum(tl.where(pivot_ids == best, pivot_keys, 0), 0), entry_above)
        below_next = tl.sum(tl.where(pivot_ids == best + 1, last_below, 0.0), 0)
        key_hi = tl.where(best + 1 < NUM_PIVOTS, ordered_key(below_next), key_hi)
    return key_lo, mass_lo


@triton.jit
def block_maxima(row_ptr, V, divisor, out_ptr, BLOCK: tl.constexpr):
    """Stores the maximum of each BOUND_BLOCK entries of z at out_ptr[i]; returns how many blocks
    and the smallest maximum."""
    per_block = tl.arange(0, BLOCK // _BOUND_BLOCK)
    smallest = float("inf")
    for start in range(0, V, BLOCK):
        _, _, z = load_z(row_ptr, start, V, divisor, BLOCK)
        maxima = tl.max(tl.reshape(z, (BLOCK // _BOUND_BLOCK, _BOUND_BLOCK)), 1)
        ids = start // _BOUND_BLOCK + per_block
        real = ids * _BOUND_BLOCK < V
        tl.store(out_ptr + ids, maxima, mask=real)
        smallest = tl.minimum(smallest, tl.min(tl.where(real, maxima, float("inf")), 0))
    return (V + _BOUND_BLOCK - 1) // _BOUND_BLOCK, smallest


@triton.jit
def gather_candidates(row_ptr, V, divisor, row_max, low, out_ptr, BLOCK: tl.constexpr):
    """Copies the entries z >= low to out_ptr (the first CANDIDATES of them, in row order);
    returns how many there are and their mass, the sum of exp(z - row_max)."""
    count = tl.zeros((), tl.int32)
    mass = 0.0
    for start in range(0, V, BLOCK):
        _, in_row, z = load_z(row_ptr, start, V, divisor, BLOCK)
        keep = in_row & (z >= low)
        slot = count + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(out_ptr + slot, z, mask=keep & (slot < _CANDIDATES))
        count += tl.sum(keep.to(tl.int32), 0)
        mass += tl.sum(tl.where(keep, tl.exp(z - row_max), 0.0), 0)
    return count, mass


@triton.jit
def row_cutoff(row_ptr, V, divisor, row_max, row_sum, row_min, by_count, by_mass, top_k, top_p, scratch_ptr,
               SEARCH_BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """threshold (-inf unless by_count | by_mass) and the kept mass sum exp(z - row_max) over
    z >= threshold, from the row's statistics; lse = row_max + log(kept mass). scratch_ptr: the
    program's row of cutoff_workspace (the candidates, then the block maxima).
    The searches run over the candidates where they fit, else over the row from the bound."""
    key_lo = ordered_key(row_min)
    key_hi = ordered_key(row_max)
    mass_lo = row_sum
    low = row_min  # a lower bound of the cut-off (module docstring)
    if by_count:
        blocks, smallest = block_maxima(row_ptr, V, divisor, scratch_ptr + _CANDIDATES, SEARCH_BLOCK)
        tl.debug_barrier()  # the maxima every thread stored, before any thread reads them
        if top_k <= blocks:
            key, _ = cutoff_search(scratch_ptr + _CANDIDATES, blocks, tl.full((), 1.0, tl.float32), row_max,
                                   ordered_key(smallest), key_hi, tl.full((), 0.0, tl.float32),
                                   top_k.to(tl.float32), False, SEARCH_BLOCK, NUM_PIVOTS)
            low = key_value(key)
    elif by_mass:
        low = tl.maximum(row_min, row_max + tl.log((1.0 - top_p) * row_sum / V) - 1.0)
    count = tl.full((), _CANDIDATES + 1, tl.int32)  # no candidates: the searches sweep the row
    if (by_count | by_mass) & (low > row_min):
        count, mass_lo = gather_candidates(row_ptr, V, divisor, row_max, low, scratch_ptr, SEARCH_BLOCK)
        tl.debug_barrier()  # the candidates every thread stored, before any thread reads them
        key_lo = ordered_key(low)
    kept = row_sum  # the mass top-p takes its share of: the row's, or what top-k keeps
    if by_count:
        key_lo, mass_lo = search_rows(scratch_ptr, count, row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo,
                                      top_k.to(tl.float32), False, SEARCH_BLOCK, NUM_PIVOTS)
        kept = mass_lo
    if by_mass:
        key_lo, mass_lo = search_rows(scratch_ptr, count, row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo,
                                      top_p * kept, True, SEARCH_BLOCK, NUM_PIVOTS)
    return tl.where(by_count | by_mass, key_value(key_lo), float("-inf")), mass_lo


@triton.jit
def search_rows(scratch_ptr, count, row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo, goal,
                BY_MASS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """cutoff_search over the `count` candidates where they fit the workspace, else over the row."""
    if count <= _CANDIDATES:
        key_lo, mass_lo = cutoff_search(scratch_ptr, count, tl.full((), 1.0, tl.float32), row_max, key_lo, key_hi,
                                        mass_lo, goal, BY_MASS, SEARCH_BLOCK, NUM_PIVOTS)
    else:
        key_lo, mass_lo = cutoff_search(row_ptr, V, divisor, row_max, key_lo, key_hi, mass_lo, goal, BY_MASS,
                                        SEARCH_BLOCK, NUM_PIVOTS)
    return key_lo, mass_lo


def cutoff_workspace(programs: int, vocab: int, device) -> torch.Tensor:
    """[programs, floats] float32: the workspace of row_cutoff's programs (its candidates, then
    its block maxima), uninitialised (a kernel writes before it reads)."""
    return torch.empty(programs, CANDIDATES + triton.cdiv(vocab, BOUND_BLOCK), dtype=torch.float32, device=device)


@triton.jit
def row_settings(temperature_ptr, top_k_ptr, top_p_ptr, row, V):
    """A row's divisor (T, or 1 for greedy) and which filters it uses (never on greedy rows)."""
    temperature = tl.load(temperature_ptr + row)
    sampling = temperature > 0.0
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    by_count = sampling & (top_k > 0) & (top_k < V)
    by_mass = sampling & (top_p < 1.0)
    return sampling, tl.where(sampling, temperature, 1.0), top_k, top_p, by_count, by_mass


@triton.jit
def _processed_kernel(logits_ptr, stride_lr, temperature_ptr, top_k_ptr, top_p_ptr, threshold_ptr, lse_ptr,
                      argmax_ptr, scratch_ptr, stride_s, V, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                      NUM_PIVOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_lr
    sampling, divisor, top_k, top_p, by_count, by_mass = row_settings(temperature_ptr, top_k_ptr, top_p_ptr, row, V)
    row_max, row_sum, row_min, argmax, _, _ = row_stats(row_ptr, 0, V, V, divisor, 0, 0, False, BLOCK_V)
    threshold, kept_mass = row_cutoff(row_ptr, V, divisor, row_max, row_sum, row_min, by_count, by_mass, top_k,
                                      top_p, scratch_ptr + row * stride_s, SEARCH_BLOCK, NUM_PIVOTS)
    tl.store(threshold_ptr + row, threshold)
    tl.store(lse_ptr + row, row_max + tl.log(kept_mass))
    tl.store(argmax_ptr + row, argmax.to(tl.int64))


def block_sizes(vocab: int, max_block: int = MAX_BLOCK_V) -> tuple[int, int, int]:
    """(BLOCK_V, SEARCH_BLOCK, num_warps) for sweeps over a vocabulary of `vocab`."""
    block_v = min(triton.next_power_of_2(vocab), max_block)
    return block_v, max(BOUND_BLOCK, min(block_v, MAX_SEARCH_BLOCK)), max(1, min(8, block_v // 256))


def processed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device side of `processed_ref`, one program per row (the code the verification kernels run).

    logits [R, V] float; temperature [R] float (0 = greedy), top_k [R] int (0 = off), top_p [R] float (1 = off)
    Returns threshold [R] float32, lse [R] float32, argmax [R] int64 (first index on ties).
    """
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    threshold = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(threshold)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block_v, search_block, num_warps = block_sizes(vocab)
    scratch = cutoff_workspace(rows, vocab, logits.device)
    _processed_kernel[(rows,)](logits, logits.stride(0), temperature.to(torch.float32).contiguous(),
                               top_k.contiguous(), top_p.to(torch.float32).contiguous(), threshold, lse, argmax,
                               scratch, scratch.stride(0), vocab, BLOCK_V=block_v, SEARCH_BLOCK=search_block, NUM_PIVOTS=NUM_PIVOTS,
                               num_warps=num_warps)
    return threshold, lse, argmax


def filter_flags(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] settings -> ([R] bool uses top-k, [R] bool uses top-p); greedy rows use neither."""
    sampling = temperature > 0
    return sampling & (top_k > 0) & (top_k < vocab), sampling & (top_p < 1)


READS_ON_CPU = True  # tests switch it off to run the device behaviour on CPU tensors


def may_read(tensor: torch.Tensor) -> bool:
    """Whether a reference may read `tensor`'s values to save work: only on the CPU, where a read
    is no device sync. On a device every decision comes from shapes and host-known hints."""
    return READS_ON_CPU and tensor.device.type == "cpu"


def resolve_filtered(filtered: bool | None, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     vocab: int) -> bool:
    """A host-known `filtered` as given; None: look where that is free (may_read), else assume
    some row is filtered (the fixed-shape path)."""
    if filtered is not None:
        return filtered
    if not may_read(temperature):
        return True
    by_count, by_mass = filter_flags(temperature, top_k, top_p, vocab)
    return bool((by_count | by_mass).any())


def _cutoffs(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, by_count: torch.Tensor,
             by_mass: torch.Tensor, max_top_k: int | None) -> torch.Tensor:
    """[R, V] processed logits -> [R] threshold, from each row's top `width` entries in descending
    order. The width: max_top_k when the host knows each filtered row has 0 < top_k <= max_top_k
    (the nucleus then lies inside that top); else, where reads are free (CPU), a partial sort that
    widens until every nucleus is inside (nuclei are usually small, and a 150k sort is costly on a
    CPU); else the full row: fixed shapes, no host reads. The threshold is the same for any width
    that holds the cut-off (the running sums are the same prefix sums)."""
    vocab = z.shape[-1]
    adaptive = max_top_k is None and may_read(z)
    if max_top_k is not None:
        width = max(1, min(vocab, max_top_k))
    elif adaptive:
        width = min(vocab, max(256, int(torch.where(by_count, top_k, 0).max())))
    else:
        width = vocab
    kth = top_k.long().clamp(1, width)[:, None] - 1
    while True:
        ranked = z.sort(-1, descending=True).values if width == vocab else z.topk(width, -1).values  # [R, width]
        count_cut = torch.where(by_count[:, None], ranked.gather(1, kth), float("-inf"))  # [R, 1]
        row_max = ranked[:, :1]
        goal = top_p[:, None] * torch.where(z >= count_cut, torch.exp(z - row_max), 0.0).sum(-1, keepdim=True)
        # The first ranked entry whose running kept mass reaches the goal: a tie group's later
        # members only add mass, so its value is the largest one that qualifies.
        reached = torch.where(ranked >= count_cut, torch.exp(ranked - row_max), 0.0).cumsum(-1) >= goal
        if not adaptive or width == vocab or bool((reached.any(-1) | ~by_mass).all()):
            break
        width = min(vocab, 8 * width)
    # Rounding can leave the goal just out of reach of the whole kept mass: then everything kept
    # stays (with a partial sort of max_top_k the entries past it are ties of the top-k cut-off).
    smallest_kept = torch.maximum(count_cut, ranked[:, -1:])
    mass_cut = torch.where(reached.any(-1, keepdim=True), ranked.gather(1, reached.int().argmax(-1, keepdim=True)),
                           smallest_kept)
    return torch.where(by_mass[:, None], torch.maximum(count_cut, mass_cut), count_cut)[:, 0]


def processed_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  filtered: bool | None = None,
                  max_top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The processed distribution of rows with their own settings, without host reads on a device.

    logits [R, V] float; temperature [R] float (0 = greedy: raw logits, no filter), top_k [R] int
    (0 = off), top_p [R] float (1 = off).
    filtered   host-known: False = no row uses top-k / top-p (the cut-off work is skipped), True =
               some may; None = look on CPU tensors, assume True on a device (resolve_filtered).
    On a device (or with READS_ON_CPU off) nothing reads tensor values: fixed shapes only. On CPU
    tensors the top-p search may read to rank only as far as the nuclei need.
    max_top_k  host-known: every row that uses top-k or top-p has 0 < top_k <= max_top_k, so a
               top-k partial sort of that width replaces the full sort (a top-p row without top-k
               breaks the promise and gets a wrong cut-off).
    Returns z [R, V] float32, threshold [R] float32 (-inf: unfiltered), lse [R] float32.
    """
    vocab = logits.shape[-1]
    sampling = temperature > 0
    z = logits.float() / torch.where(sampling, temperature.float(), 1.0)[:, None]
    if resolve_filtered(filtered, temperature, top_k, top_p, vocab):
        by_count, by_mass = filter_flags(temperature, top_k, top_p, vocab)
        threshold = _cutoffs(z, top_k, top_p.float(), by_count, by_mass, max_top_k)
        lse = torch.where(z >= threshold[:, None], z, float("-inf")).logsumexp(-1)
    else:
        threshold = torch.full(z.shape[:1], float("-inf"), device=z.device)
        lse = z.logsumexp(-1)
    return z, threshold, lse


def top_at_zero(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V] with each sampling row's maximum (per position) subtracted; greedy rows
    (temperature [B] 0) as they are. What the engine verifies and samples from: z = logits / T
    then keeps the gaps near the top, which float32 rounds away when the logits themselves are
    divided by a small T (logit 7 at T = 1e-6 is 7e6, spaced 0.5 apart: a tie sampled 0.55 /
    0.45 and its log-probability read -0.5). The distribution is the same; the arithmetic exact
    where it matters (x - max is exact for x within a factor 2 of the max). In float32, where a
    half-precision difference would round the tail's logits."""
    logits = logits.float()
    sampling = (temperature > 0).view(-1, *(1,) * (logits.dim() - 1))
    return logits - torch.where(sampling, logits.amax(-1, keepdim=True), 0.0)  # x - 0 is x: greedy rows keep theirs


def probs_ref(z: torch.Tensor, threshold: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """processed_ref's output [..., V], [...], [...] -> p [..., V] float32."""
    return torch.where(z >= threshold[..., None], torch.exp(z - lse[..., None]), 0.0)


@triton.jit
def row_lenience(lenience_ptr, lenience, row, PER_ROW: tl.constexpr):
    """Row `row`'s lenience: from the [B] tensor where it is given per row, else the scalar."""
    if PER_ROW:
        return tl.load(lenience_ptr + row)
    else:
        return lenience


def lenience_args(lenience: float | torch.Tensor, placeholder: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """(pointer, scalar, per_row) for row_lenience: a [B] tensor by pointer, a float as a kernel
    argument (no fill launch per call); `placeholder` is any tensor on the device, never read."""
    if isinstance(lenience, torch.Tensor):
        return lenience.to(torch.float32).contiguous(), 1.0, True
    return placeholder, float(lenience), False


def lenience_rows(lenience: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """float or [B] -> [B] float32 on the device (a fill, not a copy: no transfer, graph-safe)."""
    if isinstance(lenience, torch.Tensor):
        return lenience.to(torch.float32).contiguous()
    return torch.full((batch,), float(lenience), dtype=torch.float32, device=device)


def one_hot(index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[...] int -> [..., V] float32; F.one_hot would read the indices' range back to the host to check it."""
    return (index[..., None] == torch.arange(vocab, device=index.device)).float()


def residual_ref(p: torch.Tensor, q: torch.Tensor, lenience: torch.Tensor):
    """min(q, l p), the part of q that is accepted, and the unnormalised residual max(0, p - min(q, l p));
    lenience [B, 1] (residual_parts' reference)."""
    accepted_part = torch.minimum(q, lenience * p)
    return accepted_part, (p - accepted_part).clamp_min(0.0)


def check_settings(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int,
                   max_top_k: int | None = None) -> None:
    """Value checks of [R] settings. They read the tensors: callers skip them on CUDA and when told to."""
    if (temperature < 0).any() or (top_k < 0).any() or ((top_p <= 0) | (top_p > 1)).any():
        raise ValueError("need temperature >= 0 (0 = greedy), top_k >= 0 (0 = off), 0 < top_p <= 1 (1 = off)")
    if max_top_k is not None:
        by_count, by_mass = filter_flags(temperature, top_k, top_p, vocab)
        if ((by_count | by_mass) & ((top_k <= 0) | (top_k > max_top_k))).any():
            raise ValueError(f"max_top_k={max_top_k} promises 0 < top_k <= max_top_k on every row that uses "
                             f"top-k or top-p, got top_k {top_k.tolist()}")
