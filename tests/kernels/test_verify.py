"""Chain verification: the Triton kernel against its PyTorch reference, and both against the rules
and exact distributions of docs/algorithms.md (chain verification, lenience).

* Fresh random batches mixing greedy, plain and top-k / top-p sampling rows, ragged drafts that
  are often accepted: the kernel reproduces the reference exactly (same random numbers).
* Greedy rows and the top-k / top-p cut-offs are checked against the definitions written out here.
* Losslessness: over 20000 seeds in one batched call the first emitted token follows p (lenience 1)
  or emitted_distribution (lenience > 1). The Triton interpreter is slow, so without a GPU the
  kernel gets that test on a few hundred draws of a small vocabulary.
"""
import functools

import pytest
import torch

from csd_engine.kernels.emitted import emitted_distribution_ref
from csd_engine.kernels.verify import reviewer_probs, sampled_distribution, verify, verify_ref
from tests.stats import assert_distribution, fresh_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DRAWS = 20000
KERNEL_DRAWS = DRAWS if DEVICE == "cuda" else 240
LOGIT_SCALE = 3.0  # peaked reviewers, so that drafts are often accepted

# The interpreter runs the kernels in NumPy, which warns about log(0) (a vanished residual entry,
# -inf on purpose) and about turning a runtime loop bound (a 1-element array) into an int.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]


def random_batch(gen: torch.Generator, batch: int, k: int, vocab: int, with_draft_probs: bool,
                 dtype: torch.dtype = torch.float32) -> dict:
    """verify() arguments: greedy and sampling rows mixed, top-k / top-p on some rows, ragged
    drafts drawn from a q close to the reviewer's p."""
    logits = LOGIT_SCALE * torch.randn(batch, k + 1, vocab, generator=gen)
    greedy = torch.rand(batch, generator=gen) < 0.3
    temperature = torch.where(greedy, 0.0, 0.5 + torch.rand(batch, generator=gen))
    top_k = torch.where(torch.rand(batch, generator=gen) < 0.3, torch.randint(1, vocab, (batch,), generator=gen), 0)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.3, 0.5 + 0.45 * torch.rand(batch, generator=gen), 1.0)
    p = reviewer_probs(logits, temperature, top_k, top_p)[:, :k]
    q = 0.8 * p + 0.2 * torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    draft_tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    return dict(logits=logits.to(dtype).to(DEVICE), draft_tokens=draft_tokens.to(DEVICE),
                num_drafts=torch.randint(0, k + 1, (batch,), generator=gen).to(DEVICE),
                draft_probs=q.to(DEVICE) if with_draft_probs else None, temperature=temperature.to(DEVICE),
                top_k=top_k.to(torch.int32).to(DEVICE), top_p=top_p.to(DEVICE),
                seed=torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE),
                offset=torch.randint(0, 2**40, (batch,), generator=gen).to(DEVICE))


def same_logits_batch(gen: torch.Generator, rows: int, k: int, vocab: int, temperature: float, top_k: int,
                      top_p: float, with_draft_probs: bool) -> dict:
    """`rows` copies of one request with fresh seeds: drafts x_j ~ q_j (one q per position), all
    n = k, so the first emitted token of each row is an independent draw of the same law."""
    logits = LOGIT_SCALE * torch.randn(1, k + 1, vocab, generator=gen)
    q = torch.softmax(logits[:, :k] + torch.randn(1, k, vocab, generator=gen), -1)
    draft_tokens = torch.multinomial(q[0], rows, replacement=True, generator=gen).T
    return dict(logits=logits.expand(rows, -1, -1).to(DEVICE), draft_tokens=draft_tokens.to(DEVICE),
                num_drafts=torch.full((rows,), k, device=DEVICE),
                draft_probs=q.expand(rows, -1, -1).to(DEVICE) if with_draft_probs else None,
                temperature=torch.full((rows,), temperature, device=DEVICE),
                top_k=torch.full((rows,), top_k, dtype=torch.int32, device=DEVICE),
                top_p=torch.full((rows,), top_p, device=DEVICE),
                seed=torch.randint(0, 2**40, (rows,), generator=gen).to(DEVICE),
                offset=torch.randint(0, 2**40, (rows,), generator=gen).to(DEVICE))


def first_emitted(inputs: dict, result) -> torch.Tensor:
    return torch.where(result.num_accepted > 0, inputs["draft_tokens"][:, 0], result.next_token)


def emitted(inputs: dict, lenience: float, result) -> torch.Tensor:
    return emitted_distribution_ref(**{name: value for name, value in inputs.items() if name not in ("seed", "offset")},
                                    lenience=lenience, result=result)


@pytest.mark.parametrize("batch, k, vocab, with_draft_probs, lenience, dtype", [
    (1, 0, 50, False, 1.0, torch.float32),
    (8, 0, 1000, False, 1.0, torch.bfloat16),
    (3, 1, 257, True, 1.0, torch.float32),
    (8, 4, 1000, True, 2.5, torch.float32),
    (8, 7, 257, False, 2.5, torch.float32),
    (3, 7, 50, True, 2.5, torch.float16),
    (8, 4, 50, False, 1.0, torch.float32),
])
def test_kernel_matches_reference(batch, k, vocab, with_draft_probs, lenience, dtype):
    seed = fresh_seed()
    inputs = random_batch(torch.Generator().manual_seed(seed), batch, k, vocab, with_draft_probs, dtype)
    # A view of wider logits (as a padded vocabulary gives): rows are not contiguous.
    inputs["logits"] = torch.cat([inputs["logits"], inputs["logits"][..., :3]], -1)[..., :vocab]
    got = verify(**inputs, lenience=lenience)
    want = verify_ref(**inputs, lenience=lenience)
    where = f"seed={seed}, num_drafts={inputs['num_drafts'].tolist()}, want accepted={want.num_accepted.tolist()}"
    assert torch.equal(got.num_accepted, want.num_accepted), f"{where}, got {got.num_accepted.tolist()}"
    assert torch.equal(got.next_token, want.next_token), f"{where}: next_token {got.next_token} != {want.next_token}"
    assert torch.allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5), f"{where}: lse {got.lse} != {want.lse}"
    assert torch.equal(got.threshold, want.threshold), f"{where}: threshold {got.threshold} != {want.threshold}"
    beyond = torch.arange(k + 1, device=DEVICE) > inputs["num_drafts"][:, None]
    assert (got.lse[beyond] == 0).all() and (got.threshold[beyond] == 0).all(), f"{where}: past the draft"


@pytest.mark.parametrize("impl", [verify_ref, pytest.param(functools.partial(verify_ref, all_greedy=True),
                                                              id="verify_ref-all_greedy"), verify,
                                  pytest.param(functools.partial(verify, all_greedy=True), id="verify-all_greedy")])
@pytest.mark.parametrize("lenience", [1.0, 2.5])
def test_greedy_rows_follow_the_rule(impl, lenience):
    """Greedy: accept x_j while it is the argmax or (l > 1) l * softmax(x_j) > q(x_j) = 1; emit the
    argmax at the first failure, or at position n."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch, k, vocab = 6, 4, 40
    # Two tokens dominate each position, the runner-up close enough that l * p > 1 for some.
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    best = torch.randint(0, vocab, (batch, k + 1, 1), generator=gen)
    runner_up = (best + torch.randint(1, vocab, best.shape, generator=gen)) % vocab
    logits.scatter_(-1, best, 10.0).scatter_(-1, runner_up, 10.0 - 2 * torch.rand(best.shape, generator=gen))
    argmax = logits.argmax(-1)
    # Drafts copy the argmax up to a random position, the runner-up from there on.
    switch = torch.randint(0, k + 1, (batch, 1), generator=gen)
    draft_tokens = torch.where(torch.arange(k) < switch, argmax[:, :k], runner_up[:, :k, 0])
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    ones = torch.ones(batch)
    result = impl(logits.to(DEVICE), draft_tokens.to(DEVICE), num_drafts.to(DEVICE), None, (0 * ones).to(DEVICE),
                  torch.zeros(batch, dtype=torch.int32, device=DEVICE), ones.to(DEVICE),
                  torch.zeros(batch, dtype=torch.int64, device=DEVICE),
                  torch.zeros(batch, dtype=torch.int64, device=DEVICE), lenience)
    probs = torch.softmax(logits.double(), -1)
    for b in range(batch):
        accepted = 0
        while accepted < num_drafts[b]:
            x = draft_tokens[b, accepted]
            if not (x == argmax[b, accepted] or (lenience > 1 and lenience * probs[b, accepted, x] > 1)):
                break
            accepted += 1
        where = f"seed={seed}, row {b}, drafts {draft_tokens[b].tolist()}, argmax {argmax[b].tolist()}"
        assert result.num_accepted[b] == accepted, f"{where}: accepted {result.num_accepted[b]}, want {accepted}"
        assert result.next_token[b] == argmax[b, accepted], f"{where}: next token {result.next_token[b]}"
    lse = torch.logsumexp(logits, -1)
    drafted = torch.arange(k + 1) <= num_drafts[:, None]
    assert torch.allclose(result.lse.cpu()[drafted], lse[drafted], atol=1e-5), f"seed={seed}: greedy lse"
    assert (result.threshold.cpu()[drafted] == float("-inf")).all(), f"seed={seed}: greedy rows are unfiltered"


@pytest.mark.parametrize("impl", [verify_ref, verify])
@pytest.mark.parametrize("lenience", [1.0, 2.5])
def test_the_all_greedy_hint_changes_nothing_but_the_work(impl, lenience):
    """all_greedy=True skips the random numbers and residuals (verify_ref) or the emit-split launch
    (verify): on greedy rows either returns exactly what its general path does, ragged drafts and
    draft probabilities included. And a lenience given per row equals the same value as a float
    (the kernel takes a float as an argument, a tensor by pointer)."""
    seed = fresh_seed()
    inputs = random_batch(torch.Generator().manual_seed(seed), 8, 5, 300, True)
    inputs["temperature"] = torch.zeros_like(inputs["temperature"])
    general = impl(**inputs, lenience=lenience)
    hinted = impl(**inputs, lenience=lenience, all_greedy=True)
    per_row = impl(**inputs, lenience=torch.full((8,), lenience, device=DEVICE))
    for name in ("num_accepted", "next_token", "lse", "threshold"):
        assert torch.equal(getattr(hinted, name), getattr(general, name)), f"seed={seed}: {name}"
        assert torch.equal(getattr(per_row, name), getattr(general, name)), f"seed={seed}: {name}, lenience per row"


def cutoff_by_definition(z: torch.Tensor, top_k: int, top_p: float) -> float:
    """The smallest kept value of one row of processed logits, straight from the definition (float64)."""
    z = z.double()
    kept = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        kept = z >= z.sort(descending=True).values[top_k - 1]
    if top_p < 1:
        p = torch.where(kept, torch.softmax(torch.where(kept, z, float("-inf")), 0), 0.0)
        reaching = [v for v in z[kept].unique() if p[z >= v].sum() >= top_p]
        kept = z >= max(reaching)
    return z[kept].min().item()


@pytest.mark.parametrize("impl, batch", [(verify_ref, 32), (verify, 4)])
def test_cutoffs_follow_the_definition(impl, batch):
    """Integer-valued logits make many ties: a tie at the cut-off is kept whole."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab = 60
    logits = torch.randint(-4, 5, (batch, 1, vocab), generator=gen).float()
    temperature = 0.5 + torch.rand(batch, generator=gen)
    top_k = torch.randint(0, 20, (batch,), generator=gen).to(torch.int32)
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.7, 0.3 + 0.65 * torch.rand(batch, generator=gen), 1.0)
    empty = torch.zeros(batch, 0, dtype=torch.int64)
    zero = torch.zeros(batch, dtype=torch.int64)
    result = impl(*(t.to(DEVICE) for t in (logits, empty, zero)), None,
                  *(t.to(DEVICE) for t in (temperature, top_k, top_p, zero, zero)))
    z = logits[:, 0] / temperature[:, None]
    for b in range(batch):
        want = cutoff_by_definition(z[b], top_k[b].item(), top_p[b].item())
        if top_k[b] == 0 and top_p[b] == 1:
            want = float("-inf")
        where = f"seed={seed}, row {b}, top_k {top_k[b].item()}, top_p {top_p[b].item():.4f}"
        assert result.threshold[b, 0].item() == pytest.approx(want, rel=1e-6), f"{where}: {result.threshold[b, 0]}"
        kept_lse = torch.logsumexp(torch.where(z[b] >= want, z[b], float("-inf")), 0)
        assert result.lse[b, 0].item() == pytest.approx(kept_lse.item(), abs=1e-5), f"{where}: lse"


def test_emitted_distribution_is_p_at_lenience_one_and_a_distribution_otherwise():
    seed = fresh_seed()
    inputs = random_batch(torch.Generator().manual_seed(seed), 64, 4, 30, with_draft_probs=True)
    settings = [inputs[name] for name in ("temperature", "top_k", "top_p")]
    p = reviewer_probs(inputs["logits"], *settings)
    for lenience in (1.0, 2.5):
        for draft_probs in (inputs["draft_probs"], None):
            args = dict(inputs, draft_probs=draft_probs)
            result = verify_ref(**args, lenience=lenience)
            e = emitted(args, lenience, result)
            emitted_at = torch.arange(5, device=DEVICE) <= result.num_accepted[:, None]
            where = f"seed={seed}, lenience {lenience}, draft probs {draft_probs is not None}"
            assert (e[~emitted_at] == 0).all(), f"{where}: nonzero past num_accepted"
            assert torch.allclose(e[emitted_at].sum(-1), torch.ones(()), atol=1e-5), f"{where}: not normalised"
            assert (e >= 0).all(), f"{where}: negative mass"
            sampling = (inputs["temperature"] > 0)[:, None] & emitted_at
            if lenience == 1.0:
                assert torch.allclose(e[sampling], p[sampling], atol=1e-6), f"{where}: e_j != p_j"
            greedy = (inputs["temperature"] == 0)[:, None] & emitted_at
            tokens = torch.cat([inputs["draft_tokens"], result.next_token[:, None]], 1)
            tokens[torch.arange(64), result.num_accepted.long()] = result.next_token
            one_hot = torch.nn.functional.one_hot(tokens, 30).float()
            assert torch.equal(e[greedy], one_hot[greedy]), f"{where}: greedy rows must be one-hot"


@pytest.mark.parametrize("check", [verify_ref, verify])
def test_sampled_distribution_is_reviewer_probs(check):
    """A check without drafts draws from p: the distribution rebuilt from its own lse and cut-off
    is reviewer_probs' (the same values from the reference; within rounding from the kernel),
    one-hot of the drawn token on greedy rows."""
    seed = fresh_seed()
    inputs = random_batch(torch.Generator().manual_seed(seed), 16, 0, 300, with_draft_probs=False)
    settings = [inputs[name] for name in ("temperature", "top_k", "top_p")]
    result = check(**inputs)
    got = sampled_distribution(inputs["logits"][:, 0], inputs["temperature"], result)
    want = reviewer_probs(inputs["logits"][:, 0], *settings)
    if check is verify_ref:
        assert torch.equal(got, want), f"seed={seed}"
    else:
        assert torch.allclose(got, want, atol=1e-6), f"seed={seed}: {(got - want).abs().max()}"
    greedy = inputs["temperature"] == 0
    assert torch.equal(got[greedy].argmax(-1), result.next_token[greedy]), f"seed={seed}"


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 8, 0.9)])
def test_first_token_follows_p(with_draft_probs, temperature, top_k, top_p):
    """Lenience 1 is lossless: whatever the drafts, the first emitted token is a draw of p_0."""
    gen = torch.Generator().manual_seed(fresh_seed())
    while True:  # a law under which both verdicts (accept, residual sample) are common
        inputs = same_logits_batch(gen, DRAWS, 2, 12, temperature, top_k, top_p, with_draft_probs)
        p = reviewer_probs(inputs["logits"][:1, 0], *(inputs[n][:1] for n in ("temperature", "top_k", "top_p")))[0]
        if with_draft_probs:  # drafts ~ q, accepted with min(1, p/q)
            rejection = 1 - torch.minimum(p, inputs["draft_probs"][0, 0]).sum().item()
        else:  # each row's draft accepted with p(draft)
            rejection = 1 - p[inputs["draft_tokens"][:, 0]].mean().item()
        if 0.02 < rejection < 0.98:
            break
    result = verify_ref(**inputs)
    rejected_first = (result.num_accepted == 0).float().mean().item()
    assert abs(rejected_first - rejection) < 0.02, f"first drafts rejected {rejected_first:.4f} of the time, " \
                                                   f"not {rejection:.4f}"
    assert_distribution(first_emitted(inputs, result).cpu(), p.cpu())


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_lenient_first_token_follows_emitted_distribution(with_draft_probs):
    seed = fresh_seed()
    inputs = same_logits_batch(torch.Generator().manual_seed(seed), DRAWS, 1, 12, 0.8, 0, 0.95, with_draft_probs)
    if not with_draft_probs:  # one deterministic draft token for all rows, so e_0 is one law
        inputs["draft_tokens"][:] = inputs["draft_tokens"][0]
    result = verify_ref(**inputs, lenience=2.5)
    e = emitted(inputs, 2.5, result)[:, 0]
    assert torch.allclose(e, e[:1], atol=1e-6), f"seed={seed}: e_0 must not depend on the row"
    assert_distribution(first_emitted(inputs, result).cpu(), e[0].cpu())


def test_kernel_draws_follow_emitted_distribution():
    """The kernel's own draws at lenience 2.5: accept test, residual and bonus sampling. (Filtered
    rows cost the interpreter most; the kernel equals the reference on them above.)"""
    seed = fresh_seed()
    inputs = same_logits_batch(torch.Generator().manual_seed(seed), KERNEL_DRAWS, 1, 5, 1.2, 0, 1.0, True)
    result = verify(**inputs, lenience=2.5)
    e = emitted(inputs, 2.5, result)[0, 0]
    assert_distribution(first_emitted(inputs, result).cpu(), e.cpu())


def test_bad_input_is_rejected():
    inputs = random_batch(torch.Generator().manual_seed(0), 2, 3, 10, with_draft_probs=True)
    with pytest.raises(ValueError, match="logits must be"):
        verify(**dict(inputs, logits=inputs["logits"][:, 0]))
    with pytest.raises(ValueError, match="draft_tokens must have shape"):
        verify(**dict(inputs, draft_tokens=inputs["draft_tokens"][:, :2]))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(**dict(inputs, draft_probs=inputs["draft_probs"][..., :5]))
    with pytest.raises(TypeError, match="draft_tokens must be an integer"):
        verify(**dict(inputs, draft_tokens=inputs["draft_tokens"].float()))
    with pytest.raises(ValueError, match="lenience must be"):
        verify(**inputs, lenience=0.5)
    if DEVICE == "cpu":  # value checks would need a host sync on CUDA
        with pytest.raises(ValueError, match=r"num_drafts must be in \[0, k=3\]"):
            verify_ref(**dict(inputs, num_drafts=torch.tensor([1, 4])))
        with pytest.raises(ValueError, match="top_p"):
            verify(**dict(inputs, top_p=torch.tensor([0.0, 1.0])))


def test_uniforms_stay_strictly_inside_zero_one():
    """A uniform of exactly 0 or 1 would make a Gumbel score infinite (a lossless-breaking
    uniformly random token): the extremes of the 23-bit grid must stay inside (0, 1)."""
    from csd_engine.kernels.random import gumbel_ref, uniform_ref
    u = uniform_ref(torch.arange(4)[:, None], torch.arange(4)[:, None], torch.arange(200_000))
    assert 0 < u.min().item() and u.max().item() < 1
    top = (torch.tensor((1 << 23) - 1, dtype=torch.float32) + 0.5) * (1.0 / 8388608.0)
    assert top.item() < 1.0
    assert torch.isfinite(gumbel_ref(torch.arange(4)[:, None], 0, torch.arange(200_000))).all()


def test_reviewer_probs_without_filters_skips_only_the_cutoff_search():
    """filtered=False (the engine's host-known 'no row uses top-k / top-p') gives the same p as the
    full path for such rows, greedy rows included; with a filtered row the full path differs."""
    gen = torch.Generator().manual_seed(fresh_seed())
    logits = 3 * torch.randn(4, 3, 50, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    no_top_k, no_top_p = torch.zeros(4, dtype=torch.int32), torch.ones(4)
    full = reviewer_probs(logits, temperature, no_top_k, no_top_p)
    fast = reviewer_probs(logits, temperature, no_top_k, no_top_p, filtered=False)
    torch.testing.assert_close(fast, full, rtol=0, atol=0)
    assert (full[0].argmax(-1) == logits[0].argmax(-1)).all() and (full[0].max(-1).values == 1).all()
    filtered = reviewer_probs(logits, temperature, torch.tensor([0, 5, 0, 0], dtype=torch.int32), no_top_p)
    assert ((filtered[1] > 0).sum(-1) == 5).all() and not torch.equal(filtered, full)


@pytest.mark.parametrize("impl", [verify_ref, verify])
def test_lenience_per_row_equals_separate_calls(impl):
    """A [B] lenience gives each row what a call with its value as the scalar lenience gives it."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    batch = 8
    inputs = random_batch(gen, batch, 3, 60, with_draft_probs=bool(seed % 2))
    values = torch.tensor([1.0, 2.5, 4.0])
    lenience = values[torch.randint(0, 3, (batch,), generator=gen)].to(DEVICE)
    got = impl(**inputs, lenience=lenience)
    no_seed = {name: value for name, value in inputs.items() if name not in ("seed", "offset")}
    got_emitted = emitted_distribution_ref(**no_seed, lenience=lenience, result=got)
    for value in values.tolist():
        rows = lenience == value
        want = impl(**inputs, lenience=value)
        where = f"seed={seed}, lenience {value}"
        for field in ("num_accepted", "next_token", "lse", "threshold"):
            assert torch.equal(getattr(got, field)[rows], getattr(want, field)[rows]), f"{where}: {field}"
        want_emitted = emitted_distribution_ref(**no_seed, lenience=value, result=want)
        assert torch.equal(got_emitted[rows], want_emitted[rows]), f"{where}: emitted distribution"


@pytest.mark.parametrize("batch, k, vocab, splits, with_draft_probs, lenience, dtype", [
    (1, 0, 300, 3, False, 1.0, torch.float32),
    (2, 3, 257, 4, True, 2.5, torch.float32),
    (3, 2, 1000, 7, False, 1.0, torch.bfloat16),
    (4, 4, 130, 2, True, 1.0, torch.float32),
])
def test_split_sweeps_match_reference(batch, k, vocab, splits, with_draft_probs, lenience, dtype):
    """The vocabulary split over programs (as at small batch on a GPU, forced here on a small V):
    merged statistics and per-split Gumbel candidates give the reference's tokens exactly."""
    from csd_engine.kernels.verify import split_plan
    num_splits, chunk, block_v = split_plan(batch, k + 1, vocab, splits)
    assert num_splits > 1 and chunk % block_v == 0 and (num_splits - 1) * chunk < vocab <= num_splits * chunk
    seed = fresh_seed()
    for trial in range(3):
        inputs = random_batch(torch.Generator().manual_seed(seed + trial), batch, k, vocab, with_draft_probs, dtype)
        got = verify(**inputs, lenience=lenience, splits=splits)
        want = verify_ref(**inputs, lenience=lenience)
        where = f"seed={seed + trial}, num_drafts={inputs['num_drafts'].tolist()}, splits={num_splits}"
        assert torch.equal(got.num_accepted, want.num_accepted), f"{where}: {got.num_accepted} != {want.num_accepted}"
        assert torch.equal(got.next_token, want.next_token), f"{where}: {got.next_token} != {want.next_token}"
        assert torch.equal(got.threshold, want.threshold), f"{where}: threshold"
        assert torch.allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5), f"{where}: lse {got.lse} != {want.lse}"


def test_split_plan_fills_the_gpu_at_small_batch():
    from csd_engine.kernels.verify import MIN_SPLIT, split_plan
    vocab = 151936
    for batch, positions in ((1, 1), (1, 5), (4, 5), (64, 5), (256, 9)):
        splits, chunk, _ = split_plan(batch, positions, vocab)
        assert splits * chunk >= vocab and (splits == 1 or chunk >= MIN_SPLIT)
        assert batch * positions * splits >= min(132, batch * positions * (vocab // MIN_SPLIT))  # every SM busy
    assert split_plan(256, 9, vocab)[0] == 1 and split_plan(1, 5, vocab)[0] > 32
