"""The cascade review's bookkeeping kernel (kernels/review.py) against its PyTorch reference
and the rule written out by hand: rows in and out of need, with and without the correction
token written, counters that are row views of a [levels, B] buffer."""
import pytest
import torch

from csd_engine.kernels.review import review_bookkeeping, review_bookkeeping_ref
from tests.kernels.test_verify import DEVICE
from tests.stats import fresh_seed


def _inputs(gen, batch, width):
    need = torch.rand(batch, generator=gen) < 0.6
    mark = torch.randint(1, width // 2, (batch,), generator=gen)
    drafted = torch.randint(0, 5, (batch,), generator=gen) * need
    accepted = (torch.rand(batch, generator=gen) * (drafted + 1)).long().clamp(max=drafted)
    cache = torch.randint(0, width, (batch,), generator=gen)
    counters = torch.randint(0, 50, (3, batch), generator=gen)
    tokens = torch.randint(0, 1000, (batch, width + 1), generator=gen)
    token = torch.randint(0, 1000, (batch,), generator=gen)
    return [t.to(DEVICE) for t in (mark, accepted, drafted, need, cache, counters, tokens, token)]


@pytest.mark.parametrize("batch, write", [(1, True), (7, True), (7, False), (33, True)])
def test_kernel_equals_reference_and_the_rule(batch, write):
    seed = fresh_seed()
    width = 40
    mark, accepted, drafted, need, cache, counters, tokens, token = _inputs(torch.Generator().manual_seed(seed),
                                                                           batch, width)
    want_tokens, want_counters = tokens.clone(), counters.clone()
    want_mark, want_at = [], []
    for b in range(batch):
        end = int(mark[b] + accepted[b])
        want_mark.append(end + int(need[b]))
        want_at.append(end if need[b] else width)
        want_counters[1, b] += accepted[b]
        want_counters[2, b] += drafted[b]
        if write:
            want_tokens[b, want_at[-1]] = token[b]
    for run in (review_bookkeeping, review_bookkeeping_ref):
        c, n, t = cache.clone(), counters.clone(), tokens.clone()
        new_mark, at = run(mark, accepted, drafted, need, c, n[1], n[2], t, width, token if write else None)
        assert new_mark.tolist() == want_mark and at.tolist() == want_at, f"{run.__name__} seed={seed}"
        assert c.tolist() == [m - 1 for m in want_mark], f"{run.__name__} seed={seed}"
        assert torch.equal(n, want_counters) and torch.equal(t, want_tokens), f"{run.__name__} seed={seed}"


def test_bad_input_names_the_argument():
    mark, accepted, drafted, need, cache, counters, tokens, token = _inputs(torch.Generator().manual_seed(0), 3, 20)
    with pytest.raises(ValueError, match="need must be torch.bool"):
        review_bookkeeping(mark, accepted, drafted, need.long(), cache, counters[1], counters[2], tokens, 20)
    with pytest.raises(TypeError, match="scratch must be a host int"):
        review_bookkeeping(mark, accepted, drafted, need, cache, counters[1], counters[2], tokens, torch.tensor(20))
    with pytest.raises(ValueError, match="level_drafted is written in place and must be contiguous"):
        review_bookkeeping(mark, accepted, drafted, need, cache, counters[1], counters[:, 0:3].t()[0], tokens, 20)
