"""The GPU path's kernels through whole generations, on the CPU.

With CSD_CPU_KERNELS=1 (kernels.use_kernels) the engine runs in Triton's interpreter every
kernel it runs on a GPU in place of its PyTorch reference: MaG's search and in-place extend,
the self-tuning strategies' draft choice, the step's commit, the runners' non-finite check, a
cascade review's bookkeeping, the verification and a sampling review's emitted distribution. Drafts keep their plan's widths (no CPU-only trim, Models.trim_drafts), as
on a GPU. Each kernel's own tests compare it with its reference on random inputs; what they
cannot see is its wiring into the engine (which buffers it gets, with which strides, what the
next step reads of what it wrote in place): greedy tokens equal to plain decoding's and a
request with non-finite logits failing alone check that.
"""
import dataclasses

import pytest
import torch

from csd_engine import Autoregressive, Cascade, Engine, SamplingParams, Speculative, Staged
from tests.strategies.common import assert_a_non_finite_request_fails_alone, broken_and_plain
from tests.strategies.test_every_strategy import repetitive_prompt
from tests.tiny_models import perturbed, tiny_llama

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's emulation of the GPU path")

STRATEGIES = {  # name: (drafters, strategy)
    "autoregressive": ((), Autoregressive()),
    "speculative-mag": (("mag",), Speculative(k=4)),
    "cascade": (("model", "mag"), Cascade(k_matrix=((4, 2), (0, 4)), lenience=2.0, mag_tokens=4)),
    "cascade-3-levels": (("model", "model2", "mag"), Cascade(k_matrix=((2, 1, 1), (0, 2, 1), (0, 0, 2)), lenience=2.0,
                                                             mag_tokens=2)),
    "cascade-tree": (("model", "mag"), Cascade(k_matrix=((2, 1), (0, 2)), lenience=2.0, mag_tokens=2, tree=(3, 2))),
    "staged": (("model", "mag"), Staged(branching=(2, 2, 1), mag_tokens=2)),
    # the tiny drafter is as large as its target: priced as a small one's, so that drafting pays
    "cascade-auto": (("model", "mag"), Cascade.auto(model_cost=0.1)),
    "speculative-auto": (("model",), Speculative.auto(model_cost=0.1)),
}  # not Pearl(overlap=True): its drafter thread and the target would run Triton's interpreter at once,
# which keeps global state (on a GPU the compiled kernels launch from both threads; its GPU tests cover it)
# ragged prompts that repeat themselves: MaG matches, and its kernels write what later steps read
PROMPTS = [repetitive_prompt(seed, length) for seed, length in ((0, 12), (1, 7), (2, 10))]


class DevicePath:
    """A strategy whose decoder sees the GPU's Models: no trim of draft widths."""

    def __init__(self, strategy):
        self.strategy = strategy

    def decoder(self, models):
        return self.strategy.decoder(dataclasses.replace(models, trim_drafts=False))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)  # its greedy continuations repeat the prompts often enough for MaG


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_greedy_tokens_on_the_kernel_path_equal_plain_decoding(target, name, monkeypatch):
    drafters, strategy = STRATEGIES[name]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = Engine(target, max_batch_size=3, max_seq_len=64).generate(PROMPTS, params, strategy=Autoregressive())
    models = {"model": perturbed(target, 0.05, seed=4), "model2": perturbed(target, 0.1, seed=5), "mag": "mag"}
    engine = Engine(target, drafters=[models[d] for d in drafters], max_batch_size=3, max_seq_len=64)
    monkeypatch.setenv("CSD_CPU_KERNELS", "1")
    got = engine.generate(PROMPTS, params, strategy=DevicePath(strategy))
    assert [r.token_ids for r in got] == [r.token_ids for r in plain], name
    assert drafters == () or any(r.metrics.mean_accepted_tokens > 1 for r in got), f"{name}: nothing accepted"


@pytest.mark.parametrize("name", ["speculative-model", "cascade"])
def test_a_greedy_request_outlives_a_sampled_neighbour_on_the_kernel_path(target, name, monkeypatch):
    """A top-k request leaves before a greedy one: from then on every occupied row is greedy and
    the verification kernel is told so (all_greedy), drawing nothing for any row, so the freed row
    must be greedy again too: otherwise its next token is read from never-written candidates and
    a drafter embeds that garbage id (an index error here, a device-side assert on a GPU)."""
    strategy = Speculative(k=3) if name == "speculative-model" else STRATEGIES[name][1]
    drafters = [perturbed(target, 0.05, seed=4)] + (["mag"] if name == "cascade" else [])
    prompts = [PROMPTS[0], [56]]
    params = [SamplingParams(max_new_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=7, seed=3, max_new_tokens=12, ignore_eos=True)]
    plain = Engine(target, max_batch_size=1, max_seq_len=64).generate(prompts[:1], params[0])[0]
    engine = Engine(target, drafters=drafters, max_batch_size=2, max_seq_len=64)
    monkeypatch.setenv("CSD_CPU_KERNELS", "1")
    got = engine.generate(prompts, params, strategy=DevicePath(strategy))
    assert got[0].token_ids == plain.token_ids
    assert len(got[1].token_ids) == 12


def test_a_request_with_non_finite_logits_fails_alone_on_the_kernel_path(monkeypatch):
    broken, plain = broken_and_plain(lambda: tiny_llama(seed=7))
    monkeypatch.setenv("CSD_CPU_KERNELS", "1")
    engine = Engine(broken, drafters=["mag"], max_batch_size=2, max_seq_len=32)
    assert_a_non_finite_request_fails_alone(engine, DevicePath(Speculative(k=2)), plain)


def test_a_sampling_cascade_runs_on_the_kernel_path(target, monkeypatch):
    """Top-k / top-p sampling through the fixed cascade (MaG below a model, lenience 2): its
    reviews take the emitted-distribution kernel. The kernels round otherwise than their
    references, so a seeded run may differ in a token; the distribution tests hold the rule, this
    holds the wiring: every request runs to its length with tokens in the vocabulary."""
    drafters, strategy = STRATEGIES["cascade"]
    engine = Engine(target, drafters=[perturbed(target, 0.05, seed=4), "mag"], max_batch_size=3, max_seq_len=64)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    monkeypatch.setenv("CSD_CPU_KERNELS", "1")
    got = engine.generate(PROMPTS, params, strategy=DevicePath(strategy))
    vocab = target.config.vocab_size
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in got)
    assert all(0 <= t < vocab for r in got for t in r.token_ids)
    assert any(r.metrics.mean_accepted_tokens > 1 for r in got)
