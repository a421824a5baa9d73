"""What a forward of n new tokens costs against one, per model and dtype: the number that
decides whether speculative decoding can pay on a machine (a chain of k drafts needs the
(k+1)-token forward to cost little more than the 1-token one).

    .venv/bin/python -m bench.forward_cost                                   # Qwen 1.5B and 0.5B, fp32 + bf16
    .venv/bin/python -m bench.forward_cost --models smollm2-135m --dtypes float32

For each (model, dtype, n) it times the native runner's forward of n tokens after a
`--context`-token prefix (median of `--repeats`, after one warm-up) and transformers'
forward of the same tokens with its dynamic cache, for comparison. Prints a table and writes
bench/results/forward-cost.json.
"""
import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from bench.common import print_table, progress, resolve_model, write_json
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.runner import ForwardBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ns", default="1,2,3,5,9,17")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = [int(n) for n in args.ns.split(",")]
    rows = []
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            progress(f"loading {name} ({dtype_name})")
            model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).eval()
            runner = LlamaRunner(model, "cpu", dtype)
            runner.allocate(1, args.context + max(ns) + 8)
            prefix = torch.randint(0, runner.vocab_size, (1, args.context))
            runner(ForwardBatch.chain(prefix, runner.cache.lengths, args.context, need_logits=False))
            with torch.inference_mode():
                hf_cache = DynamicCache()
                model(prefix, past_key_values=hf_cache, use_cache=True)
            base = {}
            for n in ns:
                ids = torch.randint(0, runner.vocab_size, (1, n))

                def native():
                    runner.cache.lengths.fill_(args.context)
                    return runner(ForwardBatch.chain(ids, runner.cache.lengths, args.context + n))

                def hf():
                    with torch.inference_mode():
                        model(ids, past_key_values=hf_cache, use_cache=True)
                    hf_cache.crop(args.context)

                t_native, t_hf = median_seconds(native, args.repeats), median_seconds(hf, args.repeats)
                base.setdefault("native", t_native)
                base.setdefault("hf", t_hf)
                rows.append(dict(model=name, dtype=dtype_name, n=n, native_ms=t_native * 1e3,
                                 native_vs_1=t_native / base["native"], hf_ms=t_hf * 1e3, hf_vs_1=t_hf / base["hf"]))
                progress(f"{name} {dtype_name} n={n}: native {t_native * 1e3:.0f} ms, transformers {t_hf * 1e3:.0f} ms")
            del model, runner
    print(f"\nforward of n new tokens after a {args.context}-token prefix, batch 1 (median of {args.repeats})")
    print_table(rows, [("model", "model", "s"), ("dtype", "dtype", "s"), ("n", "n", "d"),
                       ("native_ms", "native ms", ".0f"), ("native_vs_1", "x n=1", ".2f"),
                       ("hf_ms", "transformers ms", ".0f"), ("hf_vs_1", "x n=1", ".2f")])
    write_json("forward-cost", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
