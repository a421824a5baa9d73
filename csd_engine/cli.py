"""`csd-engine generate`: one generation from the command line.

    csd-engine generate --target smollm2-135m --prompt "Write a haiku about caches" --strategy speculative --drafter mag
    csd-engine generate --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --drafter mag \
        --strategy cascade --k-matrix '[[2,4],[0,4]]' --lenience 2 --tree '[3,2]' --dtype bfloat16 --chat \
        --prompt "Write a Python function that checks for primes."

`--strategy cascade` without `--k-matrix` is Cascade.auto(): K and lenience tuned while generating.
"""
import argparse
import json
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGIES = ("autoregressive", "speculative", "cascade", "staged", "pearl")


def _json(text: str, flag: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be JSON, e.g. '[[2,4],[0,4]]' or '[3,2]'; got {text!r} ({exc.msg})") from None


def build_strategy(args):
    import csd_engine
    if args.strategy == "autoregressive":
        return csd_engine.Autoregressive()
    if args.strategy == "speculative":
        return csd_engine.Speculative(k=args.k)
    if args.strategy == "cascade":
        if args.k_matrix is None:
            if args.tree:
                raise ValueError("--tree needs --k-matrix (Cascade.auto() verifies chains)")
            return csd_engine.Cascade.auto()
        return csd_engine.Cascade(k_matrix=_json(args.k_matrix, "--k-matrix"), lenience=args.lenience,
                                  mag_tokens=args.mag_tokens, tree=tuple(_json(args.tree or "[]", "--tree")))
    if args.strategy == "staged":
        return csd_engine.Staged()
    return csd_engine.Pearl(gamma=args.k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="csd-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--target", required=True, help="zoo name, model folder, .gguf file or hub id")
    g.add_argument("--drafter", action="append", default=[], help="drafter (repeatable, largest first); 'mag' for MaG")
    g.add_argument("--prompt", required=True, action="append", help="prompt text (repeatable for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="default: speculative when a drafter is given, else autoregressive")
    g.add_argument("--k", type=int, default=4, help="draft length (speculative) / gamma (pearl)")
    g.add_argument("--k-matrix", default=None, help="cascade K matrix as JSON, e.g. '[[2,6],[0,8]]'")
    g.add_argument("--lenience", type=float, default=1.0)
    g.add_argument("--mag-tokens", type=int, default=4, help="tokens MaG proposes per call (cascade)")
    g.add_argument("--tree", default=None, help="cascade: candidates per depth of a top-level tree, e.g. '[3,2]'")
    g.add_argument("--dtype", choices=DTYPES, default="float32")
    g.add_argument("--device", default=None)
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (instruct models)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = parser.parse_args(argv)

    import csd_engine
    if args.strategy is None:
        args.strategy = "speculative" if args.drafter else "autoregressive"
    try:
        params = csd_engine.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                           max_new_tokens=args.max_new_tokens, seed=args.seed)
        strategy = build_strategy(args)
        engine = csd_engine.Engine(target=args.target, drafters=args.drafter, device=args.device,
                                   dtype=DTYPES[args.dtype], max_batch_size=len(args.prompt),
                                   max_seq_len=args.max_seq_len)
        prompts = args.prompt
        if args.chat:
            if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
                raise ValueError(f"--chat needs a tokenizer with a chat template; {args.target!r} has none")
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                            tokenize=True, return_dict=True)["input_ids"]
                       for p in args.prompt]
        results = engine.generate(prompts, params, strategy=strategy)
    except (ValueError, TypeError) as exc:
        print(f"csd-engine: error: {exc}", file=sys.stderr)
        return 2
    for prompt, r in zip(args.prompt, results):
        m = r.metrics
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                              "finish_reason": r.finish_reason, "metrics": vars(m)}))
        else:
            separator = "\n" if args.chat else ""  # a chat reply is not a continuation of the prompt
            print(f"{prompt}{separator}{r.text if r.text is not None else r.token_ids}")
            print(f"[{args.strategy}] {m.new_tokens} tokens in {m.wall_time_s:.2f}s = {m.tokens_per_s:.1f} tokens/s, "
                  f"mean accepted {m.mean_accepted_tokens:.2f}, finish: {r.finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
