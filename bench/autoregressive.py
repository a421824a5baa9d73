"""Autoregressive tokens/s: csd_engine's native runner against transformers' generate, same
model, same prompts, same dtype, greedy, batch 1.

    python bench/autoregressive.py --target smollm2-135m --max-new-tokens 64
    python bench/autoregressive.py --dry-run          # a tiny random model: proves it runs, in seconds

Each prompt is decoded by both, `--repeats` times, the first prompt after a warm-up run.
tokens/s: all tokens over the summed median seconds; min-max: the prompts' median tokens/s.
Text prompts are tokenized as they are (no chat template), chat prompts through the template.
JSON: bench/results/autoregressive-*.json, and its picture (tokens/s per method) beside it.
"""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/autoregressive.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import csd_engine  # noqa: E402
from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, print_table  # noqa: E402


def main(argv=None):
    ap = harness.parser(__doc__, dry_run={"prompts": 2, "max_new_tokens": 8}, target="smollm2-135m", dtype="float32",
                        max_new_tokens=64, repeats=1)
    ap.add_argument("--prompts", type=harness.positive_int, default=6,
                    help="how many prompts of bench/prompts.json, in file order (default 6)")
    args = ap.parse_args(argv)
    available = len(load_prompts())
    if args.prompts > available:
        ap.error(f"--prompts {args.prompts}: bench/prompts.json has {available}")
    harness.start(args)
    dtype = harness.DTYPES[args.dtype]
    tok = harness.load_tokenizer(args.target, args.dry_run)
    hf = harness.load_model(args.target, dtype, args.dry_run)
    prompts = [encode(tok, p, chat=False, max_tokens=48 if args.dry_run else None)
               for p in load_prompts(args.prompts)]
    # the engine loads its own copy (a tiny model is passed as it is)
    engine = csd_engine.Engine(target=hf if args.dry_run else harness.resolve_model(args.target), dtype=dtype,
                               max_batch_size=1, max_seq_len=harness.capacity(prompts, args.max_new_tokens),
                               tokenizer=tok)
    params = csd_engine.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def run_hf(ids):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                              min_new_tokens=args.max_new_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id)
        return out[0, len(ids):].tolist()

    def run_engine(ids):
        return engine.generate([ids], params)[0].token_ids

    methods = {"transformers generate": run_hf, "csd_engine native": run_engine}
    per_prompt, same = [], 0
    progress = harness.Progress(len(prompts) * len(methods))
    for i, ids in enumerate(prompts):
        outs, row = {}, {"prompt_tokens": len(ids)}
        for name, fn in methods.items():
            outs[name], timing = harness.repeat(lambda: fn(ids), args.repeats, warmup=int(i == 0))
            row[name] = {"tokens": len(outs[name]), "seconds": timing.seconds}
            progress.step(f"{name}: {len(outs[name]) / timing.median:.2f} tokens/s")
        same += outs["transformers generate"] == outs["csd_engine native"]
        per_prompt.append(row)

    rows = []
    for name in methods:
        tokens = sum(r[name]["tokens"] for r in per_prompt)
        seconds = sum(harness.Timing(r[name]["seconds"]).median for r in per_prompt)
        by_prompt = [r[name]["tokens"] / harness.Timing(r[name]["seconds"]).median for r in per_prompt]
        rows.append({"method": name, "tokens_per_s": tokens / seconds, "spread": harness.spread(by_prompt)})
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"\n{args.target}, {args.dtype}, greedy, batch 1, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats}")
    print_table(rows, [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".2f"),
                       ("spread", "min-max by prompt", "s"), ("speedup", "speedup", ".2f")])
    print(f"outputs identical: {same}/{len(prompts)}")
    path = harness.record_path(f"autoregressive-{Path(args.target).name}-{args.dtype}", args)
    harness.write_record(path, {"rows": rows, "identical_outputs": same, "prompts": len(prompts),
                                "per_prompt": per_prompt}, args)
    harness.finish(path, args)


if __name__ == "__main__":
    harness.run(main)
