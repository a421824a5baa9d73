"""The commit kernel (kernels/commit.py) against its PyTorch reference and against the rule
written out by hand: ragged counts, inactive rows, one-column and wide emitted blocks, a
strided emitted view, rows that fill the buffer up to its scratch column."""
import pytest
import torch

from csd_engine.kernels.commit import commit, commit_ref
from tests.kernels.test_verify import DEVICE
from tests.stats import fresh_seed


def _state(gen, batch, width, m):
    tokens = torch.randint(0, 1000, (batch, width), generator=gen)
    committed = torch.randint(0, width - m - 1, (batch,), generator=gen)
    pending = torch.randint(0, 1000, (batch,), generator=gen)
    emitted = torch.randint(0, 1000, (batch, m), generator=gen)
    counts = torch.randint(1, m + 1, (batch,), generator=gen)
    active = torch.rand(batch, generator=gen) < 0.7
    return [t.to(DEVICE) for t in (tokens, committed, pending, emitted, counts, active)]


def _by_hand(tokens, committed, pending, emitted, counts, active):
    tokens, committed, pending = tokens.clone(), committed.clone(), pending.clone()
    for b in range(tokens.shape[0]):
        if active[b]:
            n, start = int(counts[b]), int(committed[b])
            tokens[b, start:start + n] = torch.cat([pending[b:b + 1], emitted[b, :n - 1]])
            pending[b] = emitted[b, n - 1]
            committed[b] += n
        tokens[b, int(committed[b])] = pending[b]
    return tokens, committed, pending


@pytest.mark.parametrize("batch, width, m", [(1, 16, 1), (5, 40, 5), (8, 300, 17), (3, 12, 9)])
def test_kernel_equals_reference_and_the_rule(batch, width, m):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    state = _state(gen, batch, width, m)
    want = _by_hand(*state)
    for run in (commit, commit_ref):
        tokens, committed, pending, emitted, counts, active = [t.clone() for t in state]
        run(tokens, committed, pending, emitted, counts, active)
        assert torch.equal(committed, want[1]) and torch.equal(pending, want[2]), f"{run.__name__} seed={seed}"
        # the last column is scratch: whatever lands there is undefined
        assert torch.equal(tokens[:, :-1], want[0][:, :-1]), f"{run.__name__} seed={seed}"
        assert torch.equal(emitted, state[3]) and torch.equal(active, state[5])


def test_strided_emitted_and_a_row_reaching_the_scratch_column():
    """emitted as a column slice of a wider block (as a step's output may be); a row whose
    commit ends right before the scratch column: its pending lands in the last real slot."""
    gen = torch.Generator().manual_seed(fresh_seed())
    tokens, committed, pending, _, _, _ = _state(gen, 3, 20, 4)
    wide = torch.randint(0, 1000, (3, 9), generator=gen).to(DEVICE)
    emitted = wide[:, 2:6]
    counts = torch.tensor([4, 1, 3], device=DEVICE)
    active = torch.tensor([True, True, False], device=DEVICE)
    committed[0] = 20 - 1 - 4 - 1  # ends at slot 18 of 0..19 (19: scratch)
    want = _by_hand(tokens, committed, pending, emitted, counts, active)
    commit(tokens, committed, pending, emitted, counts, active)
    assert int(committed[0]) == 18 and torch.equal(committed, want[1]) and torch.equal(pending, want[2])
    assert torch.equal(tokens[:, :-1], want[0][:, :-1])


def test_bad_input_names_the_tensor():
    gen = torch.Generator().manual_seed(0)
    tokens, committed, pending, emitted, counts, active = _state(gen, 2, 16, 3)
    with pytest.raises(ValueError, match="counts must be torch.int64"):
        commit(tokens, committed, pending, emitted, counts.int(), active)
    with pytest.raises(ValueError, match="active must be torch.bool .* 2 rows"):
        commit(tokens, committed, pending, emitted, counts, active[:1])


def test_emitted_with_a_column_stride():
    """emitted whose columns are not adjacent (a transposed block): taken as its values."""
    gen = torch.Generator().manual_seed(fresh_seed())
    tokens, committed, pending, emitted, counts, active = _state(gen, 4, 30, 5)
    strided = emitted.t().contiguous().t()
    assert strided.stride(1) != 1
    want = _by_hand(tokens, committed, pending, emitted, counts, active)
    commit(tokens, committed, pending, strided, counts, active)
    assert torch.equal(committed, want[1]) and torch.equal(pending, want[2])
    assert torch.equal(tokens[:, :-1], want[0][:, :-1])
