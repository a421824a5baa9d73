import random
import time

import pytest
import torch

from csd_engine.drafters.mag import MaG


def propose_bruteforce(history: list[int], tail: list[int], m: int, bigram: list[int] | None) -> list[int]:
    """docs/algorithms.md, MaG, read literally, by exhaustive search."""
    space = history[:-1]
    sequence = history + tail
    proposal: list[int] = []
    while len(proposal) < m:
        match_end = None
        for length in range(min(len(sequence), len(space)), 0, -1):  # longest first
            suffix = sequence[-length:]
            for end in range(length - 1, len(space)):  # leftmost first
                if space[end - length + 1:end + 1] == suffix:
                    match_end = end
                    break
            if match_end is not None:
                break
        if match_end is None:
            break
        copied = history[match_end + 1:match_end + 1 + m - len(proposal)]
        proposal += copied
        sequence += copied
    while len(proposal) < m:
        following = sequence[-1] if bigram is None else bigram[sequence[-1]]
        proposal.append(following)
        sequence.append(following)
    return proposal


def random_tokens(rng: random.Random, vocab: int, count: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def random_tail(rng: random.Random, vocab: int, history: list[int]) -> list[int]:
    """Empty, short, or longer than the history (never empty when the history is)."""
    lengths = [rng.randint(1, 5), len(history) + rng.randint(1, 9)] + ([0] if history else [])
    return random_tokens(rng, vocab, rng.choice(lengths))


def test_propose_matches_bruteforce_on_random_sequences():
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    for scenario in range(120):
        vocab = rng.randint(2, 6)  # small vocabularies: many repeats and long matches
        bigram = None if scenario % 3 == 0 else random_tokens(rng, vocab, vocab)
        mag = MaG(None if bigram is None else torch.tensor(bigram, dtype=torch.int64))
        # Row 0 starts from a single token, the others from 0 to 40 tokens.
        histories = [random_tokens(rng, vocab, 1)] + [random_tokens(rng, vocab, rng.randint(0, 40))
                                                      for _ in range(rng.randint(0, 3))]
        mag.start(histories)
        for round_ in range(6):
            for as_tensors in (False, True):  # a second proposal without a commit changes nothing
                tails = [random_tail(rng, vocab, history) for history in histories]
                m = rng.randint(1, 12)
                got = mag.propose([torch.tensor(tail, dtype=torch.int64) for tail in tails] if as_tensors
                                  else tails, m)
                assert got.dtype == torch.int64 and got.shape == (len(histories), m)
                for row, (history, tail) in enumerate(zip(histories, tails)):
                    expected = propose_bruteforce(history, tail, m, bigram)
                    assert got[row].tolist() == expected, (
                        f"seed={seed} scenario={scenario} round={round_} row={row} history={history} "
                        f"tail={tail} m={m} bigram={bigram}")
            accepted = [random_tokens(rng, vocab, rng.choice([0, rng.randint(1, 6)])) for _ in histories]
            mag.commit(accepted)
            for history, tokens in zip(histories, accepted):
                history += tokens


def propose_costs(history: list[int], tail_vocab: list[int], commit_vocab: list[int], seed: int,
                  warmup_calls: int = 20, calls: int = 200) -> tuple[int, float, int]:
    """Rounds of propose + commit on one row: (automaton steps of the warm-up calls, mean
    and max steps per call afterwards)."""
    rng = random.Random(seed)
    mag = MaG(None)
    mag.start([history])
    per_call = []
    for _ in range(warmup_calls + calls):
        before = mag.search_steps
        mag.propose([[rng.choice(tail_vocab) for _ in range(rng.randint(0, 8))]], 10)
        per_call.append(mag.search_steps - before)
        mag.commit([[rng.choice(commit_vocab) for _ in range(rng.randint(0, 3))]])
    steady = per_call[warmup_calls:]
    return sum(per_call[:warmup_calls]), sum(steady) / calls, max(steady)


@pytest.mark.parametrize("kind", ["random", "repeated phrase", "repeated token"])
def test_propose_cost_does_not_grow_with_history_length(kind):
    """Steps per call at a 50k-token history stay within 3x of those at 1k. A repetitive
    history has suffix-link chains as long as itself; the first calls walk them once (at
    most about one step per automaton state), later calls jump over them."""
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    vocab = list(range(100))
    phrase = random_tokens(rng, 100, 20 if kind == "repeated phrase" else 1)
    costs = {}
    for length in (1_000, 50_000):
        if kind == "random":
            history, commit_vocab = random_tokens(rng, 100, length), vocab
        else:  # tails mostly leave the repetition, commits continue it
            history, commit_vocab = phrase * (length // len(phrase)), phrase
        costs[length] = propose_costs(history, tail_vocab=vocab, commit_vocab=commit_vocab, seed=seed)
        states = 2 * length  # a suffix automaton has at most 2n states
        assert costs[length][0] <= states, f"seed={seed} warm-up steps {costs[length][0]} > {states}"
    (_, mean_short, max_short), (_, mean_long, max_long) = costs[1_000], costs[50_000]
    assert mean_long < 3 * mean_short and max_long < 3 * max_short, f"seed={seed} {kind} costs {costs}"


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="bigram"):
        MaG(torch.zeros(4, dtype=torch.float32))
    mag = MaG(torch.zeros(4, dtype=torch.int64))
    mag.start([[1, 2], []])
    with pytest.raises(ValueError, match="rows"):
        mag.propose([[]], 3)
    with pytest.raises(ValueError, match="rows"):
        mag.commit([[1]])
    with pytest.raises(ValueError, match="m must"):
        mag.propose([[], [1]], 0)
    with pytest.raises(ValueError, match="empty"):
        mag.propose([[], []], 3)
    with pytest.raises(ValueError, match="bigram table"):
        mag.propose([[], [9]], 3)
