"""Decoding methods side by side on one target/drafter pair: batch 1, the same chat-templated
prompts of every category (bench/prompts.json), methods interleaved; greedy, or sampled at
--temperature (with --top-k / --top-p) where every method samples alike.

    python bench/compare.py                                  # Qwen2.5-Coder 1.5B <- 0.5B, bf16, every prompt
    python bench/compare.py --per-category 1 --methods hf,hf-assisted,ar,cascade
    python bench/compare.py --prompts 5 --max-new-tokens 64 --rounds 1 --profile   # the 2026-11-22 runs (docs/)
    python bench/compare.py --dry-run                        # tiny random models: proves it runs, in seconds
    python bench/compare.py --temperature 0.7 --top-p 0.9    # sampled: what a chat service sends

Each round decodes every prompt with every method, in an order that rotates from one prompt
(and round) to the next, so a slow spell of the machine falls on all methods alike; per prompt
the median time over the rounds is kept. Tables, overall and per category: tokens/s (tokens
over seconds, summed over the prompts), the min-max of the rounds' tokens/s, the speedup over
transformers' plain `generate`, the mean seconds to a prompt's first token (its prefill, by every
model the method runs, and the first step), mean accepted tokens per target forward, and how many outputs
equal transformers' greedy output (greedy runs only: sampled outputs are equal in distribution,
not token for token; every method samples with --seed, so each round draws the same tokens).
The JSON (rewritten after every round; per prompt, per category, overall, acceptance by draft
position) and its pictures go to bench/results/.
To add a method, add a line to METHODS. A method key may carry its own settings, so that
configurations run side by side in one interleaved run, e.g.
    --methods 'ar,cascade-int4,cascade-int4:K=[[3,4],[0,4]]:l=3,cascade-int4:K=[[4,8],[0,4]]:m=6'
(K: --k-matrix, l: --lenience, m: --mag-tokens, tree: --tree, k: --k, cost: --model-cost,
max: --auto-max-tokens).
"""
import argparse
import json
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/compare.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, order_by_category, print_table  # noqa: E402
from csd_engine import Autoregressive, Cascade, Pearl, SamplingParams, Speculative, Staged  # noqa: E402

DRY_RUN_PROMPT_TOKENS = 48  # the tiny models' prompts keep their last 48 characters


class Setup:
    """The models and engines the methods share, each engine built on first use."""

    def __init__(self, args, tokenizer, target, drafter, max_seq_len: int):
        self.args, self.tokenizer, self.target, self.drafter = args, tokenizer, target, drafter
        self.max_seq_len = max_seq_len
        self._quantized = {}

    def _engine(self, target, drafters) -> csd_engine.Engine:
        return csd_engine.Engine(target, drafters=drafters, dtype=harness.DTYPES[self.args.dtype], max_batch_size=1,
                                 max_seq_len=self.max_seq_len, tokenizer=self.tokenizer)

    @cached_property
    def engine(self) -> csd_engine.Engine:
        """Target <- [drafter, MaG]; the native runners share the transformers models' weights."""
        return self._engine(self.target, [self.drafter, "mag"])

    def engine_quantized(self, scheme: str) -> csd_engine.Engine:
        """The same target runner <- [the drafter with `scheme` weights ("int8", "int4"), MaG], built as
        the engine builds a quantized drafter (dense copies for wide calls)."""
        if scheme not in self._quantized:
            drafter = harness.quantized_drafter(self.drafter, self.engine.device, harness.DTYPES[self.args.dtype],
                                                scheme, self.args.dry_run)
            self._quantized[scheme] = self._engine(self.engine.target, [drafter, "mag"])
        return self._quantized[scheme]

    @cached_property
    def engine_mag(self) -> csd_engine.Engine:
        """The same target runner <- [MaG]."""
        return self._engine(self.engine.target, ["mag"])


def sampling(args) -> dict:
    """--temperature / --top-k / --top-p / --seed as SamplingParams' arguments (greedy: none)."""
    if not args.temperature:
        return {}
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


@dataclass
class Output:
    """One method's generation of one prompt."""
    tokens: list[int]
    first_token_s: float  # from the call to its first new token: the prefill by each model it runs, one step
    metrics: object = None  # csd_engine's Metrics; None for transformers' methods


class FirstToken(BaseStreamer):
    """A streamer for transformers' generate that keeps when the first new token came (its first
    put is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


@dataclass
class Transformers:
    """transformers' `generate` on the target, with extra generate arguments: greedy, or sampled
    at the run's temperature / top-k / top-p (torch's generator seeded with --seed first)."""
    setup: Setup
    extra: dict = field(default_factory=dict)

    def __call__(self, ids: list[int], max_new_tokens: int) -> Output:
        x = torch.tensor([ids])
        settings = sampling(self.setup.args)
        if settings:
            torch.manual_seed(settings.pop("seed"))
        first = FirstToken()
        begin = time.perf_counter()
        with torch.inference_mode():
            out = self.setup.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                             do_sample=bool(settings), eos_token_id=None, streamer=first,
                                             pad_token_id=self.setup.tokenizer.pad_token_id, **settings, **self.extra)
        return Output(out[0, len(ids):].tolist(), first.at - begin)


@dataclass
class EngineMethod:
    """csd_engine's generate with one strategy."""
    engine: csd_engine.Engine
    strategy: object
    settings: dict = field(default_factory=dict)  # sampling(args): temperature, top_k, top_p, seed

    def __call__(self, ids: list[int], max_new_tokens: int) -> Output:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **self.settings)
        result = self.engine.generate([ids], params, strategy=self.strategy)[0]
        return Output(result.token_ids, result.metrics.time_to_first_token_s, result.metrics)


@dataclass(frozen=True)
class OnEngine:
    """A csd_engine method: the strategy `build(args)` makes, decoding on the engine whose drafters
    are the 0.5B (with `scheme` weights: None, "int8", "int4") and MaG, or MaG alone (`mag_only`).
    `settings`: the per-method settings (OVERRIDES' names) it reads, so others are refused."""
    build: Callable
    scheme: str | None = None
    mag_only: bool = False
    settings: tuple = ()

    def strategy(self, args):
        """The strategy of these arguments; ValueError (the strategy's own, or where it does not fit
        this engine's drafters) before any model is loaded."""
        strategy = self.build(args)
        harness.fits_drafters(strategy, [True] if self.mag_only else [False, True])
        return strategy

    def __call__(self, setup: Setup, args) -> EngineMethod:
        engine = (setup.engine_mag if self.mag_only else setup.engine if self.scheme is None
                  else setup.engine_quantized(self.scheme))
        return EngineMethod(engine, self.build(args), sampling(args))


def k_cascade(scheme: str | None = None, tree: bool = False) -> OnEngine:
    """Cascade(--k-matrix, --lenience, --mag-tokens[, --tree]) over [0.5B (`scheme`), MaG]."""
    return OnEngine(lambda a: Cascade(k_matrix=json.loads(a.k_matrix), lenience=a.lenience, mag_tokens=a.mag_tokens,
                                      tree=json.loads(a.tree) if tree else ()),
                    scheme, settings=("K", "l", "m", *(("tree",) if tree else ())))


def self_tuning(strategy, scheme: str | None = None, tree: bool = False) -> OnEngine:
    """`strategy`.auto(model_cost=--model-cost[, max_tokens=--auto-max-tokens][, tree=--tree]) over
    [0.5B (`scheme`), MaG]; the strategy's own max_tokens where --auto-max-tokens is not given."""
    def build(a):
        return strategy.auto(model_cost=a.model_cost,
                             **({} if a.auto_max_tokens is None else {"max_tokens": a.auto_max_tokens}),
                             **({"tree": json.loads(a.tree)} if tree else {}))
    return OnEngine(build, scheme, settings=("cost", "max", *(("tree",) if tree else ())))


# key -> (label, formatted with the arguments; factory(setup, args) -> method(ids, max_new_tokens))
METHODS = {
    "hf": ("transformers generate", lambda s, a: Transformers(s)),
    "hf-assisted": ("transformers assisted ({drafter_name})",
                    lambda s, a: Transformers(s, dict(assistant_model=s.drafter))),
    "hf-lookup": ("transformers prompt lookup", lambda s, a: Transformers(s, dict(prompt_lookup_num_tokens=10))),
    "ar": ("csd_engine Autoregressive", OnEngine(lambda a: Autoregressive())),
    "spec-model": ("csd_engine Speculative({drafter_name}, k={k})",
                   OnEngine(lambda a: Speculative(k=a.k, drafter=0), settings=("k",))),
    "spec-model-conf": ("csd_engine Speculative({drafter_name}, k={k}, min_confidence=0.4)",
                        OnEngine(lambda a: Speculative(k=a.k, drafter=0, min_confidence=0.4), settings=("k",))),
    "spec-auto": ("csd_engine Speculative.auto({drafter_name})", self_tuning(Speculative)),
    "spec-auto-int8": ("csd_engine Speculative.auto({drafter_name} int8)", self_tuning(Speculative, "int8")),
    "spec-auto-int4": ("csd_engine Speculative.auto({drafter_name} int4)", self_tuning(Speculative, "int4")),
    "spec-auto-conf": ("csd_engine Speculative.auto({drafter_name}, min_confidence=0.4)",
                       OnEngine(lambda a: Speculative.auto(min_confidence=0.4))),
    "spec-mag": ("csd_engine Speculative(MaG, k={k_mag})", OnEngine(lambda a: Speculative(k=a.k_mag, drafter=1))),
    "cascade": ("csd_engine Cascade({drafter_name}+MaG, K={k_matrix}, l={lenience:g})", k_cascade()),
    "cascade-tree": ("csd_engine Cascade(same, tree={tree})", k_cascade(tree=True)),
    "cascade-int8": ("csd_engine Cascade({drafter_name} int8+MaG, K={k_matrix}, l={lenience:g})", k_cascade("int8")),
    "cascade-int4": ("csd_engine Cascade({drafter_name} int4+MaG, K={k_matrix}, l={lenience:g})", k_cascade("int4")),
    "cascade-int4-tree": ("csd_engine Cascade({drafter_name} int4+MaG, K={k_matrix}, l={lenience:g}, tree={tree})",
                          k_cascade("int4", tree=True)),
    "cascade-mag": ("csd_engine Cascade(MaG, K={k_mag_matrix})",
                    OnEngine(lambda a: Cascade(k_matrix=json.loads(a.k_mag_matrix), mag_tokens=8), mag_only=True)),
    "cascade-auto": ("csd_engine Cascade.auto()", self_tuning(Cascade)),
    "cascade-auto-int8": ("csd_engine Cascade.auto({drafter_name} int8)", self_tuning(Cascade, "int8")),
    "cascade-auto-int4": ("csd_engine Cascade.auto({drafter_name} int4)", self_tuning(Cascade, "int4")),
    "cascade-auto-int4-tree": ("csd_engine Cascade.auto({drafter_name} int4, tree={tree})",
                               self_tuning(Cascade, "int4", tree=True)),
    "staged": ("csd_engine Staged({drafter_name} tree 3,2,1,1 + 2 MaG)",
               OnEngine(lambda a: Staged(branching=(3, 2, 1, 1), drafter=0, mag_tokens=2))),
    # On one device Pearl() decodes by chain speculative steps (its two sides would not overlap);
    # pearl-overlap runs PEARL's concurrent rounds anyway.
    "pearl": ("csd_engine Pearl({drafter_name}, gamma={k})",
              OnEngine(lambda a: Pearl(gamma=a.k, drafter=0), settings=("k",))),
    "pearl-overlap": ("csd_engine Pearl({drafter_name}, gamma={k}, overlap=True)",
                      OnEngine(lambda a: Pearl(gamma=a.k, drafter=0, overlap=True), settings=("k",))),
}


def json_text(text: str) -> str:
    """argparse type of a K matrix or tree: JSON, kept as its compact text (the labels show it)."""
    try:
        return json.dumps(json.loads(text), separators=(",", ":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected JSON, e.g. [[2,4],[0,4]] or [3,2]; got {text!r}") from None


OVERRIDES = {"K": ("k_matrix", json_text), "l": ("lenience", float), "m": ("mag_tokens", int),
             "tree": ("tree", json_text), "k": ("k", int), "cost": ("model_cost", float),
             "max": ("auto_max_tokens", int)}


def split_methods(text: str) -> list[str]:
    """--methods' keys: split at the commas outside brackets (a key's K matrix has its own)."""
    keys, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            keys.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"--methods has unbalanced brackets: {text!r}")
    return [key for key in keys if key]


def method_args(args, key: str):
    """(METHODS key, a copy of the arguments with the settings of `key` ("name:K=..:l=..") applied);
    ValueError for an unknown method, setting or value, a setting given twice, or a setting the
    method does not read."""
    name, *settings = key.split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    own, seen = Namespace(**vars(args)), set()
    for setting in settings:
        short, _, value = setting.partition("=")
        if short not in OVERRIDES or not value:
            raise ValueError(f"method {key!r}: {setting!r} is not a setting; write NAME=VALUE with NAME in "
                             f"{', '.join(OVERRIDES)}")
        takes = getattr(METHODS[name][1], "settings", ())
        if short not in takes:
            raise ValueError(f"method {key!r}: {name} does not read {short}; its settings: "
                             f"{', '.join(takes) or 'none'}")
        if short in seen:
            raise ValueError(f"method {key!r}: {short} is given twice")
        seen.add(short)
        dest, kind = OVERRIDES[short]
        try:
            setattr(own, dest, kind(value))
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"method {key!r}: {short}={value!r} is not a valid value ({exc})") from None
    return name, own


def strategies(args) -> dict:
    """--methods' keys -> (METHODS key, the key's arguments, its csd_engine strategy or None for
    transformers' methods); ValueError naming the key where a method or its strategy is wrong."""
    configured = {}
    for key in split_methods(args.methods):
        name, own = method_args(args, key)
        factory = METHODS[name][1]
        try:
            configured[key] = name, own, factory.strategy(own) if isinstance(factory, OnEngine) else None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"method {key!r}: {exc}") from None
    return configured


def label(key: str, name: str, own) -> str:
    """The method's label with its settings; those its label does not show are appended."""
    template = METHODS[name][0]
    hidden = [setting for setting in key.split(":")[1:]
              if "{" + OVERRIDES[setting.partition("=")[0]][0] not in template]
    return template.format(**vars(own)) + (f" [{', '.join(hidden)}]" if hidden else "")


def parse_args(argv=None):
    ap = harness.parser(__doc__, dry_run={"max_new_tokens": 8, "per_category": 1}, target="qwen2.5-coder-1.5b",
                        drafter="qwen2.5-coder-0.5b", dtype="bfloat16", max_new_tokens=128, rounds=2, categories=None,
                        per_category=None, prompts_file=None)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated keys of METHODS, each optionally with its own settings "
                         "(KEY:K=[[3,4],[0,4]]:l=3, module docstring; default every key)")
    ap.add_argument("--prompts", type=harness.positive_int, default=None,
                    help="at most this many prompts in all, taken round-robin over the categories (default: all "
                         "that --categories and --per-category select)")
    ap.add_argument("--k", type=int, default=4,
                    help="draft length of Speculative and Pearl with the neural drafter (default 4)")
    ap.add_argument("--k-mag", type=int, default=6, help="draft length of Speculative with MaG (default 6)")
    ap.add_argument("--k-matrix", type=json_text, default="[[2,4],[0,4]]",
                    help="K matrix of Cascade target <- drafter <- MaG (default [[2,4],[0,4]]: bench/tune.py's best on "
                         "the 2-core CPU)")
    ap.add_argument("--tree", type=json_text, default="[3,2]",
                    help="candidates per depth of the top-level tree of cascade-tree, cascade-int4-tree and "
                         "cascade-auto-int4-tree (the tree each row may choose; default [3,2])")
    ap.add_argument("--k-mag-matrix", type=json_text, default="[[8]]",
                    help="K matrix of Cascade 1.5B <- MaG (default [[8]])")
    ap.add_argument("--lenience", type=float, default=2.0,
                    help="lenience of the K-matrix cascades, >= 1: how far the drafter's reviews of MaG's tokens are "
                         "relaxed (never the target's; default 2)")
    ap.add_argument("--mag-tokens", type=int, default=4, help="tokens MaG proposes per call in the K-matrix cascades "
                                                               "(default 4, the CLI's)")
    ap.add_argument("--model-cost", type=float, default=None,
                    help="the self-tuning strategies' drafter cost, x a target forward (default: their own, "
                         "csd_engine.strategies.budget.cost_ratio)")
    ap.add_argument("--auto-max-tokens", type=int, default=None,
                    help="the self-tuning strategies' longest draft per source (their max_tokens; default: "
                         "their own, 6)")
    ap.add_argument("--temperature", type=harness.non_negative_float, default=0.0,
                    help="sampling temperature of every method; 0: greedy, outputs compared token for token "
                         "(default 0)")
    ap.add_argument("--top-k", type=harness.non_negative_int, default=0,
                    help="with --temperature: keep the k likeliest tokens; 0: off (default 0)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="with --temperature: keep the smallest set of likeliest tokens holding this much "
                         "probability, in (0, 1]; 1: off (default 1)")
    ap.add_argument("--seed", type=harness.non_negative_int, default=0,
                    help="with --temperature: the seed every method samples with, on every prompt and round "
                         "(default 0)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, one instrumented run per csd_engine method on the first prompt: "
                         "time per target step in the target, drafters, verification, MaG and the rest (skipped "
                         "with a warning if the engine's internals no longer fit bench.common.instrumented)")
    args = ap.parse_args(argv)
    # the methods' labels name the drafter: "0.5B" for the default one (the README's tables), else its name
    args.drafter_name = "0.5B" if args.drafter == "qwen2.5-coder-0.5b" else Path(args.drafter).name
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p:g}")
    if not args.temperature and (args.top_k or args.top_p < 1):
        ap.error("--top-k and --top-p filter sampled tokens: give a --temperature > 0 with them")
    try:
        SamplingParams(**sampling(args))
    except ValueError as exc:
        ap.error(str(exc))
    try:
        keys = split_methods(args.methods)
    except ValueError as exc:
        ap.error(str(exc))
    if not keys or len(set(keys)) < len(keys):
        ap.error(f"--methods must name at least one method, each once; got {args.methods!r}")
    try:
        strategies(args)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv=None):
    args = parse_args(argv)
    harness.start(args)
    configured = strategies(args)
    methods = list(configured)
    labels = {key: label(key, name, own) for key, (name, own, _) in configured.items()}
    prompts = order_by_category(load_prompts(categories=args.categories, per_category=args.per_category,
                                             path=args.prompts_file))
    prompts = prompts[:args.prompts] if args.prompts else prompts

    tokenizer, target, drafter = harness.load_pair(args)
    clip = DRY_RUN_PROMPT_TOKENS if args.dry_run else None
    encoded = [encode(tokenizer, p, max_tokens=clip) for p in prompts]
    setup = Setup(args, tokenizer, target, drafter, max_seq_len=harness.capacity(encoded, args.max_new_tokens))
    harness.progress("warm-up (6 tokens per method)")
    runners = {}
    for key, (name, own, _) in configured.items():
        try:  # builds the method's engine: the models' own limits (vocabularies, shapes) show here
            runners[key] = METHODS[name][1](setup, own)
            runners[key](encoded[0][:32], 6)
        except ValueError as exc:
            print(f"{Path(sys.argv[0]).name}: error: method {key!r} ({labels[key]}) cannot run on these models: {exc}",
                  file=sys.stderr)
            sys.exit(2)

    path = harness.record_path(f"compare-{Path(args.target).name}-{args.dtype}", args)
    runs = [{key: {"seconds": [], "first_token_s": []} for key in methods} for _ in prompts]  # per prompt, per method
    progress = harness.Progress(args.rounds * len(prompts) * len(methods))
    for round_ in range(args.rounds):
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            shift = (round_ * len(prompts) + i) % len(methods)
            for key in methods[shift:] + methods[:shift]:
                begin = time.perf_counter()
                out = runners[key](ids, args.max_new_tokens)
                seconds = time.perf_counter() - begin
                run = runs[i][key]
                run["seconds"].append(seconds)
                run["first_token_s"].append(out.first_token_s)
                if round_ == 0:
                    run.update(tokens=len(out.tokens), output=out.tokens, **metrics_of(out.metrics))
                progress.step(f"round {round_ + 1}, prompt {i + 1}/{len(prompts)} [{prompt['category']}] "
                              f"{labels[key]}: {len(out.tokens) / seconds:.2f} tokens/s, first token after "
                              f"{out.first_token_s:.2f} s")
            if round_ == 0 and not args.temperature:
                runs[i]["reference"] = (runs[i]["hf"]["output"] if "hf" in runs[i]
                                        else Transformers(setup)(ids, args.max_new_tokens).tokens)
        summary = summarize(prompts, encoded, runs, methods, labels)
        harness.write_record(path, {"rounds_done": round_ + 1, "methods": labels, **summary}, args)

    models = "tiny random models (dry run)" if args.dry_run else f"{args.target} <- {args.drafter}"
    decoding = "greedy" if not args.temperature else ", ".join(
        f"{name} {value:g}" for name, value in sampling(args).items()
        if (name, value) not in (("top_k", 0), ("top_p", 1.0)))
    print(f"\n{models}, {args.dtype}, {decoding}, batch 1, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, median of {args.rounds} rounds per prompt")
    print_tables(summary, methods, labels)
    profile = []
    if args.profile:
        profile = profile_methods({key: runners[key] for key in methods if isinstance(runners[key], EngineMethod)},
                                  labels, encoded[0], args.max_new_tokens)
    harness.write_record(path, {"rounds_done": args.rounds, "methods": labels, **summary, "profile": profile}, args)
    harness.finish(path, args)


def metrics_of(metrics) -> dict:
    """What the JSON keeps of a csd_engine result's metrics (first round)."""
    if metrics is None:
        return {}
    return {"target_forwards": metrics.target_forwards,
            "acceptance_by_position": list(getattr(metrics, "acceptance_by_position", None) or [])}


def summarize(prompts, encoded, runs, methods, labels) -> dict:
    """Per prompt, per category and overall: tokens, seconds (per prompt the median over the
    rounds), tokens/s, the min and max of the rounds' tokens/s, speedup over "hf", seconds to the
    first token (per prompt the median over the rounds; over prompts their mean), mean accepted
    tokens, outputs equal to the reference (transformers' greedy text) and to csd's Autoregressive
    (where it ran), acceptance by draft position (mean over prompts)."""
    per_prompt = []
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        row = {"index": i, "category": prompt["category"], "prompt_tokens": len(ids)}
        greedy = "reference" in runs[i]  # sampled runs keep none
        for key in methods:
            run = runs[i][key]
            row[key] = {"tokens": run["tokens"], "seconds": run["seconds"],
                        "tokens_per_s": run["tokens"] / statistics.median(run["seconds"]),
                        "first_token_s": statistics.median(run["first_token_s"]),
                        # greedy runs: transformers' greedy output; csd's own plain decoding, what a
                        # lossless greedy method must reproduce (sampled runs: None, equal in distribution)
                        "identical": run["output"] == runs[i]["reference"] if greedy else None,
                        "same_as_ar": run["output"] == runs[i]["ar"]["output"] if greedy and "ar" in runs[i] else None,
                        "mean_accepted": (run["tokens"] / run["target_forwards"]
                                          if run.get("target_forwards") else None),
                        "acceptance_by_position": run.get("acceptance_by_position")}
        per_prompt.append(row)
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    per_category = {c: aggregate([r for r in per_prompt if r["category"] == c], runs, methods) for c in categories}
    overall = aggregate(per_prompt, runs, methods)
    rows = [{"method": labels[key], "key": key, **{k: v for k, v in overall[key].items()
                                                    if k != "acceptance_by_position"}} for key in methods]
    return {"prompts": [{"category": p["category"], "prompt_tokens": len(ids)} for p, ids in zip(prompts, encoded)],
            "rows": rows, "per_category": per_category, "overall": overall, "per_prompt": per_prompt}


def aggregate(rows: list[dict], runs, methods) -> dict:
    out = {}
    for key in methods:
        cells = [r[key] for r in rows]
        tokens = sum(c["tokens"] for c in cells)
        seconds = sum(statistics.median(c["seconds"]) for c in cells)
        rounds = min(len(c["seconds"]) for c in cells)
        by_round = [tokens / sum(c["seconds"][r] for c in cells) for r in range(rounds)]
        forwards = [runs[r["index"]][key].get("target_forwards") for r in rows]
        positions = [c["acceptance_by_position"] for c in cells if c["acceptance_by_position"]]
        out[key] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                    "min_tokens_per_s": min(by_round), "max_tokens_per_s": max(by_round),
                    "first_token_s": statistics.fmean(c["first_token_s"] for c in cells),
                    "mean_accepted": tokens / sum(forwards) if all(forwards) else None,
                    "identical": (f"{sum(c['identical'] for c in cells)}/{len(cells)}"
                                  if all(c["identical"] is not None for c in cells) else None),
                    "same_as_ar": (f"{sum(c['same_as_ar'] for c in cells)}/{len(cells)}"
                                   if all(c.get("same_as_ar") is not None for c in cells) else None),
                    "acceptance_by_position": mean_by_position(positions)}
    base = out.get("hf", {}).get("tokens_per_s")
    for cell in out.values():
        cell["speedup"] = cell["tokens_per_s"] / base if base else None
    return out


def mean_by_position(lists: list[list[float]]) -> list[float]:
    """Position-wise mean over the lists that reach each position."""
    width = max(map(len, lists), default=0)
    return [statistics.fmean(v[p] for v in lists if len(v) > p) for p in range(width)]


def print_tables(summary: dict, methods: list[str], labels: dict) -> None:
    rows = [{**row, "spread": harness.spread([row["min_tokens_per_s"], row["max_tokens_per_s"]])}
            for row in summary["rows"]]
    print_table(rows, [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".2f"), ("spread", "min-max", "s"),
                       ("speedup", "vs transformers", ".2f"), ("first_token_s", "first token s", ".2f"),
                       ("mean_accepted", "mean accepted", ".2f"), ("identical", "= greedy", "s"),
                       ("same_as_ar", "= csd AR", "s")])
    categories = summary["per_category"]
    print("\nper category: tokens/s (speedup over transformers generate)")
    matrix = []
    for key in methods:
        row = {"method": labels[key]}
        for category, cells in categories.items():
            cell = cells[key]
            row[category] = f"{cell['tokens_per_s']:.2f}" + (f" ({cell['speedup']:.2f}x)" if cell["speedup"] else "")
        matrix.append(row)
    counts = {c: sum(p["category"] == c for p in summary["prompts"]) for c in categories}
    print_table(matrix, [("method", "method", "s")] + [(c, f"{c} ({counts[c]})", "s") for c in categories])


def profile_methods(runners: dict, labels: dict, ids: list[int], max_new_tokens: int) -> list[dict]:
    """Milliseconds per target step spent in each part (bench.common.instrumented), first prompt.
    The instrumentation patches engine internals; where they have changed, a warning replaces the row."""
    from bench.common import Stopwatch, instrumented
    rows = []
    for key, method in runners.items():
        engine = method.engine
        try:
            stopwatch = Stopwatch(engine.device)
            with instrumented(engine, stopwatch):
                begin = time.perf_counter()
                metrics = method(ids, max_new_tokens).metrics
                seconds = time.perf_counter() - begin
        except Exception as exc:  # noqa: BLE001  the profile is optional; the timed results stand
            harness.progress(f"warning: no profile for {labels[key]} ({type(exc).__name__}: {exc})")
            continue
        steps = metrics.target_forwards
        parts = {part: s / steps * 1e3 for part, s in stopwatch.seconds.items()}
        row = dict(method=labels[key], ms_per_step=seconds / steps * 1e3, mean_accepted=metrics.mean_accepted_tokens,
                   **{f"{part}_ms": parts.get(part, 0.0)
                      for part in ("prefill", "target", "drafters", "verify", "sample", "mag")})
        # PEARL's concurrent rounds time the drafter beside the target: the parts overlap, so no remainder
        concurrent = getattr(getattr(method, "strategy", None), "overlap", None) is True
        row["other_ms"] = None if concurrent else row["ms_per_step"] - sum(parts.values())
        rows.append(row)
        harness.progress(f"profile {labels[key]}: {harness.figures(row['ms_per_step'])} ms per target step")
    if rows:
        print("\nwhere a target step's time goes (ms per target forward; first prompt; prefill spread over the steps; "
              "'other' is '-' where the drafter runs beside the target)")
        ms = harness.figures
        print_table(rows, [("method", "method", "s"), ("ms_per_step", "ms/step", ms),
                           ("mean_accepted", "MAT", ".2f"), ("prefill_ms", "prefill", ms), ("target_ms", "target", ms),
                           ("drafters_ms", "drafters", ms), ("verify_ms", "verify", ms), ("sample_ms", "sample", ms),
                           ("mag_ms", "MaG", ms), ("other_ms", "other", ms)])
    return rows


if __name__ == "__main__":
    harness.run(main)
