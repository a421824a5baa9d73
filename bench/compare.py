"""Decoding methods side by side on one target/drafter pair, greedy, same prompts, one run.

    .venv/bin/python bench/compare.py                      # Qwen2.5-Coder 1.5B <- 0.5B, bf16
    .venv/bin/python bench/compare.py --prompts 5 --max-new-tokens 64 --methods hf,ar,spec-mag,cascade-mag

Prints a table (tokens/s, speedup over transformers' plain generate, mean accepted tokens,
whether the output equals plain greedy decoding) and writes bench/results/compare-*.json.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import csd_engine
from bench.common import Stopwatch, instrumented, load_prompts, print_table, progress, resolve_model, write_json
from csd_engine import Autoregressive, Cascade, Pearl, SamplingParams, Speculative, Staged

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = ("hf", "hf-assisted", "hf-lookup", "ar", "spec-model", "spec-mag", "cascade", "cascade-tree", "cascade-mag",
           "cascade-auto", "staged", "pearl")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--prompts", type=int, default=5, help="prompts from bench/prompts.json (one per category first)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--k", type=int, default=4, help="draft length of Speculative with the 0.5B drafter")
    ap.add_argument("--k-mag", type=int, default=6, help="draft length of Speculative with MaG")
    ap.add_argument("--k-matrix", default="[[2,4],[0,4]]",
                    help="Cascade 1.5B <- 0.5B <- MaG (default: bench/tune.py's best on this CPU)")
    ap.add_argument("--tree", default="[3,2]", help="candidates per depth of cascade-tree's top-level tree")
    ap.add_argument("--k-mag-matrix", default="[[8]]", help="Cascade 1.5B <- MaG")
    ap.add_argument("--lenience", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one instrumented run per csd_engine method on the first prompt: "
                         "time per target step in the target, drafters, verification, MaG and the rest")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import json
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    dtype = DTYPES[args.dtype]

    progress(f"loading {args.target} and {args.drafter} ({args.dtype})")
    tpath, dpath = resolve_model(args.target), resolve_model(args.drafter)
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype).eval()
    drafter = AutoModelForCausalLM.from_pretrained(dpath, dtype=dtype).eval()
    # The engine's native runners share these weight tensors (same dtype and device: no copy).
    engine = csd_engine.Engine(target, drafters=[drafter, "mag"], dtype=dtype, max_batch_size=1,
                               max_seq_len=1024, tokenizer=tok)
    engine_mag = csd_engine.Engine(engine.target, drafters=["mag"], dtype=dtype, max_batch_size=1,
                                   max_seq_len=1024, tokenizer=tok)
    strategies = {
        "ar": (engine, Autoregressive()),
        "spec-model": (engine, Speculative(k=args.k, drafter=0)),
        "spec-mag": (engine, Speculative(k=args.k_mag, drafter=1)),
        "cascade": (engine, Cascade(k_matrix=json.loads(args.k_matrix), lenience=args.lenience, mag_tokens=4)),
        "cascade-tree": (engine, Cascade(k_matrix=json.loads(args.k_matrix), lenience=args.lenience, mag_tokens=4,
                                         tree=tuple(json.loads(args.tree)))),
        "cascade-mag": (engine_mag, Cascade(k_matrix=json.loads(args.k_mag_matrix), mag_tokens=8)),
        "cascade-auto": (engine, Cascade.auto()),
        "staged": (engine, Staged(branching=(3, 2, 1, 1), drafter=0, mag_tokens=2)),
        "pearl": (engine, Pearl(gamma=args.k, drafter=0)),
    }
    names = {"hf": "transformers generate", "hf-assisted": "transformers assisted (0.5B)",
             "hf-lookup": "transformers prompt lookup", "ar": "csd_engine Autoregressive",
             "spec-model": f"csd_engine Speculative(0.5B, k={args.k})",
             "spec-mag": f"csd_engine Speculative(MaG, k={args.k_mag})",
             "cascade": f"csd_engine Cascade(0.5B+MaG, K={args.k_matrix}, l={args.lenience:g})",
             "cascade-tree": f"csd_engine Cascade(same, tree={args.tree})",
             "cascade-mag": f"csd_engine Cascade(MaG, K={args.k_mag_matrix})",
             "cascade-auto": "csd_engine Cascade.auto()",
             "staged": "csd_engine Staged(0.5B tree 3,2,1,1 + 2 MaG)", "pearl": f"csd_engine Pearl(0.5B, gamma={args.k})"}

    def hf_run(ids, n=args.max_new_tokens, **extra):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id, **extra)
        return out[0, len(ids):].tolist(), None

    def engine_run(name, ids, n=args.max_new_tokens):
        eng, strategy = strategies[name]
        r = eng.generate([ids], SamplingParams(max_new_tokens=n, ignore_eos=True), strategy=strategy)[0]
        return r.token_ids, r.metrics

    runners = {"hf": lambda ids, **kw: hf_run(ids, **kw),
               "hf-assisted": lambda ids, **kw: hf_run(ids, assistant_model=drafter, **kw),
               "hf-lookup": lambda ids, **kw: hf_run(ids, prompt_lookup_num_tokens=10, **kw)}
    for name in strategies:
        runners[name] = (lambda key: lambda ids, **kw: engine_run(key, ids, **kw))(name)

    prompts = order_by_category(load_prompts())[:args.prompts]
    encoded = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    progress("warm-up (a few tokens per method)")
    for name in methods:
        runners[name](encoded[0][:32], n=6)

    stats = {name: {"tokens": 0, "seconds": 0.0, "identical": 0, "forwards": 0} for name in methods}
    per_prompt = []
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        reference = None
        row = {"category": p["category"], "prompt_tokens": len(ids)}
        for name in methods:
            t0 = time.perf_counter()
            out, metrics = runners[name](ids)
            dt = time.perf_counter() - t0
            if reference is None:
                reference = out if name == "hf" else hf_run(ids)[0]
            s = stats[name]
            s["tokens"] += len(out)
            s["seconds"] += dt
            s["identical"] += out == reference
            s["forwards"] += metrics.target_forwards if metrics else len(out)
            row[name] = {"tokens_per_s": len(out) / dt, "identical": out == reference,
                         "mean_accepted": len(out) / metrics.target_forwards if metrics else None}
            progress(f"prompt {i + 1}/{len(prompts)} [{p['category']}] {names[name]}: {len(out) / dt:.2f} tok/s"
                     + (f", MAT {len(out) / metrics.target_forwards:.2f}" if metrics else ""))
        per_prompt.append(row)

    base = stats["hf"]["tokens"] / stats["hf"]["seconds"] if "hf" in stats else None
    rows = []
    for name in methods:
        s = stats[name]
        tps = s["tokens"] / s["seconds"]
        rows.append({"method": names[name], "key": name, "tokens_per_s": tps,
                     "speedup": tps / base if base else None,
                     "mean_accepted": s["tokens"] / s["forwards"] if name in strategies else None,
                     "identical": f"{s['identical']}/{len(prompts)}"})
    print(f"\n{args.target} <- {args.drafter}, {args.dtype}, greedy, batch 1, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens")
    print_table(rows, [("method", "method", "s"), ("tokens_per_s", "tokens/s", ".2f"),
                       ("speedup", "vs transformers", ".2f"), ("mean_accepted", "mean accepted", ".2f"),
                       ("identical", "= greedy", "s")])
    profile = profile_methods([m for m in methods if m in strategies], strategies, names, encoded[0],
                              args.max_new_tokens) if args.profile else []
    write_json(f"compare-{args.target}-{args.dtype}", {"args": vars(args), "rows": rows, "per_prompt": per_prompt,
                                                         "profile": profile}, args.out)


def profile_methods(methods, strategies, names, ids, max_new_tokens) -> list[dict]:
    """Milliseconds per target step spent in each part (bench.common.instrumented), first prompt."""
    rows = []
    for name in methods:
        engine, strategy = strategies[name]
        stopwatch = Stopwatch(engine.device)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        with instrumented(engine, stopwatch):
            start = time.perf_counter()
            result = engine.generate([ids], params, strategy=strategy)[0]
            seconds = time.perf_counter() - start
        steps = result.metrics.target_forwards
        parts = {part: s / steps * 1e3 for part, s in stopwatch.seconds.items()}
        row = dict(method=names[name], ms_per_step=seconds / steps * 1e3, mean_accepted=result.metrics.mean_accepted_tokens,
                   **{f"{part}_ms": parts.get(part, 0.0)
                      for part in ("prefill", "target", "drafters", "verify", "sample", "mag")})
        row["other_ms"] = row["ms_per_step"] - sum(parts.values())
        rows.append(row)
        progress(f"profile {names[name]}: {row['ms_per_step']:.0f} ms per target step")
    print("\nwhere a target step's time goes (ms per target forward; first prompt; prefill spread over the steps)")
    print_table(rows, [("method", "method", "s"), ("ms_per_step", "ms/step", ".0f"), ("mean_accepted", "MAT", ".2f"),
                       ("prefill_ms", "prefill", ".0f"), ("target_ms", "target", ".0f"), ("drafters_ms", "drafters", ".0f"),
                       ("verify_ms", "verify", ".1f"), ("sample_ms", "sample", ".1f"), ("mag_ms", "MaG", ".1f"),
                       ("other_ms", "other", ".0f")])
    return rows


def order_by_category(prompts):
    """One prompt of each category first, so a short run still covers every kind of text."""
    seen, first, rest = set(), [], []
    for p in prompts:
        (rest if p["category"] in seen else first).append(p)
        seen.add(p["category"])
    return first + rest


if __name__ == "__main__":
    main()
