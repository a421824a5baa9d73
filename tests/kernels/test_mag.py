"""kernels/mag.py: the one-launch MaG proposal equals its PyTorch reference exactly, on random
buffers with small vocabularies (long and tied matches everywhere), searches that span several
of the kernel's position blocks, every option, and the edge rows (empty, clamped, unsearched);
so does the proposal written in place (mag_extend), and the reference writes what it says."""
import time

import pytest
import torch

from csd_engine.kernels.mag import BLOCK, block_positions, mag_extend, mag_extend_ref, mag_propose, mag_propose_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = time.time_ns() % 2**31
    return torch.Generator().manual_seed(seed), seed


def assert_same(args, seed):
    got = mag_propose(*args)
    want = mag_propose_ref(*args)
    for name, a, b in zip(("tokens", "length", "match"), got, want):
        assert torch.equal(a, b), f"{name} differs (seed {seed}, m/bound/options {args[3:5]} {args[7:]}):\n{a}\n{b}"


def random_case(gen: torch.Generator):
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    batch, capacity, vocab = draw(1, 5), draw(1, 3 * BLOCK), draw(2, 6)
    tokens = torch.randint(0, vocab, (batch, capacity), generator=gen)
    end = torch.randint(0, capacity + 1, (batch,), generator=gen)
    history_end = (end * torch.rand(batch, generator=gen)).long() + torch.randint(0, 3, (batch,), generator=gen)
    has_bigram = draw(0, 2) > 0
    bigram = torch.randint(0, vocab + 1, (vocab,), generator=gen) if has_bigram else None  # vocab: unknown
    bigram_prob = torch.rand(vocab, generator=gen) if has_bigram else None
    min_match = draw(1, 4)
    args = (tokens, end, history_end, draw(1, 9), draw(0, capacity + 4), bigram, bigram_prob, min_match,
            draw(min_match, 12), float(torch.rand(1, generator=gen)), draw(0, 1) == 1, draw(1, 2))
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def test_random_cases_match_the_reference():
    gen, seed = fresh_generator()
    for _ in range(25):
        assert_same(random_case(gen), seed)


@pytest.mark.parametrize("leftmost", [True, False])
def test_ties_across_position_blocks(leftmost):
    """A period-5 buffer: the query's suffix recurs in every block; the leftmost occurrence
    is in the first block, the rightmost in the last searched one."""
    capacity = 3 * BLOCK + 7
    tokens = (torch.arange(capacity) % 5)[None].repeat(2, 1).to(DEVICE)
    end = torch.tensor([capacity, capacity - 40], device=DEVICE)
    history_end = end - 2
    args = (tokens, end, history_end, 6, capacity, None, None, 1, 32, 0.5, leftmost, 1)
    assert_same(args, 0)
    proposal, length, match = mag_propose(*args)
    assert (match == 32).all()
    # The leftmost occurrence has 6 tokens after it; the rightmost ends 5 or fewer before the history's end.
    assert (length == 6).all() if leftmost else (length < 6).all(), length


@pytest.mark.parametrize("max_match", [33, 64, 100])
def test_matches_longer_than_a_tile_is_wide(max_match):
    """max_match past 32 narrows the kernel's tiles (fewer positions, more compared tokens, the
    last ones masked where max_match is not a power of two): a period-3 buffer, so the longest
    matches are max_match long and recur in every tile; both tie rules, two passes."""
    assert block_positions(max_match) < BLOCK
    capacity = 2 * BLOCK + 11
    tokens = (torch.arange(capacity) % 3)[None].repeat(3, 1).to(DEVICE)
    tokens[1, 40] = 7  # row 1: a break, so only matches after it reach max_match
    end = torch.tensor([capacity, capacity - 5, max_match // 2], device=DEVICE)
    for leftmost in (True, False):
        args = (tokens, end, end - 1, 6, capacity, None, None, 1, max_match, 0.5, leftmost, 2)
        assert_same(args, 0)
        match = mag_propose(*args)[2]
        assert match[0] == max_match and match[1] == max_match and match[2] < max_match, match


def test_edge_rows():
    """end 0 (padding rows), history_end past end (clamped), bound 0 (nothing searched), and
    a bf16 bigram table (the threshold is rounded as the reference's comparison rounds it)."""
    gen, seed = fresh_generator()
    tokens = torch.randint(0, 3, (4, 50), generator=gen).to(DEVICE)
    end = torch.tensor([0, 50, 20, 1], device=DEVICE)
    history_end = torch.tensor([0, 60, 10, 1], device=DEVICE)
    bigram = torch.tensor([1, 2, 0], device=DEVICE)
    prob = torch.tensor([0.3, 0.7, 0.5], device=DEVICE).to(torch.bfloat16)
    for bound in (0, 1, 50):
        for threshold in (0.3, 0.5, 0.7001):
            assert_same((tokens, end, history_end, 5, bound, bigram, prob, 1, 8, threshold, True, 2), seed)
    empty = torch.zeros(0, 50, dtype=torch.int64, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert [t.shape for t in mag_propose(empty, none, none, 3, 50, None, None, 1, 8, 0.5, True, 1)] == \
        [(0, 3), (0,), (0,)]


def test_extend_writes_the_kept_proposal_in_place():
    """mag_extend: the kernel's buffer and outputs equal the reference's, and the reference
    writes exactly tokens[b, end[b] + j] = proposal[b, j] for j < min(length, cap) on rows in
    `rows` short of their goal (inside the buffer) and changes nothing else: ends near the
    buffer's end, caps 0 to past m, rows left out, goals reached or not, padding rows (end 0)."""
    gen, seed = fresh_generator()
    for _ in range(25):
        args = random_case(gen)
        tokens, end, batch = args[0], args[1], args[0].shape[0]
        cap = torch.randint(0, args[3] + 2, (batch,), generator=gen).to(DEVICE)
        rows = (torch.rand(batch, generator=gen) < 0.8).to(DEVICE)
        goal = end + torch.randint(-1, 3, (batch,), generator=gen).to(DEVICE)  # reached (<= end) or not
        got_tokens, want_tokens = tokens.clone(), tokens.clone()
        got = mag_extend(got_tokens, *args[1:], cap, rows, goal)
        want = mag_extend_ref(want_tokens, *args[1:], cap, rows, goal)
        where = (f"seed {seed}, m/bound {args[3:5]}, end {end.tolist()}, cap {cap.tolist()}, rows {rows.tolist()}, "
                 f"goal {goal.tolist()}")
        for name, a, b in zip(("proposal", "length", "match", "end"), got, want):
            assert torch.equal(a, b), f"{name} differs ({where}):\n{a}\n{b}"
        assert torch.equal(got_tokens, want_tokens), f"the buffers differ ({where})"
        proposal, length = mag_propose_ref(tokens, *args[1:])[:2]
        assert torch.equal(want[0], proposal) and torch.equal(want[1], length), where
        keep = [min(int(length[b]), int(cap[b])) if rows[b] and end[b] < goal[b] else 0 for b in range(batch)]
        assert want[3].tolist() == [int(e) + k for e, k in zip(end, keep)], where
        expected = tokens.clone()
        for b in range(batch):
            for j in range(keep[b]):
                if end[b] + j < tokens.shape[1]:
                    expected[b, end[b] + j] = proposal[b, j]
        assert torch.equal(want_tokens, expected), f"the reference wrote elsewhere ({where})"
