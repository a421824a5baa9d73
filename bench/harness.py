"""What every bench script shares: its command line, model loading, repeated measurement,
progress lines and the JSON record.

* `parser(__doc__, dry_run={...}, target=..., rounds=2)`: the shared options each script asks for,
  plus --out, --threads, --dry-run and --no-plot for all. Its `parse_args` also refuses what would
  only fail later (an unusable --out, prompt options that select nothing, a model that is neither
  a zoo name nor a folder) and gives the options the command line leaves out their --dry-run
  values. `start(args)` applies --threads. Type functions for counts and lists: `positive_int`,
  `positive_float`, `non_negative_float`, `numbers`, `names`.
* `run(main)`: each script's `if __name__ == "__main__"`: Ctrl-C ends it with one line (and where
  the JSON it wrote so far is) and exit status 130 instead of a traceback.
* `load_pair(args)`: tokenizer, target and drafter (zoo names or folders), or with --dry-run
  bench/tiny.py's random models and character tokenizer.
* `repeat(fn, repeats)`: a warm-up call, then `repeats` timed calls -> `Timing` (median, min,
  max); `spread(values)` is the "min-max" cell the tables print beside a median, `figures(x)` a
  number to 3 significant figures (milliseconds from under 1 to thousands).
* `Progress(total)`: stderr lines with done/total and an ETA.
* `record_path(name, args)` + `write_record(path, payload)`: bench/results/NAME-YYYYmmdd-HHMMSS.json
  (never overwritten) with the git commit (and whether the tree was dirty), library versions,
  hardware and date in front of the script's payload. A name reserved but never written is
  removed when the process ends; each write replaces the file whole (an interrupted write
  leaves the previous one).

Not a script itself: `python bench/harness.py` says which to run.
"""
import argparse
import atexit
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from csd_engine import ops

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEQ_MARGIN = 64  # cache slots past the longest prompt + max_new_tokens (a speculative step's draft overhang)


# -- argparse types -------------------------------------------------------------------------------
def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count (prompts, tokens, repeats, threads): an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type of a seed or an optional count (0: off): an int >= 0."""
    return _int_at_least(text, 0)


def non_negative_float(text: str) -> float:
    """argparse type of a rate or temperature: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type of a duration or budget: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def numbers(kind=int, low=1):
    """argparse type of a comma-separated list of `kind` values >= `low`, each once -> a list."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            values = None
        if not values or any(not low <= v < math.inf for v in values) or len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s >= {low:g}, each once; "
                                             f"got {text!r}")
        return values
    return parse


def names(allowed):
    """argparse type of a comma-separated list of names out of `allowed`, each once -> a list."""
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if set(values) - set(allowed) or len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"expected comma-separated names out of {', '.join(allowed)}, each "
                                             f"once; got {text!r}")
        return values
    return parse


# name -> (help, type); the default comes from the script
OPTIONS = {
    "target": ("target model: a zoo name (csd_engine/models/zoo.py) or a Hugging Face folder", str),
    "drafter": ("drafter model: a zoo name or a folder", str),
    "dtype": (f"weights and compute dtype: {', '.join(DTYPES)}", str),
    "max_new_tokens": ("tokens generated per prompt (end of sequence ignored)", positive_int),
    "repeats": ("timed runs per measurement after one warm-up; tables show the median and min-max", positive_int),
    "rounds": ("rounds over all prompts and methods; the median time per prompt is kept", positive_int),
    "categories": ("comma-separated prompt categories of bench/prompts.json; all when not given", str),
    "per_category": ("this many prompts of each category (each must have that many); all when not given",
                     positive_int),
    "prompts_file": ("prompts to use instead of bench/prompts.json, in its format: a JSON list of {\"category\", "
                     "\"prompt\" or \"messages\"}", str),
}


class Parser(argparse.ArgumentParser):
    """The bench scripts' parser. After parsing it gives the options the command line leaves
    out their --dry-run values (with --dry-run), then refuses, as argparse errors, what would
    otherwise fail only after models are loaded or measurements ran: an --out that cannot
    be written, prompt options that select nothing, a model that is neither a zoo name nor a
    folder. `given`: the dests the last command line set."""

    def __init__(self, doc: str, dry_run: dict):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.dry_run, self.given = dry_run, set()

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        parsed = super().parse_args(argv, namespace)
        self.given = self._given(argv)
        if parsed.dry_run:
            actions = {action.dest: action for action in self._actions}
            for dest, value in self.dry_run.items():
                if dest not in self.given:
                    kind = actions[dest].type
                    setattr(parsed, dest, kind(value) if kind and isinstance(value, str) else value)
        self._check_out(parsed.out)
        if not parsed.dry_run:
            for dest in ("target", "drafter"):
                if hasattr(parsed, dest):
                    self.check_model(getattr(parsed, dest), "--" + dest)
        if hasattr(parsed, "prompts_file"):
            self._check_prompts(parsed)
        return parsed

    def format_help(self) -> str:
        """The --dry-run line lists the values it gives (known once every option is added)."""
        actions = {action.dest: action for action in self._actions}
        given = []
        for dest, value in self.dry_run.items():
            flag = actions[dest].option_strings[-1]
            if value is True:
                given.append(flag)
            elif isinstance(value, list):
                given += [f"{flag} {v}" for v in value]
            else:
                given.append(f"{flag} {value}")
        actions["dry_run"].help = ("tiny random models (bench/tiny.py) instead of the real ones: proves the script "
                                   "runs end to end in seconds, its numbers mean nothing; options not given then take "
                                   + ", ".join(given))
        return super().format_help()

    def _given(self, argv: list[str]) -> set[str]:
        """The dests `argv` sets: a second parse in which no option has a default."""
        defaults = [(action, action.default) for action in self._actions]
        try:
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            return set(vars(super().parse_known_args(argv, argparse.Namespace())[0]))
        finally:
            for action, default in defaults:
                action.default = default

    def _check_out(self, out: str | None) -> None:
        folder = Path(out) if out else HERE / "results"
        what = f"--out {out}" if out else f"the default --out ({folder})"
        if folder.exists() and not folder.is_dir():
            self.error(f"{what} is a file, not a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            self.error(f"{what} cannot hold the results: {exc.strerror or exc}")

    def check_model(self, name: str, flag: str) -> None:
        """`name` is a zoo name, a model folder or a hub id ("org/name"), else an argparse error:
        csd_engine's own check (the CLI's: "did you mean" for a typo of a zoo name, a missing
        path), then anything else that is neither a path nor "org/name"."""
        from csd_engine.models import zoo
        from csd_engine.models.loader import check_spec
        try:
            check_spec(name)
        except ValueError as exc:
            self.error(f"{flag}: {exc}")  # the message names the spec
        if zoo.is_zoo_name(name) or Path(name).expanduser().exists():
            return
        if name.count("/") != 1 or name.startswith((".", "/", "~")):  # not a hub id "org/name" either
            self.error(f"{flag} {name}: no such model folder, and not a zoo name ({', '.join(zoo.MODELS)})")

    def _check_prompts(self, args) -> None:
        """The prompt options select prompts, and --per-category N finds N in every category."""
        from bench.common import load_prompts
        categories, per_category = getattr(args, "categories", None), getattr(args, "per_category", None)
        try:
            prompts = load_prompts(categories=categories, path=args.prompts_file)
        except ValueError as exc:
            self.error(str(exc))
        if per_category:
            counts = {}
            for p in prompts:
                counts[p["category"]] = counts.get(p["category"], 0) + 1
            short = {c: n for c, n in counts.items() if n < per_category}
            if short:
                self.error(f"--per-category {per_category}: " + ", ".join(
                    f"category {c!r} has {n} prompt{'s' * (n != 1)}" for c, n in short.items()))


def parser(doc: str, dry_run: dict | None = None, threads: int | None = None, **defaults) -> Parser:
    """A Parser whose description is the script's docstring, with the options of OPTIONS named in
    `defaults` (each with its default) and the four every script has. `dry_run`: the values
    --dry-run gives options the command line leaves out (written as on the command line; a list
    for a repeatable option); --threads 1 among them."""
    ap = Parser(doc, {"threads": 1, **(dry_run or {})})
    for name, default in defaults.items():
        help_text, kind = OPTIONS[name]
        choices = list(DTYPES) if name == "dtype" else None
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default, choices=choices,
                        help=f"{help_text} (default {default})")
    ap.add_argument("--threads", type=positive_int, default=threads,
                    help="torch CPU threads (default " + (str(threads) if threads else "torch's choice") + ")")
    ap.add_argument("--out", default=None, help="folder for the JSON and pictures (default bench/results)")
    ap.add_argument("--dry-run", action="store_true", help="tiny random models")  # the full help: format_help
    ap.add_argument("--no-plot", action="store_true", help="write no PNG pictures beside the JSON")
    return ap


def start(args: argparse.Namespace) -> None:
    """--threads (a dry run's default is one thread: tiny models on a busy machine run 30x faster
    than with torch's default of one thread per core); a fixed seed."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)


def capacity(encoded: list[list[int]], max_new_tokens: int) -> int:
    """The engine's max_seq_len for these prompts: the longest, its new tokens and a margin, so
    no generation is cut short."""
    return max(map(len, encoded)) + max_new_tokens + SEQ_MARGIN


def fits_drafters(strategy, is_mag: list[bool]) -> None:
    """ValueError where `strategy` could not decode with drafters of these kinds (True: MaG), found
    before any model loads: a K matrix of the wrong size or that drafts nothing, a drafter index
    past the last drafter."""
    from csd_engine import Cascade
    from csd_engine.strategies.cascade import _validate_k_matrix
    if isinstance(strategy, Cascade):
        _validate_k_matrix(strategy.k_matrix, len(is_mag), is_mag)
    drafter = getattr(strategy, "drafter", None)
    if isinstance(drafter, int) and not drafter < len(is_mag):
        raise ValueError(f"drafter={drafter} needs drafter {drafter}, but there are {len(is_mag)}")


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
    a quantized drafter (dense copies for wide calls). "int4" groups 128 inputs where the model's
    widths allow, else the largest group that divides them (said on stderr; SmolLM2's 576 inputs:
    64); a dry run's tiny rows take 32."""
    from csd_engine.models.llama import LlamaRunner
    from csd_engine.models.quant import DEFAULT_INT4_GROUP, INT4_GROUPS, drafter_dense_rows
    quantize = scheme
    if scheme == "int4":
        widths = {model.config.hidden_size, model.config.intermediate_size}
        fits = [g for g in INT4_GROUPS if all(w % g == 0 for w in widths)]
        if not fits:
            raise ValueError(f"int4: no group size of {INT4_GROUPS} divides the drafter's widths {sorted(widths)}")
        group = 32 if dry_run else min(DEFAULT_INT4_GROUP, max(fits))  # 128 divides wherever 256 does
        if group != DEFAULT_INT4_GROUP:
            quantize = f"int4g{group}"
            if not dry_run:
                progress(f"int4 with groups of {DEFAULT_INT4_GROUP} does not fit the drafter's widths "
                         f"{sorted(widths)}: {quantize}")
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


def spread(values, fmt=".2f") -> str:
    """The min-max cell printed beside a median ("-" for a single measurement); `fmt`: a format
    spec or a function (`figures`)."""
    values = [v for v in values if v is not None]
    if len(set(values)) < 2:
        return "-"
    text = fmt if callable(fmt) else lambda v: format(v, fmt)
    return f"{text(min(values))}-{text(max(values))}"


def figures(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant figures without an exponent (0.0123, 1.23, 123, 1234): a
    table cell that says something for a tiny model's 0.4 ms and a large one's 1200 ms alike."""
    if not value or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


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
_reserved: set[Path] = set()  # names record_path handed out and no write_record filled yet
_written: list[Path] = []  # the records this process wrote, in order (run() names the last)


def record_path(name: str, args: argparse.Namespace) -> Path:
    """(--out or bench/results)/NAME[-dry-run]-YYYYmmdd-HHMMSS.json (UTC), a new name even
    within the same second or beside another process: the file is created empty to hold the
    name, and removed when the process ends if nothing was written to it (an interrupted run
    leaves no empty file for bench/plot.py to trip on)."""
    out = Path(args.out or HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = name.replace("/", "_") + ("-dry-run" if args.dry_run else "")
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    path, n = out / f"{stem}.json", 1
    while True:
        try:
            path.open("x").close()
            break
        except FileExistsError:
            n += 1
            path = out / f"{stem}-{n}.json"
    _reserved.add(path)
    return path


@atexit.register
def _drop_unwritten() -> None:
    """Removes the names reserved but never written (still empty)."""
    for path in _reserved:
        try:
            if path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass
    _reserved.clear()


def write_record(path: Path, payload: dict, args: argparse.Namespace | None = None) -> Path:
    """Writes the header (bench, date, git, versions, hardware, args) and `payload` to `path`
    (rewritable: a long script may save after every section). The text goes to a temporary file
    first, then replaces `path` whole: a write cut short (Ctrl-C) keeps the previous record."""
    record = {"bench": path.stem, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "git": git_state(),
              "versions": versions(), "hardware": hardware(), **({"args": vars(args)} if args else {}), **payload}
    text = json.dumps(record, indent=2, default=str) + "\n"
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    _reserved.discard(path)
    if path not in _written:
        _written.append(path)
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


def run(main, argv=None) -> None:
    """A bench script's `if __name__ == "__main__"`: main(argv). Ctrl-C (SIGINT) ends it with
    one line on stderr instead of a traceback, naming the JSON the run last wrote (a script that
    saves as it goes, as compare.py after every round, keeps what it measured there), and exit
    status 130 as a shell's interrupted command. Reserved but unwritten record names are removed
    on the way out (record_path)."""
    try:
        main(argv)
    except KeyboardInterrupt:
        kept = f"; the results it saved so far are in {_written[-1]}" if _written else ""
        print(f"{Path(sys.argv[0]).name}: interrupted{kept}", file=sys.stderr, flush=True)
        sys.exit(130)


def not_a_script(path: str) -> None:
    """What a shared bench module says when run as a script: what it is and what to run
    instead (exit status 2)."""
    scripts = sorted(p.name for p in HERE.glob("*.py") if p.stem not in ("__init__", "harness", "common", "tiny"))
    print(f"{Path(path).name} is a module the bench scripts share, not a benchmark: run one of bench/"
          + ", bench/".join(scripts) + " (each says what it measures in --help; README.md, Running the benchmarks)",
          file=sys.stderr)
    sys.exit(2)


def finish(path: Path, args: argparse.Namespace) -> None:
    """Says where the JSON went and draws its pictures beside it (bench/plot.py)."""
    print(f"\nwrote {path}")
    if args.no_plot:
        return
    from bench import plot
    for picture in plot.draw(path):
        print(f"wrote {picture}")


if __name__ == "__main__":
    not_a_script(__file__)
