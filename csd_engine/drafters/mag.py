"""MaG, the statistical drafter of CS Drafting (ALGORITHMS.md section 4).

Per row, MaG continues `history + tail` by copying what followed the longest earlier match
in the committed history, and fills what is left with a bigram chain. Its proposals are
deterministic, so the level above verifies them with a one-hot `q`.

Why this scales with long contexts: a naive search rescans the whole history in Python
for every proposal. Here each row keeps a suffix automaton of its committed history,
extended as tokens are committed:

* committing a token costs amortised O(1) new states and transitions, whatever the
  history length (at most 2n states and 3n transitions for n tokens, transitions in
  dicts);
* every state remembers where its strings first end, so "longest suffix that occurs
  earlier" and "its leftmost occurrence" come out of the automaton without a scan;
* a proposal is one matching walk over `tail` and the proposed tokens, started from the
  committed history's own match (the suffix link of the last state, free to read): one
  transition per token, plus suffix-link fallbacks when a token leaves every continuation
  seen so far. In natural text suffix-link chains are short; in a history stuck
  repeating itself they grow with its length, but they then consist of long runs of
  states with identical transitions, and a fallback jumps over a whole run through a
  cached, self-checking pointer (see `SuffixIndex._run_top`). The first walk over a run
  takes one step per state, so at most as many steps as the history created states;
  afterwards the run is a single jump until new transitions split it. Query cost:
  O(len(tail) + m) amortised, independent of the history length (tests/drafters/
  test_mag.py counts the steps at 1k and 50k tokens, random and repetitive).

Memory is a few hundred bytes per committed token per row (one small dict per state).
"""
from operator import index

import torch

ROOT = 0  # the automaton state of the empty string
NO_STATE = -1  # suffix link of ROOT; "no state has that transition"


class SuffixIndex:
    """Suffix automaton of one row's committed history, grown one token at a time.

    Matching is done against the search space of section 4: the history without its last
    token. A string occurs there unless its first occurrence ends at the last token, and
    the only state whose strings first end there is `last`, so a walk simply never stops
    in `last` (see `advance`).
    """

    def __init__(self, tokens: list[int]):
        self.history: list[int] = []
        self.length = [0]  # longest string of each state
        self.link = [NO_STATE]  # suffix link: state of the longest shorter suffix class
        self.first_end = [-1]  # end position of the strings' first occurrence
        self.edges: list[dict[int, int]] = [{}]
        self.run_top = [ROOT]  # cached highest ancestor with the same transitions (a hint)
        self.last = ROOT  # state of the whole history
        self.steps = 0  # transitions and suffix links followed by queries (cost measure)
        for token in tokens:
            self.append(token)

    def _new_state(self, length: int, link: int, first_end: int, edges: dict[int, int]) -> int:
        self.length.append(length)
        self.link.append(link)
        self.first_end.append(first_end)
        self.edges.append(edges)
        self.run_top.append(len(self.run_top))
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """Standard online suffix-automaton extension by one token."""
        position = len(self.history)
        self.history.append(token)
        current = self._new_state(position + 1, ROOT, position, {})
        state = self.last
        while state != NO_STATE and token not in self.edges[state]:
            self.edges[state][token] = current
            state = self.link[state]
        if state != NO_STATE:
            target = self.edges[state][token]
            if self.length[state] + 1 == self.length[target]:
                self.link[current] = target
            else:
                # `target` mixes strings that now end at `position` with longer ones that
                # do not: split off the shorter ones. They first end where `target`'s do.
                clone = self._new_state(self.length[state] + 1, self.link[target],
                                        self.first_end[target], dict(self.edges[target]))
                while state != NO_STATE and self.edges[state].get(token) == target:
                    self.edges[state][token] = clone
                    state = self.link[state]
                self.link[target] = self.link[current] = clone
        self.last = current

    def committed_match(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the history that occurs earlier."""
        if self.last == ROOT:
            return ROOT, 0
        anchor = self.link[self.last]
        return anchor, self.length[anchor]

    def _run_top(self, state: int) -> int:
        """Highest suffix-link ancestor of `state` with exactly the same transitions.

        A string followed by a token has every suffix followed by it too, so transition
        sets only grow up a suffix-link chain: an ancestor with as many transitions as
        `state` has the same ones, and so has everything in between. That makes a cached
        top checkable in O(1) (equal counts) whatever was added since, and lets a fallback
        jump over a whole run of states at once. Walked states are path-compressed.
        """
        count = len(self.edges[state])
        walked = []
        top = state
        while True:
            self.steps += 1
            cached = self.run_top[top]
            if cached != top and len(self.edges[cached]) == count:
                following = cached
            else:
                following = self.link[top]
                if following == NO_STATE or len(self.edges[following]) != count:
                    break
            walked.append(top)
            top = following
        for visited in walked:
            self.run_top[visited] = top
        return top

    def _owner(self, state: int, token: int) -> int:
        """Deepest state on the suffix-link chain from `state` with a transition on
        `token`, or NO_STATE."""
        while state != NO_STATE and token not in self.edges[state]:
            state = self.link[self._run_top(state)]
        return state

    def advance(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Match (state, length) of a sequence -> match of the sequence + [token].

        A match is the longest suffix of the sequence occurring in the search space: its
        automaton state and its length (0 = no match, at ROOT).
        """
        self.steps += 1
        owner = self._owner(state, token)
        if owner == NO_STATE:
            return ROOT, 0
        if owner != state:
            length = self.length[owner]
        target = self.edges[owner][token]
        if target == self.last:
            # The match occurs only as the history's own suffix, outside the search
            # space; its suffixes that occur earlier are those of the history's match.
            return self.committed_match()
        return target, length + 1

    def continuation(self, state: int, count: int) -> list[int]:
        """Up to `count` tokens that follow the leftmost occurrence of a match in `state`,
        stopping at the end of the history."""
        start = self.first_end[state] + 1
        return self.history[start:start + count]


class MaG:
    """The statistical drafter: copies from the history, falls back to a bigram chain.

    bigram: [V] int64, `bigram[prev]` = most likely next token (see drafters/bigram.py).
    Without it, MaG fills by repeating the last token. Proposals are returned on the CPU.
    """

    def __init__(self, bigram: torch.Tensor | None = None):
        if bigram is not None:
            if not isinstance(bigram, torch.Tensor) or bigram.dtype != torch.int64 or bigram.dim() != 1:
                raise TypeError("bigram must be a 1-D int64 tensor [vocab_size] or None")
            bigram = bigram.tolist()  # plain list: indexed once per filled token
        self._bigram = bigram
        self._rows: list[SuffixIndex] = []

    @property
    def search_steps(self) -> int:
        """Automaton steps taken by `propose` since `start` (the cost tests measure)."""
        return sum(row.steps for row in self._rows)

    def start(self, histories: list[list[int]]) -> None:
        """Forget everything and index one history (prompt token ids) per batch row."""
        self._rows = [SuffixIndex(list(map(index, history))) for history in histories]

    def commit(self, tokens: list[list[int]]) -> None:
        """Append newly accepted tokens to each row's history (a row may get [])."""
        self._check_batch(tokens, "tokens")
        for row, accepted in zip(self._rows, tokens):
            for token in accepted:
                row.append(index(token))

    def propose(self, tails: list[list[int]], m: int) -> torch.Tensor:
        """[B, m] int64: m tokens continuing `history[row] + tails[row]` for each row.

        `tails[row]` are drafted but not yet committed tokens (in a cascade MaG drafts on
        top of an unverified draft): they are part of the query whose suffix is matched,
        but the search space is the committed history without its last token, and copies
        stop at the end of the committed history.
        """
        self._check_batch(tails, "tails")
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"m must be a positive int, got {m!r}")
        return torch.tensor([self._propose_row(row, tail, m) for row, tail in zip(self._rows, tails)],
                            dtype=torch.int64).reshape(len(tails), m)

    def _propose_row(self, row: SuffixIndex, tail: list[int], m: int) -> list[int]:
        state, length = row.committed_match()
        tail = list(map(index, tail))  # plain ints: tensors would hash by identity
        for token in tail:
            state, length = row.advance(state, length, token)
        proposal: list[int] = []
        while length > 0 and len(proposal) < m:
            copied = row.continuation(state, m - len(proposal))
            for token in copied:
                state, length = row.advance(state, length, token)
            proposal += copied
        if len(proposal) < m:
            query_end = proposal or tail or row.history
            if not query_end:
                raise ValueError("MaG cannot continue an empty history with an empty tail")
            proposal += self._bigram_chain(query_end[-1], m - len(proposal))
        return proposal

    def _bigram_chain(self, previous: int, count: int) -> list[int]:
        chain = []
        for _ in range(count):
            if self._bigram is not None:
                if not 0 <= previous < len(self._bigram):
                    raise ValueError(f"token {previous} is outside the bigram table [0, {len(self._bigram)})")
                previous = self._bigram[previous]
            chain.append(previous)
        return chain

    def _check_batch(self, per_row: list, name: str) -> None:
        if len(per_row) != len(self._rows):
            raise ValueError(f"{name} has {len(per_row)} rows but start() was given {len(self._rows)} histories")
