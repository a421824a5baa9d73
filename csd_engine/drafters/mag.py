"""MaG, the statistical drafter of CS Drafting (docs/algorithms.md, MaG), on the device.

Glossary, per batch row b of a token buffer `tokens` [B, C]:
* query: tokens[b, :end[b]], the committed history followed by unverified draft tokens;
* search space: tokens[b, :history_end[b] - 1], the committed history without its last token;
* match: the longest suffix of the query (at most `max_match` tokens) that occurs in the
  search space; its leftmost occurrence (the spec's) or, as an option, its rightmost;
* copy: up to m tokens that followed the occurrence, never past the committed history;
  the search is repeated on the query extended by the copy `copy_passes - 1` more times;
* bigram fill: the chain `next = bigram[prev]` continues the proposal while
  `bigram_prob[prev] >= min_bigram_prob`; without a table nothing is filled.
The search itself is kernels/mag.py: one Triton launch on a GPU, its PyTorch reference on a
CPU. Both are fixed-shape work with no host read, so a speculative step that calls `propose`
can be captured in one CUDA graph.
"""
from dataclasses import dataclass

import torch

from csd_engine.checks import is_int
from csd_engine.kernels import use_kernels
from csd_engine.kernels.mag import mag_extend, mag_extend_ref, mag_propose, mag_propose_ref


@dataclass
class MaGProposal:
    """tokens [B, m] int64: the proposal, entries past `length` padded with the last real
    token (or the query's last token where length is 0); length [B] int64 in 0..m;
    match [B] int64: length of the suffix match of the first copy, 0 if none."""
    tokens: torch.Tensor
    length: torch.Tensor
    match: torch.Tensor


class MaG:
    """The statistical drafter: copies from the committed history, then a confident bigram chain.

    bigram [V] int64: `bigram[a]` = most likely token after a; bigram_prob [V] float: its
    probability (drafters/bigram.py builds both, `MaG(*table)`). min_match: shorter matches
    count as none (1 = the spec; on real text one-token matches had 7% of their copied
    tokens accepted, longer ones 30-65%: 2 trades ~10% of accepted tokens for ~40% fewer
    proposed). max_match: longest suffix compared (cost is proportional).
    min_bigram_prob: 0 fills every position (the spec); the default fills only tokens the
    table calls more likely than not. occurrence: "leftmost" (the spec) or "rightmost" (most
    recent). copy_passes: searches per proposal; the spec repeats the search until m tokens,
    the default does not, since a second pass added no accepted token on real text (Qwen
    tokenizer, bench prompts and greedy continuations) for twice the work.
    """

    def __init__(self, bigram: torch.Tensor | None = None, bigram_prob: torch.Tensor | None = None,
                 min_match: int = 1, max_match: int = 32, min_bigram_prob: float = 0.5,
                 occurrence: str = "leftmost", copy_passes: int = 1):
        if (bigram is None) != (bigram_prob is None):
            raise ValueError("bigram and bigram_prob go together: pass both (see drafters/bigram.py) or neither")
        if bigram is not None:
            if not isinstance(bigram, torch.Tensor) or bigram.dtype != torch.int64 or bigram.dim() != 1:
                raise TypeError("bigram must be a 1-D int64 tensor [vocab_size]")
            if (not isinstance(bigram_prob, torch.Tensor) or not bigram_prob.is_floating_point()
                    or bigram_prob.shape != bigram.shape):
                raise TypeError(f"bigram_prob must be a floating-point tensor shaped like bigram "
                                f"{tuple(bigram.shape)}, got {getattr(bigram_prob, 'dtype', type(bigram_prob))} "
                                f"{tuple(getattr(bigram_prob, 'shape', ()))}")
        for name, value, low in (("min_match", min_match, 1), ("max_match", max_match, 1), ("copy_passes", copy_passes, 1)):
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if min_match > max_match:
            raise ValueError(f"min_match ({min_match}) must not exceed max_match ({max_match})")
        if isinstance(min_bigram_prob, bool) or not isinstance(min_bigram_prob, (int, float)) \
                or not 0 <= min_bigram_prob <= 1:
            raise ValueError(f"min_bigram_prob must be a number in [0, 1], got {min_bigram_prob!r}")
        if occurrence not in ("leftmost", "rightmost"):
            raise ValueError(f"occurrence must be 'leftmost' or 'rightmost', got {occurrence!r}")
        self.bigram, self.bigram_prob = bigram, bigram_prob
        self.min_match, self.max_match = min_match, max_match
        self.min_bigram_prob = float(min_bigram_prob)
        self.occurrence, self.copy_passes = occurrence, copy_passes

    def to(self, device) -> "MaG":
        if self.bigram is not None:
            self.bigram, self.bigram_prob = self.bigram.to(device), self.bigram_prob.to(device)
        return self

    def propose(self, tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int,
                search_bound: int | None = None) -> MaGProposal:
        """Up to m tokens continuing each row's query (see the glossary above).

        tokens [B, C] int64; end [B] int64 in 0..C; history_end [B] int64 in 0..end[b];
        m: host int >= 1; search_bound: host int, only tokens[:, :search_bound] are searched
        (a bound on history_end - 1 leaves the result unchanged). Rows with end 0 (padding)
        propose nothing. Out-of-range values are clamped, never read out of bounds.
        """
        self._check(tokens, end, history_end, m, search_bound)
        propose = mag_propose if use_kernels(tokens) else mag_propose_ref
        tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
        return MaGProposal(*propose(tokens, end, history_end, m, *self._settings(tokens, search_bound)))

    def extend(self, tokens: torch.Tensor, end: torch.Tensor, history_end: torch.Tensor, m: int,
               search_bound: int | None, cap: torch.Tensor, rows: torch.Tensor,
               goal: torch.Tensor) -> tuple[MaGProposal, torch.Tensor]:
        """`propose`, and its first min(length, cap[b]) tokens written into tokens[b, end[b]:] in
        place for the rows with rows[b] whose end[b] is short of goal[b] (one launch on a GPU,
        where a cascade step appends MaG's tokens to its working sequences many times). cap and
        goal [B] int64, rows [B] bool; tokens contiguous along C. Returns the proposal and each
        row's end after the write."""
        self._check(tokens, end, history_end, m, search_bound)
        batch = tokens.shape[0]
        for name, value, dtype in (("cap", cap, torch.int64), ("rows", rows, torch.bool), ("goal", goal, torch.int64)):
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.shape != (batch,):
                raise TypeError(f"{name} must be a {dtype} tensor [{batch}], got "
                                f"{getattr(value, 'dtype', type(value))} {tuple(getattr(value, 'shape', ()))}")
        if tokens.stride(1) != 1:
            raise ValueError("tokens must be contiguous along its columns (stride 1): extend writes into it")
        extend = mag_extend if use_kernels(tokens) else mag_extend_ref
        *proposal, new_end = extend(tokens, end, history_end, m, *self._settings(tokens, search_bound), cap, rows, goal)
        return MaGProposal(*proposal), new_end

    def _check(self, tokens, end, history_end, m, search_bound) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 2:
            raise TypeError(f"tokens must be an int64 tensor [B, C], got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.shape[1] == 0:
            raise ValueError("tokens must have at least one column (C >= 1)")
        batch = tokens.shape[0]
        for name, value in (("end", end), ("history_end", history_end)):
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.shape != (batch,):
                raise TypeError(f"{name} must be an int64 tensor [{batch}], got "
                                f"{getattr(value, 'dtype', type(value))} {tuple(getattr(value, 'shape', ()))}")
        if not is_int(m) or m < 1:
            raise ValueError(f"m must be a positive int, got {m!r}")
        if search_bound is not None and (not is_int(search_bound) or search_bound < 0):
            raise ValueError(f"search_bound must be None or an int >= 0, got {search_bound!r}")
        if self.bigram is not None and self.bigram.device != tokens.device:
            raise ValueError(f"the bigram table is on {self.bigram.device}, tokens on {tokens.device}: call MaG.to")

    def _settings(self, tokens, search_bound) -> tuple:
        """The kernels' arguments after end, history_end and m."""
        bound = tokens.shape[1] if search_bound is None else min(search_bound, tokens.shape[1])
        return (bound, self.bigram, self.bigram_prob, self.min_match, self.max_match, self.min_bigram_prob,
                self.occurrence == "leftmost", self.copy_passes)
