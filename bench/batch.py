"""Throughput by batch size: csd_engine's strategies over the same prompts with several rows
decoding at once, greedy, against Autoregressive at the same batch size.

    python bench/batch.py                                    # Qwen pair (int4 drafter) + MaG, batch 1, 2 and 4
    python bench/batch.py --batch-sizes 4,8 --prompts 16 --strategy speculative_auto
    python bench/batch.py --dry-run                          # tiny random models: proves it runs, in seconds

For each of --batch-sizes an engine of that many rows (target <- [--drafter with --quantize
weights, MaG]) generates
--prompts prompts of bench/prompts.json (round-robin over the categories, chat template) with
each --strategy (a name, or a JSON configuration as `serve --strategy-config` takes it;
Autoregressive is always measured first, the baseline): `engine.generate`, the rows refilled as
requests end (continuous batching), --max-new-tokens each, end of sequence ignored. Per round the
strategies run in a rotating order; tokens/s is all tokens over the median seconds of the
rounds, prefills included. "= AR": prompts whose tokens equal Autoregressive's at that batch
size (past 17 matrix rows a bf16 forward on the CPU takes torch's matmul, which rounds
otherwise: a near-tie can flip). JSON: bench/results/batch-*.json, saved after every batch size;
its picture: tokens/s over Autoregressive's per strategy and batch size.
"""
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/batch.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, order_by_category, print_table  # noqa: E402
from bench.serve import build_strategy  # noqa: E402

BASELINE = "autoregressive"
STRATEGIES = ["speculative_auto", "cascade_auto"]  # beside the baseline when --strategy is not given


def parser():
    ap = harness.parser(__doc__, dry_run={"prompts": 3, "batch_sizes": "1,2", "max_new_tokens": 8, "quantize": "none"},
                        target="qwen2.5-coder-1.5b", drafter="qwen2.5-coder-0.5b", dtype="bfloat16",
                        max_new_tokens=64, rounds=1, categories=None)
    ap.add_argument("--batch-sizes", type=harness.numbers(int, 1), default="1,2,4",
                    help="the engine's rows, comma-separated (default 1,2,4)")
    ap.add_argument("--quantize", choices=("none", "int8", "int4"), default="int4",
                    help="the drafter's weights, quantized at load (default int4, the README's main command)")
    ap.add_argument("--prompts", type=harness.positive_int, default=12,
                    help="prompts per strategy and batch size, round-robin over the categories (default 12)")
    ap.add_argument("--strategy", action="append", default=None,
                    help="a strategy name or a JSON configuration (repeatable; default: " + ", ".join(STRATEGIES)
                         + "); autoregressive is always measured")
    return ap


def check_args(ap, args) -> list[str]:
    """The strategies to measure, the baseline first, each built here once so that a bad one is
    refused before any model loads."""
    specs = [BASELINE] + [s for s in (args.strategy or STRATEGIES) if s != BASELINE]
    for spec in specs:
        try:
            harness.fits_drafters(build_strategy(spec, [args.drafter, "mag"]), [False, True])
        except ValueError as exc:
            ap.error(f"--strategy {spec}: {exc}")
    available = len(load_prompts(categories=args.categories))
    if args.prompts > available:
        ap.error(f"--prompts {args.prompts}: bench/prompts.json has {available}"
                 + (f" in --categories {args.categories}" if args.categories else ""))
    return specs


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    specs = check_args(ap, args)
    harness.start(args)
    work = tempfile.TemporaryDirectory(prefix="bench-batch-")
    target, drafter = args.target, args.drafter
    if args.dry_run:
        from bench.tiny import save_pair
        harness.progress(f"dry run: tiny random target and drafter instead of {args.target} and {args.drafter}")
        target, drafter = save_pair(work.name)
    drafter = drafter if args.quantize == "none" else f"{drafter}:{args.quantize}"
    tokenizer = harness.load_tokenizer(target if args.dry_run else harness.resolve_model(target))
    prompts = order_by_category(load_prompts(categories=args.categories))[:args.prompts]
    encoded = [encode(tokenizer, p, max_tokens=48 if args.dry_run else None) for p in prompts]
    params = csd_engine.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    path = harness.record_path(f"batch-{Path(args.target).name}-{args.dtype}", args)
    rows, progress = [], harness.Progress(len(args.batch_sizes) * args.rounds * len(specs))
    for batch in args.batch_sizes:
        harness.progress(f"batch {batch}: loading {args.target} <- {drafter} + MaG")
        engine = csd_engine.Engine(target, drafters=[drafter, "mag"], dtype=harness.DTYPES[args.dtype],
                                   max_batch_size=batch, max_seq_len=harness.capacity(encoded, args.max_new_tokens),
                                   tokenizer=tokenizer)
        engine.generate(encoded[:1], csd_engine.SamplingParams(max_new_tokens=2))  # warm-up
        seconds, outputs = {s: [] for s in specs}, {}
        for r in range(args.rounds):
            for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
                begin = time.perf_counter()
                results = engine.generate(encoded, params, strategy=build_strategy(spec, [drafter, "mag"]))
                seconds[spec].append(time.perf_counter() - begin)
                outputs[spec] = [res.token_ids for res in results]
                progress.step(f"batch {batch}, {spec}: {len(encoded) * args.max_new_tokens / seconds[spec][-1]:.2f} "
                              "tokens/s")
        tokens = len(encoded) * args.max_new_tokens
        baseline = tokens / harness.Timing(seconds[BASELINE]).median
        for spec in specs:
            per_s = tokens / harness.Timing(seconds[spec]).median
            same = sum(a == b for a, b in zip(outputs[spec], outputs[BASELINE]))
            rows.append({"batch": batch, "strategy": spec, "tokens_per_s": per_s, "speedup": per_s / baseline,
                         "same_as_ar": same, "same": f"{same}/{len(encoded)}", "seconds": seconds[spec]})
        del engine
        harness.write_record(path, {"rows": rows, "prompts": len(encoded)}, args)  # a run cut short keeps its sizes

    pair = "tiny random target <- drafter" if args.dry_run else f"{args.target} <- {args.drafter}"
    pair += f" ({args.quantize})" if args.quantize != "none" else ""
    print(f"\n{pair} + MaG, {args.dtype}, greedy, {len(encoded)} prompts x "
          f"{args.max_new_tokens} tokens, median of {args.rounds} round(s)")
    print_table(rows, [("batch", "batch", "d"), ("strategy", "strategy", "s"), ("tokens_per_s", "tokens/s", ".2f"),
                       ("speedup", "x AR", ".2f"), ("same", "= AR", "s")])
    harness.finish(path, args)
    work.cleanup()


if __name__ == "__main__":
    harness.run(main)
