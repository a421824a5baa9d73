"""CUDA graphs of the native runner.

On the CPU: bucket choice, graph keys and eager-fallback decisions, static-buffer copy-in, and
the padded static-buffer forward against the plain runner on real values (off CUDA it runs as
a plain call; the Triton attention runs in the interpreter). The padded rows' cache rows hold
NaN, so a padded row that leaked into a real one would show. On a GPU: capture and replay give
logits and cache entries bit-identical to eager runs of the same inputs.
"""
import time

import pytest
import torch

from csd_engine import Engine, SamplingParams, Speculative
from csd_engine.models.graphs import (PADDED_LENGTH, GraphedRunner, GraphKey, StaticInputs, batch_buckets,
                                      bucket_for, graph_key, maybe_graphed)
from csd_engine.models.hf import HFRunner
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.runner import ForwardBatch
from tests.strategies.common import assert_greedy_equals_autoregressive
from tests.tiny_models import VOCAB, perturbed, random_prompts, tiny_gpt2, tiny_llama

MAX_BATCH, CAPACITY, MAX_TOKENS = 8, 48, 8


def fresh_seed() -> int:
    return time.time_ns() % 2**31


def random_tree_mask(rows: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor masks [rows, n, n] and depths [rows, n] of random trees rooted at node 0."""
    mask = torch.zeros(rows, n, n, dtype=torch.bool)
    depth = torch.zeros(rows, n, dtype=torch.int64)
    for r in range(rows):
        mask[r, 0, 0] = True
        for i in range(1, n):
            parent = int(torch.randint(0, i, (), generator=gen))
            mask[r, i] = mask[r, parent]
            mask[r, i, i] = True
            depth[r, i] = depth[r, parent] + 1
    return mask, depth


def random_batch(mode: str, lengths: torch.Tensor, gen: torch.Generator) -> ForwardBatch:
    """decode (n = 1), chain (n = k + 1 = 5) or tree (6 nodes) after each row's cached prefix."""
    rows = lengths.shape[0]
    n = {"decode": 1, "chain": 5, "tree": 6}[mode]
    ids = torch.randint(0, VOCAB, (rows, n), generator=gen)
    if mode != "tree":
        return ForwardBatch.chain(ids, lengths, int(lengths.max()) + n)
    mask, depth = random_tree_mask(rows, n, gen)
    return ForwardBatch(ids, lengths[:, None] + depth, int(lengths.max()) + n, mask)


def prefilled_pair(rows: int, device, dtype, gen: torch.Generator):
    """A plain Triton-attention runner and a graphed one on the same weights, both holding the
    same random prefix of ragged length per row."""
    model = tiny_llama(seed=int(torch.randint(0, 1000, (), generator=gen)))
    plain = LlamaRunner(model, device, dtype)
    graphed = GraphedRunner(LlamaRunner(model, device, dtype), max_tokens=MAX_TOKENS)
    for runner in (plain, graphed):
        runner.allocate(MAX_BATCH, CAPACITY)
        runner.use_rows(rows)
    prefix = torch.randint(0, VOCAB, (rows, 20), generator=gen).to(device)
    plain(ForwardBatch.chain(prefix, plain.cache.lengths, 20, need_logits=False))  # SDPA: quick in the interpreter
    plain.attention_backend = "triton"
    graphed.runner.full_cache.k.copy_(plain.full_cache.k)
    graphed.runner.full_cache.v.copy_(plain.full_cache.v)
    lengths = torch.randint(1, 21, (rows,), generator=gen).to(device)
    plain.cache.reset(lengths)
    graphed.cache.reset(lengths)
    return plain, graphed


# -- pure logic ---------------------------------------------------------------------------------
def test_every_batch_gets_the_smallest_bucket_that_holds_it():
    for max_batch in range(1, 70):
        buckets = batch_buckets(max_batch)
        assert buckets[0] == 1 and buckets[-1] == max_batch and buckets == sorted(set(buckets))
        for rows in range(1, max_batch + 1):
            bucket = bucket_for(rows, buckets)
            assert bucket >= rows and not [b for b in buckets if rows <= b < bucket]
            assert bucket < 2 * rows, "a batch fills more than half its bucket"
        assert bucket_for(max_batch + 1, buckets) is None
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            batch_buckets(bad)


def test_graph_key_and_eager_fallback_decisions():
    gen = torch.Generator().manual_seed(fresh_seed())
    buckets = batch_buckets(6)  # [1, 2, 4, 6]

    def batch(rows, n, tree=False, need_logits=True):
        ids = torch.randint(0, VOCAB, (rows, n), generator=gen)
        mask = random_tree_mask(rows, n, gen)[0] if tree else None
        return ForwardBatch(ids, ids, 64, mask, need_logits)

    assert graph_key(batch(3, 1), buckets, 8) == GraphKey(bucket=4, n=1, tree=False)
    assert graph_key(batch(5, 8, tree=True), buckets, 8) == GraphKey(bucket=6, n=8, tree=True)
    assert graph_key(batch(1, 5), buckets, 8) == GraphKey(bucket=1, n=5, tree=False)
    assert graph_key(batch(2, 9), buckets, 8) is None  # more new tokens than any graph takes
    assert graph_key(batch(7, 1), buckets, 8) is None  # more rows than the largest bucket
    assert graph_key(batch(2, 3, need_logits=False), buckets, 8) is None  # prefill


def test_static_inputs_copy_the_batch_and_mark_padded_rows():
    gen = torch.Generator().manual_seed(seed := fresh_seed())
    inputs = StaticInputs(GraphKey(bucket=8, n=6, tree=True), "cpu")
    for rows in (7, 3):  # a smaller batch after a larger one: stale rows must become padding
        lengths = torch.randint(0, 30, (rows,), generator=gen)
        batch = random_batch("tree", lengths, gen)
        inputs.load(batch, lengths)
        assert torch.equal(inputs.input_ids[:rows], batch.input_ids), f"seed {seed}"
        assert torch.equal(inputs.positions[:rows], batch.positions), f"seed {seed}"
        assert torch.equal(inputs.tree_mask[:rows], batch.tree_mask), f"seed {seed}"
        assert torch.equal(inputs.lengths[:rows], lengths), f"seed {seed}"
        assert (inputs.lengths[rows:] == PADDED_LENGTH).all(), f"seed {seed}"
    static = inputs.forward_batch(CAPACITY)
    assert static.input_ids is inputs.input_ids and static.tree_mask is inputs.tree_mask and static.need_logits


# -- padded forward on real values (CPU) ----------------------------------------------------------
@pytest.mark.parametrize("mode", ["decode", "chain", "tree"])
def test_padded_static_forward_matches_the_plain_runner(mode):
    """Two steps of a ragged batch padded to its bucket: the real rows' logits and cache entries
    equal the plain runner's; cache slots the step does not write stay bit-identical, even
    with NaN in the padded rows' cache rows."""
    gen = torch.Generator().manual_seed(seed := fresh_seed())
    rows = [3, 5, 6, 7][int(torch.randint(0, 4, (), generator=gen))]  # never a bucket: always padded
    plain, graphed = prefilled_pair(rows, "cpu", torch.float32, gen)
    full = graphed.runner.full_cache
    bucket = bucket_for(rows, graphed.buckets)
    full.k[:, rows:bucket] = float("nan")
    full.v[:, rows:bucket] = float("nan")
    for step in range(2):
        lengths = plain.cache.lengths.clone()
        batch = random_batch(mode, lengths, gen)
        before_k, before_v = full.k[:, :rows].clone(), full.v[:, :rows].clone()
        expected = plain(batch)
        got = graphed(batch)
        msg = f"seed {seed}, {rows} rows, step {step}"
        assert got.shape == expected.shape and torch.isfinite(got).all(), msg
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=msg)

        n = batch.input_ids.shape[1]
        slots = torch.arange(CAPACITY)
        written = (slots >= lengths[:, None]) & (slots < lengths[:, None] + n)  # [rows, S]
        for new, old, ref in ((full.k, before_k, plain.full_cache.k), (full.v, before_v, plain.full_cache.v)):
            new = new[:, :rows].transpose(2, 3)  # [layers, rows, S, kv_heads, D]
            keep = ~written[None, :, :, None, None].expand_as(new)
            assert torch.equal(new[keep], old.transpose(2, 3)[keep]), f"{msg}: a slot outside the step changed"
            torch.testing.assert_close(new[~keep], ref[:, :rows].transpose(2, 3)[~keep], rtol=1e-5, atol=1e-5,
                                       msg=msg)
        advance = torch.randint(1, n + 1, (rows,), generator=gen)  # ragged acceptance
        plain.cache.advance(advance)
        graphed.cache.advance(advance)
    assert list(graphed.inputs) == [GraphKey(bucket, n, mode == "tree")]  # one key, its buffers reused


def test_shapes_without_a_graph_run_eagerly_with_the_same_results():
    gen = torch.Generator().manual_seed(seed := fresh_seed())
    plain, graphed = prefilled_pair(3, "cpu", torch.float32, gen)
    prefill = ForwardBatch.chain(torch.randint(0, VOCAB, (3, 2), generator=gen), plain.cache.lengths, CAPACITY,
                                 need_logits=False)  # the next forward overwrites its entries
    assert graphed(prefill) is None and not graphed.inputs, f"prefill must run eagerly (seed {seed})"
    long_chain = ForwardBatch.chain(torch.randint(0, VOCAB, (3, MAX_TOKENS + 1), generator=gen),
                                    plain.cache.lengths, CAPACITY)
    assert torch.equal(graphed(long_chain), plain(long_chain)), f"seed {seed}"
    assert not graphed.inputs, f"n > max_tokens must run eagerly (seed {seed})"
    narrow = GraphedRunner(graphed.runner, max_tokens=MAX_TOKENS, max_batch=2)  # 3 rows > largest bucket
    assert narrow.buckets == [1, 2]
    decode = ForwardBatch.chain(torch.randint(0, VOCAB, (3, 1), generator=gen), plain.cache.lengths, CAPACITY)
    assert torch.equal(narrow(decode), plain(decode)) and not narrow.inputs, f"seed {seed}"


def test_maybe_graphed_wraps_only_native_runners_on_cuda():
    runner = LlamaRunner(tiny_llama(), "cpu", torch.float32)
    assert maybe_graphed(runner, False) is runner
    assert maybe_graphed(runner, True) is runner  # no CUDA device: nothing to capture
    hf = HFRunner(tiny_gpt2(), "cpu")
    assert maybe_graphed(hf, True) is hf
    with pytest.raises(TypeError, match="cuda_graphs"):
        maybe_graphed(runner, 1)
    with pytest.raises(TypeError, match="LlamaRunner"):
        GraphedRunner(hf)
    with pytest.raises(ValueError, match="max_tokens"):
        GraphedRunner(runner, max_tokens=0)
    graphed = GraphedRunner(runner)
    assert runner.attention_backend == "triton" and graphed.vocab_size == runner.vocab_size


def test_the_wrapper_describes_the_model_as_the_runner_does():
    """End tokens, sliding window and position limit are what the engine stops and sizes by:
    the wrapper must show the wrapped runner's, also when set after wrapping (as the loader does)."""
    runner = LlamaRunner(tiny_llama(), "cpu", torch.float32)
    runner.eos_token_ids, runner.attention_window = (2, 7), 400
    runner.position_limit = (300, "has a learned position table of 300")
    graphed = GraphedRunner(runner)
    for field in ("vocab_size", "num_params", "device", "weight_bytes", "eos_token_ids", "attention_window",
                  "position_limit", "trained_positions"):
        assert getattr(graphed, field) == getattr(runner, field), field
    graphed.eos_token_ids = (5,)
    assert runner.eos_token_ids == (5,)
    engine = Engine(graphed, max_batch_size=2)
    assert engine.max_seq_len == 300 - 256 and engine.eos_token_ids(SamplingParams()) == {5}


# -- capture and replay (GPU) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "chain", "tree"])
@pytest.mark.parametrize("rows", [4, 3], ids=["full-bucket", "padded"])
def test_replay_is_bit_identical_to_eager(mode, rows):
    """Several steps (the first captures, later ones replay with new inputs): logits and cache
    entries equal an eager run of the same inputs bit for bit. A full bucket is compared with
    the plain runner; a padded batch with the eager forward of its padded static inputs."""
    gen = torch.Generator().manual_seed(seed := fresh_seed())
    plain, graphed = prefilled_pair(rows, "cuda", torch.bfloat16, gen)
    for step in range(3):
        batch = random_batch(mode, plain.cache.lengths.cpu(), gen)
        batch = ForwardBatch(batch.input_ids.cuda(), batch.positions.cuda(), batch.kv_bound,
                             None if batch.tree_mask is None else batch.tree_mask.cuda())
        got = graphed(batch)
        key = graph_key(batch, graphed.buckets, MAX_TOKENS)
        assert key in graphed.graphs, f"step {step} did not replay a graph"
        msg = f"seed {seed}, {mode}, {rows} rows, step {step}"
        if rows == key.bucket:
            assert torch.equal(got, plain(batch)), msg
            assert torch.equal(graphed.runner.full_cache.k[:, :rows], plain.full_cache.k[:, :rows]), msg
            assert torch.equal(graphed.runner.full_cache.v[:, :rows], plain.full_cache.v[:, :rows]), msg
        else:
            cache_k = graphed.runner.full_cache.k[:, :rows].clone()
            eager = graphed._forward_static(graphed.inputs[key])[:rows]  # rewrites the same entries
            assert torch.equal(got, eager), msg
            assert torch.equal(graphed.runner.full_cache.k[:, :rows], cache_k), msg
            plain(batch)  # keeps the plain runner's cache in step for the next batch's lengths
        advance = torch.randint(1, batch.input_ids.shape[1] + 1, (rows,), generator=gen).cuda()
        plain.cache.advance(advance)
        graphed.cache.advance(advance)


@pytest.mark.gpu
def test_engine_with_graphed_runners_decodes_like_the_eager_engine():
    target = tiny_llama(seed=31)
    drafter = perturbed(target, noise=0.3, seed=32)

    def engine(graphs: bool):
        runners = [maybe_graphed(LlamaRunner(m, "cuda", torch.float32, "triton"), graphs) for m in (target, drafter)]
        return Engine(runners[0], drafters=[runners[1]], device="cuda", max_batch_size=4, max_seq_len=96)

    prompts = random_prompts(3, lo=1, hi=14, seed=fresh_seed())
    graphed = engine(True)
    assert isinstance(graphed.target, GraphedRunner) and isinstance(graphed.drafters[0], GraphedRunner)
    fast = assert_greedy_equals_autoregressive(graphed, prompts, Speculative(k=3))
    eager = engine(False).generate(prompts, SamplingParams(max_new_tokens=24), strategy=Speculative(k=3))
    assert [r.token_ids for r in fast] == [r.token_ids for r in eager]
    assert graphed.target.graphs, "the target never replayed a graph"
