"""A decoding step reads nothing back from the device: every strategy's `step` (and the `plan`
the engine reads with its tokens) runs without a single device-to-host read, so on a GPU the
step is a fixed sequence of device work, and the engine's `read_host` is the one read per step.

Counted on the CPU with a dispatch mode (`_local_scalar_dense` is behind `.item()`, `bool(t)`,
`int(t)`; `nonzero`, `masked_select`, `unique` and boolean-mask indexing have data-dependent
shapes, a sync on CUDA) and a patched `Tensor.tolist` / `Tensor.numpy` (they bypass dispatch).
The native runner's debug bound check (a read, CSD_DEBUG) is switched off here, and so is the
PyTorch references' habit of looking at values on CPU tensors, where a read costs nothing and
saves a full sort (kernels.sampling.READS_ON_CPU), and the engine's trim of the target's width
(Engine.trim_drafts, also CPU-only): what is counted is the device path.
"""
import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import csd_engine.scheduler
import csd_engine.models.llama
from csd_engine.kernels import sampling
from csd_engine import Autoregressive, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged
from csd_engine.host_reads import is_host_read, reading_python_values
from tests.tiny_models import perturbed, random_prompts, tiny_llama


class HostReads(TorchDispatchMode):
    """Counts the ops that read the device on the host (or would sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        read = is_host_read(func, args)
        if read:
            self.reads.append(read)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(reads: list):
    mode = HostReads()
    try:
        with reading_python_values(mode.reads.append), mode:
            yield
    finally:
        reads += mode.reads


class Counted:
    """Wraps a strategy so that its decoder's `step` and `plan` run under the counter."""

    def __init__(self, strategy, reads: list, steps: list):
        self.strategy, self.reads, self.steps = strategy, reads, steps

    def decoder(self, models):
        # the device design: no CPU-only trim of the target's width (Engine.trim_drafts)
        decoder = self.strategy.decoder(dataclasses.replace(models, trim_drafts=False))
        step = decoder.step

        def counted_step(*args, **kwargs):
            self.steps.append(1)
            with counting(self.reads):
                return step(*args, **kwargs)

        decoder.step = counted_step
        if hasattr(decoder, "plan"):
            plan = decoder.plan

            def counted_plan(*args, **kwargs):
                with counting(self.reads):
                    return plan(*args, **kwargs)

            decoder.plan = counted_plan
        return decoder


STRATEGIES = {
    "autoregressive": ((), Autoregressive()),
    "speculative-model": (("d1",), Speculative(k=3)),
    "speculative-mag": (("mag",), Speculative(k=4)),
    "speculative-confidence": (("d1",), Speculative(k=3, min_confidence=0.15)),
    # rows choose lengths, sit out and catch up (the lag is the plan's, read with the step's tokens)
    "speculative-auto": (("d1",), Speculative.auto(max_tokens=3, model_cost=0.1, min_confidence=0.15)),
    "cascade": (("d1", "mag"), Cascade(k_matrix=[[2, 2], [0, 2]], lenience=2, mag_tokens=2)),
    "cascade3": (("d1", "d2", "mag"), Cascade(k_matrix=[[2, 1, 1], [0, 2, 1], [0, 0, 2]], lenience=2, mag_tokens=2)),
    "cascade-tree": (("d1", "mag"), Cascade(k_matrix=[[2, 1], [0, 2]], mag_tokens=2, tree=(3, 2))),
    "cascade-auto": (("d1", "mag"), Cascade.auto()),
    "cascade-auto-tree": (("d1", "mag"), Cascade.auto(tree=(3, 2))),
    "staged": (("d1", "mag"), Staged(branching=(2, 2, 1), mag_tokens=2)),
    "pearl": (("d1",), Pearl(gamma=3, overlap=True)),
}
# Sampled rows run the Triton verification kernels in the interpreter (seconds per call): a
# few steps each, still more than one per row (the first step's plan is read apart). Their
# launchers take the same path whatever the strategy, so the sampled settings use the Triton
# verifier with the strategies that call every launcher path (chain without and with q and
# lenience, tree), the PyTorch references with the others.
TRITON_SAMPLED = ("speculative-model", "cascade", "cascade-tree")
SETTINGS = {"greedy": SamplingParams(max_new_tokens=10),
            "sampled": SamplingParams(temperature=1.0, seed=3, max_new_tokens=6),
            "top-k-top-p": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=4, max_new_tokens=6)}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=51)
    return {"target": target, "d1": perturbed(target, noise=0.2, seed=52), "d2": perturbed(target, noise=0.4, seed=53)}


@pytest.mark.parametrize("setting,batch", [("greedy", 1), ("sampled", 4), ("top-k-top-p", 4)])
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_step_reads_nothing_back(models, name, setting, batch, monkeypatch):
    monkeypatch.setattr(csd_engine.models.llama, "DEBUG_CHECKS", False)
    monkeypatch.setattr(sampling, "READS_ON_CPU", False)
    engine_reads = []
    read_host = csd_engine.scheduler.read_host
    monkeypatch.setattr(csd_engine.scheduler, "read_host", lambda t: engine_reads.append(1) or read_host(t))
    drafters, strategy = STRATEGIES[name]
    backend = "triton" if setting == "greedy" or name in TRITON_SAMPLED else "torch"
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=batch, max_seq_len=64, verify_backend=backend)
    prompts = random_prompts(batch, lo=2, hi=12, seed=61)
    prompts[0] = (prompts[0][:3] * 5)[:12]  # MaG matches
    reads, steps = [], []
    engine.generate(prompts, SETTINGS[setting], strategy=Counted(strategy, reads, steps))
    assert steps, "no step ran"
    assert reads == [], f"{name}: {len(reads)} host reads inside {len(steps)} steps: {sorted(set(reads))}"
    assert len(engine_reads) in (len(steps), len(steps) + 1)  # one per step (+ the first step's plan)


class SyncErrors(Counted):
    """On CUDA: every step runs under torch.cuda.set_sync_debug_mode("error")."""

    def decoder(self, models):
        decoder = super().decoder(models)
        for name in ("step", "plan"):
            if hasattr(decoder, name):
                setattr(decoder, name, self._strict(getattr(decoder, name)))
        return decoder

    @staticmethod
    def _strict(fn):
        def strict(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return strict


@pytest.mark.gpu
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_step_never_synchronises_on_cuda(models, name, monkeypatch):
    monkeypatch.setattr(csd_engine.models.llama, "DEBUG_CHECKS", False)
    drafters, strategy = STRATEGIES[name]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=4, max_seq_len=64, device="cuda")
    prompts = random_prompts(4, lo=2, hi=12, seed=61)
    for params in SETTINGS.values():
        engine.generate(prompts, params, strategy=SyncErrors(strategy, [], []))
