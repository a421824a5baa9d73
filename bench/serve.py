"""Serving throughput and latency: clients with Poisson arrivals against `csd-engine serve`, per
strategy, beside the same prompts through offline continuous batching.

    python bench/serve.py --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --requests 64 --rate 2
    python bench/serve.py --strategy speculative --strategy '{"cascade": {"k_matrix": [[2, 4], [0, 4]]}}'
    python bench/serve.py --url http://127.0.0.1:8000 --target ...   # a server already running
    python bench/serve.py --dry-run      # tiny random models, a few requests: proves it runs, in seconds
    python bench/serve.py --synthetic    # on a GPU: bench/gpu.py's Llama-2-7B-shaped random target

For each --strategy (a name, or a JSON configuration as `serve --strategy-config` takes it) the
script starts `python -m csd_engine serve` on a free local port with --target, --drafter and
MaG as drafters, waits for /health and warms it up. Then --requests streamed completions of
bench/prompts.json's prompts (chat template, token ids sent), arriving as a Poisson process of
--rate requests/s (seeded), with at most --clients in flight. Measured at the client:
time to first token (TTFT, from sending), inter-token latency (ITL: the gaps between chunks that
carry tokens; a speculative step delivers several at once), and output tokens/s over the whole
run; from the server's /metrics, the drafts' acceptance. Then the same prompts go through
`engine.scheduler` in this process (all queued at once, same rows): offline tokens/s, and
whether the greedy outputs are identical. JSON: bench/results/serve-*.json, rewritten after each
strategy (a run cut short keeps the strategies it measured).

--synthetic (for a lent GPU, which has no weights and no hub): the target is bench/gpu.py's
random bf16 Llama-2-7B-shaped model (its layers past the drafter's scaled so that they only
nudge the residual stream), saved with a character tokenizer over its vocabulary; the drafter
is its first layers (an early-exit spec, "folder[:2]"); prompts keep their last 64 tokens.
"""
import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/serve.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness  # noqa: E402
from bench.common import encode, load_prompts, order_by_category, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ["autoregressive", "speculative", "cascade"]  # when --strategy is not given
SYNTHETIC_RESIDUAL_SCALE = 0.05  # bench/gpu.py's default --residual-scale
SYNTHETIC_PROMPT_TOKENS = 64


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating between the closest ranks; None if empty."""
    if not values:
        return None
    values = sorted(values)
    rank = (len(values) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strategy_flags(spec: str) -> list[str]:
    return ["--strategy-config", spec] if spec.lstrip().startswith("{") else ["--strategy", spec]


def build_strategy(spec: str, drafters: list[str]):
    """The strategy `serve` builds from the same flags (the CLI's defaults included)."""
    from csd_engine import cli
    flags = {dest: None for dest in cli.ALL_FLAGS}
    config = spec.lstrip().startswith("{")
    return cli.build_strategy(argparse.Namespace(strategy=None if config else spec, strategy_config=spec if config
                                                 else None, drafter=drafters, **flags))


class Server:
    """`python -m csd_engine serve` in a subprocess on a free port, its output in a log file."""

    def __init__(self, args, target: str, drafters: list[str], spec: str, log: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "csd_engine", "serve", "--port", str(port), "--target", target,
                   *[flag for d in drafters for flag in ("--drafter", d)], *strategy_flags(spec),
                   "--max-batch-size", str(args.max_batch_size), "--max-waiting", str(args.requests),
                   "--max-seq-len", str(args.max_seq_len), "--dtype", args.dtype, "--model-name", "bench",
                   "--log-level", "warning"]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if args.prefill_chunk:
            command += ["--prefill-chunk", str(args.prefill_chunk)]
        if args.batch_invariant:
            command += ["--batch-invariant"]
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not answer /health in {timeout:.0f}s (log: {self.log})")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def one_request(http, ids: list[int], args, delay: float, clients: asyncio.Semaphore) -> dict:
    """One streamed completion sent `delay` seconds after the run's start: its tokens and times."""
    await asyncio.sleep(delay)
    async with clients:
        body = {"model": "bench", "prompt": ids, "max_tokens": args.max_new_tokens, "temperature": args.temperature,
                "ignore_eos": True, "stream": True}
        if args.temperature > 0:
            body["seed"] = args.seed
        sent = time.perf_counter()
        tokens, times = [], []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                new = chunk["choices"][0]["token_ids"]
                if new:
                    tokens += new
                    times.append(time.perf_counter())
    if not times:
        return {"error": "no tokens"}
    return {"sent": sent, "done": times[-1], "tokens": tokens, "ttft_s": times[0] - sent,
            "itl_s": [b - a for a, b in zip(times, times[1:])]}


async def run_clients(url: str, prompts: list[list[int]], args) -> tuple[list[dict], float]:
    """Every request, arriving as a Poisson process of args.rate requests/s; (results, seconds
    from the first send to the last token)."""
    import httpx
    rng = random.Random(args.seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
    clients = asyncio.Semaphore(args.clients)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        results = await asyncio.gather(*(one_request(http, ids, args, d, clients) for ids, d in zip(prompts, delays)))
    ok = [r for r in results if "error" not in r]
    seconds = max(r["done"] for r in ok) - min(r["sent"] for r in ok) if ok else 0.0
    return results, seconds


def scrape(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not set(s.labels) - {"model_name"}}


def summarize(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(len(r["tokens"]) for r in ok)
    ttft = [r["ttft_s"] * 1000 for r in ok]
    itl = [gap * 1000 for r in ok for gap in r["itl_s"]]
    return {"requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
            "requests_per_s": len(ok) / seconds if seconds else None,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99)}


def save_synthetic(folder: str, dry_run: bool) -> tuple[str, str]:
    """bench/gpu.py's synthetic target saved under `folder` with a character tokenizer over its
    vocabulary; returns (its folder, the drafter spec: its first layers)."""
    import torch

    from bench.gpu import DRY_RUN, Models, Sizes
    from bench.tiny import tiny_tokenizer
    sizes = DRY_RUN if dry_run else Sizes()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Models(sizes, device, residual_scale=SYNTHETIC_RESIDUAL_SCALE).target
    path = Path(folder) / "synthetic-target"
    harness.progress(f"saving the synthetic target to {path}")
    model.save_pretrained(path)
    tiny_tokenizer(sizes.model["vocab_size"]).save_pretrained(path)
    return str(path), f"{path}[:{sizes.drafter_layers}]"


def offline(engine, strategy, prompts: list[list[int]], args) -> tuple[list[list[int]], float]:
    """The prompts through engine.scheduler, all queued at once: (outputs, seconds)."""
    from csd_engine import SamplingParams
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=True,
                            seed=args.seed if args.temperature > 0 else None)
    outputs = {}
    begin = time.perf_counter()
    with engine.scheduler(strategy, prefill_chunk=args.prefill_chunk) as scheduler:
        ids = [scheduler.add(p, params) for p in prompts]
        while scheduler.has_unfinished():
            outputs.update((o.request_id, o.result.token_ids) for o in scheduler.step() if o.finished)
    return [outputs[i] for i in ids], time.perf_counter() - begin


def check_args(ap, args) -> list[str]:
    """The strategies to measure (--strategy, or STRATEGIES), every one built here first, and
    the options that would only fail once the servers run; an argparse error where one is wrong."""
    if args.url and (args.dry_run or args.synthetic):
        ap.error("--url measures a running server; --dry-run and --synthetic start servers of their own models")
    if args.url and len(args.strategy or []) > 1:
        ap.error("--url measures the one running server: give at most one --strategy, the one it runs (the offline "
                 "reference decodes with it)")
    specs = args.strategy or STRATEGIES
    for spec in specs:
        try:
            harness.fits_drafters(build_strategy(spec, [args.drafter, "mag"]), [False, True])
        except ValueError as exc:
            ap.error(f"--strategy {spec}: {exc}")
    from csd_engine import SamplingParams
    try:
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    except ValueError as exc:
        ap.error(f"--temperature {args.temperature:g}: {exc}")
    if args.url:
        import httpx
        try:
            status = httpx.get(args.url.rstrip("/") + "/health", timeout=10).status_code
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            ap.error(f"--url {args.url}: no server answers there ({type(exc).__name__}: {exc})")
        if status != 200:
            ap.error(f"--url {args.url}: its /health answers HTTP {status}")
    return specs


def parser():
    ap = harness.parser(__doc__, dry_run={"requests": 6, "max_new_tokens": 8, "rate": 50.0, "max_seq_len": 128,
                                          "strategy": ["autoregressive", "speculative"]},
                        target="qwen2.5-coder-1.5b", drafter="qwen2.5-coder-0.5b", dtype="bfloat16",
                        max_new_tokens=64, prompts_file=None)
    ap.add_argument("--strategy", action="append", default=None,
                    help="a strategy name or a JSON configuration (repeatable; default: " + ", ".join(STRATEGIES) + ")")
    ap.add_argument("--requests", type=harness.positive_int, default=32, help="requests per strategy (default 32)")
    ap.add_argument("--rate", type=harness.non_negative_float, default=2.0,
                    help="mean arrivals per second of the Poisson process; 0 sends all at once (default 2)")
    ap.add_argument("--clients", type=harness.positive_int, default=16, help="requests in flight at most (default 16)")
    ap.add_argument("--max-batch-size", type=harness.positive_int, default=8, help="the server's rows (default 8)")
    ap.add_argument("--max-seq-len", type=harness.positive_int, default=1024,
                    help="the server's and the offline engine's: longest prompt + --max-new-tokens at least "
                         "(default 1024)")
    ap.add_argument("--prefill-chunk", type=harness.positive_int, default=None,
                    help="prompt tokens prefilled per step (serve --prefill-chunk; default: whole prompts)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="server and offline engine with batch_invariant=True (greedy outputs then equal offline)")
    ap.add_argument("--synthetic", action="store_true",
                    help="bench/gpu.py's random Llama-2-7B-shaped target and its first layers as drafter (a GPU "
                         "without weights); with --dry-run its tiny shape")
    ap.add_argument("--temperature", type=harness.non_negative_float, default=0.0,
                    help="sampling temperature; 0: greedy, outputs compared with offline (default 0)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the arrival times (and of sampling, at a temperature; default 0)")
    ap.add_argument("--url", default=None,
                    help="a running server to measure instead of starting one per strategy; --strategy (at most one) "
                         "then names what it runs, for the offline reference")
    ap.add_argument("--startup-timeout", type=harness.positive_float, default=900.0,
                    help="seconds to wait for a server's /health (default 900)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    specs = check_args(ap, args)
    harness.start(args)
    work = tempfile.TemporaryDirectory(prefix="bench-serve-")
    if args.synthetic:
        args.target, args.drafter = save_synthetic(work.name, args.dry_run)
    elif args.dry_run:
        from bench.tiny import save_pair
        harness.progress("dry run: tiny random target and drafter instead of "
                         f"{args.target} and {args.drafter}")
        args.target, args.drafter = save_pair(work.name)
    if args.url:
        specs = ["(running server)"]
    local = args.dry_run or args.synthetic  # model folders made here
    target = args.target if local else harness.resolve_model(args.target)
    drafters = [args.drafter if local else harness.resolve_model(args.drafter), "mag"]
    tokenizer = harness.load_tokenizer(target)
    prompts = order_by_category(load_prompts(path=args.prompts_file))
    keep = 48 if args.dry_run else SYNTHETIC_PROMPT_TOKENS if args.synthetic else None
    encoded = [encode(tokenizer, prompts[i % len(prompts)], max_tokens=keep) for i in range(args.requests)]
    longest = max(map(len, encoded))
    if longest + args.max_new_tokens > args.max_seq_len:
        ap.error(f"--max-seq-len {args.max_seq_len} is too short for the longest prompt ({longest} tokens) and "
                 f"--max-new-tokens {args.max_new_tokens}: give at least {longest + args.max_new_tokens}")

    import csd_engine
    harness.progress(f"loading {args.target} and {args.drafter} for the offline reference")
    engine = csd_engine.Engine(target, drafters=drafters, dtype=harness.DTYPES[args.dtype],
                               max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                               batch_invariant=args.batch_invariant)
    path = harness.record_path(f"serve-{Path(args.target).name}-{args.dtype}", args)
    rows, progress = [], harness.Progress(len(specs))
    for spec in specs:
        server = None
        try:
            if args.url is None:
                server = Server(args, target, drafters, spec, Path(work.name) / f"server-{len(rows)}.log")
                harness.progress(f"{spec}: starting the server")
            url = args.url or server.url
            if server:
                server.wait(args.startup_timeout)
            asyncio.run(run_clients(url, encoded[:1], argparse.Namespace(**{**vars(args), "rate": 0})))  # warm-up
            before = scrape(url)
            results, seconds = asyncio.run(run_clients(url, encoded, args))
            after = scrape(url)
        finally:
            if server:
                server.stop()
        row = {"strategy": spec, **summarize(results, seconds)}
        drafted = after.get("vllm:spec_decode_num_draft_tokens_total", 0) - before.get(
            "vllm:spec_decode_num_draft_tokens_total", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens_total", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens_total", 0)
        row["acceptance"] = accepted / drafted if drafted else None
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            row["first_error"] = errors[0]
        if args.url is None or args.strategy:
            strategy = build_strategy(spec if args.url is None else args.strategy[0], drafters)
            outputs, offline_s = offline(engine, strategy, encoded, args)
            row["offline_tokens_per_s"] = sum(map(len, outputs)) / offline_s
            row["identical_to_offline"] = sum(r.get("tokens") == o for r, o in zip(results, outputs))
            row["offline_match"] = f"{row['identical_to_offline']}/{len(results)}"  # the table's "= offline"
        row["per_request"] = [{k: r.get(k) for k in ("error", "ttft_s", "itl_s")} | {"tokens": len(r.get("tokens", []))}
                              for r in results]
        rows.append(row)
        harness.write_record(path, {"rows": rows}, args)  # a run cut short keeps the strategies done
        progress.step(f"{spec}: {row['tokens_per_s'] or 0:.1f} tokens/s served, TTFT p50 "
                      f"{row['ttft_p50_ms'] or 0:.0f} ms, {row['errors']} errors")

    pair = "synthetic Llama-2-7B-shaped target <- its first layers" if args.synthetic else \
        f"{args.target} <- {args.drafter}"
    print(f"\n{pair} + MaG, {args.dtype}, {args.requests} requests x {args.max_new_tokens} "
          f"tokens, Poisson {args.rate:g}/s, {args.clients} clients, {args.max_batch_size} rows"
          + (f", prefill chunk {args.prefill_chunk}" if args.prefill_chunk else "")
          + (", batch-invariant" if args.batch_invariant else ""))
    print_table(rows, [("strategy", "strategy", "s"), ("tokens_per_s", "tokens/s", ".1f"),
                       ("requests_per_s", "req/s", ".2f"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                       ("ttft_p99_ms", "TTFT p99 ms", ".0f"), ("itl_p50_ms", "ITL p50 ms", ".1f"),
                       ("itl_p99_ms", "ITL p99 ms", ".1f"), ("acceptance", "acceptance", ".2f"),
                       ("offline_tokens_per_s", "offline tokens/s", ".1f"),
                       ("offline_match", "= offline", "s"), ("errors", "errors", "d")])
    harness.finish(path, args)
    work.cleanup()


if __name__ == "__main__":
    harness.run(main)
