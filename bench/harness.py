"""What every bench script shares: its command line, model loading, repeated measurement,
progress lines and the JSON record.

* `parser(__doc__, target=..., rounds=2)`: the shared options each script asks for, plus
  --out, --threads, --dry-run and --no-plot for all; `start(args)` applies --threads.
* `load_pair(args)`: tokenizer, target and drafter (zoo names or folders), or with --dry-run
  bench/tiny.py's random models and character tokenizer.
* `repeat(fn, repeats)`: a warm-up call, then `repeats` timed calls -> `Timing` (median, min,
  max); `spread(values)` is the "min-max" cell the tables print beside a median.
* `Progress(total)`: stderr lines with done/total and an ETA.
* `record_path(name, args)` + `write_record(path, payload)`: bench/results/NAME-YYYYmmdd-HHMMSS.json
  (never overwritten) with the git commit (and whether the tree was dirty), library versions,
  hardware and date in front of the script's payload.
"""
import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from csd_engine import ops

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# name -> (help, type); the default comes from the script
OPTIONS = {
    "target": ("target model: a zoo name (csd_engine/models/zoo.py) or a Hugging Face folder", str),
    "drafter": ("drafter model: a zoo name or a folder", str),
    "dtype": (f"weights and compute dtype: {', '.join(DTYPES)}", str),
    "max_new_tokens": ("tokens generated per prompt (end of sequence ignored)", int),
    "repeats": ("timed runs per measurement after one warm-up; tables show the median and min-max", int),
    "rounds": ("rounds over all prompts and methods; the median time per prompt is kept", int),
    "categories": ("comma-separated prompt categories of bench/prompts.json; all when not given", str),
    "per_category": ("at most this many prompts of each category; all when not given", int),
    "prompts_file": ("prompts to use instead of bench/prompts.json, in its format: a JSON list of {\"category\", "
                     "\"prompt\" or \"messages\"}", str),
}


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """An ArgumentParser whose description is the script's docstring, with the options of
    OPTIONS named in `defaults` (each with its default) and the four every script has."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        help_text, kind = OPTIONS[name]
        choices = list(DTYPES) if name == "dtype" else None
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, choices=choices,
                        help=f"{help_text} (default {default})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="folder for the JSON and pictures (default bench/results)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny random models and a few tokens: proves the script runs end to end in seconds")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG pictures beside the JSON")
    return ap


def start(args: argparse.Namespace) -> None:
    """--threads; a dry run defaults to one thread (tiny models on a busy machine: 30x faster
    than torch's default of one thread per core)."""
    threads = args.threads or (1 if args.dry_run else None)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)


# -- models ---------------------------------------------------------------------------------------
def resolve_model(name: str) -> str:
    from csd_engine.models import zoo
    return str(zoo.resolve(name)) if zoo.is_zoo_name(name) else name


def load_model(name: str, dtype: torch.dtype, dry_run: bool = False, seed: int = 0):
    """A transformers causal LM in eval mode: `name` loaded, or a tiny random one (dry run)."""
    if dry_run:
        from bench.tiny import tiny_qwen2
        return tiny_qwen2(seed=seed).to(dtype)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype).eval()


def load_tokenizer(name: str, dry_run: bool = False):
    if dry_run:
        from bench.tiny import tiny_tokenizer
        return tiny_tokenizer()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model(name))


def load_pair(args: argparse.Namespace):
    """(tokenizer, target, drafter) of --target and --drafter in --dtype; with --dry-run a tiny
    random target and a drafter that is the target plus noise."""
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        from bench.tiny import perturbed
        progress(f"dry run: tiny random target and drafter ({args.dtype}) instead of {args.target} and {args.drafter}")
        target = load_model(args.target, dtype, dry_run=True)
        return load_tokenizer(args.target, dry_run=True), target, perturbed(target)
    progress(f"loading {args.target} and {args.drafter} ({args.dtype})")
    return (load_tokenizer(args.target), load_model(args.target, dtype), load_model(args.drafter, dtype))


def quantized_drafter(model, device, dtype: torch.dtype, scheme: str, dry_run: bool = False):
    """A native runner over `model` with `scheme` weights ("int8", "int4"), built as the engine builds
    a quantized drafter (dense copies for wide calls); a dry run's tiny rows take int4's 32-groups."""
    from csd_engine.models.llama import LlamaRunner
    from csd_engine.models.quant import drafter_dense_rows
    quantize = scheme + "g32" if dry_run and scheme == "int4" else scheme
    return LlamaRunner(model, device, dtype, quantize=quantize, dense_rows=drafter_dense_rows(device, dtype, quantize))


# -- measuring ------------------------------------------------------------------------------------
@dataclass
class Timing:
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)


def repeat(fn, repeats: int, warmup: int = 1):
    """(last result, Timing) of `warmup` untimed calls then `repeats` timed ones."""
    for _ in range(warmup):
        fn()
    seconds, out = [], None
    for _ in range(max(repeats, 1)):
        begin = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - begin)
    return out, Timing(seconds)


def spread(values, fmt: str = ".2f") -> str:
    """The min-max cell printed beside a median ("-" for a single measurement)."""
    values = [v for v in values if v is not None]
    if len(set(values)) < 2:
        return "-"
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Progress:
    """Progress lines for a run of `total` similar units, with an ETA from the mean so far."""

    def __init__(self, total: int):
        self.total, self.done, self.begin = total, 0, time.perf_counter()

    def step(self, msg: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.begin
        left = elapsed / self.done * (self.total - self.done)
        progress(f"[{self.done}/{self.total}, {_duration(elapsed)} in, ETA {_duration(left)}] {msg}")


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


# -- the JSON record ------------------------------------------------------------------------------
def record_path(name: str, args: argparse.Namespace) -> Path:
    """(--out or bench/results)/NAME[-dry-run]-YYYYmmdd-HHMMSS.json (UTC), a new name even
    within the same second."""
    out = Path(args.out or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = name.replace("/", "_") + ("-dry-run" if args.dry_run else "")
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    path, n = out / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.json"
    path.touch()
    return path


def write_record(path: Path, payload: dict, args: argparse.Namespace | None = None) -> Path:
    """Writes the header (bench, date, git, versions, hardware, args) and `payload` to `path`
    (rewritable: a long script may save after every section)."""
    record = {"bench": path.stem, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "git": git_state(),
              "versions": versions(), "hardware": hardware(), **({"args": vars(args)} if args else {}), **payload}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def git_state() -> dict:
    def git(*argv):
        try:
            done = subprocess.run(["git", *argv], cwd=HERE, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):  # no git on the machine (a lent GPU, say)
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(status) if status is not None else None}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("torch", "triton", "transformers", "csd_engine", "numpy"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # built in place (a lent GPU), not installed
            module = sys.modules.get(package)
            found[package] = getattr(module, "__version__", None)
    found["cuda"] = torch.version.cuda
    return found


def hardware() -> dict:
    info = {"machine": platform.machine(), "system": platform.system(), "cpu": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_native_bf16": torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
            "csd_bf16_linear": ops.bf16_kernel_pays()}  # bf16 matmuls through csd_engine's CPU kernel
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def finish(path: Path, args: argparse.Namespace) -> None:
    """Says where the JSON went and draws its pictures beside it (bench/plot.py)."""
    print(f"\nwrote {path}")
    if args.no_plot:
        return
    from bench import plot
    for picture in plot.draw(path):
        print(f"wrote {picture}")
