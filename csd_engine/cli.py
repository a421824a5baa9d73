"""`csd-engine generate`: one generation from the command line; `csd-engine serve`: an
OpenAI-compatible HTTP server (csd_engine/serving/server.py; needs the `serve` extra).

    csd-engine generate --target smollm2-135m --prompt "Write a haiku about caches" --strategy speculative --drafter mag
    csd-engine generate --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --drafter mag \
        --strategy cascade --k-matrix '[[2,4],[0,4]]' --lenience 2 --tree '[3,2]' --dtype bfloat16 --chat \
        --prompt "Write a Python function that checks for primes."
    csd-engine generate ... --strategy-config '{"staged": {"branching": [3, 2, 1], "mag_tokens": 2}}'

Every option of every strategy is reachable through `--strategy-config` (JSON: one strategy
name -> its keyword arguments; lists become tuples). The simple flags cover the common ones,
each for the strategies that take it; a flag the chosen strategy does not take is an error.
`--strategy cascade` without `--k-matrix` is Cascade.auto(): each row chooses its own budgets every step;
`--strategy speculative_auto` is Speculative.auto(): each row chooses its own draft length.

    csd-engine serve --target smollm2-135m --drafter mag --strategy speculative --port 8000 \
        --max-batch-size 8 --max-waiting 64

`serve` takes the same model and strategy flags as `generate`.
"""
import argparse
import inspect
import json
import logging
import sys

import torch

from csd_engine import AutoCascade, Autoregressive, AutoSpeculative, Cascade, Engine, Pearl, SamplingParams, Speculative, Staged, __version__
from csd_engine.engine import DTYPES

LOG_LEVELS = ("debug", "info", "warning", "error")
CUDA_GRAPHS = {"off": False, "forward": True, "step": "step"}  # --cuda-graphs -> Engine(cuda_graphs=...)
# name -> (what builds it, the class whose keyword arguments it takes)
STRATEGIES = {
    "autoregressive": (Autoregressive, Autoregressive),
    "speculative": (Speculative, Speculative),
    "speculative_auto": (Speculative.auto, AutoSpeculative),
    "cascade": (Cascade, Cascade),
    "cascade_auto": (Cascade.auto, AutoCascade),
    "staged": (Staged, Staged),
    "pearl": (Pearl, Pearl),
}
# The simple flags (argparse dests) each strategy takes; each maps to the option of that name.
STRATEGY_FLAGS = {
    "autoregressive": (),
    "speculative": ("k",),
    "speculative_auto": (),
    "cascade": ("k_matrix", "lenience", "mag_tokens", "tree"),
    "cascade_auto": ("tree",),
    "staged": ("branching", "mag_tokens"),
    "pearl": ("gamma",),
}
ALL_FLAGS = tuple(dict.fromkeys(dest for dests in STRATEGY_FLAGS.values() for dest in dests))
JSON_FLAGS = ("k_matrix", "tree", "branching")
CLI_CASCADE_MAG_TOKENS = 4  # the CLI's cascade default since its first version (the class's is 10)


JSON_EXAMPLES = {"k_matrix": "'[[2,4],[0,4]]'", "tree": "'[3,2]'", "branching": "'[4,2,1,1]'"}


def _json(text: str, flag: str, example: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} must be JSON, e.g. {example}; got {text!r} ({exc.msg})") from None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _tuples(value):
    """JSON lists as the tuples the strategy dataclasses hold (nested lists too)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def make_strategy(name: str, options: dict):
    """`name`'s strategy built as StrategyClass(**options); unknown names and options are a
    ValueError naming the allowed ones, bad values the strategy's own error."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; strategies: {', '.join(STRATEGIES)}")
    build, cls = STRATEGIES[name]
    allowed = list(inspect.signature(cls).parameters)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(allowed) or 'none'}")
    return build(**{key: _tuples(value) for key, value in options.items()})


def parse_strategy_config(text: str) -> tuple[str, dict]:
    """`{"<strategy name>": {<option>: <value>, ...}}` -> (name, options)."""
    example = '\'{"cascade": {"k_matrix": [[2, 4], [0, 4]], "lenience": 2}}\''
    config = _json(text, "--strategy-config", example) if text.strip() else None
    if not isinstance(config, dict) or len(config) != 1:
        raise ValueError(f"--strategy-config must be a JSON object with one key, the strategy name "
                         f"({', '.join(STRATEGIES)}), e.g. {example}; got {text!r}")
    (name, options), = config.items()
    if not isinstance(options, dict):
        raise ValueError(f"--strategy-config: the options of {name!r} must be a JSON object of keyword "
                         f"arguments, e.g. {example}; got {options!r}")
    return name, options


def build_strategy(args):
    """The strategy the arguments ask for: from --strategy-config, else from the simple flags."""
    given = [dest for dest in ALL_FLAGS if getattr(args, dest) is not None]
    if args.strategy_config is not None:
        name, options = parse_strategy_config(args.strategy_config)
        if args.strategy is not None and args.strategy != name:
            raise ValueError(f"--strategy {args.strategy} contradicts --strategy-config, which configures {name!r}")
        if given:
            raise ValueError(f"--strategy-config sets every option: put {', '.join(map(_flag, given))} in it instead")
        return make_strategy(name, options)
    name = args.strategy or ("speculative" if args.drafter else "autoregressive")
    refused = [dest for dest in given if dest not in STRATEGY_FLAGS[name]]
    if refused:
        taken = ", ".join(map(_flag, STRATEGY_FLAGS[name])) or "none"
        raise ValueError(f"--strategy {name} does not take {', '.join(map(_flag, refused))} (its flags: {taken}); "
                         f"any option of any strategy: --strategy-config '{{\"{name}\": {{...}}}}'")
    options = {dest: _json(getattr(args, dest), _flag(dest), JSON_EXAMPLES[dest]) if dest in JSON_FLAGS
               else getattr(args, dest)
               for dest in given}
    if name == "cascade":
        if "k_matrix" not in options:
            fixed = [dest for dest in options if dest not in STRATEGY_FLAGS["cascade_auto"]]
            if fixed:
                raise ValueError(f"{', '.join(map(_flag, fixed))} needs --k-matrix (--strategy cascade without "
                                 f"it is Cascade.auto(), whose rows choose their own budgets)")
            return make_strategy("cascade_auto", options)
        options.setdefault("mag_tokens", CLI_CASCADE_MAG_TOKENS)
    return make_strategy(name, options)


def _configure_logging(level: str) -> None:
    # The root handler is the application's to set; basicConfig leaves one already there alone.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("csd_engine").setLevel(level.upper())
    if level != "debug":  # transformers' loading progress bars and advice are noise on a command line
        import transformers
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


def _model_and_strategy_flags(g: argparse.ArgumentParser) -> None:
    """The flags `generate` and `serve` share: models, dtype, device, strategy and its options."""
    g.add_argument("--target", required=True, help="zoo name, model folder, .gguf file or hub id")
    g.add_argument("--drafter", action="append", default=[], help="drafter (repeatable, largest first); 'mag' for MaG")
    g.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="default: speculative when a drafter is given, else autoregressive")
    g.add_argument("--strategy-config", default=None, metavar="JSON",
                   help="any strategy with any of its options, e.g. '{\"staged\": {\"branching\": [3,2,1], "
                        "\"mag_tokens\": 2}}'; replaces the strategy flags below")
    g.add_argument("--k", type=int, default=None, help="speculative: draft length (default 4)")
    g.add_argument("--gamma", type=int, default=None, help="pearl: draft length (default 4)")
    g.add_argument("--k-matrix", default=None, help="cascade: K matrix as JSON, e.g. '[[2,6],[0,8]]'")
    g.add_argument("--lenience", type=float, default=None, help="cascade: lenience >= 1 (default 1)")
    g.add_argument("--mag-tokens", type=int, default=None,
                   help=f"cascade / staged: tokens MaG proposes per call (default {CLI_CASCADE_MAG_TOKENS} / 0)")
    g.add_argument("--tree", default=None, help="cascade: candidates per depth of a top-level tree, e.g. '[3,2]' "
                                                "(Cascade.auto(): the tree each row may choose)")
    g.add_argument("--branching", default=None, help="staged: children per depth as JSON, e.g. '[4,2,1,1]'")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the models' dtype (default float32; bfloat16 is faster on a CPU with AVX-512 BF16 and on GPUs)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda where torch sees one, else cpu)")
    g.add_argument("--cuda-graphs", choices=list(CUDA_GRAPHS), default="off",
                   help="on a GPU with native runners: 'forward' replays each forward from a CUDA graph, 'step' "
                        "each whole decoding step (not Pearl's concurrent rounds); ignored on a CPU (default off)")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="longest sequence a request may reach, prompt included (default 2048, or less where a "
                        "model's sliding window, position table or trained positions end first)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default torch's; 1 is fastest for tiny models on a busy machine)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="csd_engine's log messages on stderr (model builds, progress; default info)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="csd-engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    _model_and_strategy_flags(g)
    g.add_argument("--prompt", required=True, action="append", help="prompt text (repeatable for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64; fewer where --max-seq-len ends first)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample within top-p probability mass (default 1: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one per prompt)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (instruct models)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.add_argument("--stream", action="store_true", help="print the text as each step commits it (one prompt)")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    _model_and_strategy_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="default 8000")
    s.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together (default 8)")
    s.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a row; one more is refused with 429 (default 64)")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per step, so a long prompt does not stall the streams already "
                        "running (default: a whole prompt when it joins)")
    s.add_argument("--batch-invariant", action="store_true",
                   help="a request's logits never depend on what shares its batch (Engine(batch_invariant=True))")
    s.add_argument("--model-name", default=None, help="the name clients use as `model` (default: --target)")
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    try:
        return serve(args) if args.command == "serve" else generate(args)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (after a stream, on a line of its own)
        print(("\n" if getattr(args, "stream", False) else "") + "csd-engine: interrupted", file=sys.stderr)
        return 130


def _check_drafters(drafters: list[str]) -> None:
    """MaG is the smallest drafter: once, and last (drafters go largest first)."""
    mags = [i for i, d in enumerate(drafters) if d.lower() == "mag"]
    if len(mags) > 1:
        raise ValueError("--drafter mag is given twice: MaG is one drafter, the last one")
    if mags and mags[0] != len(drafters) - 1:
        raise ValueError(f"--drafter mag must come last: drafters go largest first and MaG is the smallest "
                         f"(got {' '.join('--drafter ' + d for d in drafters)})")


def generate(args) -> int:
    """`csd-engine generate`: exit status 0, or 2 for a bad argument (named on stderr)."""
    try:
        _check_drafters(args.drafter)
        _set_threads(args.threads)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed, stop=args.stop)
        if args.stream and (len(args.prompt) > 1 or args.json):
            raise ValueError("--stream prints one prompt's text as it comes: give one --prompt and no --json")
        strategy = build_strategy(args)
        engine = Engine(target=args.target, drafters=args.drafter, device=args.device,
                        dtype=DTYPES[args.dtype], max_batch_size=len(args.prompt), max_seq_len=args.max_seq_len,
                        cuda_graphs=CUDA_GRAPHS[args.cuda_graphs])
        prompts = args.prompt
        if args.chat:
            if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
                raise ValueError(f"--chat needs a tokenizer with a chat template; {args.target!r} has none")
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                            tokenize=True, return_dict=True)["input_ids"]
                       for p in args.prompt]
        if args.stream:
            return _stream(engine, args, prompts[0], params, strategy)
        results = engine.generate(prompts, params, strategy=strategy)
    except (ValueError, TypeError, MemoryError) as exc:
        print(f"csd-engine: error: {exc}", file=sys.stderr)
        return 2
    for prompt, r in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                              "finish_reason": r.finish_reason, "metrics": vars(r.metrics)}))
        else:
            separator = "\n" if args.chat else ""  # a chat reply is not a continuation of the prompt
            print(f"{prompt}{separator}{r.text if r.text is not None else r.token_ids}")
            _summary(strategy, r)
    return 0


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _stream(engine, args, prompt, params, strategy) -> int:
    """Print the prompt, then each step's text as it comes (token ids without a tokenizer)."""
    print(args.prompt[0] + ("\n" if args.chat else ""), end="", flush=True)
    for out in engine.stream([prompt], params, strategy=strategy):
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)), end="", flush=True)
        if out.finished:
            print()
            _summary(strategy, out.result)
    return 0


def _summary(strategy, r) -> None:
    m = r.metrics
    print(f"[{type(strategy).__name__}] {m.new_tokens} tokens in {m.wall_time_s:.2f}s = {m.tokens_per_s:.1f} tokens/s, "
          f"mean accepted {m.mean_accepted_tokens:.2f}, finish: {r.finish_reason}", file=sys.stderr)


def serve(args) -> int:
    """Load the models, then serve until interrupted (Ctrl-C)."""
    try:
        from csd_engine.serving import AsyncEngine
        from csd_engine.serving.server import build_app
        import uvicorn
    except ImportError as exc:
        print(f"csd-engine: error: serve needs the `serve` extra ({exc.name} is missing): "
              "pip install 'csd_engine[serve]'", file=sys.stderr)
        return 2
    try:
        _check_drafters(args.drafter)
        _set_threads(args.threads)
        if args.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
        if not 1 <= args.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {args.port}")
        if args.prefill_chunk is not None and args.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be >= 1 (prompt tokens per step), got {args.prefill_chunk}")
        strategy = build_strategy(args)
        engine = Engine(target=args.target, drafters=args.drafter, device=args.device, dtype=DTYPES[args.dtype],
                        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                        batch_invariant=args.batch_invariant, cuda_graphs=CUDA_GRAPHS[args.cuda_graphs])
        async_engine = AsyncEngine(engine, strategy, max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk)
    except (ValueError, TypeError, MemoryError) as exc:
        print(f"csd-engine: error: {exc}", file=sys.stderr)
        return 2
    name = args.model_name or args.target
    logging.getLogger(__name__).info("loaded %s (%s); starting the server on http://%s:%d", name,
                                     type(strategy).__name__, args.host, args.port)
    try:
        uvicorn.run(build_app(async_engine, name), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
