"""Staged speculative decoding with tree drafts is lossless: greedy equals plain greedy decoding
(several tree shapes, batched with ragged prompts and ragged accepted depths, MaG second stage,
generic runner, Triton tree kernel), sampling follows the target, and the target's cache after
tree compaction holds exactly what plain decoding would have put there."""

import pytest
import torch

from csd_engine import Autoregressive, Engine, SamplingParams
from csd_engine.strategies import staged
from csd_engine.strategies.base import Decoder, commit
from csd_engine.strategies.staged import Staged
from csd_engine.strategies.tree import TreeShape, branching_parents, verify_tree_and_commit
from tests.stats import fresh_seed
from tests.strategies.common import assert_greedy_equals_autoregressive, assert_samples_follow_target
from tests.tiny_models import VOCAB, hf_greedy, perturbed, random_prompts, tiny_gpt2, tiny_llama


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=21)
    return target, perturbed(target, noise=0.3, seed=22)


@pytest.mark.parametrize("branching", [(4, 2, 1, 1), (2,), (3, 3), (1, 1, 1, 1)])
def test_greedy_equals_autoregressive_batched(pair, branching):
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model], max_batch_size=3, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, lo=1, hi=14, seed=fresh_seed())
    out = assert_greedy_equals_autoregressive(engine, prompts, Staged(branching), max_new_tokens=16)
    depth = len(branching)
    for r in out:
        m = r.metrics
        assert m.drafted == depth * m.target_forwards  # "drafted" counts the tree's depth per step
        assert 0 <= m.accepted <= m.drafted
        assert m.drafter_forwards == [depth * m.target_forwards]  # one drafter forward per level
        assert len(m.acceptance_by_position) <= depth and all(0 <= a <= 1 for a in m.acceptance_by_position)
        assert m.mean_accepted_tokens == pytest.approx(m.new_tokens / m.target_forwards)


def test_greedy_with_an_unrelated_drafter():
    target = tiny_llama(seed=31)
    engine = Engine(target, drafters=[tiny_llama(seed=32)], max_batch_size=1, max_seq_len=48, verify_backend="torch")
    assert_greedy_equals_autoregressive(engine, random_prompts(1, seed=fresh_seed()), Staged((3, 2)),
                                        max_new_tokens=12)


@pytest.mark.parametrize("engine_has_mag, review", [(False, True), (True, True), (True, False)])
def test_greedy_with_mag_second_stage(pair, engine_has_mag, review):
    target, draft_model = pair
    drafters = [draft_model, "mag"] if engine_has_mag else [draft_model]
    engine = Engine(target, drafters=drafters, max_batch_size=2, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(2, lo=2, hi=10, seed=fresh_seed())
    prompts[0] = prompts[0][:3] * 4  # repetitive: MaG finds matches to copy
    strategy = Staged((2, 1), mag_tokens=3, mag_review=review)
    out = assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=16)
    own_mag = strategy.decoder(engine).mag
    assert (own_mag is engine.drafters[1]) if engine_has_mag else own_mag is not None  # the engine's MaG if any
    for r in out:
        # drafter depth 2 + the MaG nodes it proposed (at most 3; counted exactly in test_the_mag_chain_...)
        assert 2 * r.metrics.target_forwards <= r.metrics.drafted <= 5 * r.metrics.target_forwards


def test_greedy_generic_runner_with_and_without_mag():
    target = tiny_gpt2(seed=3)
    engine = Engine(target, drafters=[perturbed(target, 0.2)], max_batch_size=2, max_seq_len=48,
                    verify_backend="torch")
    prompts = random_prompts(2, seed=fresh_seed())
    for strategy in (Staged((3, 2, 1)), Staged((2,), mag_tokens=2)):
        assert_greedy_equals_autoregressive(engine, prompts, strategy, max_new_tokens=10)


def test_greedy_with_the_triton_tree_kernel(pair):
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model], max_batch_size=2, max_seq_len=32, verify_backend="triton")
    assert_greedy_equals_autoregressive(engine, random_prompts(2, seed=fresh_seed()), Staged((2, 1)),
                                        max_new_tokens=6)


class OracleTrees(Decoder):
    """A strategy whose trees hold the target's greedy continuation on one random root-to-node
    path, stopped at a fixed depth per row, and wrong tokens everywhere else: every row
    accepts exactly its own depth every step, through children that are not the first, so
    the accepted entries must move in the cache."""

    def __init__(self, engine, prompts, reference, depths, branching, seed):
        self.engine, self.prompts, self.reference, self.depths = engine, prompts, reference, depths
        self.parents = branching_parents(branching)
        self.tree = TreeShape.build(torch.tensor([self.parents]))  # depth bound N - 1: a wide emitted block
        self.max_tokens_per_forward = len(self.parents)
        self.generator = torch.Generator().manual_seed(seed)

    def decoder(self, engine):
        return self

    def _pick(self, options):
        return options[int(torch.randint(len(options), (1,), generator=self.generator))]

    def _row(self, row, committed, pending):
        emitted = committed - (len(self.prompts[row]) - 1)
        # what the target emits next, one per depth (nothing for a row emptied after its request)
        upcoming = self.reference[row][emitted:] if emitted >= 0 else []
        upcoming = upcoming + [0] * len(self.parents)
        depth_of = self.tree.depth[0].tolist()
        path = [0]
        for _ in range(self.depths[row]):
            path.append(self._pick([i for i, p in enumerate(self.parents) if p == path[-1]]))
        tokens = [pending]
        for node in range(1, len(self.parents)):
            right = upcoming[depth_of[node] - 1]
            wrong = (right + 1 + self._pick(list(range(VOCAB - 1)))) % VOCAB
            tokens.append(right if node in path else wrong)
        return tokens

    def step(self, state, plan=None):
        rows = [self._row(r, c, p) for r, (c, p) in enumerate(zip(state.committed.tolist(), state.pending.tolist()))]
        out = verify_tree_and_commit(self.engine, state, torch.tensor(rows), self.tree.expand(state.batch))[0]
        commit(state, out)
        return out


def cached_kv(runner, row: int, length: int) -> torch.Tensor:
    """[2, layers, kv_heads, length, head_dim]: the first `length` cached keys and values of a row."""
    if hasattr(runner, "caches"):  # generic runner: one transformers cache per row
        layers = runner.caches[row].layers
        return torch.stack([torch.stack([getattr(layer, name)[0, :, :length] for layer in layers])
                            for name in ("keys", "values")])
    return torch.stack([runner.cache.k[:, row, :, :length], runner.cache.v[:, row, :, :length]])


@pytest.mark.parametrize("native", [True, False])
def test_ragged_depths_compact_the_cache_like_plain_decoding(pair, native):
    """Rows accept 0, 2 and 4 nodes per step; output and the target's final cache must equal
    those of plain greedy decoding (the cache compared slot by slot)."""
    target, _ = pair
    seed = fresh_seed()
    prompts = random_prompts(3, lo=1, hi=12, seed=seed)
    engines = [Engine(target, max_batch_size=3, max_seq_len=64, verify_backend="torch", native=native)
               for _ in range(2)]
    params = SamplingParams(max_new_tokens=14)
    plain = engines[0].generate(prompts, params, strategy=Autoregressive())
    # The oracle looks ahead: up to a tree's depth past what finished rows last committed.
    longer = engines[1].generate(prompts, SamplingParams(max_new_tokens=26))
    depths = [0, 2, 4]
    oracle = OracleTrees(engines[1], prompts, [r.token_ids for r in longer], depths, (3, 2, 1, 1), seed)
    plain_runner, tree_runner = (e.target for e in engines)
    plain_lengths = plain_runner.cache.lengths.tolist()  # every plain row ends in the last step: none emptied
    checked = 0
    with engines[1].scheduler(oracle) as scheduler:  # each tree row checked in the step it ends
        for p in prompts:
            scheduler.add(p, params)
        while scheduler.has_unfinished():
            for out in scheduler.step():
                if not out.finished:
                    continue
                row, b, a = int(out.request_id), out.result, plain[int(out.request_id)]
                assert b.token_ids == a.token_ids, f"row {row}"
                assert b.metrics.accepted == depths[row] * b.metrics.target_forwards, f"row {row}"
                length = plain_lengths[row]
                assert tree_runner.cache.lengths[row] >= length  # a step may commit past the limit
                torch.testing.assert_close(cached_kv(tree_runner, row, length), cached_kv(plain_runner, row, length),
                                           atol=1e-5, rtol=1e-5, msg=lambda m: f"row {row}: {m}")
                checked += 1
    assert checked == len(prompts)


def test_good_drafter_accepts_more_than_one_token_per_target_forward():
    target = tiny_llama(seed=41)
    engine = Engine(target, drafters=[perturbed(target, 0.05, seed=42)], max_batch_size=2, max_seq_len=64,
                    verify_backend="torch")
    out = assert_greedy_equals_autoregressive(engine, random_prompts(2, seed=fresh_seed()), Staged(), 20)
    for r in out:
        m = r.metrics
        assert m.mean_accepted_tokens > 1.5
        assert m.accepted + m.target_forwards >= m.new_tokens  # tokens past max_new_tokens are dropped
        assert m.acceptance_by_position[0] >= m.acceptance_by_position[-1]  # deep nodes survive less often


# The check reads the first two tokens: deeper levels could not change them, so the trees stop
# at depth 2 (the MaG chain supplies depth 2 in the second case).
@pytest.mark.parametrize("strategy,temperature,top_k", [(Staged((4, 2)), 1.0, 0),
                                                        (Staged((2,), mag_tokens=2), 0.7, 20)])
def test_sampling_follows_the_target(pair, strategy, temperature, top_k):
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model], max_batch_size=2000, max_seq_len=24, verify_backend="torch")
    prompt = [5, 17, 5, 17, 5]  # MaG proposes 17 after 5
    results = assert_samples_follow_target(engine, target, prompt, strategy, temperature, top_k)
    assert sum(r.metrics.accepted for r in results) > 0


def test_bad_configurations_are_refused():
    for bad in ((), [], (0,), (2, -1), (2.5,), (True,), "4,2", None):
        with pytest.raises(ValueError, match="branching"):
            Staged(branching=bad)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="mag_tokens must be"):
            Staged(mag_tokens=bad)
        with pytest.raises(ValueError, match=r"\(drafter=\.\.\.\) must be an int >= 0"):
            Staged(drafter=bad)
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match=r"mag_review must be True \(the drafter reviews MaG's tokens\) or False"):
            Staged(mag_tokens=2, mag_review=bad)
    assert Staged(branching=[4, 2]).branching == (4, 2)

    target = tiny_llama(seed=1)
    params = SamplingParams(max_new_tokens=2)
    for drafters, strategy in (([], Staged()), (["mag"], Staged()), ([target, "mag"], Staged(drafter=1)),
                               ([target], Staged(drafter=1))):
        engine = Engine(target, drafters=drafters, max_batch_size=1, max_seq_len=16)
        with pytest.raises(ValueError, match="neural drafter"):
            engine.generate([[1, 2]], params, strategy=strategy)
    engine = Engine(target, drafters=[target], max_batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[1, 2]], params, strategy=Staged(branching=(VOCAB + 1,)))
    for too_big in (Staged(branching=(1,) * 129), Staged(branching=(4, 4, 4), mag_tokens=120)):
        with pytest.raises(ValueError, match="headroom"):
            engine.generate([[1, 2]], params, strategy=too_big)
    with pytest.raises(ValueError, match=r"feeds 2199023255551 tokens per forward, more than the cache's"):
        engine.generate([[1, 2]], params, strategy=Staged(branching=(2,) * 40))  # at once, never built
    assert engine.generate([[1, 2]], params, strategy=Staged(branching=(2, 2)))[0].token_ids


@pytest.mark.parametrize("branching", [(2,), (2, 1)])
def test_the_second_stage_chain_is_the_drafters_own_continuation(pair, monkeypatch, branching):
    """MaG drafts for the drafter: the chain under the likely leaf is the drafter's own greedy
    continuation of its likely path (transformers' greedy of the drafter), exactly as deep as
    MaG's proposal agrees with it, padding after (never verified nor counted as drafted), with
    no drafter forward more than the tree's levels (one more for a single level). MaG's
    proposals are planted: the drafter's continuation with one token wrong (or none), of random length."""
    target, draft_model = pair
    depth, m, generator = len(branching), 3, torch.Generator().manual_seed(fresh_seed())
    leaf = len(branching_parents(branching[:-1]))  # the last level's first node: the likely leaf
    proposals, steps = [], []
    propose, verify = staged.StagedDecoder._mag_stage, staged.verify_tree_and_commit

    def plant(self, state, path):
        tokens, length = propose(self, state, path)  # writes the context after the committed prefix
        ends = state.committed + 1 + path.shape[1]
        for b in range(state.batch):
            if state.active[b]:
                own = hf_greedy(draft_model, state.tokens[b, :ends[b]].tolist(), m)
                cut = int(torch.randint(m + 1, (1,), generator=generator))
                tokens[b] = torch.tensor(own[:cut] + [(t + 1) % VOCAB for t in own[cut:cut + 1]] + own[cut + 1:])
        length = torch.randint(m + 1, length.shape, generator=generator)
        proposals.append((tokens.clone(), length))
        return tokens, length

    def spy_verify(models, state, tokens, tree, *args, **kwargs):
        above = state.committed + depth  # committed + pending + the path above the leaf (_mag_stage's scratch)
        steps.append([(b, state.tokens[b, :above[b]].tolist() + [int(tokens[b, leaf])], tokens[b, -m:].tolist(),
                       int((tree.parents[b, -m:] != -2).sum())) for b in range(state.batch) if state.active[b]])
        return verify(models, state, tokens, tree, *args, **kwargs)
    monkeypatch.setattr(staged.StagedDecoder, "_mag_stage", plant)
    monkeypatch.setattr(staged, "verify_tree_and_commit", spy_verify)
    engine = Engine(target, drafters=[draft_model], max_batch_size=3, max_seq_len=64, verify_backend="torch")
    prompts = random_prompts(3, seed=fresh_seed())
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16), strategy=Staged(branching, mag_tokens=m))
    depths = []
    for (offered, length), rows in zip(proposals, steps):
        for row, context, chain, real in rows:
            own = hf_greedy(draft_model, context, m)
            mine = [context[-1]] + own[:-1]  # the drafter's token where MaG offered each of its own
            agreed = 0
            while agreed < int(length[row]) and int(offered[row, agreed]) == mine[agreed]:
                agreed += 1
            assert real == agreed and chain[:real] == own[:real]
            depths.append(real)
    assert 0 < max(depths) and min(depths) < m, f"chain depths {depths}: nothing accepted or nothing cut"
    for r, prompt in zip(results, prompts):
        assert r.metrics.drafter_forwards == [(depth + (depth == 1)) * r.metrics.target_forwards]
        assert r.token_ids == hf_greedy(target, prompt, 16)
    assert sum(r.metrics.drafted for r in results) == sum(depth + d for d in depths)


def test_the_mag_chain_verifies_only_the_tokens_mag_proposed(pair, monkeypatch):
    """Unreviewed (mag_review=False): where MaG proposes fewer than mag_tokens tokens after the
    drafter's likely path, the chain's other nodes are padding (parent -2), never verified nor
    counted as drafted."""
    target, draft_model = pair
    proposed, real = [], []
    propose, verify = staged.StagedDecoder._mag_stage, staged.verify_tree_and_commit

    def spy_stage(self, state, path):
        proposal = propose(self, state, path)
        proposed.append(proposal[1].clone())
        return proposal

    def spy_verify(models, state, tokens, tree, *args, **kwargs):
        real.append((tree.parents[:, -3:] != -2).sum(1))
        return verify(models, state, tokens, tree, *args, **kwargs)
    monkeypatch.setattr(staged.StagedDecoder, "_mag_stage", spy_stage)
    monkeypatch.setattr(staged, "verify_tree_and_commit", spy_verify)
    engine = Engine(target, drafters=[draft_model], max_batch_size=2, max_seq_len=48, verify_backend="torch")
    engine.generate(random_prompts(2, seed=3), SamplingParams(max_new_tokens=12),
                    strategy=Staged((2,), mag_tokens=3, mag_review=False))
    assert any((p < 3).any() for p in proposed), "MaG always proposed a full chain: nothing padded"
    assert all(torch.equal(r, p) for r, p in zip(real, proposed))
    # the metrics count as drafted the tree's depth and MaG's real nodes, not the padding
    proposed.clear()
    [result] = engine.generate(random_prompts(1, seed=4), SamplingParams(max_new_tokens=12),
                               strategy=Staged((2,), mag_tokens=3, mag_review=False))
    assert result.metrics.drafted == sum(1 + int(p[0]) for p in proposed) < 4 * len(proposed)


def test_each_tree_step_draws_from_fresh_random_counters(pair):
    """A tree check draws from counters offset .. offset + max_depth (a depth each, the bonus
    included): the next step starts past them, so no two steps of a row share a random number."""
    target, draft_model = pair
    engine = Engine(target, drafters=[draft_model], max_batch_size=1, max_seq_len=48, verify_backend="torch")
    branching = (2, 2, 1)
    with engine.scheduler(Staged(branching)) as scheduler:
        scheduler.add([5, 17, 5, 17, 5], SamplingParams(temperature=1.0, seed=3, max_new_tokens=12))
        offsets = [0]
        while scheduler.has_unfinished():
            scheduler.step()
            offsets.append(int(scheduler.state.offset[0]))
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [len(branching) + 1] * (len(offsets) - 1)
