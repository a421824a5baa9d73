"""The shared processed distribution (kernels/sampling.py): device code against processed_ref, the
reference against the definition, and the references' promise of no host reads.

* `processed` runs the statistics and cut-off search that verify.py and tree_verify.py both use;
  its thresholds must equal processed_ref's exactly, and so must verify's own (integer-valued
  logits make ties at the cut-off common).
* processed_ref's partial-sort path (max_top_k) equals its full-sort path where the promise holds.
* Every PyTorch reference the engine runs on its device (processed_ref, reviewer_probs,
  verify_ref, emitted_distribution, tree_verify_ref) runs under a dispatch mode that counts reads
  of tensor values into Python: with check_values off and host-known hints there must be none.
"""
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csd_engine.kernels.sampling import processed, processed_ref, top_at_zero
from csd_engine.kernels.tree_verify import tree_verify_ref
from csd_engine.kernels.emitted import emitted_distribution_ref
from csd_engine.kernels.verify import reviewer_probs, verify, verify_ref
from tests.kernels.test_verify import cutoff_by_definition, random_batch
from tests.stats import fresh_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]


def tied_rows(gen: torch.Generator, rows: int, vocab: int):
    """Integer logits (many ties), greedy rows, top-k (some >= V), top-p, both and neither mixed."""
    logits = torch.randint(-6, 7, (rows, vocab), generator=gen).float() + 0.25 * torch.randint(0, 2, (rows, 1),
                                                                                                 generator=gen)
    temperature = torch.where(torch.rand(rows, generator=gen) < 0.2, 0.0, 0.5 + torch.rand(rows, generator=gen))
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(1, vocab + 3, (rows,), generator=gen), 0)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.6, 0.2 + 0.75 * torch.rand(rows, generator=gen), 1.0)
    return logits, temperature, top_k.to(torch.int32), top_p


@pytest.mark.parametrize("rows, vocab", [(16, 60), (6, 700)])
def test_device_thresholds_equal_reference(rows, vocab):
    seed = fresh_seed()
    logits, temperature, top_k, top_p = (t.to(DEVICE) for t in tied_rows(torch.Generator().manual_seed(seed), rows,
                                                                            vocab))
    threshold, lse, argmax = processed(logits, temperature, top_k, top_p)
    z, want_threshold, want_lse = processed_ref(logits, temperature, top_k, top_p)
    where = f"seed={seed}, top_k {top_k.tolist()}, top_p {top_p.tolist()}"
    assert torch.equal(threshold, want_threshold), f"{where}: {threshold} != {want_threshold}"
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, z.argmax(-1)), where
    for b in range(rows):  # and the reference follows the definition, ties at the cut-off kept whole
        row_k, row_p = top_k[b].item(), top_p[b].item()
        filtered = temperature[b] > 0 and (0 < row_k < vocab or row_p < 1)
        want = cutoff_by_definition(z[b].cpu(), row_k, row_p) if filtered else float("-inf")
        assert want_threshold[b].item() == pytest.approx(want, rel=1e-6), f"{where}, row {b}"


def test_searches_over_candidates_equal_reference():
    """The cut-off searched over a row's candidates (the entries at or above a lower bound,
    kernels/sampling.py) or, where they overflow the workspace, over the row from the bound,
    equals processed_ref's: top-k within and past the block-maxima bound, top-p alone on peaked
    and on flat rows, and ties at the bound too many to copy."""
    from csd_engine.kernels.sampling import BOUND_BLOCK, CANDIDATES
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab = 3000
    blocks = -(-vocab // BOUND_BLOCK)
    peaked = 3 * torch.randn(6, vocab, generator=gen)
    ints = torch.randint(-6, 7, (2, vocab), generator=gen).float()
    flat = 0.01 * torch.randn(2, vocab, generator=gen)
    tied_top = torch.where(torch.arange(vocab) < CANDIDATES + 300, 5.0, torch.randn(2, vocab, generator=gen))
    logits = torch.cat([peaked, ints, flat, tied_top])
    rows = logits.shape[0]
    top_k = torch.tensor([1, 7, blocks, blocks + 1, 0, 0, 40, 0, 0, 0, 3, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 0.95, 0.5, 0.9, 0.7, 0.9, 0.99, 0.9, 0.6])
    temperature = 0.5 + torch.rand(rows, generator=gen)
    settings = [t.to(DEVICE) for t in (logits, temperature, top_k, top_p)]
    threshold, lse, _ = processed(*settings)
    z, want_threshold, want_lse = processed_ref(*settings)
    assert torch.equal(threshold, want_threshold), f"seed={seed}: {threshold} != {want_threshold}"
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    for b in range(rows):
        want = cutoff_by_definition(z[b].cpu(), int(top_k[b]), float(top_p[b]))
        assert want_threshold[b].item() == pytest.approx(want, rel=1e-6), f"seed={seed}, row {b}"


def test_verify_thresholds_equal_reference():
    """verify's split sweeps and merged statistics feed the same search: position by position its
    thresholds are processed_ref's."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, k, vocab = 5, 2, 300
    logits, temperature, top_k, top_p = tied_rows(gen, batch * (k + 1), vocab)
    logits = logits.view(batch, k + 1, vocab)
    temperature, top_k, top_p = temperature[:batch], top_k[:batch], top_p[:batch]
    zeros = torch.zeros(batch, dtype=torch.int64)
    args = [t.to(DEVICE) for t in (logits, torch.zeros(batch, k, dtype=torch.int64), torch.full((batch,), k))]
    settings = [t.to(DEVICE) for t in (temperature, top_k, top_p, zeros, zeros)]
    for splits in (1, 3):
        result = verify(*args, None, *settings, splits=splits)
        for j in range(k + 1):
            _, want, _ = processed_ref(args[0][:, j], *settings[:3])
            assert torch.equal(result.threshold[:, j], want), f"seed={seed}, splits={splits}, position {j}"


def test_partial_sorts_equal_full_sort(monkeypatch):
    """The full sort (a device's fixed shapes), the CPU's widening partial sort and a host-known
    max_top_k (every filtered row has 0 < top_k <= max_top_k) give the same thresholds."""
    from csd_engine.kernels import sampling
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, max_top_k = 24, 3000, 400
    logits, temperature, _, top_p = tied_rows(gen, rows, vocab)
    logits = logits * torch.rand(rows, 1, generator=gen)  # flat rows too: their nuclei pass 256 entries
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(1, max_top_k + 1, (rows,), generator=gen),
                        0).to(torch.int32)
    settings = (logits, temperature, top_k, top_p)
    widening = processed_ref(*settings, filtered=True)
    monkeypatch.setattr(sampling, "READS_ON_CPU", False)
    full = processed_ref(*settings, filtered=True)
    for got, want in zip(widening, full):
        assert torch.equal(got, want), f"seed={seed}: widening partial sort"
    has_k = top_k > 0
    hinted = processed_ref(*(t[has_k] for t in settings), filtered=True, max_top_k=max_top_k)
    for got, want in zip(hinted, full):
        assert torch.equal(got, want[has_k]), f"seed={seed}: max_top_k"
    if DEVICE != "cpu":
        return  # the max_top_k check reads values: it runs on CPU tensors only (a sync on a GPU)
    with pytest.raises(ValueError, match="max_top_k"):
        inputs = random_batch(gen, 2, 1, 50, False)
        verify_ref(**dict(inputs, temperature=torch.ones(2, device=DEVICE), top_k=torch.tensor([0, 3], device=DEVICE),
                          top_p=torch.tensor([0.9, 1.0], device=DEVICE)),
                   max_top_k=8)


class HostReads(TorchDispatchMode):
    """Counts the ops that move tensor values into Python (a device sync on a GPU)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
    BOOL_INDEXED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS:
            self.record(str(func))
        elif func in self.BOOL_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.record(f"{func} with a bool index")
        return func(*args, **kwargs)

    def record(self, what: str) -> None:
        """The read and the line of kernels/ that made it."""
        lines = [f"{frame.filename.split('/')[-1]}:{frame.lineno}" for frame in traceback.extract_stack()
                 if "/kernels/" in frame.filename and "/tests/" not in frame.filename]
        self.reads.append(f"{what} at {lines[-1] if lines else '?'}")


@pytest.fixture
def count_reads(monkeypatch):
    """A context that fails the test if the code inside reads tensor values into Python."""
    tolist = torch.Tensor.tolist

    class Counting(HostReads):
        def __enter__(self):
            def counted_tolist(tensor):
                self.record("Tensor.tolist")
                return tolist(tensor)
            monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
            return super().__enter__()

        def __exit__(self, *exc):
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
            return super().__exit__(*exc)

    return Counting


def test_read_counter_sees_reads(count_reads):
    t = torch.tensor([1.0, -1.0])
    for read in (lambda: t.sum().item(), lambda: bool(t.any()), lambda: t.nonzero(), lambda: t[t > 0],
                 lambda: t.tolist(), lambda: int(t.argmax())):
        with count_reads() as counter:
            read()
        assert counter.reads, "a read went uncounted"


@pytest.mark.parametrize("filtered", [False, True, None])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_references_do_not_read_the_device(count_reads, monkeypatch, filtered, with_draft_probs):
    """CPU tensors with the reads a CPU may make switched off behave as on a device: hints given
    (filtered, all_greedy) or not (None: assume the general case), nothing is read."""
    from csd_engine.kernels import sampling
    monkeypatch.setattr(sampling, "READS_ON_CPU", False)
    gen = torch.Generator().manual_seed(fresh_seed())
    batch, k, vocab = 6, 3, 64
    inputs = random_batch(gen, batch, k, vocab, with_draft_probs)
    if filtered is False:
        inputs.update(top_k=torch.zeros_like(inputs["top_k"]), top_p=torch.ones_like(inputs["top_p"]))
    settings = [inputs[name] for name in ("temperature", "top_k", "top_p")]
    lenience = 1.0 + 2 * torch.rand(batch, generator=gen).to(DEVICE)
    no_seed = {name: value for name, value in inputs.items() if name not in ("seed", "offset")}
    tree_inputs = dict(logits=inputs["logits"], tokens=torch.randint(0, vocab, (batch, k + 1), generator=gen).to(DEVICE),
                       parents=torch.tensor([-1, 0, 0, 1]).expand(batch, k + 1).contiguous().to(DEVICE),
                       draft_probs=inputs["logits"].softmax(-1) if with_draft_probs else None,
                       **{name: inputs[name] for name in ("temperature", "top_k", "top_p", "seed", "offset")})
    with count_reads() as counter:
        processed_ref(inputs["logits"][:, 0], *settings, filtered=filtered)
        reviewer_probs(inputs["logits"], *settings, filtered=filtered)
        for l in (2.5, lenience):
            result = verify_ref(**inputs, lenience=l, filtered=filtered, check_values=False)
            emitted_distribution_ref(**no_seed, lenience=l, result=result, check_values=False)
        for all_greedy in (False, True, None):
            tree_verify_ref(**tree_inputs, all_greedy=all_greedy, filtered=filtered, check_values=False)
    assert counter.reads == [], f"host reads: {counter.reads}"


def test_top_at_zero_moves_sampling_rows_only():
    """Sampling rows' maxima go to 0 (per position), in float32; greedy rows are left bit for bit,
    non-finite entries included (a NaN or inf there must not spread over its row)."""
    x = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0)).bfloat16() * 30
    x[0, 1, 7] = float("inf")
    x[0, 0, 3] = float("nan")
    out = top_at_zero(x, torch.tensor([0.0, 1e-6, 0.7]))
    assert out.dtype == torch.float32
    assert torch.equal(out[0].nan_to_num(0.0), x[0].float().nan_to_num(0.0)) and out[0, 0, 3].isnan()
    assert torch.equal(out[1:].amax(-1), torch.zeros(2, 2))
    assert torch.equal(out[1:], x[1:].float() - x[1:].float().amax(-1, keepdim=True))
