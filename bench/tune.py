"""Cascade.auto() against a grid search of K matrices and lenience, on the Qwen pair.

    python bench/tune.py                         # 1.5B <- 0.5B <- MaG, bf16, 3 prompts x 48 tokens
    python bench/tune.py --prompts 2 --max-new-tokens 32 --quick
    python bench/tune.py --dry-run               # tiny random models, one point of each kind: proves it runs
    python bench/tune.py --quantize int4 --a 2,4,6 --b 2,4,8 --m 4 --lenience-values 2,3
                                                 # an int4 drafter, a grid of your own

Every configuration decodes the same prompts (greedy, batch 1, `--repeats` runs each, median
kept, after a warm-up); the grid covers K = [[a, b], [0, m]] (a tokens from the 0.5B drafter,
then b from MaG; the drafter reviews m MaG tokens at a time) and lenience, plus
Speculative(0.5B, k) and Cascade with MaG alone. Cascade.auto() runs with no configuration
given: its rows choose their budgets from what they count while decoding, which its measured
time includes. The table ends with auto's tokens/s as a fraction of the best grid point's. Grid
points whose K could not decode (a = b = 0: the target would get no draft) are skipped, and said
so. The JSON goes to bench/results/tune-*.json, its picture (tokens/s per configuration,
Cascade.auto() highlighted) beside it. A dry run cuts each part of the quick grid that the
command line leaves out (--a, --b, --m, --lenience-values; Speculative's k, MaG-only's K) to its
first value; the values given, or the whole quick grid with --quick, run as given.
"""
import itertools
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/tune.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, order_by_category, print_table  # noqa: E402
from csd_engine import Cascade, SamplingParams, Speculative  # noqa: E402


# the grid's values: Speculative's k, MaG-only K=[[m]], and the cascade's a, b, m and lenience
QUICK = {"k": (2, 4), "mag": (8,), "a": (2, 4), "b": (2, 6), "m": (4,), "lenience": (1.0, 2.0)}
FULL = {"k": (2, 4, 6), "mag": (4, 8, 16), "a": (2, 4, 6), "b": (0, 4, 8), "m": (4, 8), "lenience": (1.0, 2.0)}


def grid_size(values: dict) -> int:
    """Configurations in a default grid: Speculative's, MaG-only's, then the cascade's product."""
    return len(values["k"]) + len(values["mag"]) + math.prod(len(values[key]) for key in ("a", "b", "m", "lenience"))


def grid(args, first_only: bool = False) -> tuple[list[tuple[str, object, bool]], list[str]]:
    """(configurations, skipped). Configurations: (label, strategy, uses the MaG-only engine):
    Speculative and MaG-only points, then the cascade's K = [[a, b], [0, m]] x lenience (the
    options' values, or the quick or full default grid; `first_only`: the default grid's first
    value of each, a dry run's few points). Skipped: the cascade points that could not decode
    with [0.5B, MaG] (a = b = 0 drafts nothing), each with the reason. A value no strategy takes
    (lenience < 1, m = 0) is a ValueError."""
    drafter = f"0.5B {args.quantize}" if args.quantize else "0.5B"
    values = {key: v[:1] if first_only else v for key, v in (QUICK if args.quick else FULL).items()}
    configs = [(f"Speculative({drafter}, k={k})", Speculative(k=k, drafter=0), False) for k in values["k"]]
    configs += [(f"Cascade(MaG, K=[[{m}]])", Cascade(k_matrix=[[m]], mag_tokens=m), True) for m in values["mag"]]
    given = (args.a, args.b, args.m, args.lenience_values)
    skipped = []
    cascade = [g or values[key] for g, key in zip(given, ("a", "b", "m", "lenience"))]
    for a, b, m, lenience in itertools.product(*cascade):
        strategy = Cascade(k_matrix=[[a, b], [0, m]], lenience=lenience, mag_tokens=m)
        label = f"Cascade({drafter}+MaG, K=[[{a},{b}],[0,{m}]], l={lenience:g})"
        try:
            harness.fits_drafters(strategy, [False, True])
        except ValueError as exc:
            skipped.append(f"{label}: {exc}")
            continue
        configs.append((label, strategy, False))
    return configs, skipped


def main(argv=None):
    ap = harness.parser(__doc__, dry_run={"quick": True, "prompts": 1, "max_new_tokens": 8},
                        target="qwen2.5-coder-1.5b", drafter="qwen2.5-coder-0.5b", dtype="bfloat16",
                        max_new_tokens=48, repeats=1, prompts_file=None)
    ap.add_argument("--prompts", type=harness.positive_int, default=3,
                    help="prompts from bench/prompts.json (one per category first; default 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a small grid: {grid_size(QUICK)} configurations instead of {grid_size(FULL)} "
                         "(Autoregressive and Cascade.auto() run beside either); --a, --b, --m and --lenience-values "
                         "replace their part of it")
    ap.add_argument("--quantize", default=None, choices=("int8", "int4"), help="the drafter's weights (default bf16)")
    ap.add_argument("--a", type=harness.numbers(int, 0), default=None,
                    help="comma-separated values of a: the 0.5B's tokens per draft")
    ap.add_argument("--b", type=harness.numbers(int, 0), default=None,
                    help="comma-separated values of b: MaG's tokens after the 0.5B's")
    ap.add_argument("--m", type=harness.numbers(int, 1), default=None,
                    help="comma-separated values of m: MaG tokens the 0.5B reviews at a time")
    ap.add_argument("--lenience-values", type=harness.numbers(float, 1), default=None,
                    help="comma-separated lenience values")
    args = ap.parse_args(argv)
    try:  # a dry run: the options left out take one value each (the default grid's first)
        configs, skipped = grid(args, first_only=args.dry_run and "quick" not in ap.given)
    except ValueError as exc:
        ap.error(f"bad grid values: {exc}")
    if not any(label.startswith("Cascade(0.5B") for label, _, _ in configs):
        ap.error(f"no cascade grid point can decode: {skipped[0]}"
                 + (f" (and {len(skipped) - 1} more points)" if len(skipped) > 1 else ""))
    available = len(load_prompts(path=args.prompts_file))
    if args.prompts > available:
        ap.error(f"--prompts {args.prompts}: there are {available} prompts")
    harness.start(args)
    for reason in skipped:
        harness.progress(f"skipping {reason}")
    dtype = harness.DTYPES[args.dtype]
    tok, target, drafter = harness.load_pair(args)
    if args.quantize:
        drafter = harness.quantized_drafter(drafter, target.device, dtype, args.quantize, args.dry_run)
    prompts = order_by_category(load_prompts(path=args.prompts_file))[:args.prompts]
    encoded = [encode(tok, p, max_tokens=48 if args.dry_run else None) for p in prompts]
    capacity = harness.capacity(encoded, args.max_new_tokens)
    engine = csd_engine.Engine(target, drafters=[drafter, "mag"], dtype=dtype, max_batch_size=1, max_seq_len=capacity,
                               tokenizer=tok)
    engine_mag = csd_engine.Engine(engine.target, drafters=["mag"], dtype=dtype, max_batch_size=1,
                                   max_seq_len=capacity, tokenizer=tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    reference = [engine.generate([ids], params)[0].token_ids for ids in encoded]  # plain greedy (also a warm-up)
    progress = harness.Progress(len(configs) + 2)

    def measure(label, strategy, mag_only):
        eng = engine_mag if mag_only else engine
        eng.generate([encoded[0][:32]], SamplingParams(max_new_tokens=6, ignore_eos=True), strategy=strategy)
        tokens = forwards = identical = 0
        timings = []
        for ids, ref in zip(encoded, reference):
            result, timing = harness.repeat(lambda: eng.generate([ids], params, strategy=strategy)[0], args.repeats,
                                            warmup=0)
            timings.append(timing)
            tokens += len(result.token_ids)
            forwards += result.metrics.target_forwards
            identical += result.token_ids == ref
        by_repeat = [tokens / sum(t.seconds[r] for t in timings) for r in range(args.repeats)]
        row = dict(config=label, tokens_per_s=tokens / sum(t.median for t in timings),
                   spread=harness.spread(by_repeat), mean_accepted=tokens / forwards,
                   identical=f"{identical}/{len(encoded)}")
        progress.step(f"{label}: {row['tokens_per_s']:.2f} tokens/s, MAT {row['mean_accepted']:.2f}")
        return row

    rows = [measure(label, strategy, mag_only) for label, strategy, mag_only in configs]
    ar = measure("Autoregressive", csd_engine.Autoregressive(), False)
    auto = measure("Cascade.auto()", Cascade.auto(), False)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    rows.sort(key=lambda r: -r["tokens_per_s"])
    for row in rows + [ar, auto]:
        row["vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
        row["of_best"] = row["tokens_per_s"] / best["tokens_per_s"]
    drafter_name = f"{args.drafter} ({args.quantize})" if args.quantize else args.drafter
    print(f"\n{args.target} <- {drafter_name} (<- MaG), {args.dtype}, greedy, batch 1, {len(encoded)} prompts x "
          f"{args.max_new_tokens} tokens; grid sorted by tokens/s, then Autoregressive and Cascade.auto()")
    print_table(rows + [ar, auto], [("config", "configuration", "s"), ("tokens_per_s", "tokens/s", ".2f"),
                                    ("spread", "min-max", "s"), ("vs_ar", "vs AR", ".2f"), ("of_best", "of best", ".2f"),
                                    ("mean_accepted", "MAT", ".2f"), ("identical", "= greedy", "s")])
    print(f"\nCascade.auto() reaches {auto['of_best']:.0%} of the best grid point ({best['config']})")
    if skipped:
        print(f"skipped {len(skipped)} grid points that could not decode: " + "; ".join(skipped))
    path = harness.record_path(f"tune-{Path(args.target).name}-{args.dtype}", args)
    harness.write_record(path, {"rows": rows, "autoregressive": ar, "auto": auto, "best": best, "skipped": skipped},
                         args)
    harness.finish(path, args)


if __name__ == "__main__":
    harness.run(main)
