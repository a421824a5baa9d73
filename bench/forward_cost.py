"""What a forward of n new tokens costs against one, per model and dtype: the number that
decides whether speculative decoding can pay on a machine (a chain of k drafts needs the
(k+1)-token forward to cost little more than the 1-token one).

    .venv/bin/python -m bench.forward_cost                                   # Qwen 1.5B and 0.5B, fp32 + bf16
    .venv/bin/python -m bench.forward_cost --models smollm2-135m --dtypes float32 --drafters ""
    .venv/bin/python -m bench.forward_cost --dtypes bfloat16 --agreement 64   # + drafters' greedy agreement

For each (model, dtype, n) it times the native runner's forward of n tokens after a
`--context`-token prefix (median of `--repeats`, after one warm-up) and transformers'
forward of the same tokens with its dynamic cache, for comparison. `--drafters` adds cheaper
drafters (issue 13: quantized weights, early exits; load_runner's spec suffixes), native runner
only, in `--drafter-dtype`. "x target" is each row's time over the first model's one-token
forward in bfloat16 (the target's decoding step). `--agreement N` also lets the first model
generate N greedy tokens from each of `--prompts` chat prompts and reports how often each
drafter's greedy next token agrees with the target's on that text (teacher-forced, one forward
each): the per-token acceptance of greedy speculation. Prints a table and writes
bench/results/forward-cost.json.
"""
import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from bench.common import load_prompts, print_table, progress, resolve_model, write_json
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import split_spec
from csd_engine.models.runner import ForwardBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DRAFTERS = ["qwen2.5-coder-0.5b:int8", "qwen2.5-coder-0.5b:int4", "qwen2.5-coder-0.5b[:12]",
            "qwen2.5-coder-0.5b[:16]", "qwen2.5-coder-0.5b[:20]", "qwen2.5-coder-0.5b:int4[:16]",
            "qwen2.5-coder-1.5b:int4", "qwen2.5-coder-1.5b[:8]"]


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load(spec: str, dtype: torch.dtype):
    """(native runner, transformers model or None) for a spec; suffixed specs get no transformers twin."""
    name, quantize, layers = split_spec(spec)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).eval()
    runner = LlamaRunner(model, "cpu", dtype, quantize=quantize)
    plain = quantize is None and layers is None
    return (runner if layers is None else runner.truncated(layers)), (model if plain else None)


def greedy_text(runner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt followed by `tokens` greedy tokens of `runner` (one row at a time)."""
    out = []
    for ids in prompts:
        runner.allocate(1, len(ids) + tokens + 8)
        seq = torch.tensor([ids])
        for _ in range(tokens):
            new = seq[:, runner.cache.lengths[0]:]
            logits = runner(ForwardBatch.chain(new, runner.cache.lengths, seq.shape[1]))
            runner.cache.advance(torch.tensor([new.shape[1]]))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(seq[0].tolist())
    return out


def target_text(name: str, runner, prompts: int, tokens: int):
    """The target's greedy continuations of the first `prompts` chat prompts, and its own
    teacher-forced greedy choices on them (the reference a drafter agrees with or not)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(resolve_model(split_spec(name)[0]))
    prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for p in load_prompts(prompts)]
    texts = greedy_text(runner, prompt_ids, tokens)
    return texts, greedy_choices(runner, texts, tokens)


def greedy_choices(runner, texts: list[list[int]], tokens: int) -> torch.Tensor:
    """[texts, tokens] the runner's greedy next token at each of the last `tokens` positions."""
    picks = []
    for ids in texts:
        runner.allocate(1, len(ids) + 8)
        logits = runner(ForwardBatch.chain(torch.tensor([ids]), runner.cache.lengths, len(ids)))
        picks.append(logits[0, -tokens - 1:-1].argmax(-1))
    return torch.stack(picks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="specs with :int8/:int4/[:L] suffixes")
    ap.add_argument("--drafter-dtype", default="bfloat16")
    ap.add_argument("--agreement", type=int, default=0, help="greedy tokens per prompt (0: skip)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--ns", default="1,2,3,5,9,17")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = [int(n) for n in args.ns.split(",")]
    models, drafters = args.models.split(","), [d for d in args.drafters.split(",") if d]
    rows, target_step, texts, target_picks = [], None, None, None
    for name in models + drafters:
        for dtype_name in args.dtypes.split(",") if name in models else [args.drafter_dtype]:
            dtype = DTYPES[dtype_name]
            progress(f"loading {name} ({dtype_name})")
            runner, model = load(name, dtype)
            if args.agreement and dtype == torch.bfloat16 and texts is None:  # the target's text, once
                texts, target_picks = target_text(name, runner, args.prompts, args.agreement)
            agree = None
            if texts is not None and dtype == torch.bfloat16:
                agree = (greedy_choices(runner, texts, args.agreement) == target_picks).float().mean().item()
            runner.allocate(1, args.context + max(ns) + 8)
            prefix = torch.randint(0, runner.vocab_size, (1, args.context))
            runner(ForwardBatch.chain(prefix, runner.cache.lengths, args.context, need_logits=False))
            if model is not None:
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

                t_native = median_seconds(native, args.repeats)
                t_hf = median_seconds(hf, args.repeats) if model is not None else None
                base.setdefault("native", t_native)
                base.setdefault("hf", t_hf)
                if target_step is None and name == models[0] and dtype == torch.bfloat16:
                    target_step = t_native
                rows.append(dict(model=name, dtype=dtype_name, n=n, native_ms=t_native * 1e3,
                                 native_vs_1=t_native / base["native"], hf_ms=t_hf and t_hf * 1e3,
                                 hf_vs_1=t_hf and t_hf / base["hf"], vs_target=target_step and t_native / target_step,
                                 agreement=agree if n == ns[0] else None))
                progress(f"{name} {dtype_name} n={n}: native {t_native * 1e3:.0f} ms" +
                         (f", transformers {t_hf * 1e3:.0f} ms" if t_hf else ""))
            del model, runner
    print(f"\nforward of n new tokens after a {args.context}-token prefix, batch 1 (median of {args.repeats})")
    print_table(rows, [("model", "model", "s"), ("dtype", "dtype", "s"), ("n", "n", "d"),
                       ("native_ms", "native ms", ".0f"), ("native_vs_1", "x n=1", ".2f"),
                       ("vs_target", "x target", ".2f"), ("agreement", "greedy agreement", ".3f"),
                       ("hf_ms", "transformers ms", ".0f"), ("hf_vs_1", "x n=1", ".2f")])
    write_json("forward-cost", {"args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
