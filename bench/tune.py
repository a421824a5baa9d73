"""Cascade.auto() against a grid search of K matrices and lenience, on the Qwen pair.

    .venv/bin/python -m bench.tune                         # 1.5B <- 0.5B <- MaG, bf16, 3 prompts x 48 tokens
    .venv/bin/python -m bench.tune --prompts 2 --max-new-tokens 32 --quick

Every configuration decodes the same prompts (greedy, batch 1, one run each, after a warm-up);
the grid covers K = [[a, b], [0, m]] (a tokens from the 0.5B drafter, then b from MaG; the
drafter reviews m MaG tokens at a time) and lenience, plus Speculative(0.5B, k) and Cascade
with MaG alone. Cascade.auto() runs with no configuration given: its calibration steps are
part of its measured time. The table ends with auto's tokens/s as a fraction of the best grid
point's; the JSON goes to bench/results/tune-*.json.
"""
import argparse
import itertools
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import csd_engine
from bench.common import load_prompts, print_table, progress, resolve_model, write_json
from bench.compare import order_by_category
from csd_engine import Cascade, SamplingParams, Speculative


def grid(quick: bool) -> list[tuple[str, object, bool]]:
    """(label, strategy, uses the MaG-only engine)."""
    configs = [(f"Speculative(0.5B, k={k})", Speculative(k=k, drafter=0), False) for k in ((2, 4) if quick else (2, 4, 6))]
    configs += [(f"Cascade(MaG, K=[[{m}]])", Cascade(k_matrix=[[m]], mag_tokens=m), True)
                for m in ((8,) if quick else (4, 8, 16))]
    a_values, b_values, m_values, lenience_values = ((2, 4), (2, 6), (4,), (1.0, 2.0)) if quick else \
        ((2, 4, 6), (0, 4, 8), (4, 8), (1.0, 2.0))
    for a, b, m, lenience in itertools.product(a_values, b_values, m_values, lenience_values):
        configs.append((f"Cascade(0.5B+MaG, K=[[{a},{b}],[0,{m}]], l={lenience:g})",
                        Cascade(k_matrix=[[a, b], [0, m]], lenience=lenience, mag_tokens=m), False))
    return configs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=3, help="prompts from bench/prompts.json (one per category first)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="a small grid (13 points instead of 42)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16
    tpath, dpath = resolve_model(args.target), resolve_model(args.drafter)
    progress(f"loading {args.target} and {args.drafter} (bfloat16)")
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype).eval()
    drafter = AutoModelForCausalLM.from_pretrained(dpath, dtype=dtype).eval()
    engine = csd_engine.Engine(target, drafters=[drafter, "mag"], dtype=dtype, max_batch_size=1, max_seq_len=1024,
                               tokenizer=tok)
    engine_mag = csd_engine.Engine(engine.target, drafters=["mag"], dtype=dtype, max_batch_size=1, max_seq_len=1024,
                                   tokenizer=tok)
    prompts = order_by_category(load_prompts())[:args.prompts]
    encoded = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    reference = [engine.generate([ids], params)[0].token_ids for ids in encoded]  # plain greedy (also a warm-up)

    def measure(label, strategy, mag_only):
        eng = engine_mag if mag_only else engine
        eng.generate([encoded[0][:32]], SamplingParams(max_new_tokens=6, ignore_eos=True), strategy=strategy)
        tokens = seconds = forwards = 0
        identical = 0
        for ids, ref in zip(encoded, reference):
            start = time.perf_counter()
            result = eng.generate([ids], params, strategy=strategy)[0]
            seconds += time.perf_counter() - start
            tokens += len(result.token_ids)
            forwards += result.metrics.target_forwards
            identical += result.token_ids == ref
        row = dict(config=label, tokens_per_s=tokens / seconds, mean_accepted=tokens / forwards,
                   identical=f"{identical}/{len(encoded)}")
        progress(f"{label}: {row['tokens_per_s']:.2f} tokens/s, MAT {row['mean_accepted']:.2f}")
        return row

    configs = grid(args.quick)
    rows = []
    for i, (label, strategy, mag_only) in enumerate(configs):
        progress(f"[{i + 1}/{len(configs) + 2}]")
        rows.append(measure(label, strategy, mag_only))
    progress(f"[{len(configs) + 1}/{len(configs) + 2}]")
    ar = measure("Autoregressive", csd_engine.Autoregressive(), False)
    progress(f"[{len(configs) + 2}/{len(configs) + 2}]")
    auto = measure("Cascade.auto()", Cascade.auto(), False)
    best = max(rows, key=lambda r: r["tokens_per_s"])
    rows.sort(key=lambda r: -r["tokens_per_s"])
    for row in rows + [ar, auto]:
        row["vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
        row["of_best"] = row["tokens_per_s"] / best["tokens_per_s"]
    print(f"\n{args.target} <- {args.drafter} (<- MaG), bf16, greedy, batch 1, {len(encoded)} prompts x "
          f"{args.max_new_tokens} tokens; grid sorted by tokens/s, then Autoregressive and Cascade.auto()")
    print_table(rows + [ar, auto], [("config", "configuration", "s"), ("tokens_per_s", "tokens/s", ".2f"),
                                    ("vs_ar", "vs AR", ".2f"), ("of_best", "of best", ".2f"),
                                    ("mean_accepted", "MAT", ".2f"), ("identical", "= greedy", "s")])
    print(f"\nCascade.auto() reaches {auto['of_best']:.0%} of the best grid point ({best['config']})")
    write_json(f"tune-{args.target}", {"args": vars(args), "rows": rows, "autoregressive": ar, "auto": auto,
                                       "best": best}, args.out)


if __name__ == "__main__":
    main()
