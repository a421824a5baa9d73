"""Token trees (docs/algorithms.md, token trees): their shape, growing one with a neural drafter, and
verifying one with the target in a single forward.

A tree is a parent array whose node 0 is the root, the row's `pending` token (position
`committed`); node i sits at position `committed + depth[i]`. `verify_tree_and_commit` is
the step every tree strategy ends with, whoever built the tree: the target reviews all
nodes at once, the accepted path's cache entries move into contiguous slots, and the
emitted block goes back to the engine.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from csd_engine.models.runner import ForwardBatch, Runner
from csd_engine.ops import PADDING, ROOT, build_tree_mask
from csd_engine.strategies.base import (TARGET_STREAM, DecodeState, Models, StepOutput, catch_up_tokens,
                                        emitted_block, emitted_logprobs, forward_tokens, logits_at)


@dataclass(frozen=True)
class TreeShape:
    """Attention metadata of a batch of trees (node 0 = root = pending)."""

    parents: torch.Tensor  # [B, N] int64: -1 for the root, [0, i) for node i, -2 for padding at the end
    mask: torch.Tensor  # [B, N, N] bool: node i sees j iff j is i or an ancestor of i
    depth: torch.Tensor  # [B, N] int64
    max_depth: int  # host-known bound on depth (the emitted block is max_depth + 1 wide)

    @classmethod
    def build(cls, parents: torch.Tensor, max_depth: int | None = None) -> "TreeShape":
        """From a parent array; without `max_depth` the bound is N - 1 (no host read)."""
        mask, depth, _ = build_tree_mask(parents)
        return cls(parents, mask, depth, parents.shape[1] - 1 if max_depth is None else max_depth)

    def expand(self, batch: int) -> "TreeShape":
        """The same tree for `batch` rows (from a shape built for one row)."""
        return TreeShape(self.parents.expand(batch, -1), self.mask.expand(batch, -1, -1),
                         self.depth.expand(batch, -1), self.max_depth)


def branching_parents(branching: tuple[int, ...]) -> list[int]:
    """Parent array of the tree where every node of depth d has branching[d] children:
    the root, then one level after another, each node's children next to each other."""
    parents, level = [ROOT], [0]
    for children in branching:
        start = len(parents)
        parents += [node for node in level for _ in range(children)]
        level = list(range(start, len(parents)))
    return parents


def first_child_path(parents: list[int]) -> list[int]:
    """The nodes from the root down through each node's first child to a leaf."""
    path = [0]
    while path[-1] in parents:
        path.append(parents.index(path[-1]))
    return path


def with_chain(parents: list[int], under: int, length: int) -> list[int]:
    """`parents` plus a chain of `length` nodes hanging from node `under`."""
    start = len(parents)
    return parents + [under if i == 0 else start + i - 1 for i in range(length)]


def grow_tree(drafter: Runner, state: DecodeState, branching: tuple[int, ...], tree: TreeShape, max_behind: int,
              metrics_index: int, chain: Callable | None = None,
              chain_tree: TreeShape | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens [B, 1 + sum of level sizes]: pending, then level after level the drafter's
    top-b tokens after each node of the level above, most likely first (deterministic
    children: the target accepts each with probability p'(c), which is lossless).

    `tree` (one row) must start with the nodes of `branching_parents(branching)`; it may
    hold more after them. `max_behind` bounds how far the drafter's cache trails the
    committed prefix. One drafter forward per level: the first catches up on the
    committed tokens and `pending` (which the drafter then keeps cached), each later one
    feeds every tree node so far with the tree mask. Earlier levels are fed again (same
    slots, same values) because the runner lets new tokens see only the committed cache
    and the tokens of the current forward; committing tree nodes to the cache would make
    them visible to every node. Trees are small, so the extra work is small too.

    With `chain` the drafter also drafts its most likely path m tokens deeper, sped up by a
    cheaper drafter (the second stage, a vertical cascade under the tree): chain(path), path
    [B, L - 1] the most likely path above the last level (each level's first node), returns
    (tokens [B, m], length [B]) proposed after it. The last level's forward also feeds them,
    hung under that path (chain_tree: branching_parents(branching[:-1]) with the chain under
    its first-child path's end), so it gives the drafter's top-1 after each of them at no
    extra forward (one more where the tree has a single level). The drafter accepts them
    while they equal its own top-1 (the first against the likely leaf); its top-1 after the
    r it accepted are its next r tokens after the leaf. Then tokens end with those [B, m] and
    r [B] is returned (None without a chain); the target sees only the first r of them.
    """
    ids, counts = catch_up_tokens(state, drafter, max_behind)
    last = logits_at(forward_tokens(drafter, state, ids), counts - 1)[:, None]  # [B, 1, V]: after pending
    drafter.cache.advance(counts * state.active)
    levels, proposed, after = [state.pending[:, None]], None, None
    for depth, children in enumerate(branching):
        if chain is not None and depth == len(branching) - 1:
            proposed = chain(torch.cat([level[:, :1] for level in levels], dim=1)[:, 1:])  # first nodes, root off
        if depth > 0 or proposed is not None:
            shape = tree if proposed is None else chain_tree
            fed = torch.cat(levels[1:] + ([] if proposed is None else [proposed[0]]), dim=1)
            nodes = slice(1, 1 + fed.shape[1])
            batch = ForwardBatch(fed, state.committed[:, None] + shape.depth[:, nodes],
                                 state.max_committed + 1 + fed.shape[1],
                                 shape.mask[:, nodes, nodes].expand(state.batch, -1, -1), rows=state.rows_in_use)
            logits = drafter(batch)
            if proposed is not None:
                m = proposed[0].shape[1]
                after, logits = logits[:, -m:].argmax(dim=-1), logits[:, :-m]
            if depth > 0:
                last = logits[:, -levels[-1].shape[1]:]
        levels.append(last.topk(children, dim=-1).indices.flatten(1))
    single = proposed is not None and len(branching) == 1  # the chain had a forward of its own
    state.metrics.count_drafter(metrics_index, len(branching) + single)
    tokens = torch.cat(levels, dim=1)
    if proposed is None:
        return tokens, None
    offered, length = proposed
    expected = torch.cat([levels[-1][:, :1], after[:, :-1]], dim=1)  # the drafter's own token at each
    agree = (offered == expected) & (torch.arange(offered.shape[1], device=offered.device)[None, :] < length[:, None])
    return torch.cat([tokens, after], dim=1), agree.long().cumprod(dim=1).sum(dim=1)


def verify_tree_and_commit(models: Models, state: DecodeState, tokens: torch.Tensor, tree: TreeShape,
                           draft_probs: torch.Tensor | None = None,
                           drafted: torch.Tensor | None = None) -> tuple[StepOutput, torch.Tensor]:
    """The target reviews `tokens` [B, N] (tokens[:, 0] = pending) arranged as `tree` in one
    forward; returns (each row's accepted path then its correction / bonus token, the path's
    node indices [B, max_depth], -1 after it).

    draft_probs: None for deterministic children, else [B, N, V] (the q each node was drawn
    from). drafted: [B] depth of each row's tree, for the metrics (default: its deepest node
    that is not padding).
    The target's cache ends holding pending and the accepted path in contiguous slots; the
    random counters offset .. offset + max_depth are consumed. The caller commits the output."""
    target = models.target
    n_nodes = tokens.shape[1]
    logits = target(ForwardBatch(tokens, state.committed[:, None] + tree.depth, state.max_committed + n_nodes,
                                 tree.mask, flag_all=False, rows=state.rows_in_use))
    result = models.verifier.tree(logits, tokens, tree.parents, draft_probs,
                                  **state.sampling_args(TARGET_STREAM))
    accepted = result.num_accepted
    path = result.accepted_nodes[:, :tree.max_depth]  # node at depth 1, 2, ...; -1 after the path
    # the token at depth d was drawn from the logits of the path node at depth d - 1 (the root's first)
    nodes = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], 1)
    target.flag_used_logits(logits, nodes, accepted + 1)  # what plain decoding computes: not off the path

    # Node i was written at slot committed + i; the path node at depth d belongs at committed + d.
    contiguous = state.committed[:, None] + torch.arange(1, tree.max_depth + 1, device=tokens.device)
    target.cache.move(torch.where(path >= 0, state.committed[:, None] + path, contiguous), contiguous)
    target.cache.advance((accepted + 1) * state.active)

    state.offset += tree.max_depth + 1
    state.metrics.target_forwards += 1
    if drafted is None:  # drafted = the depth of the row's real nodes (not padding where a drafter proposed less)
        drafted = torch.where(tree.parents != PADDING, tree.depth, 0).max(dim=1).values
    state.metrics.record(0, accepted, drafted, state.active, tree.max_depth)
    path_tokens = tokens.gather(1, path.clamp(min=0))
    emitted = emitted_block(path_tokens, accepted, result.next_token)
    logprobs = None
    if state.want_logprobs:
        logprobs = emitted_logprobs(state, logits.gather(1, nodes[:, :, None].expand(-1, -1, logits.shape[2])), emitted)
    return StepOutput(emitted, accepted + 1, logprobs), path
