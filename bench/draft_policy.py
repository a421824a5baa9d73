"""Which draft-length policy pays with a target and its drafters, replayed offline on real acceptance.

    python bench/draft_policy.py                                # Qwen 1.5B <- 0.5B int4 + MaG, every bench prompt
    python bench/draft_policy.py --per-category 1 --max-new-tokens 64
    python bench/draft_policy.py --dry-run                      # tiny random models, seconds
    python bench/draft_policy.py --replay RUN.json --drafter-cost 0.06   # re-price a run's traces, no models

Greedy speculative decoding emits the target's greedy continuation whatever is drafted, so one
pass records all that a policy needs. Per prompt: that continuation (csd_engine's
Autoregressive), the drafter's greedy token at every position with the continuation
teacher-forced (a chain of a drafts from position t is accepted up to the drafter's run of
agreement from t), and MaG's proposal at every position (accepted up to its own agreement).
Each policy of POLICIES is then replayed step by step and priced in target forwards:

    step = width(1 + tokens the target checks) + drafter forwards x drafter cost + step overhead

where plain decoding costs 1 a token. width(n) (a forward of n tokens over a one-token one) and
the drafter's one-token forward are timed here at the first prompt's context unless given; the
step overhead (verification, MaG and the host's work of a speculative step) is given, 0.07 by
default (`bench/compare.py --profile` on the AVX-512 CPU: verification, MaG and the rest took
about 10 ms of a cascade step beyond plain decoding's, against a 128 ms target forward).
The tables show tokens per cost: the speedup over plain decoding a policy would reach if the
cost model held (prefill and the rest are not in it: bench/compare.py measures real speed).
The oracle rows know, each step, what the target will accept and draft the length that gives
the most tokens per cost: the gap to them is about what better length choices could win with
these drafters; what lies beyond needs better or cheaper drafters.
"""
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/draft_policy.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, order_by_category, print_table  # noqa: E402
from csd_engine import Autoregressive, SamplingParams  # noqa: E402
from csd_engine.models.llama import LlamaRunner  # noqa: E402
from csd_engine.models.runner import ForwardBatch  # noqa: E402
from csd_engine.kernels.draft_budget import Counts, Grid, Prices, draft_budgets_ref  # noqa: E402

WIDTHS = (1, 2, 3, 5, 9, 17)  # forward widths timed for width(n); wider ones extend the last slope
MAG_TOKENS = 16  # the longest MaG proposal recorded (the cascade's direct_tokens)


@dataclass
class Trace:
    """One prompt's greedy continuation, seen from every position t >= 1 (position 0 comes from
    the prefill): runs[t] drafter tokens in a row agree with the continuation from t;
    MaG proposes mag_length[t] tokens there, its first mag_agree[t] agree, after a suffix match
    of mag_match[t] tokens."""
    category: str
    runs: list[int]
    mag_length: list[int]
    mag_agree: list[int]
    mag_match: list[int]

    @property
    def tokens(self) -> int:
        return len(self.runs)


@dataclass
class Costs:
    """The cost model, in one-token target forwards."""
    widths: list[tuple[int, float]]  # (n, a forward of n tokens over a one-token one), n ascending from 1
    drafter: float  # the drafter's one-token forward
    step: float  # a speculative step's own work (verification, MaG, host)

    def width(self, n: int) -> float:
        (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(self.widths, self.widths[1:]) if b[0] >= n),
                                  self.widths[-2:])
        return y0 + (max(n, 1) - x0) * (y1 - y0) / (x1 - x0)

    def table(self, n: int) -> torch.Tensor:
        """[n + 1] width(w) for w = 0..n, as kernels/draft_budget.py takes it."""
        return torch.tensor([self.width(w) for w in range(n + 1)])


@dataclass
class Step:
    model: int = 0  # drafter tokens, drafted one forward each
    mag: int = 0  # MaG tokens sent straight to the target (up to what MaG proposes)


# -- policies: choose(trace, t, memory) -> Step; learn(memory, step, drafted, accepted) --------------
@dataclass
class Fixed:
    """A chain of k drafter tokens every step."""
    k: int

    def choose(self, trace, t, memory, costs):
        return Step(model=self.k)


@dataclass
class SpeculativeAutoRule:
    """Speculative.auto()'s choice, by csd_engine's own functions: the length <= max_tokens that
    maximises expected tokens per cost at the row's counted rate (prior `prior` drafts at
    `prior_rate`), with the cost model's drafter cost (the engine's is budget.cost_ratio's)."""
    max_tokens: int = 6
    prior: float = 4.0
    prior_rate: float = 0.8

    def choose(self, trace, t, memory, costs):
        grid = Grid(self.max_tokens, 0, (), self.prior, self.prior_rate, stops_early=False)
        counts = Counts((torch.tensor([memory.get("accepted", 0.0)]), torch.tensor([memory.get("checked", 0.0)])),
                        None, None, None)
        model = torch.tensor([float(costs.drafter)])
        prices = Prices(costs.table(self.max_tokens + 1), model, model)
        return Step(model=int(draft_budgets_ref(grid, prices, counts)[1, 0]))

    def learn(self, memory, step, drafted, accepted):
        if step.model:
            memory["accepted"] = memory.get("accepted", 0) + accepted
            memory["checked"] = memory.get("checked", 0) + min(accepted + 1, drafted)


@dataclass
class GrowShrink:
    """k grows by 2 after a fully accepted draft and shrinks by 1 otherwise (transformers'
    "heuristic" schedule for assisted generation), from `start`."""
    start: int = 5

    def choose(self, trace, t, memory, costs):
        return Step(model=memory.setdefault("k", self.start))

    def learn(self, memory, step, drafted, accepted):
        memory["k"] = memory["k"] + 2 if accepted == drafted else max(1, memory["k"] - 1)


@dataclass
class MaGWhenMatched:
    """MaG's tokens straight to the target where its suffix match is at least `match` long (the
    cascade's direct path, direct_match), else `otherwise`."""
    match: int
    otherwise: object

    def choose(self, trace, t, memory, costs):
        if trace.mag_match[t] >= self.match and trace.mag_length[t]:
            return Step(mag=MAG_TOKENS)
        return self.otherwise.choose(trace, t, memory, costs)

    def learn(self, memory, step, drafted, accepted):
        if step.model and hasattr(self.otherwise, "learn"):
            self.otherwise.learn(memory, step, drafted, accepted)


@dataclass
class Oracle:
    """Each step drafts, knowing what the target will accept, the tokens that give the most
    tokens per cost: a drafter chain no longer than what will be accepted (at most MAG_TOKENS),
    or with `mag` also MaG's tokens up to their agreement."""
    mag: bool = False

    def choose(self, trace, t, memory, costs):
        steps = [Step(model=a) for a in range(min(trace.runs[t], MAG_TOKENS) + 1)]
        if self.mag:
            steps += [Step(mag=g) for g in range(1, trace.mag_agree[t] + 1)]
        return max(steps, key=lambda step: (step.model + step.mag + 1) / step_cost(step, step.model + step.mag, costs))


POLICIES = {
    "chain k=2": Fixed(2), "chain k=4": Fixed(4), "chain k=6": Fixed(6), "chain k=8": Fixed(8),
    "grow +2 / shrink -1": GrowShrink(),
    "Speculative.auto's rule": SpeculativeAutoRule(),
    "Speculative.auto's rule, max 10": SpeculativeAutoRule(max_tokens=10),
    "MaG when matched >= 8, else Speculative.auto's rule": MaGWhenMatched(8, SpeculativeAutoRule()),
    "MaG when matched >= 4, else Speculative.auto's rule": MaGWhenMatched(4, SpeculativeAutoRule()),
    "oracle: the drafter's chain": Oracle(),
    "oracle: the drafter's chain or MaG": Oracle(mag=True),
}


def step_cost(step: Step, drafted: int, costs: Costs) -> float:
    return costs.width(1 + drafted) + step.model * costs.drafter + (costs.step if drafted else 0.0)


def replay(trace: Trace, policy, costs: Costs) -> tuple[float, int]:
    """(cost, target forwards) of decoding the trace's positions 1.. with `policy`."""
    t, cost, forwards, memory = 1, 0.0, 0, {}
    while t < trace.tokens:
        step = policy.choose(trace, t, memory, costs)
        if step.mag:
            drafted = min(step.mag, trace.mag_length[t])
            accepted = min(drafted, trace.mag_agree[t])
        else:
            drafted = step.model
            accepted = min(drafted, trace.runs[t])
        cost += step_cost(step, drafted, costs)
        forwards += 1
        if hasattr(policy, "learn"):
            policy.learn(memory, step, drafted, accepted)
        t += accepted + 1
    return cost, forwards


# -- recording --------------------------------------------------------------------------------------
def record(engine, forcer, ids: list[int], max_new_tokens: int, category: str) -> Trace:
    """The greedy continuation of `ids` and what the drafter (`forcer`, a runner of its own) and
    the engine's MaG would have drafted at each of its positions."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    out = engine.generate([ids], params, strategy=Autoregressive())[0].token_ids
    n, p = len(out), len(ids)
    forcer.prefill(slice(0, 1), torch.tensor([ids]))
    forcer.cache.lengths.fill_(p)
    logits = forcer(ForwardBatch.chain(torch.tensor([out]), forcer.cache.lengths, p + n))[0]
    agree = (logits[:-1].argmax(-1) == torch.tensor(out[1:])).tolist()  # agree[t - 1]: the drafter's token t
    runs = [0] * (n + 1)
    for t in range(n - 1, 0, -1):
        runs[t] = runs[t + 1] + 1 if agree[t - 1] else 0
    sequence = torch.tensor([ids + out])
    end = p + torch.arange(n)  # row t: the history up to position t
    proposal = engine.drafters[1].propose(sequence.expand(n, -1).contiguous(), end, end, MAG_TOKENS)
    mag_agree = []
    for t in range(n):
        expected = out[t:t + MAG_TOKENS]
        drafted = proposal.tokens[t, :int(proposal.length[t])].tolist()
        mag_agree.append(next((i for i, (a, b) in enumerate(zip(drafted, expected)) if a != b),
                              min(len(drafted), len(expected))))
    return Trace(category, runs[:n], proposal.length.tolist(), mag_agree, proposal.match.tolist())


def time_costs(target, drafter, ids: list[int], repeats: int) -> tuple[list[tuple[int, float]], float]:
    """width(n) for n in WIDTHS and the drafter's one-token forward, both over the target's
    one-token forward, after `ids` in the cache: medians of `repeats` interleaved sweeps."""
    for runner in (target, drafter):
        runner.allocate(1, len(ids) + max(WIDTHS) + 1)
        runner.prefill(slice(0, 1), torch.tensor([ids]))
        runner.cache.lengths.fill_(len(ids))
    calls = [(target, n) for n in WIDTHS] + [(drafter, 1)]
    seconds = {i: [] for i in range(len(calls))}
    for sweep in range(repeats + 1):
        for i, (runner, n) in enumerate(calls):
            batch = ForwardBatch.chain(torch.tensor([ids[-n:]]), runner.cache.lengths, len(ids) + n)
            begin = time.perf_counter()
            runner(batch)
            if sweep:  # the first sweep warms up
                seconds[i].append(time.perf_counter() - begin)
    median = [statistics.median(seconds[i]) for i in range(len(calls))]
    one = median[0]
    return [(n, m / one) for n, m in zip(WIDTHS, median)], median[-1] / one


# what a recording fixes: --replay takes them from its args, and refuses them on the command line
RECORDED = ("target", "drafter", "dtype", "max_new_tokens", "repeats", "categories", "per_category", "prompts_file",
            "quantize")


def read_recording(path: str) -> tuple[list[Trace], list[tuple[int, float]], float, dict]:
    """(traces, width curve, drafter cost, args) of a JSON this script wrote; ValueError saying
    why where the file is not one."""
    try:
        recorded = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} ({exc})") from None
    try:
        traces = [Trace(**trace) for trace in recorded["traces"]]
        widths = [tuple(w) for w in recorded["costs"]["widths"]]
        drafter_cost = float(recorded["costs"]["drafter"])
        args = dict(recorded["args"])
    except KeyError as exc:
        raise ValueError(f"{path} is not a recording of bench/draft_policy.py (it has no {exc})") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a recording of bench/draft_policy.py ({exc})") from None
    if not traces:
        raise ValueError(f"{path} holds no traces")
    return traces, widths, drafter_cost, args


def parse_args(argv=None):
    ap = harness.parser(__doc__, dry_run={"max_new_tokens": 12, "per_category": 1}, target="qwen2.5-coder-1.5b",
                        drafter="qwen2.5-coder-0.5b", dtype="bfloat16", max_new_tokens=128, repeats=5, categories=None,
                        per_category=None, prompts_file=None)
    ap.add_argument("--quantize", default="int4", choices=["int4", "int8", "none"],
                    help="the drafter's weights (default int4, the README's main command)")
    ap.add_argument("--drafter-cost", type=float, default=None,
                    help="the drafter's one-token forward, x the target's (default: timed)")
    ap.add_argument("--width-cost", type=float, default=None,
                    help="one more token's cost in a target forward (default: the timed curve)")
    ap.add_argument("--step-cost", type=float, default=0.07, help="a speculative step's own work, x a target forward (default 0.07)")
    ap.add_argument("--replay", default=None, metavar="JSON",
                    help="replay the traces a run of this script recorded (its timed costs unless given): no models; "
                         "the models, prompts and tokens are the recording's (" + ", ".join(
                             "--" + dest.replace("_", "-") for dest in RECORDED) + " are refused beside it)")
    args = ap.parse_args(argv)
    for name in ("drafter_cost", "width_cost", "step_cost"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            ap.error(f"--{name.replace('_', '-')} must be a number >= 0 (x a one-token target forward), got {value}")
    if args.max_new_tokens < 2:
        ap.error(f"--max-new-tokens must be at least 2, got {args.max_new_tokens}")
    if args.replay:
        refused = [dest for dest in RECORDED if dest in ap.given]
        if refused:
            ap.error(f"--replay re-prices a recorded run: {', '.join('--' + d.replace('_', '-') for d in refused)} "
                     "would change what it recorded (the recording's own are used)")
        try:
            recorded = read_recording(args.replay)[3]
        except ValueError as exc:
            ap.error(f"--replay: {exc}")
        if args.dry_run and not recorded.get("dry_run"):
            ap.error(f"--dry-run: {args.replay} is not the recording of a dry run")
        for dest in (*RECORDED, "dry_run"):  # the output's name, labels and dry-run tag
            setattr(args, dest, recorded.get(dest))
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.start(args)
    if args.replay:
        traces, widths, drafter_cost, _ = read_recording(args.replay)
    else:
        traces, widths, drafter_cost = record_all(args)
    if args.width_cost is not None:
        widths = [(1, 1.0), (2, 1.0 + args.width_cost)]
    costs = Costs(widths, drafter_cost if args.drafter_cost is None else args.drafter_cost, args.step_cost)
    summary = summarize(traces, costs)
    path = harness.record_path(f"draft-policy-{Path(args.target).name}-{args.dtype}-{args.quantize}", args)
    harness.write_record(path, {"costs": {"widths": costs.widths, "drafter": costs.drafter, "step": costs.step},
                                "policies": list(POLICIES), **summary,
                                "traces": [dataclasses.asdict(trace) for trace in traces]}, args)
    print(f"\ncosts (x a one-token target forward): drafter {costs.drafter:.3f}, step {costs.step:.3f}, widths "
          + ", ".join(f"{n}: {w:.2f}" for n, w in costs.widths))
    categories = list(summary["per_category"])
    print_table([{"policy": name, **{c: summary["per_category"][c][name]["tokens_per_cost"] for c in categories},
                  "all": summary["overall"][name]["tokens_per_cost"],
                  "accepted": summary["overall"][name]["tokens_per_forward"]} for name in POLICIES],
                [("policy", "policy (tokens per cost, x plain decoding)", "")]
                + [(c, c, ".2f") for c in categories] + [("all", "all", ".2f"), ("accepted", "tokens/forward", ".2f")])
    harness.finish(path, args)


def record_all(args) -> tuple[list[Trace], list[tuple[int, float]], float]:
    """Every prompt's trace, and the timed width curve and drafter cost."""
    prompts = order_by_category(load_prompts(categories=args.categories, per_category=args.per_category,
                                             path=args.prompts_file))
    tokenizer, target, drafter_model = harness.load_pair(args)
    dtype, device = harness.DTYPES[args.dtype], torch.device("cpu")
    encoded = [encode(tokenizer, p, max_tokens=48 if args.dry_run else None) for p in prompts]
    capacity = harness.capacity(encoded, args.max_new_tokens)

    def drafter_runner():
        if args.quantize == "none":
            return LlamaRunner(drafter_model, device, dtype)
        return harness.quantized_drafter(drafter_model, device, dtype, args.quantize, args.dry_run)

    engine = csd_engine.Engine(target, drafters=[drafter_runner(), "mag"], dtype=dtype, max_batch_size=1,
                               max_seq_len=capacity, tokenizer=tokenizer)
    forcer, timer = drafter_runner(), LlamaRunner(target, device, dtype)
    harness.progress(f"timing forwards after the first prompt's {len(encoded[0])} tokens")
    widths, drafter_cost = time_costs(timer, forcer, encoded[0], args.repeats)
    forcer.allocate(1, capacity)
    traces, progress = [], harness.Progress(len(prompts))
    for prompt, ids in zip(prompts, encoded):
        traces.append(record(engine, forcer, ids, args.max_new_tokens, prompt["category"]))
        trace = traces[-1]
        progress.step(f"[{prompt['category']}] drafter agrees on {sum(r > 0 for r in trace.runs[1:])} of "
                      f"{trace.tokens - 1} positions, MaG proposes at {sum(x > 0 for x in trace.mag_length)}")
    return traces, widths, drafter_cost


def summarize(traces: list[Trace], costs: Costs) -> dict:
    """Per category and overall, per policy: tokens per cost and tokens per target forward."""
    groups = {}
    for trace in traces:
        groups.setdefault(trace.category, []).append(trace)

    def cell(group, policy):
        results = [replay(trace, policy, costs) for trace in group]
        tokens = sum(trace.tokens - 1 for trace in group)
        return {"tokens_per_cost": tokens / sum(c for c, _ in results),
                "tokens_per_forward": tokens / sum(f for _, f in results)}

    return {"per_category": {c: {name: cell(g, p) for name, p in POLICIES.items()} for c, g in groups.items()},
            "overall": {name: cell(traces, p) for name, p in POLICIES.items()},
            "per_prompt": [{"category": t.category, "drafter_agreement": sum(r > 0 for r in t.runs[1:]) / (t.tokens - 1),
                            "mag_proposals": sum(x > 0 for x in t.mag_length),
                            "mag_agreed_tokens": sum(t.mag_agree)} for t in traces]}


if __name__ == "__main__":
    harness.run(main)
