"""PEARL is lossless whatever runs in parallel: greedy equals plain greedy decoding, sampling
follows the target (including the drafter's extension checked at the bonus position), both
caches hold exactly the committed sequence after many mode switches, and threads never make
the output depend on timing."""
import time
from concurrent.futures import wait

import pytest
import torch

from csd_engine import Autoregressive, Cascade, Engine, SamplingParams, Speculative, Staged
from csd_engine.models.loader import load_runner
from csd_engine.models.runner import ForwardBatch
from csd_engine.strategies.pearl import Pearl, PearlDecoder
from tests.stats import assert_distribution, fresh_seed
from tests.strategies.common import assert_greedy_equals_autoregressive, assert_samples_follow_target
from tests.tiny_models import perturbed, random_prompts, tiny_llama

# noise 0: the drafter is the target (every draft accepted, post-verify all the time);
# 0.1: agrees often, so rows switch modes at different rounds; 3.0: nearly every pre-verify fails.
NOISES = (0.0, 0.1, 3.0)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=21)
    return target, [perturbed(target, noise=n, seed=22) for n in NOISES]


def assert_metrics_consistent(result, gamma):
    m = result.metrics
    assert sum(m.draft_lengths.values()) == m.target_forwards, m  # one histogram entry per round
    assert set(m.draft_lengths) <= {1, gamma - 1, gamma}
    assert m.mean_accepted_tokens >= 1
    assert sum(m.drafter_forwards) == gamma * m.target_forwards
    assert sorted(m.wait_time_s) == ["drafter", "target"] and min(m.wait_time_s.values()) >= 0


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_autoregressive(models, batch):
    """Every gamma with every drafter, ragged prompts; adaptive=False (post-verify off) too."""
    target, drafters = models
    engine = Engine(target, drafters=drafters, max_batch_size=3, max_seq_len=96, verify_backend="torch")
    seed = fresh_seed()
    prompts = random_prompts(batch, lo=1, hi=14, seed=seed)
    params = SamplingParams(max_new_tokens=24)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    for gamma, adaptive in ((1, True), (3, True), (5, True), (3, False)):
        for drafter, noise in enumerate(NOISES):
            strategy = Pearl(gamma=gamma, drafter=drafter, adaptive=adaptive, overlap=True)
            out = engine.generate(prompts, params, strategy=strategy)
            case = f"seed {seed}, gamma {gamma}, adaptive {adaptive}, drafter noise {noise}"
            assert [r.token_ids for r in out] == [r.token_ids for r in plain], case
            for r in out:
                assert_metrics_consistent(r, gamma)
                assert adaptive or gamma not in r.metrics.draft_lengths, case  # drafts stop at gamma
            m = out[0].metrics
            if noise == 0 and gamma > 1:  # the drafter is the target: every draft is accepted
                assert m.accepted == m.drafted, case
                if adaptive:  # one pre-verify round, then post-verify for good
                    assert m.draft_lengths == {1: 1, gamma: m.target_forwards - 1}, case
                else:  # pre-verify (1 draft) and the rest of the draft (gamma-1, bonus) alternate
                    assert abs(m.draft_lengths[1] - m.draft_lengths[gamma - 1]) <= 1, case
            if noise == 3.0:
                assert m.accepted < m.drafted, case


@pytest.mark.parametrize("temperature,top_k,adaptive", [(1.0, 0, True), (0.7, 20, True), (1.0, 0, False)])
def test_sampling_follows_the_target(models, temperature, top_k, adaptive):
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=2000, max_seq_len=32, verify_backend="torch")
    gamma = 3
    strategy = Pearl(gamma=gamma, adaptive=adaptive, overlap=True)
    results = assert_samples_follow_target(engine, target, [5, 17, 5, 17, 5], strategy, temperature, top_k)
    # The second token comes from post-verify rounds (a carried draft) as well as pre-verify ones.
    assert sum(r.metrics.draft_lengths.get(gamma if adaptive else gamma - 1, 0) for r in results) > 200
    assert sum(r.metrics.accepted for r in results) > 0


def test_extension_token_follows_the_target(models):
    """With gamma=2 the third token of a row whose first two drafts were accepted is the
    drafter's extension, verified against the target's distribution at the bonus position.
    Checked on the exact marginal of the third token (all 96^2 two-token prefixes)."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=2000, max_seq_len=32, verify_backend="torch")
    prompt, draws, base = [5, 17, 5, 17, 5], 2000, fresh_seed()
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=base + i) for i in range(draws)]
    results = engine.generate([prompt] * draws, params, strategy=Pearl(gamma=2, overlap=True))
    # Three accepted drafts in three tokens: e_1 (pre-verify), then e_2 and the extension (post-verify).
    assert sum(r.metrics.accepted == 3 for r in results) > draws // 4
    vocab = target.config.vocab_size
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        one_token = torch.cat([torch.tensor(prompt).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        second = torch.softmax(target(one_token).logits[:, -1].double(), -1)  # [V, V]
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (t1, t2), t1-major
        prefixes = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], 1)
        third = torch.softmax(target(prefixes).logits[:, -1].double(), -1)  # [V*V, V]
    marginal = ((first[:, None] * second).reshape(-1, 1) * third).sum(0)
    assert_distribution(torch.tensor([r.token_ids[2] for r in results]), marginal)


def committed_prefix_matches_fresh_prefill(model, runner, row: int, sequence: list[int]) -> None:
    """The first len(sequence) cache entries of `row` equal those of a fresh prefill of `sequence`."""
    fresh, _ = load_runner(model, "cpu", torch.float32)
    fresh.allocate(1, len(sequence) + 8)
    fresh.cache.reset()
    fresh(ForwardBatch.chain(torch.tensor([sequence]), fresh.cache.lengths, len(sequence), need_logits=False))
    n = len(sequence)
    for name in ("k", "v"):
        got = getattr(runner.cache, name)[:, row, :, :n]
        want = getattr(fresh.cache, name)[:, 0, :, :n]
        err = (got - want).abs().max().item()
        # fp32 entries written by 1..γ-token forwards vs one prefill differ by rounding only (up to
        # ~1e-5 at magnitude ~3, seen); an entry for a wrong token or slot differs by O(1).
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"row {row}: cache {name} differs by {err:.2e}"


def test_both_caches_hold_the_committed_sequence_after_many_switches(models):
    """Checked for each request in the step it ends (its row is emptied at the next step)."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=3, max_seq_len=192, verify_backend="torch")
    seed = fresh_seed()
    prompts = random_prompts(3, lo=1, hi=14, seed=seed)
    params = [SamplingParams(temperature=1.0, max_new_tokens=150, seed=seed + i) for i in range(3)]
    gamma = 3
    checked = 0
    with engine.scheduler(Pearl(gamma=gamma, overlap=True)) as scheduler:
        ids = {scheduler.add(p, q): i for i, (p, q) in enumerate(zip(prompts, params))}
        while scheduler.has_unfinished():
            for out in scheduler.step():
                if not out.finished:
                    continue
                row, r = ids[out.request_id], out.result
                target_length = int(engine.target.cache.lengths[row])
                drafter_length = int(engine.drafters[0].cache.lengths[row])
                assert r.metrics.draft_lengths.get(1, 0) > 5 and r.metrics.draft_lengths.get(gamma, 0) > 5, \
                    f"seed {seed}"
                # The last emitted token is pending; the final step may have committed a few tokens past the limit.
                sequence = (prompts[row] + r.token_ids)[:-1]
                assert len(sequence) <= target_length < len(sequence) + gamma, f"seed {seed}"
                assert len(sequence) <= drafter_length < target_length + gamma, f"seed {seed}"
                committed_prefix_matches_fresh_prefill(target, engine.target, row, sequence)
                committed_prefix_matches_fresh_prefill(drafters[1], engine.drafters[0], row, sequence)
                checked += 1
    assert checked == 3


def test_same_seeds_give_the_same_tokens_despite_threads(models):
    """Also runs the default (Triton) verification backend, with the drafter's sampling inside
    the worker thread."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=3, max_seq_len=64)
    seed = fresh_seed()
    prompts = random_prompts(3, lo=1, hi=14, seed=seed)
    params = [SamplingParams(temperature=0.8, max_new_tokens=10, seed=seed + i) for i in range(3)]
    runs = [engine.generate(prompts, params, strategy=Pearl(gamma=3, overlap=True)) for _ in range(2)]
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids, f"seed {seed}"
        assert a.metrics.draft_lengths == b.metrics.draft_lengths
        assert_metrics_consistent(a, 3)


@pytest.mark.parametrize("where", ["target forward", "interrupt while joining", "second interrupt while waiting"])
def test_a_failed_step_leaves_no_drafter_work_running(models, monkeypatch, where):
    """A PEARL round that raises (its target forward fails, or Ctrl-C lands while the host waits
    for the drafter, or a second Ctrl-C while the failed round waits for its drafter): the round's
    drafter job (on the worker thread, writing the drafter's cache) ends before generate raises,
    so nothing runs on the engine's caches afterwards, and the next generate is exact."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(2, lo=3, hi=9, seed=5)
    params = SamplingParams(max_new_tokens=12)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    drafter_forward, target_forward, join = engine.drafters[0].forward, engine.target.forward, PearlDecoder._join
    finished, calls = [], []
    error = RuntimeError("the target failed") if where == "target forward" else KeyboardInterrupt()
    waits = []

    def slow_drafter(batch):
        time.sleep(0.05)
        out = drafter_forward(batch)
        finished.append(time.perf_counter())
        return out

    def failing_target(batch):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return target_forward(batch)

    def interrupted_join(self, job, *args):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return join(self, job, *args)

    def interrupted_wait(jobs):  # the second Ctrl-C: on the failed round's first wait for its drafter
        if len(calls) == 3 and not waits:
            waits.append(1)
            raise KeyboardInterrupt()
        return wait(jobs)

    monkeypatch.setattr(engine.drafters[0], "forward", slow_drafter)
    if where == "second interrupt while waiting":
        monkeypatch.setattr("csd_engine.strategies.pearl.wait", interrupted_wait)
    if where != "interrupt while joining":
        monkeypatch.setattr(engine.target, "forward", failing_target)
    else:
        monkeypatch.setattr(PearlDecoder, "_join", interrupted_join)
    with pytest.raises(type(error)):
        engine.generate(prompts, params, strategy=Pearl(gamma=3, overlap=True))
    raised = time.perf_counter()
    time.sleep(0.5)
    assert not [t for t in finished if t > raised], "the drafter thread went on after generate raised"
    monkeypatch.undo()
    assert [r.token_ids for r in engine.generate(prompts, params, strategy=Pearl(gamma=3, overlap=True))] == \
        [r.token_ids for r in plain]


def test_a_sampled_request_joins_rows_that_carry_greedy_drafts(models):
    """Two rows decode greedily (drafts carried over, their distributions not kept while every
    row is greedy); a sampled request takes the row the short one frees: every request ends, the
    greedy ones equal plain decoding and the sampled one its tokens alone."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[0]], max_batch_size=2, max_seq_len=96, verify_backend="torch")
    prompts = random_prompts(3, lo=3, hi=9, seed=3)
    params = [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=40),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=1)]
    strategy = Pearl(gamma=3, overlap=True)
    got = engine.generate(prompts, params, strategy=strategy)
    plain = engine.generate(prompts[:2], params[:2], strategy=Autoregressive())
    assert [r.token_ids for r in got[:2]] == [r.token_ids for r in plain]
    assert got[2].token_ids == engine.generate(prompts[2:], params[2:], strategy=strategy)[0].token_ids


def test_bad_configurations_are_refused(models):
    target, drafters = models
    for bad in (0, -1, 65, 2.5, True, "4"):
        with pytest.raises(ValueError, match="gamma must be"):
            Pearl(gamma=bad)
    with pytest.raises(ValueError, match=r"\(drafter=\.\.\.\) must be an int >= 0"):
        Pearl(drafter=-1)
    with pytest.raises(ValueError, match="adaptive must be"):
        Pearl(adaptive="yes")
    with pytest.raises(ValueError, match="overlap must be None .*, True or False, got 'yes'"):
        Pearl(overlap="yes")
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="needs engine.drafters"):
        Engine(target, max_batch_size=1, max_seq_len=32).generate([[1, 2]], params, strategy=Pearl())
    with pytest.raises(ValueError, match="neural drafter"):
        Engine(target, drafters=["mag"], max_batch_size=1, max_seq_len=32).generate([[1, 2]], params, strategy=Pearl())
    engine = Engine(target, drafters=[drafters[0], "mag"], max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="neural drafter"):
        engine.generate([[1, 2]], params, strategy=Pearl(drafter=1))
    assert engine.generate([[1, 2]], params, strategy=Pearl(drafter=0))[0].token_ids
    two = Engine(target, drafters=[drafters[0]], max_batch_size=1, max_seq_len=32, drafter_device="cpu:0")
    with pytest.raises(ValueError, match=r"Pearl\(overlap=False\) runs the drafter and the target in turn on one "
                                         "device, but this engine puts the drafter on cpu:0"):
        two.generate([[1, 2]], params, strategy=Pearl(overlap=False))
    assert two.generate([[1, 2]], params, strategy=Pearl())[0].token_ids  # still usable


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_on_one_device_pearl_decodes_by_chain_speculative_steps(models, temperature):
    """overlap=None with the drafter on the target's device: the steps are Speculative(k=gamma)'s
    (run in turn, a PEARL round would cost as much and emit less), so the tokens, greedy and
    seeded samples alike, and the forward counts are Speculative's; overlap=True still runs PEARL."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    seed = fresh_seed()
    prompts = random_prompts(2, lo=2, hi=10, seed=seed)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=seed)
    chain, pearl, overlapped = (engine.generate(prompts, params, strategy=s)
                                for s in (Speculative(k=3), Pearl(gamma=3), Pearl(gamma=3, overlap=True)))
    for a, b, c in zip(chain, pearl, overlapped):
        assert a.token_ids == b.token_ids, f"seed {seed}"
        assert (a.metrics.target_forwards, a.metrics.drafter_forwards) == \
            (b.metrics.target_forwards, b.metrics.drafter_forwards)
        assert not b.metrics.draft_lengths and c.metrics.draft_lengths  # PEARL's round histogram: overlapped only


@pytest.mark.gpu
def test_greedy_equals_autoregressive_on_cuda_streams(models):
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], device="cuda", max_batch_size=3, max_seq_len=96)
    assert_greedy_equals_autoregressive(engine, random_prompts(3, lo=1, hi=14, seed=fresh_seed()),
                                        Pearl(gamma=3, overlap=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_on_its_own_device_gives_the_same_tokens(models, temperature):
    """Engine(drafter_device=...) puts the drafter on another device and PEARL moves its inputs
    and drafts across. On this machine the other device is "cpu:0": a distinct device name on
    the same memory, so every copy of the bridge runs (as no-ops) and the tokens, greedy and
    sampled with a seed, must be those of the one-device engine. The other strategies refuse
    such an engine with a message naming drafter_device, and it stays usable."""
    target, drafters = models
    seed = fresh_seed()
    prompts = random_prompts(2, lo=2, hi=10, seed=seed)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=seed)
    one = Engine(target, drafters=[drafters[1]], max_batch_size=2, max_seq_len=64, verify_backend="torch")
    two = Engine(target, drafters=[drafters[1], "mag"], max_batch_size=2, max_seq_len=64, verify_backend="torch",
                 drafter_device="cpu:0")
    assert two.drafters[0].device == torch.device("cpu:0") != two.device
    expected = one.generate(prompts, params, strategy=Pearl(gamma=3, overlap=True))
    assert [r.token_ids for r in two.generate(prompts, params, strategy=Pearl(gamma=3, overlap=True))] == \
        [r.token_ids for r in expected], f"seed {seed}"
    for strategy in (Speculative(k=2), Cascade(k_matrix=[[2, 2], [0, 2]]), Cascade.auto(), Staged()):
        with pytest.raises(ValueError, match="drafter_device"):
            two.generate(prompts, params, strategy=strategy)
    assert [r.token_ids for r in two.generate(prompts, params, strategy=Autoregressive())] == \
        [r.token_ids for r in one.generate(prompts, params, strategy=Autoregressive())]


@pytest.mark.gpu
def test_target_on_the_cpu_and_drafter_on_cuda_equals_autoregressive(models):
    """The two-device layout for real: the target on the CPU, the drafter on the GPU."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], device="cpu", drafter_device="cuda", max_batch_size=3,
                    max_seq_len=96, verify_backend="torch")
    assert_greedy_equals_autoregressive(engine, random_prompts(3, lo=1, hi=14, seed=fresh_seed()),
                                        Pearl(gamma=3, overlap=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_models_on_a_second_gpu_equal_autoregressive(models):
    """Triton launches on the current device, whatever its tensors' device: an engine on cuda:1,
    and PEARL's drafter on cuda:1 driven from its worker thread (current device: cuda:0), run
    their kernels under the right device (models.runner.on_device)."""
    target, drafters = models
    prompts = random_prompts(3, lo=1, hi=14, seed=fresh_seed())
    second = Engine(target, drafters=[drafters[1]], device="cuda:1", max_batch_size=3, max_seq_len=96)
    assert_greedy_equals_autoregressive(second, prompts, Speculative(k=3))
    split = Engine(target, drafters=[drafters[1]], device="cuda:0", drafter_device="cuda:1", max_batch_size=3,
                   max_seq_len=96, cuda_graphs=True)
    assert_greedy_equals_autoregressive(split, prompts, Pearl(gamma=3, overlap=True))


def test_wait_time_is_each_requests_own(models):
    """A request's wait_time_s counts the rounds it decoded in: one side waits per round, so the
    sum stays within its wall time, however many requests the scheduler served before it."""
    target, drafters = models
    engine = Engine(target, drafters=[drafters[1]], max_batch_size=1, max_seq_len=64)
    with engine.scheduler(Pearl(gamma=3, overlap=True)) as scheduler:
        for i in range(5):
            scheduler.add(random_prompts(1, seed=i)[0], SamplingParams(max_new_tokens=20))
            results = []
            while not results:
                results = [o.result for o in scheduler.step() if o.finished]
            m = results[0].metrics
            assert sum(m.wait_time_s.values()) <= m.wall_time_s, f"request {i}: {m.wait_time_s} in {m.wall_time_s} s"
