"""Autoregressive tokens/s: csd_engine's native runner against transformers' generate,
same model, same prompts, same dtype, greedy, batch 1, one run.

    .venv/bin/python bench/autoregressive.py --model smollm2-135m --max-new-tokens 64
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import csd_engine
from bench.common import load_prompts, print_table, progress, resolve_model, write_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6, help="how many prompts of bench/prompts.json")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    path = resolve_model(args.model)
    prompts = [p["prompt"] for p in load_prompts(args.prompts)]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    engine = csd_engine.Engine(target=path, dtype=dtype, max_batch_size=1, max_seq_len=1024)
    params = csd_engine.SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def run_hf(ids):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                              min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()

    def run_engine(ids):
        return engine.generate([ids], params)[0].token_ids

    progress("warm-up")
    warm = tok(prompts[0])["input_ids"]
    run_hf(warm), run_engine(warm)
    totals = {"transformers generate": [0, 0.0], "csd_engine native": [0, 0.0]}
    same = 0
    for i, prompt in enumerate(prompts):
        ids = tok(prompt)["input_ids"]
        outs = {}
        for name, fn in (("transformers generate", run_hf), ("csd_engine native", run_engine)):
            t = time.perf_counter()
            outs[name] = fn(ids)
            totals[name][0] += len(outs[name])
            totals[name][1] += time.perf_counter() - t
        same += outs["transformers generate"] == outs["csd_engine native"]
        progress(f"prompt {i + 1}/{len(prompts)} done")
    base = totals["transformers generate"][0] / totals["transformers generate"][1]
    rows = [{"method": name, "tokens_per_s": n / t, "speedup": (n / t) / base} for name, (n, t) in totals.items()]
    print(f"\n{args.model}, {args.dtype}, greedy, batch 1, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print_table(rows, [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".2f"), ("speedup", "speedup", ".2f")])
    print(f"outputs identical: {same}/{len(prompts)}")
    write_json(f"autoregressive-{args.model}-{args.dtype}", {"args": vars(args), "rows": rows,
                                                              "identical_outputs": same, "prompts": len(prompts)},
               args.out)


if __name__ == "__main__":
    main()
