"""Staged speculative decoding (docs/algorithms.md, token trees): a neural drafter grows a token
tree, sped up by MaG below it (the second stage), and the target verifies the whole tree in
one forward.

The tree has the same shape in every row, so its parent array, attention mask and depths
are built once. Children are the drafter's top-b tokens, deterministic for greedy and
sampling rows alike: the target accepts such a child with probability p'(c) and removes it
from p' on rejection, which emits exactly the target's distribution.

Second stage (a vertical cascade under the tree): the drafter drafts its most likely path
(the first child at every depth) up to `mag_tokens` tokens deeper than the tree, and MaG
drafts those for it. MaG proposes them after the path above the last level; the drafter
reviews them in its last level's forward, accepting while they equal its own top-1 token,
and its top-1 after the r it accepted become a chain of r nodes under that path's leaf:
r tokens of the drafter's for no extra drafter forward (one where the tree has one level).
With `mag_review=False` MaG continues the whole likely path instead and the target alone
checks its tokens. The chain's other nodes are padding (parent -2), never verified. Every
node is a function of the prefix, so the target's rule is the tree's as ever. MaG is the
engine's own MaG drafter if it has one (its bigram table included), else a fresh MaG without
a bigram table; it matches on the device.
"""
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.drafters.mag import MaG
from csd_engine.ops import PADDING
from csd_engine.strategies.base import (DecodeState, Decoder, Models, StepOutput, check_drafter_index, commit,
                                        require_one_device, require_trees)
from csd_engine.strategies.tree import (TreeShape, branching_parents, first_child_path, grow_tree,
                                        verify_tree_and_commit, with_chain)


@dataclass(frozen=True)
class Staged:
    """branching[d]: children of every node at depth d (the root, `pending`, is depth 0);
    drafter: index of the neural drafter in engine.drafters that grows the tree;
    mag_tokens: how much deeper MaG takes the drafter's most likely path (0 = no second stage);
    mag_review: the drafter reviews MaG's tokens (the spec's second stage, a vertical cascade);
    False hangs MaG's proposal after that whole path unreviewed, for the target alone to check."""

    branching: tuple = (4, 2, 1, 1)
    drafter: int = 0
    mag_tokens: int = 0
    mag_review: bool = True

    def __post_init__(self):
        if not isinstance(self.branching, (tuple, list)) or not self.branching \
                or not all(is_int(b) and b >= 1 for b in self.branching):
            raise ValueError(f"Staged.branching must be a non-empty tuple of ints >= 1 (children per node at "
                             f"each depth, e.g. (4, 2, 1, 1)), got {self.branching!r}")
        object.__setattr__(self, "branching", tuple(self.branching))
        check_drafter_index(self.drafter, "Staged")
        if not is_int(self.mag_tokens) or self.mag_tokens < 0:
            raise ValueError(f"Staged.mag_tokens must be an int >= 0 (0 = no MaG stage), got {self.mag_tokens!r}")
        if not isinstance(self.mag_review, bool):
            raise ValueError(f"Staged.mag_review must be True (the drafter reviews MaG's tokens) or False (the "
                             f"target alone checks them), got {self.mag_review!r}")

    @property
    def draft_nodes(self) -> int:
        """Nodes below the root: the tree's, counted level by level (not built: (2,) * 40 has 2**41),
        then MaG's chain."""
        nodes, level = 0, 1
        for children in self.branching:
            level *= children
            nodes += level
        return nodes + self.mag_tokens

    @property
    def depth(self) -> int:
        return len(self.branching) + self.mag_tokens

    def decoder(self, models: Models):
        drafters = models.drafters
        if self.drafter >= len(drafters) or isinstance(drafters[self.drafter], MaG):
            neural = [i for i, d in enumerate(drafters) if not isinstance(d, MaG)]
            raise ValueError(f"Staged(drafter={self.drafter}) must name a neural drafter of the engine; "
                             f"the neural drafters are at indices {neural} of its {len(drafters)} drafter(s)")
        vocab = models.target.vocab_size
        if max(self.branching) > vocab:
            raise ValueError(f"Staged.branching={self.branching} asks for more children than the vocabulary "
                             f"has tokens ({vocab})")
        if self.draft_nodes + 1 > models.capacity:  # (the scheduler then bounds it by the cache's headroom)
            raise ValueError(f"Staged(branching={self.branching}, mag_tokens={self.mag_tokens}) feeds "
                             f"{self.draft_nodes + 1} tokens per forward, more than the cache's {models.capacity} "
                             "slots: fewer depths or children")
        require_one_device(models, "Staged")
        require_trees(models, "Staged", drafters=(self.drafter,))
        return StagedDecoder(models, self)


class StagedDecoder(Decoder):
    def __init__(self, models: Models, config: Staged):
        self.models = models
        self.drafter = models.drafters[config.drafter]
        self.drafter_index = config.drafter
        self.drafters_used = (config.drafter,)  # MaG keeps no cache; other neural drafters sit idle
        self.branching = config.branching
        self.mag_tokens = config.mag_tokens
        parents = branching_parents(config.branching)
        likely_path = first_child_path(parents)[1:]  # the drafter's top-1 chain, below the root
        # On the device: indexing with a Python list would copy it there every step (a sync).
        self.likely_path = torch.tensor(likely_path, device=models.device)
        self.mag, self.chain_tree = None, None
        if config.mag_tokens:
            self.mag = next((d for d in models.drafters if isinstance(d, MaG)), None) or MaG()
            if config.mag_review:  # the drafter's last forward also feeds MaG's chain, under the path above
                above = branching_parents(config.branching[:-1])
                self.chain_tree = TreeShape.build(torch.tensor([with_chain(above, first_child_path(above)[-1],
                                                                           config.mag_tokens)], device=models.device))
            parents = with_chain(parents, likely_path[-1], config.mag_tokens)
        self.tree = TreeShape.build(torch.tensor([parents], device=models.device), config.depth)
        self.max_tokens_per_forward = len(parents)

    def step(self, state: DecodeState, plan=None) -> StepOutput:
        # The drafter trails the committed prefix by at most the last step's accepted path.
        stage = None if self.chain_tree is None else lambda path: self._mag_stage(state, path)
        tokens, chain = grow_tree(self.drafter, state, self.branching, self.tree, self.tree.max_depth,
                                  self.drafter_index, stage, self.chain_tree)
        if self.mag is not None and stage is None:  # MaG after the whole likely path, for the target alone
            offered, chain = self._mag_stage(state, tokens[:, self.likely_path])
            tokens = torch.cat([tokens, offered], dim=1)
        tree = self.tree.expand(state.batch)
        if chain is not None:  # the chain under the likely leaf: padding past its length
            real = torch.arange(self.mag_tokens, device=tokens.device)[None, :] < chain[:, None]
            real = torch.cat([torch.ones_like(tokens[:, :-self.mag_tokens], dtype=torch.bool), real], 1)
            tree = TreeShape(torch.where(real, tree.parents, PADDING), tree.mask, tree.depth, tree.max_depth)
        out = verify_tree_and_commit(self.models, state, tokens, tree)[0]
        commit(state, out)
        return out

    def _mag_stage(self, state: DecodeState, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MaG's (tokens, length) continuing committed sequence + pending + `path` (the drafter's
        likely path, above the tree's last level where the drafter reviews them), written after
        the committed prefix (scratch slots the next commit overwrites)."""
        base = state.committed + 1
        cols = torch.cat([state.committed[:, None], base[:, None] + torch.arange(path.shape[1], device=path.device)], 1)
        state.tokens.scatter_(1, cols.clamp(max=state.tokens.shape[1] - 1), torch.cat([state.pending[:, None], path], 1))
        proposal = self.mag.propose(state.tokens, base + path.shape[1], base, self.mag_tokens, state.max_committed + 1)
        return proposal.tokens, proposal.length
