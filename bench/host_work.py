"""Host work per decoding step, per strategy, counted on the CPU: what a GPU step waits on when
Python launches it op by op (issue 11; bench/gpu.py's step split times it on a GPU).

For each strategy, batch size and sampling mode, one `generate` runs with every decoder step
(and plan) under a dispatch-mode counter, which gives per target step:
* host reads: ops that move values to Python (`.item()`, `bool(t)`, `nonzero`, `.tolist()`,
  ...) inside the step. The design is 0 (the engine's one `read_host` per step is outside it);
  tests/strategies/test_host_reads.py asserts it, this table shows it;
* strategy ops: tensor ops a step dispatches outside its model forwards, verifier calls, MaG
  proposals and one-launch kernels (the strategy's code, the engine's helpers, the random
  streams' seed mixing), each some microseconds of host time; of them, strategy kernels: those
  that launch a kernel on a GPU (views and `empty` launch none);
* calls of what runs as whole kernels on a GPU: verifier calls (a chain's 4 Triton launches, 3
  when every row is greedy; a tree's 2), a sampling review's emitted distribution (2), MaG calls
  (one launch), one-launch kernels whose PyTorch reference the CPU runs (ONE_LAUNCH: the
  self-tuning strategies' draft choice, kernels/draft_budget.py; the step's commit,
  kernels/commit.py; a runner's non-finite check of its logits, kernels/nonfinite.py; a cascade
  review's bookkeeping, kernels/review.py), drafter forwards (a CUDA-graph replay each when graphed);
* launches: strategy kernels + the verifier calls' launches + 2 x emitted distributions + MaG
  calls + one-launch kernels, the kernel launches a step issues besides its model forwards;
* drafter tokens: positions per row that the step's drafter forwards compute (their host-known
  widths, padding included), the drafters' share of the step's GPU work.
Tiny random models: the counts depend on the strategy's configuration, not on model size (nor
on --threads, which is 1 unless given: tiny models run fastest on one thread).

    python bench/host_work.py [--tokens 32] [--out DIR]
    python bench/host_work.py --dry-run         # two strategies, a few tokens
"""
import os
import sys
from collections import Counter

if __package__ in (None, ""):  # run as `python bench/host_work.py`: make the `bench` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench import harness  # noqa: E402
from bench.common import print_table  # noqa: E402
from bench.tiny import perturbed, tiny_qwen2  # noqa: E402
from csd_engine import Autoregressive, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged  # noqa: E402
from csd_engine.drafters.mag import MaG  # noqa: E402
from csd_engine.host_reads import is_host_read, reading_python_values  # noqa: E402
from csd_engine.models import runner  # noqa: E402
from csd_engine.strategies import base, cascade, cascade_auto, speculative_auto  # noqa: E402

aten = torch.ops.aten
NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided}  # allocations; views are found by `is_view`
# launches per chain verification (kernels/verify.py): 4 Triton kernels, 3 when every row is greedy
VERIFY_LAUNCHES = {"greedy": 3, "top-k/top-p": 4}
TREE_LAUNCHES = 2  # per tree verification (kernels/tree_verify.py): its kernel and the fill of accepted_nodes
EMITTED_LAUNCHES = 2  # Triton launches per emitted distribution of a sampling review (kernels/emitted.py)
# the CPU references of one-launch kernels, by the module that calls them: (module, name)
ONE_LAUNCH = ((cascade_auto, "draft_budgets_ref"), (speculative_auto, "draft_budgets_ref"), (base, "commit_ref"),
              (runner, "flag_nonfinite_ref"), (cascade, "review_bookkeeping_ref"))
STRATEGIES = {  # name: (drafters, strategy)
    "autoregressive": ((), Autoregressive()),
    "speculative k=4": (("d1",), Speculative(k=4)),
    "speculative MaG k=4": (("mag",), Speculative(k=4)),
    "Speculative.auto()": (("d1",), Speculative.auto()),
    "cascade [[4,2],[0,4]] l=2": (("d1", "mag"), Cascade(k_matrix=((4, 2), (0, 4)), lenience=2.0, mag_tokens=4)),
    "cascade 3 levels": (("d1", "d2", "mag"), Cascade(k_matrix=((2, 1, 1), (0, 2, 1), (0, 0, 2)), lenience=2.0,
                                                      mag_tokens=2)),
    "cascade direct 16": (("d1", "mag"), Cascade(k_matrix=((2, 4), (0, 4)), lenience=2.0, mag_tokens=4,
                                                 direct_tokens=16)),
    "cascade tree (3,2)": (("d1", "mag"), Cascade(k_matrix=((2, 4), (0, 4)), lenience=2.0, mag_tokens=4, tree=(3, 2))),
    "Cascade.auto()": (("d1", "mag"), Cascade.auto()),
    "staged (2,2,1) + MaG": (("d1", "mag"), Staged(branching=(2, 2, 1), mag_tokens=2)),
    "pearl gamma=4": (("d1",), Pearl(gamma=4, overlap=True)),
}
DRY_RUN = ("autoregressive", "cascade [[4,2],[0,4]] l=2")
MODES = {"greedy": dict(), "top-k/top-p": dict(temperature=0.8, top_k=20, top_p=0.9, seed=1)}


class Counting(TorchDispatchMode):
    """Counts every op dispatched while a step or plan runs, by the call it runs in: a model
    forward, a verifier call, a MaG proposal or a one-launch kernel's reference (each one graph
    replay or one or a few Triton launches on a GPU), or none of them: the strategy's own ops,
    wherever they are written (the engine's helpers, the random streams' seed mixing)."""

    def __init__(self, counts: Counter, context: list):
        super().__init__()
        self.counts, self.context = counts, context

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_host_read(func, args):
            self.counts["host_reads"] += 1
        where = self.context[-1]
        self.counts[where] += 1
        if where == "strategy" and not func.is_view and func.overloadpacket not in NO_KERNEL:
            self.counts["strategy_kernels"] += 1
        return func(*args, **(kwargs or {}))


class Counted:
    """A strategy whose decoder's `step` and `plan` run under the counter."""

    def __init__(self, strategy, counts: Counter, context: list):
        self.strategy, self.counts, self.context = strategy, counts, context

    def decoder(self, models):
        decoder = self.strategy.decoder(models)
        for name in ("step", "plan"):
            setattr(decoder, name, self._counted(getattr(decoder, name), name == "step"))
        return decoder

    def _counted(self, fn, is_step):
        def run(*args, **kwargs):
            self.counts["steps"] += is_step

            def read(name):
                self.counts["host_reads"] += 1

            self.context.append("strategy")  # count_calls counts while this is the innermost context
            try:
                with reading_python_values(read), Counting(self.counts, self.context):
                    return fn(*args, **kwargs)
            finally:
                self.context.pop()
        return run


def count_calls(engine: Engine, counts: Counter, context: list):
    """Marks the calls that run as whole kernels on a GPU (model forwards, verifier calls, MaG
    proposals, ONE_LAUNCH) as the context of the ops inside them, and counts them and the
    drafters' forward widths (inside steps and plans only: not prefills). Returns what undoes
    the module-level wraps (ONE_LAUNCH's)."""
    def wrap(obj, name, part, count=None):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if context[-1] == "strategy" and count is not None:
                count(*args)
            context.append(part)
            try:
                return original(*args, **kwargs)
            finally:
                context.pop()
        setattr(obj, name, wrapped)

    wrap(engine.verifier, "chain", "verify", lambda *a: counts.update(["verifier_calls"]))
    wrap(engine.verifier, "tree", "verify", lambda *a: counts.update(["verifier_calls", "tree_calls"]))
    wrap(engine.verifier, "emitted_distribution", "verify", lambda *a: counts.update(["emitted_calls"]))
    wrap(engine.target, "forward", "model")
    originals = [(module, name, getattr(module, name)) for module, name in ONE_LAUNCH]
    for module, name, _ in originals:  # the CPU's reference of what is one launch on a GPU
        wrap(module, name, "one_launch", lambda *a: counts.update(["one_launch_calls"]))
    for drafter in engine.drafters:
        if isinstance(drafter, MaG):
            for method in ("propose", "extend"):  # one launch each on a GPU (extend writes in the same)
                wrap(drafter, method, "mag", lambda *a: counts.update(["mag_calls"]))
        else:
            wrap(drafter, "forward", "model", lambda batch: counts.update({"drafter_tokens": batch.input_ids.shape[1]}))
    return lambda: [setattr(module, name, original) for module, name, original in originals]


def measure(models: dict, name: str, batch: int, mode: str, tokens: int) -> dict:
    drafters, strategy = STRATEGIES[name]
    engine = Engine(models["target"], drafters=[models[d] if d != "mag" else "mag" for d in drafters],
                    max_batch_size=batch, max_seq_len=64 + tokens, device="cpu")
    engine.trim_drafts = False  # count the device path: no CPU-only trim of the draft widths (one read each)
    prompts = [[(7 * row + 3 * i) % 90 + 1 for i in range(12 + 3 * row)] for row in range(batch)]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, **MODES[mode])
    engine.generate(prompts, params, strategy=strategy)  # warm-up: nothing cached in the counts
    counts, context = Counter(), ["outside"]
    restore = count_calls(engine, counts, context)
    try:
        results = engine.generate(prompts, params, strategy=Counted(strategy, counts, context))
    finally:
        restore()
    steps = max(counts["steps"], 1)
    first = results[0].metrics  # every row runs to max_new_tokens (ignore_eos): row 0 stands for all
    per_step = {key: counts[key] / steps
                for key in ("host_reads", "strategy", "strategy_kernels", "verifier_calls", "emitted_calls",
                            "tree_calls", "mag_calls", "one_launch_calls", "drafter_tokens")}
    chains = per_step["verifier_calls"] - per_step["tree_calls"]
    per_step["launches"] = (per_step["strategy_kernels"] + VERIFY_LAUNCHES[mode] * chains
                            + TREE_LAUNCHES * per_step["tree_calls"]
                            + EMITTED_LAUNCHES * per_step["emitted_calls"] + per_step["mag_calls"]
                            + per_step["one_launch_calls"])
    return dict(strategy=name, batch=batch, mode=mode, steps=counts["steps"],
                host_reads_per_step=per_step["host_reads"], strategy_ops_per_step=per_step["strategy"],
                strategy_kernels_per_step=per_step["strategy_kernels"],
                verifier_calls_per_step=per_step["verifier_calls"], emitted_calls_per_step=per_step["emitted_calls"],
                mag_calls_per_step=per_step["mag_calls"], one_launch_calls_per_step=per_step["one_launch_calls"],
                drafter_forwards_per_step=sum(first.drafter_forwards) / max(first.target_forwards, 1),
                drafter_tokens_per_step=per_step["drafter_tokens"],
                launches_per_step=per_step["launches"],
                model_ops_per_step=counts["model"] / steps)


def main(argv=None):
    ap = harness.parser(__doc__, dry_run={"tokens": 6}, threads=1)
    ap.add_argument("--tokens", type=harness.positive_int, default=32, help="new tokens per request (default 32)")
    ap.add_argument("--batches", type=harness.numbers(int, 1), default="1,4",
                    help="comma-separated batch sizes (default 1,4)")
    args = ap.parse_args(argv)
    harness.start(args)
    names = DRY_RUN if args.dry_run else tuple(STRATEGIES)
    tokens, batches = args.tokens, args.batches
    target = tiny_qwen2(seed=0, layers=2)
    models = {"target": target, "d1": perturbed(target, 0.05, seed=1), "d2": perturbed(target, 0.15, seed=2)}
    path = harness.record_path("host-work", args)
    rows = []
    bar = harness.Progress(len(names) * len(batches) * len(MODES))
    for name in names:
        for batch in batches:
            for mode in MODES:
                rows.append(measure(models, name, batch, mode, tokens))
                bar.step(f"{name}, batch {batch}, {mode}: {rows[-1]['launches_per_step']:.0f} launches/step")
                harness.write_record(path, {"rows": rows, "tokens": tokens}, args)
    print_table(rows, [("strategy", "strategy", "s"), ("batch", "B", "d"), ("mode", "mode", "s"),
                       ("steps", "steps", "d"), ("host_reads_per_step", "host reads", ".1f"),
                       ("strategy_ops_per_step", "strategy ops", ".0f"),
                       ("strategy_kernels_per_step", "of them kernels", ".0f"),
                       ("verifier_calls_per_step", "verify calls", ".1f"),
                       ("emitted_calls_per_step", "emitted", ".1f"), ("mag_calls_per_step", "MaG calls", ".1f"),
                       ("one_launch_calls_per_step", "one-launch", ".1f"),
                       ("drafter_forwards_per_step", "drafter fwd", ".1f"),
                       ("drafter_tokens_per_step", "drafter tokens", ".1f"),
                       ("launches_per_step", "launches", ".0f")])
    harness.finish(path, args)


if __name__ == "__main__":
    harness.run(main)
