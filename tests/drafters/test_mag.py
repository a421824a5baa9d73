import random
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csd_engine.drafters.mag import MaG

aten = torch.ops.aten
PROBS = [0.0, 0.25, 0.5, 0.75, 1.0]  # exact in float32: threshold comparisons agree with Python


def propose_reference(row: list[int], end: int, history_end: int, m: int, min_match: int, max_match: int,
                      bigram: list[int] | None, prob: list[float] | None, min_prob: float, occurrence: str,
                      passes: int, search_bound: int | None) -> tuple[list[int], int, int]:
    """The rule of mag.py's glossary read literally, by exhaustive search: (proposal padded
    to m tokens, its length, the first match's length)."""
    query, history = row[:end], row[:history_end]
    space = history[:-1][:search_bound]
    proposal: list[int] = []
    first_match = 0
    for search in range(passes):
        sequence = query + proposal
        found = None
        for length in range(min(max_match, len(sequence), len(space)), min_match - 1, -1):  # longest first
            ends = [e for e in range(length - 1, len(space)) if space[e - length + 1:e + 1] == sequence[-length:]]
            if ends:
                found = length, ends[0] if occurrence == "leftmost" else ends[-1]
                break
        if found is None or len(proposal) == m:
            break
        length, match_end = found
        first_match = first_match or length
        proposal += history[match_end + 1:match_end + 1 + m - len(proposal)]
    while bigram is not None and len(proposal) < m and (query + proposal):
        previous = (query + proposal)[-1]
        if prob[previous] < min_prob:
            break
        proposal.append(bigram[previous])
    length = len(proposal)
    padding = (query + proposal)[-1] if query + proposal else row[0]
    return proposal + [padding] * (m - length), length, first_match


def random_case(rng: random.Random):
    """A ragged batch: rows of random tokens from a small vocabulary (many repeats), some
    with copied stretches, some with drafts past the history, some padding rows (end 0)."""
    vocab = rng.randint(2, 6)
    batch, capacity = rng.randint(1, 4), rng.randint(1, 48)
    rows, ends, history_ends = [], [], []
    for _ in range(batch):
        row = [rng.randrange(vocab) for _ in range(capacity)]
        if capacity > 8 and rng.random() < 0.5:  # a long repeat: matches longer than max_match
            start, size = rng.randrange(capacity // 2), rng.randint(2, capacity // 2)
            row[capacity - size:] = row[start:start + size]
        end = rng.choice([0, rng.randint(0, capacity), capacity])
        history_end = rng.choice([end, rng.randint(0, end)])  # == end: no draft
        rows.append(row)
        ends.append(end)
        history_ends.append(history_end)
    return vocab, rows, ends, history_ends


def random_mag(rng: random.Random, vocab: int) -> tuple[MaG, dict]:
    config = dict(min_match=rng.randint(1, 3), max_match=rng.choice([3, 5, 32]),
                  min_bigram_prob=rng.choice(PROBS), occurrence=rng.choice(["leftmost", "rightmost"]),
                  copy_passes=rng.randint(1, 3))
    bigram = prob = None
    if rng.random() < 0.7:
        bigram = [rng.randrange(vocab) for _ in range(vocab)]
        prob = [rng.choice(PROBS) for _ in range(vocab)]
    mag = MaG(None if bigram is None else torch.tensor(bigram), None if prob is None else torch.tensor(prob),
              **config)
    reference = dict(min_match=config["min_match"], max_match=config["max_match"], bigram=bigram, prob=prob,
                     min_prob=config["min_bigram_prob"], occurrence=config["occurrence"],
                     passes=config["copy_passes"])
    return mag, reference


def test_propose_matches_reference_on_random_batches():
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    for scenario in range(300):
        vocab, rows, ends, history_ends = random_case(rng)
        mag, reference = random_mag(rng, vocab)
        m = rng.randint(1, 12)
        search_bound = rng.choice([None, rng.randint(0, len(rows[0]) + 2)])
        got = mag.propose(torch.tensor(rows), torch.tensor(ends), torch.tensor(history_ends), m, search_bound)
        assert got.tokens.dtype == got.length.dtype == got.match.dtype == torch.int64
        assert got.tokens.shape == (len(rows), m) and got.length.shape == got.match.shape == (len(rows),)
        for b, row in enumerate(rows):
            expected = propose_reference(row, ends[b], history_ends[b], m, search_bound=search_bound, **reference)
            actual = got.tokens[b].tolist(), int(got.length[b]), int(got.match[b])
            assert actual == expected, (f"seed={seed} scenario={scenario} row={b}: {row} end={ends[b]} "
                                        f"history_end={history_ends[b]} m={m} bound={search_bound} {reference}")


def test_examples_from_the_spec():
    tokens = torch.tensor([[1, 2, 3, 1, 2, 9, 9, 9],  # history 1 2 3 1 2: copies 3 1 2, searches again, 3
                           [5, 6, 7, 5, 6, 7, 5, 9],  # draft 5 after history 5 6 7 5 6 7
                           [4, 4, 4, 4, 4, 4, 4, 4]])  # padding row
    got = MaG(max_match=4, copy_passes=2).propose(tokens, torch.tensor([5, 7, 0]), torch.tensor([5, 6, 0]), 4)
    assert got.tokens.tolist() == [[3, 1, 2, 3], [6, 7, 5, 6], [4, 4, 4, 4]]
    assert got.length.tolist() == [4, 4, 0] and got.match.tolist() == [2, 4, 0]
    once = MaG(max_match=4, copy_passes=1).propose(tokens, torch.tensor([5, 7, 0]), torch.tensor([5, 6, 0]), 4)
    assert once.tokens.tolist() == [[3, 1, 2, 2], [6, 7, 7, 7], [4, 4, 4, 4]] and once.length.tolist() == [3, 2, 0]


def test_empty_batch():
    empty = torch.zeros(0, dtype=torch.int64)
    got = MaG(torch.tensor([1, 0]), torch.tensor([0.9, 0.9])).propose(torch.zeros(0, 5, dtype=torch.int64),
                                                                     empty, empty, 3)
    assert got.tokens.shape == (0, 3) and got.length.shape == got.match.shape == (0,)


def test_bigram_fills_only_while_confident():
    bigram = torch.tensor([1, 2, 3, 0])
    prob = torch.tensor([0.9, 0.8, 0.3, 0.9])
    tokens = torch.tensor([[7, 0]])  # 7 is outside the table: never confident
    for min_prob, expected, length in ((0.5, [1, 2, 2, 2], 2), (0.0, [1, 2, 3, 0], 4), (0.95, [0, 0, 0, 0], 0)):
        got = MaG(bigram, prob, min_bigram_prob=min_prob).propose(tokens, torch.tensor([2]), torch.tensor([2]), 4)
        assert got.tokens.tolist() == [expected] and got.length.tolist() == [length]
    got = MaG(bigram, prob, min_bigram_prob=0.0).propose(tokens, torch.tensor([1]), torch.tensor([1]), 3)
    assert got.tokens.tolist() == [[7, 7, 7]] and got.length.tolist() == [0]
    got = MaG().propose(tokens, torch.tensor([2]), torch.tensor([2]), 3)  # no table: no fill
    assert got.tokens.tolist() == [[0, 0, 0]] and got.length.tolist() == [0]


class HostReads(TorchDispatchMode):
    """Counts the ops that read the device from the host or have data-dependent shapes."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default):
            self.seen.append(str(func))
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                index is not None and index.dtype == torch.bool for index in args[1]):
            self.seen.append(f"{func} with a bool index")
        return func(*args, **kwargs)


def count_host_reads(monkeypatch, function) -> list[str]:
    tolist = torch.Tensor.tolist
    reads = HostReads()

    def counted_tolist(tensor):
        reads.seen.append("tolist")
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with reads:
        function()
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return reads.seen


def test_counter_sees_host_reads(monkeypatch):
    tensor = torch.arange(4)
    seen = count_host_reads(monkeypatch, lambda: (tensor.sum().item(), bool(tensor[0]), tensor.tolist(),
                                                  tensor[tensor > 1], tensor.nonzero()))
    assert seen.count("aten._local_scalar_dense.default") == 2 and "tolist" in seen
    assert "aten.index.Tensor with a bool index" in seen and "aten.nonzero.default" in seen


@pytest.mark.parametrize("with_table", [False, True])
def test_propose_reads_nothing_on_the_host(monkeypatch, with_table):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (3, 64), generator=generator)
    bigram = torch.randint(0, 20, (20,), generator=generator) if with_table else None
    prob = torch.rand(20, generator=generator) if with_table else None
    mag = MaG(bigram, prob, min_match=2, copy_passes=2)
    seen = count_host_reads(monkeypatch, lambda: mag.propose(tokens, torch.tensor([40, 64, 0]),
                                                             torch.tensor([30, 60, 0]), 6, search_bound=60))
    assert seen == []


def test_search_bound_above_every_history_changes_nothing():
    generator = torch.Generator().manual_seed(time.time_ns() % 2**32)
    tokens = torch.randint(0, 3, (4, 200), generator=generator)
    end, history_end = torch.tensor([150, 90, 200, 1]), torch.tensor([120, 90, 180, 1])
    mag = MaG(max_match=8)
    full = mag.propose(tokens, end, history_end, 8)
    bounded = mag.propose(tokens, end, history_end, 8, search_bound=179)
    assert all(torch.equal(a, b) for a, b in zip(vars(full).values(), vars(bounded).values()))


def test_to_moves_the_tables():
    mag = MaG(torch.tensor([1, 0]), torch.tensor([0.5, 0.5]))
    assert mag.to("meta") is mag and mag.bigram.device.type == mag.bigram_prob.device.type == "meta"
    with pytest.raises(ValueError, match="MaG.to"):
        mag.propose(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([2]), torch.tensor([2]), 2)


def test_bad_arguments_raise():
    table, prob = torch.zeros(4, dtype=torch.int64), torch.zeros(4)
    with pytest.raises(TypeError, match="bigram must"):
        MaG(torch.zeros(4), prob)
    with pytest.raises(TypeError, match="bigram_prob"):
        MaG(table, torch.zeros(3))
    with pytest.raises(ValueError, match="together"):
        MaG(table)
    for kwargs, message in (({"min_match": 0}, "min_match"), ({"max_match": 2, "min_match": 3}, "exceed"),
                            ({"min_bigram_prob": 1.5}, "min_bigram_prob"), ({"occurrence": "last"}, "occurrence"),
                            ({"copy_passes": 0}, "copy_passes"), ({"max_match": True}, "max_match")):
        with pytest.raises(ValueError, match=message):
            MaG(**kwargs)
    mag, tokens, lengths = MaG(), torch.zeros(2, 5, dtype=torch.int64), torch.tensor([3, 3])
    with pytest.raises(TypeError, match="tokens"):
        mag.propose(tokens.int(), lengths, lengths, 2)
    with pytest.raises(ValueError, match="column"):
        mag.propose(tokens[:, :0], lengths, lengths, 2)
    with pytest.raises(TypeError, match="history_end"):
        mag.propose(tokens, lengths, lengths[:1], 2)
    with pytest.raises(ValueError, match="m must"):
        mag.propose(tokens, lengths, lengths, 0)
    with pytest.raises(ValueError, match="search_bound"):
        mag.propose(tokens, lengths, lengths, 2, search_bound=-1)
    cap, rows, goal = torch.tensor([2, 2]), torch.tensor([True, True]), torch.tensor([5, 3])
    with pytest.raises(TypeError, match="cap must be a torch.int64 tensor \\[2\\]"):
        mag.extend(tokens, lengths, lengths, 2, None, cap.int(), rows, goal)
    with pytest.raises(TypeError, match="rows must be a torch.bool tensor \\[2\\]"):
        mag.extend(tokens, lengths, lengths, 2, None, cap, rows[:1], goal)
    with pytest.raises(TypeError, match="goal must be a torch.int64 tensor \\[2\\]"):
        mag.extend(tokens, lengths, lengths, 2, None, cap, rows, goal.float())
    with pytest.raises(ValueError, match="contiguous"):  # a copy would take the writes
        mag.extend(torch.zeros(5, 2, dtype=torch.int64).t(), lengths, lengths, 2, None, cap, rows, goal)
    with pytest.raises(ValueError, match="m must"):
        mag.extend(tokens, lengths, lengths, 0, None, cap, rows, goal)
    # still usable: one token copied where the row is short of its goal (row 1 has reached it)
    _, end = mag.extend(tokens, lengths, lengths, 2, None, cap, rows, goal)
    assert end.tolist() == [4, 3]


@pytest.mark.gpu
def test_propose_runs_in_a_cuda_graph():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (4, 256), generator=generator).cuda()
    end, history_end = torch.tensor([200, 256, 0, 10]).cuda(), torch.tensor([190, 250, 0, 10]).cuda()
    mag = MaG(torch.randint(0, 5, (5,), generator=generator), torch.rand(5, generator=generator)).to("cuda")
    expected = mag.propose(tokens, end, history_end, 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mag.propose(tokens, end, history_end, 8)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mag.propose(tokens, end, history_end, 8)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(vars(captured).values(), vars(expected).values()))
    on_cpu = mag.to("cpu").propose(tokens.cpu(), end.cpu(), history_end.cpu(), 8)  # the reference
    assert all(torch.equal(a.cpu(), b) for a, b in zip(vars(expected).values(), vars(on_cpu).values()))


@pytest.mark.gpu
def test_extend_runs_in_a_cuda_graph_and_matches_the_reference():
    """The compiled kernel's in-place write (mag_extend) captured and replayed equals the CPU
    reference's, buffer included (the interpreter checks the same in tests/kernels/test_mag.py)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4, (4, 256), generator=generator)
    end, history_end = torch.tensor([200, 253, 0, 10]), torch.tensor([190, 250, 0, 10])
    cap, rows, goal = torch.tensor([8, 2, 8, 0]), torch.tensor([True, True, False, True]), torch.tensor([300, 300, 5, 20])
    mag = MaG(torch.randint(0, 4, (4,), generator=generator), torch.rand(4, generator=generator))
    want_tokens = tokens.clone()
    want, want_end = mag.extend(want_tokens, end, history_end, 8, None, cap, rows, goal)
    mag.to("cuda")
    args = [t.cuda() for t in (end, history_end)]
    buffer, cap, rows, goal = tokens.cuda(), cap.cuda(), rows.cuda(), goal.cuda()  # no host copies in the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mag.extend(buffer.clone(), *args, 8, None, cap, rows, goal)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, got_end = mag.extend(buffer, *args, 8, None, cap, rows, goal)
    graph.replay()
    assert torch.equal(buffer.cpu(), want_tokens) and torch.equal(got_end.cpu(), want_end)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(vars(got).values(), vars(want).values()))
