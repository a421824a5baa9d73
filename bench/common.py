"""Shared by the bench scripts: prompts, timing, a short table and a JSON record."""
import json
import os
import platform
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def load_prompts(limit: int | None = None, categories: str | None = None) -> list[dict]:
    prompts = json.loads((HERE / "prompts.json").read_text())
    if categories:
        wanted = set(categories.split(","))
        prompts = [p for p in prompts if p["category"] in wanted]
    return prompts[:limit] if limit else prompts


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads (torch {torch.__version__})"


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns]
                                              for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for i, line in enumerate(cells):
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def write_json(name: str, payload: dict, out_dir: str | None = None) -> Path:
    out = Path(out_dir or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"hardware": hardware(), "date": time.strftime("%Y-%m-%d %H:%M"), **payload}
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path


def resolve_model(name: str) -> str:
    from csd_engine.models import zoo
    return str(zoo.resolve(name)) if zoo.is_zoo_name(name) else name


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_s(fn, device: torch.device):
    """(result, seconds) of one call, the device drained on both sides."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


class Stopwatch:
    """Wall time of wrapped calls summed per part. On CUDA the device is drained on both sides
    of each timed call so its GPU work lands in its own part; those syncs slow the step a
    little, which is why benches report the uninstrumented time beside the split."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = defaultdict(float)

    def wrap(self, fn, part_of):
        """part_of(*args, **kwargs) names the part a call belongs to, or None: not timed."""
        def timed(*args, **kwargs):
            part = part_of(*args, **kwargs)
            if part is None:
                return fn(*args, **kwargs)
            out, seconds = wall_s(lambda: fn(*args, **kwargs), self.device)
            self.seconds[part] += seconds
            return out
        return timed


@contextmanager
def instrumented(engine, stopwatch: Stopwatch):
    """Time, per part, the engine's model forwards (`target`, `drafters`, and `prefill`),
    chain verifications (`verify` for reviews of drafts, `sample` for a drafter drawing its own
    next token), tree verifications (`verify`) and MaG's proposals (`mag`). What a step spends
    outside them is the engine's own Python and tensor bookkeeping."""
    from csd_engine.drafters.mag import MaG
    runners = [(engine.target, "target")] + [(d, "drafters") for d in engine.drafters if not isinstance(d, MaG)]
    for runner, part in runners:
        runner.forward = stopwatch.wrap(runner.forward, lambda batch, part=part: part if batch.need_logits else "prefill")
    mags = [d for d in engine.drafters if isinstance(d, MaG)]
    for mag in mags:
        mag.propose = stopwatch.wrap(mag.propose, lambda *a, **kw: "mag")
    verifier = engine.verifier
    chain, tree = verifier.chain, verifier.tree
    assert "chain" not in vars(verifier), "instrumented() does not nest"
    verifier.chain = stopwatch.wrap(chain, lambda logits, *a, **kw: "verify" if logits.shape[1] > 1 else "sample")
    verifier.tree = stopwatch.wrap(tree, lambda *a, **kw: "verify")
    try:
        yield
    finally:
        for runner, _ in runners:
            del runner.forward  # back to the class's method
        for mag in mags:
            del mag.propose
        del verifier.chain, verifier.tree  # back to the class's methods
