"""Shared by the bench scripts: prompts, timing, a short table and a JSON record."""
import json
import os
import platform
import sys
import time
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
