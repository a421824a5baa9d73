"""What a forward of n new tokens costs against one, per model and dtype: the number that
decides whether speculative decoding can pay on a machine (a chain of k drafts needs the
(k+1)-token forward to cost little more than the 1-token one).

    python bench/forward_cost.py                                   # Qwen 1.5B and 0.5B, fp32 + bf16
    python bench/forward_cost.py --models smollm2-135m --dtypes float32
    python bench/forward_cost.py --dry-run                         # a tiny random model, seconds

`--drafters` adds cheaper drafters by spec (quantized weights, early exits: load_runner's
`:int8` / `:int4` / `[:L]` suffixes), native runner only; "x target" is a row's time over the
first model's one-token forward in the same dtype. The greedy-agreement table of docs/measurements.md
came from this script's version in commit 3b771e0 (`--agreement`).

For each (model, dtype, n) every path of PATHS (csd_engine's native runner; transformers'
forward with its dynamic cache, for comparison; `--paths` picks some) times a forward of n tokens
after a `--context`-token prefix: median and min-max of `--repeats` calls after one warm-up. The
calls are interleaved (each repeat sweeps every n and path once), so a machine's drift falls on
every width alike instead of bending the curve. A new
path (a quantized or early-exit drafter, say) is one more entry in PATHS; "native,
batch-invariant" is the runner of Engine(batch_invariant=True), to price that mode; "native,
PyTorch ops" the runner without its fused ops (fused=False: on the CPU the C++ layer ops of
csrc/decode_cpu.cpp, drafters too); "native, torch matmul" the runner with csd_engine's bf16
CPU kernel switched off (CSD_BF16_LINEAR=0: torch's matmul, oneDNN's, for every width), to
see where the kernel pays on a CPU. Prints a table and
writes bench/results/forward-cost-*.json.
"""
import contextlib
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/forward_cost.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench import harness  # noqa: E402
from bench.common import print_table  # noqa: E402
from csd_engine import ops  # noqa: E402
from csd_engine.models.llama import LlamaRunner  # noqa: E402
from csd_engine.models.loader import load_runner, split_spec  # noqa: E402
from csd_engine.models.quant import drafter_dense_rows  # noqa: E402
from csd_engine.models.runner import ForwardBatch  # noqa: E402


def native(model, dtype: torch.dtype, prefix: torch.Tensor, max_n: int, batch_invariant: bool = False,
           fused: bool | None = None):
    """csd_engine's native runner: static cache, rolled back to the prefix by a length update."""
    context = prefix.shape[1]
    runner = LlamaRunner(model, "cpu", dtype, fused=fused)
    if batch_invariant:
        runner.make_batch_invariant()
    runner.allocate(1, context + max_n + 8)
    runner(ForwardBatch.chain(prefix, runner.cache.lengths, context, need_logits=False))

    def forward(ids):
        runner.cache.lengths.fill_(context)
        return runner(ForwardBatch.chain(ids, runner.cache.lengths, context + ids.shape[1]))
    return forward


@contextlib.contextmanager
def bf16_kernel(enabled: bool):
    """csd_engine's bf16 CPU kernel on or off inside (CSD_BF16_LINEAR), as it was afterwards."""
    before = os.environ.get("CSD_BF16_LINEAR")
    os.environ["CSD_BF16_LINEAR"] = "1" if enabled else "0"
    ops.bf16_kernel_pays.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["CSD_BF16_LINEAR"]
        else:
            os.environ["CSD_BF16_LINEAR"] = before
        ops.bf16_kernel_pays.cache_clear()


def torch_matmul(model, dtype: torch.dtype, prefix: torch.Tensor, max_n: int):
    """The native runner with every bf16 matmul on torch's op (the kernel off for its calls)."""
    with bf16_kernel(False):
        forward = native(model, dtype, prefix, max_n)

    def off(ids):
        with bf16_kernel(False):
            return forward(ids)
    return off


def transformers_dynamic(model, dtype: torch.dtype, prefix: torch.Tensor, max_n: int):
    """transformers' own forward with its dynamic cache, cropped back to the prefix after each call."""
    context, cache = prefix.shape[1], DynamicCache()
    with torch.inference_mode():
        model(prefix, past_key_values=cache, use_cache=True)

    def forward(ids):
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
        cache.crop(context)
    return forward


# key -> (column label, builder(model, dtype, prefix, max_n) -> forward(ids)); each row gets
# KEY_ms (median), KEY_min_ms, KEY_max_ms and KEY_vs_1 (median / the n = 1 median, --ns has 1)
PATHS = {
    "native": ("native", native),
    "invariant": ("native, batch-invariant", lambda *a: native(*a, batch_invariant=True)),
    "plain": ("native, PyTorch ops", lambda *a: native(*a, fused=False)),  # no fused norm / RoPE / attention ops
    "torch-matmul": ("native, torch matmul", torch_matmul),
    "hf": ("transformers", transformers_dynamic),
}


def timed_rows(key: dict, forwards: dict, vocab: int, ns: list[int], repeats: int) -> list[dict]:
    """One row per n (`ns` holds 1: the times are also given relative to it): every forward of
    `forwards` (path key -> forward(ids)) after one warm-up call per (n, path), then `repeats`
    rounds that each time every n and path once, in that order."""
    ids = {n: torch.randint(0, vocab, (1, n)) for n in ns}
    seconds = {(n, path): [] for n in ns for path in forwards}
    for n in ns:
        for forward in forwards.values():
            forward(ids[n])
    for _ in range(max(repeats, 1)):
        for n in ns:
            for path, forward in forwards.items():
                _, timing = harness.repeat(lambda: forward(ids[n]), 1, warmup=0)
                seconds[n, path] += timing.seconds
    rows = []
    for n in ns:
        row = dict(key, n=n)
        for path in forwards:
            timing = harness.Timing(seconds[n, path])
            one = harness.Timing(seconds[1, path])
            row.update({f"{path}_ms": timing.median * 1e3, f"{path}_min_ms": timing.min * 1e3,
                        f"{path}_max_ms": timing.max * 1e3, f"{path}_vs_1": timing.median / one.median})
        rows.append(row)
    return rows


def main(argv=None):
    ap = harness.parser(__doc__, dry_run={"models": "tiny", "ns": "1,3", "context": 16, "repeats": 1}, repeats=5)
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b",
                    help="comma-separated zoo names or folders (default qwen2.5-coder-1.5b,qwen2.5-coder-0.5b)")
    ap.add_argument("--dtypes", type=harness.names(harness.DTYPES), default="float32,bfloat16",
                    help=f"comma-separated, out of {', '.join(harness.DTYPES)} (default float32,bfloat16)")
    ap.add_argument("--ns", type=harness.numbers(int, 1), default="1,2,3,5,9,17",
                    help="new tokens per forward, comma-separated; 1 among them (the times are relative to it; "
                         "default 1,2,3,5,9,17)")
    ap.add_argument("--context", type=harness.positive_int, default=128,
                    help="tokens already in the cache (default 128)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated keys of {', '.join(PATHS)} (default all)")
    ap.add_argument("--drafters", default="",
                    help="drafter specs, e.g. qwen2.5-coder-0.5b:int4,qwen2.5-coder-0.5b[:20] (default none)")
    ap.add_argument("--packed-only", action="store_true",
                    help="quantized drafters without the engine's dense copies for wide calls (the packed op at every "
                         "width; models/quant.py)")
    args = ap.parse_args(argv)
    ns = args.ns
    if 1 not in ns:
        ap.error(f"--ns must include 1: every width is timed relative to the one-token forward; got "
                 f"{','.join(map(str, ns))}")
    keys = args.paths.split(",")
    if "native" not in keys or set(keys) - set(PATHS):
        ap.error(f"--paths must name native (the x-target column's) and only keys of {', '.join(PATHS)}; "
                 f"got {args.paths!r}")
    if not args.dry_run:
        for name in args.models.split(","):
            ap.check_model(name, "--models")
        for spec in filter(None, args.drafters.split(",")):
            try:
                ap.check_model(split_spec(spec)[0], "--drafters")
            except ValueError as exc:  # a bad :int4 / [:L] suffix
                ap.error(f"--drafters {spec}: {exc}")
    harness.start(args)
    paths = {key: PATHS[key] for key in keys}
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes:
            dtype = harness.DTYPES[dtype_name]
            harness.progress(f"loading {name} ({dtype_name})" + (": a tiny random model (dry run)" if args.dry_run
                                                                   else ""))
            model = harness.load_model(name, dtype, args.dry_run)
            prefix = torch.randint(0, model.config.vocab_size, (1, args.context))
            forwards = {key: build(model, dtype, prefix, max(ns)) for key, (_, build) in paths.items()}
            rows += timed_rows(dict(model=name, dtype=dtype_name), forwards, model.config.vocab_size, ns, args.repeats)
            harness.progress(f"{name} {dtype_name}, native: " + ", ".join(
                f"n={row['n']} {harness.figures(row['native_ms'])} ms" for row in rows[-len(ns):]))
            del model, forwards
    for spec in filter(None, args.drafters.split(",")):
        for dtype_name in args.dtypes:
            harness.progress(f"loading drafter {spec} ({dtype_name})")
            # default: as the engine builds a drafter
            dense_rows = 0 if args.packed_only else drafter_dense_rows("cpu", harness.DTYPES[dtype_name],
                                                                         split_spec(spec)[1])
            forwards = {}
            for key in [k for k in ("native", "plain") if k in keys]:  # the other paths are the target's
                runner, _ = load_runner(spec, "cpu", harness.DTYPES[dtype_name], native=True, dense_rows=dense_rows,
                                        fused=None if key == "native" else False)
                prefix = torch.randint(0, runner.vocab_size, (1, args.context))
                runner.allocate(1, args.context + max(ns) + 8)
                runner(ForwardBatch.chain(prefix, runner.cache.lengths, args.context, need_logits=False))

                def forward(ids, runner=runner):
                    runner.cache.lengths.fill_(args.context)
                    return runner(ForwardBatch.chain(ids, runner.cache.lengths, args.context + ids.shape[1]))
                forwards[key] = forward
            rows += timed_rows(dict(model=spec, dtype=dtype_name), forwards, runner.vocab_size, ns, args.repeats)
            del runner, forward, forwards
    for row in rows:
        # the first model's 1-token forward
        target = next(r for r in rows if r["dtype"] == row["dtype"] and r["n"] == 1)
        row["x_target"] = row["native_ms"] / target["native_ms"]
    for row in rows:
        for key in paths:
            if f"{key}_ms" in row:
                row[f"{key}_spread"] = harness.spread([row[f"{key}_min_ms"], row[f"{key}_max_ms"]], harness.figures)
    print(f"\nforward of n new tokens after a {args.context}-token prefix, batch 1 (median of {args.repeats})")
    columns = [("model", "model", "s"), ("dtype", "dtype", "s"), ("n", "n", "d")]
    for key, (label, _) in paths.items():
        columns += [(f"{key}_ms", f"{label} ms", harness.figures), (f"{key}_spread", "min-max", "s"),
                    (f"{key}_vs_1", "x n=1", ".2f")]
    columns.append(("x_target", "native x target", ".2f"))
    print_table(rows, columns)
    path = harness.record_path("forward-cost", args)
    harness.write_record(path, {"paths": {key: label for key, (label, _) in paths.items()}, "rows": rows}, args)
    harness.finish(path, args)


if __name__ == "__main__":
    harness.run(main)
