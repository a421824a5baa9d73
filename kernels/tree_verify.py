"""Lossless verification of a token tree (staged speculative decoding, docs/algorithms.md: token trees).

Row b holds a tree of N nodes. Node 0 is the root: the last emitted token, not yet in the
target's cache. Nodes 1..N-1 are draft tokens; `parents[b, i] < i`, and padded nodes (parent
-2) come after the real ones and are ignored. `logits[b, i]` is the target's next-token
distribution after the path root..i.

The walk starts at the root. At node v (depth d) the row tries v's children in index order:
* greedy row (temperature 0): move to the first child whose token is argmax logits[b, v];
* sampling row: with p' = p_v (the processed distribution: temperature, top-k, top-p), the
  r-th child c tried at v is accepted iff u * q(c) < p'(c), u = uniform(seed, offset + d, 0)
  for r = 0 (what verify.py draws for a chain's token at d: a chain-shaped tree's walk is the
  chain's) and uniform(seed, offset + d, 1 + V + r) after it. q is the child's proposal `draft_probs[b, c]`; a rejection leaves
  p' = norm(max(0, p' - q)). Without draft_probs every child is deterministic (q one-hot):
  the test is u < p'(c) and a rejection removes c from p'.
Accepting a child moves there. Where no child is accepted the row emits one token: the
argmax (greedy) or argmax_y log p'(y) + gumbel(seed, offset + d, 1 + y) (sampling; if p'
vanished in floating point, p_v is sampled instead). Every step of a sampling row is a
rejection-sampling stage whose outcome is distributed as p_v, so the emitted tokens follow
the target exactly.

Processed distribution: z = logits / temperature; top-k keeps z >= the k-th largest z
(ties kept); top-p then keeps z >= t, t the largest kept value whose kept mass at or above
it is >= top_p (ties kept). top_k 0 and top_p 1 switch them off. Its statistics, cut-off
search and PyTorch reference are sampling.py's, shared with verify.py.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .random import gumbel, gumbel_ref, uniform, uniform_ref
from .sampling import (NUM_PIVOTS, block_sizes, check_settings, cutoff_workspace, gumbel_update, load_p,
                       may_read, probs_ref, processed_ref, row_cutoff, row_settings, row_stats)

TREE_BLOCK_V = 1024
NUM_WARPS = 8  # one program per row and few rows: wide programs keep more of V in flight
PADDING = -2  # parent of a padded node (csd_engine.ops builds masks with the same convention)


@dataclass
class TreeVerifyResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft nodes = depth of the final node
    accepted_nodes: torch.Tensor  # [B, N] int64, node index at depth 1, 2, ...; -1 after the path
    next_token: torch.Tensor  # [B] int64, the correction / bonus token emitted after the path


@triton.jit
def _write_target_probs(row_ptr, residual_ptr, V, divisor, lse, threshold, BLOCK_V: tl.constexpr):
    """residual = p_v = exp(z - lse) where z >= threshold; returns its sum."""
    tl.debug_barrier()  # see _tree_verify_kernel: workspace writes are fenced on both sides
    total = 0.0
    for start in range(0, V, BLOCK_V):
        offs, in_row, _, _, p = load_p(row_ptr, start, V, divisor, threshold, lse, BLOCK_V)
        tl.store(residual_ptr + offs, p, mask=in_row)
        total += tl.sum(p, axis=0)
    tl.debug_barrier()
    return total


@triton.jit
def _shrink_residual(residual_ptr, draft_ptr, token, mass, V, DRAWN: tl.constexpr, BLOCK_V: tl.constexpr):
    """After a rejected child: residual = max(0, residual / mass - q) for a drawn child (q at
    draft_ptr), residual[token] = 0 for a deterministic one. Returns the new sum."""
    tl.debug_barrier()
    total = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = tl.load(residual_ptr + offs, mask=offs < V, other=0.0)
        if DRAWN:
            q = tl.load(draft_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
            w = tl.maximum(w / mass - q, 0.0)
        else:
            w = tl.where(offs == token, 0.0, w)
        tl.store(residual_ptr + offs, w, mask=offs < V)
        total += tl.sum(w, axis=0)
    tl.debug_barrier()
    return total


@triton.jit
def _sample_residual(residual_ptr, V, seed, counter, BLOCK_V: tl.constexpr):
    """Gumbel-max sample of the (unnormalised) residual."""
    best_score = float("-inf")
    best_index = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = tl.load(residual_ptr + offs, mask=offs < V, other=0.0)
        log_w = tl.where(w > 0.0, tl.log(tl.where(w > 0.0, w, 1.0)), float("-inf"))  # log(0) = -inf, no warning
        best_score, best_index = gumbel_update(log_w, gumbel(seed, counter, 1 + offs), start, best_score, best_index)
    return best_index


@triton.jit
def _tree_verify_kernel(logits_ptr, stride_lb, stride_ln, draft_ptr, stride_db, stride_dn,
                        tokens_ptr, parents_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, offset_ptr,
                        residual_ptr, num_accepted_ptr, accepted_nodes_ptr, next_token_ptr, scratch_ptr, stride_s, N, V,
                        HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                        NUM_PIVOTS: tl.constexpr):
    """One program per row. The residual p' lives in the row's workspace, written in blocks
    but read back one element at a time (p'(c), which any thread may have stored): every
    write is fenced by barriers on both sides, so no thread reads a stale or a future value.
    All branch conditions are per-row scalars, the same in every thread."""
    b = tl.program_id(0).to(tl.int64)
    sampling, divisor, top_k, top_p, by_count, by_mass = row_settings(temperature_ptr, top_k_ptr, top_p_ptr, b, V)
    greedy = ~sampling
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    tokens_row = tokens_ptr + b * N
    parents_row = parents_ptr + b * N
    residual_row = residual_ptr + b * V  # p' of the current node, unnormalised, sum = mass

    node = 0
    searching = True
    for depth in range(0, N):  # the path holds at most N - 1 draft nodes
        if searching:
            node_logits = logits_ptr + b * stride_lb + node * stride_ln
            counter = offset + depth
            # Greedy rows: divisor 1, so best is the argmax of the raw logits.
            row_max, row_sum, row_min, best, _, _ = row_stats(node_logits, 0, V, V, divisor, seed, counter, False,
                                                              BLOCK_V)
            threshold = float("-inf")
            lse = 0.0
            mass = 0.0
            if sampling:
                threshold, kept_mass = row_cutoff(node_logits, V, divisor, row_max, row_sum, row_min, by_count,
                                                  by_mass, top_k, top_p, scratch_ptr + b * stride_s, SEARCH_BLOCK,
                                                  NUM_PIVOTS)
                lse = row_max + tl.log(kept_mass)
                mass = _write_target_probs(node_logits, residual_row, V, divisor, lse, threshold, BLOCK_V)

            chosen = -1
            tried = 0
            for child in range(node + 1, N):
                if (tl.load(parents_row + child) == node) & (chosen < 0):
                    token = tl.load(tokens_row + child)
                    if greedy:
                        accepted = token == best
                    else:
                        # u * q(c) < p'(c) = residual[c] / mass, without dividing: once p' has
                        # vanished (mass 0) nothing is accepted and nothing more is removed.
                        u_mass = uniform(seed, counter, tl.where(tried == 0, 0, 1 + V + tried)) * mass
                        draft_row = draft_ptr + b * stride_db + child * stride_dn
                        if HAS_DRAFT_PROBS:
                            u_mass *= tl.load(draft_row + token).to(tl.float32)
                        accepted = u_mass < tl.load(residual_row + token)
                        if (mass > 0.0) & ~accepted:
                            mass = _shrink_residual(residual_row, draft_row, token, mass, V, HAS_DRAFT_PROBS, BLOCK_V)
                    if accepted:
                        chosen = child
                    tried += 1

            if chosen >= 0:
                tl.store(accepted_nodes_ptr + b * N + depth, chosen.to(tl.int64))
                node = chosen
            else:
                emitted = best
                if sampling:
                    if mass <= 0.0:  # p' vanished in floating point: sample p_v instead
                        _write_target_probs(node_logits, residual_row, V, divisor, lse, threshold, BLOCK_V)
                    emitted = _sample_residual(residual_row, V, seed, counter, BLOCK_V)
                tl.store(next_token_ptr + b, emitted.to(tl.int64))
                tl.store(num_accepted_ptr + b, depth)
                searching = False


def _check_inputs(logits, tokens, parents, draft_probs, temperature, top_k, top_p, seed, offset, check_values=True,
                  max_top_k=None) -> None:
    """Shapes, dtypes and devices always; tensor values only on the CPU with check_values."""
    if logits.dim() != 3 or min(logits.shape) < 1:
        raise ValueError(f"logits must be [B, N, V] with B, N, V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating dtype, got {logits.dtype}")
    batch, nodes, vocab = logits.shape
    for name, t in (("tokens", tokens), ("parents", parents)):
        if tuple(t.shape) != (batch, nodes):
            raise ValueError(f"{name} must be [B={batch}, N={nodes}], got {tuple(t.shape)}")
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (batch, nodes, vocab):
            raise ValueError(f"draft_probs must be None or [B={batch}, N={nodes}, V={vocab}], got {tuple(draft_probs.shape)}")
        if not draft_probs.is_floating_point():
            raise TypeError(f"draft_probs must be a floating dtype, got {draft_probs.dtype}")
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed), ("offset", offset)):
        if tuple(t.shape) != (batch,):
            raise ValueError(f"{name} must be [B={batch}], got {tuple(t.shape)}")
    tensors = [logits, tokens, parents, temperature, top_k, top_p, seed, offset] + ([draft_probs] if draft_probs is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device, got {[str(t.device) for t in tensors]}")
    if logits.is_cuda or not check_values:
        return  # as in verify.py: checking the values below would cost a host sync on every step
    index = torch.arange(nodes, device=parents.device)
    padded = parents == PADDING
    real = (parents >= 0) & (parents < index)
    if not (parents[:, 0] == -1).all():
        raise ValueError("parents[:, 0] must be -1: node 0 is the root")
    if not (real | padded)[:, 1:].all():
        raise ValueError(f"parents[b, i] for i >= 1 must be in [0, i) or {PADDING} (padding)")
    if (padded.int().cummax(dim=1).values != padded.int()).any():
        raise ValueError("padded nodes (parent -2) must come after every real node of their row")
    if ((tokens < 0) | (tokens >= vocab))[real].any():
        raise ValueError(f"draft tokens must be in [0, V={vocab})")
    check_settings(temperature, top_k, top_p, vocab, max_top_k)


def tree_verify(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                offset: torch.Tensor, *, all_greedy: bool | None = None, check_values: bool = True) -> TreeVerifyResult:
    """Verify one token tree per row; see the module docstring for the rule.

    logits       [B, N, V] float  target logits at every node (fp32 / bf16 / fp16)
    tokens       [B, N]    int    tokens[b, 0] = root token, then the draft tokens
    parents      [B, N]    int    -1 for the root, [0, i) for node i, -2 for padding at the end
    draft_probs  None (deterministic children) or [B, N, V] float: the q node i was drawn from
    temperature  [B] float (0 = greedy), top_k [B] int (0 = off), top_p [B] float (1 = off)
    seed, offset [B] int64 counter-based randomness: depth d uses counter offset + d
    check_values False skips the value checks on CPU tensors (on CUDA they never run: a host sync)
    all_greedy   the references' hint, taken and unused: the one launch is the same either way
    Returns TreeVerifyResult(num_accepted [B] int64, accepted_nodes [B, N] int64, next_token [B] int64).

    One program per row walks the tree; the residual p' lives in a float32 workspace [B, V]
    allocated here (4 * B * V bytes).
    """
    _check_inputs(logits, tokens, parents, draft_probs, temperature, top_k, top_p, seed, offset, check_values)
    batch, nodes, vocab = logits.shape
    device = logits.device
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    draft = logits if draft_probs is None else draft_probs  # unread without draft probs
    if draft.stride(-1) != 1:
        draft = draft.contiguous()
    residual = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    block_v, search_block, _ = block_sizes(vocab, TREE_BLOCK_V)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    next_token = torch.empty(batch, dtype=torch.int64, device=device)
    scratch = cutoff_workspace(batch, vocab, device)
    _tree_verify_kernel[(batch,)](
        logits, logits.stride(0), logits.stride(1), draft, draft.stride(0), draft.stride(1),
        tokens.to(torch.int64).contiguous(), parents.to(torch.int64).contiguous(),
        temperature.to(torch.float32).contiguous(), top_k.to(torch.int32).contiguous(),
        top_p.to(torch.float32).contiguous(), seed.to(torch.int64).contiguous(), offset.to(torch.int64).contiguous(),
        residual, num_accepted, accepted_nodes, next_token, scratch, scratch.stride(0), nodes, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v, SEARCH_BLOCK=search_block, NUM_PIVOTS=NUM_PIVOTS,
        num_warps=NUM_WARPS)
    return TreeVerifyResult(num_accepted, accepted_nodes, next_token)


def tree_verify_ref(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                    temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                    offset: torch.Tensor, *, all_greedy: bool | None = None, filtered: bool | None = None,
                    max_top_k: int | None = None, check_values: bool = True) -> TreeVerifyResult:
    """PyTorch twin of `tree_verify`: same arguments, same random numbers, same result.
    Vectorised over rows; Python loops over depth and over child slots (N * N / 2 small steps),
    fixed shapes throughout. Host-known hints (None = look on CPU tensors, the general case on a
    device; with them and check_values=False nothing reads the device):
    all_greedy  every row has temperature 0: only each node's argmax is needed
    filtered, max_top_k  as in sampling.processed_ref
    """
    _check_inputs(logits, tokens, parents, draft_probs, temperature, top_k, top_p, seed, offset, check_values,
                  max_top_k)
    batch, nodes, vocab = logits.shape
    device = logits.device
    rows = torch.arange(batch, device=device)
    seed, offset, tokens, parents = seed.long(), offset.long(), tokens.long(), parents.long()
    greedy = temperature == 0
    if all_greedy is None:
        all_greedy = may_read(greedy) and bool(greedy.all())
    if all_greedy:
        return _greedy_tree_verify_ref(logits, tokens, parents)
    per_node = [s.repeat_interleave(nodes) for s in (temperature, top_k, top_p)]
    probs = probs_ref(*processed_ref(logits.reshape(-1, vocab), *per_node, filtered, max_top_k)).view(logits.shape)
    best = logits.argmax(-1)  # [B, N] greedy choice after each node; ties -> first index
    gumbel_index = 1 + torch.arange(vocab, device=device)

    node = torch.zeros(batch, dtype=torch.int64, device=device)
    searching = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    next_token = torch.zeros(batch, dtype=torch.int64, device=device)
    for depth in range(nodes):
        counter = offset + depth
        residual = probs[rows, node]  # p', unnormalised; its sum is `mass`
        mass = residual.sum(-1)
        chosen = torch.full((batch,), -1, dtype=torch.int64, device=device)
        tried = torch.zeros(batch, dtype=torch.int64, device=device)
        for child in range(depth + 1, nodes):  # a node at depth d has index >= d, its children > d
            trying = searching & (parents[:, child] == node) & (chosen < 0)
            token = torch.where(trying, tokens[:, child], 0)
            u_mass = uniform_ref(seed, counter, torch.where(tried == 0, 0, 1 + vocab + tried)) * mass  # u * q(c) < p'(c)
            if draft_probs is None:
                sampled_accept = u_mass < residual[rows, token]
                shrunk = residual.clone()
                shrunk[rows, token] = 0
            else:
                q = draft_probs[:, child].float()
                sampled_accept = u_mass * q[rows, token] < residual[rows, token]
                shrunk = (residual / mass[:, None] - q).clamp(min=0)
            accepted = trying & torch.where(greedy, token == best[rows, node], sampled_accept)
            rejected = trying & ~greedy & (mass > 0) & ~accepted
            residual = torch.where(rejected[:, None], shrunk, residual)
            mass = torch.where(rejected, shrunk.sum(-1), mass)
            chosen = torch.where(accepted, child, chosen)
            tried += trying.long()
        stopping = searching & (chosen < 0)
        residual = torch.where((mass > 0)[:, None], residual, probs[rows, node])
        sampled = (residual.log() + gumbel_ref(seed[:, None], counter[:, None], gumbel_index)).argmax(-1)
        next_token = torch.where(stopping, torch.where(greedy, best[rows, node], sampled), next_token)
        num_accepted = torch.where(stopping, depth, num_accepted)
        moved = searching & ~stopping
        accepted_nodes[:, depth] = torch.where(moved, chosen, -1)
        node = torch.where(moved, chosen, node)
        searching = moved
    return TreeVerifyResult(num_accepted, accepted_nodes, next_token)


def _greedy_tree_verify_ref(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> TreeVerifyResult:
    """tree_verify_ref for a batch whose rows are all greedy: from the root, move to the first
    child (in node order) whose token is the target's argmax after the current node; stop where
    none is, emitting that argmax. One vectorised step per depth, nothing vocabulary-sized."""
    batch, nodes, _ = logits.shape
    device = logits.device
    rows = torch.arange(batch, device=device)
    best = logits.argmax(-1)  # [B, N]; ties -> first index, as everywhere
    child_index = torch.arange(nodes, device=device)[None, :]
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    searching = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    for depth in range(nodes):
        matches = (parents == node[:, None]) & (child_index > 0) & (tokens == best[rows, node][:, None])
        found = searching & matches.any(-1)
        chosen = matches.int().argmax(-1)  # the first matching child
        num_accepted = torch.where(searching & ~found, depth, num_accepted)
        accepted_nodes[:, depth] = torch.where(found, chosen, -1)
        node = torch.where(found, chosen, node)
        searching = found
    return TreeVerifyResult(num_accepted, accepted_nodes, best[rows, node])
