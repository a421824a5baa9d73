"""Shared by the bench scripts: prompts, a short table, timing and the engine instrumentation
(bench/harness.py has the command line, loading, repeats and the JSON record)."""
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ALIASES = {"summarisation": "summarization"}  # the spelling of JSON recorded before 2026-11-23


PROMPTS_FORMAT = ('a JSON list of {"category": "...", "prompt": "..."} or {"category": "...", "messages": '
                  '[{"role": "user", "content": "..."}, ...]}, as bench/prompts.json')


def _is_prompt(p) -> bool:
    if not isinstance(p, dict) or not isinstance(p.get("category"), str):
        return False
    messages = p.get("messages")
    if isinstance(messages, list) and messages:
        return all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages)
    return isinstance(p.get("prompt"), str) and bool(p["prompt"])


def load_prompts(limit: int | None = None, categories: str | None = None, per_category: int | None = None,
                 path: str | Path | None = None) -> list[dict]:
    """The entries of bench/prompts.json, or of the file at `path` in its format ({"category", and
    "prompt" (text) or "messages" (chat)}), in file order: those of `categories` (comma-separated;
    default all), at most `per_category` of each, at most `limit` in all. A file that cannot be
    read or holds no prompts, or an unknown category, is a ValueError saying so."""
    path = Path(path) if path else HERE / "prompts.json"
    try:
        prompts = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read prompts from {path}: {exc}; expected {PROMPTS_FORMAT}") from None
    if not isinstance(prompts, list):
        kind = {dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(type(prompts), "a number")
        raise ValueError(f"{path} holds {kind}, not a list of prompts; expected {PROMPTS_FORMAT}")
    if not prompts:
        raise ValueError(f"{path} holds no prompts; expected {PROMPTS_FORMAT}")
    for i, p in enumerate(prompts):
        if not _is_prompt(p):
            raise ValueError(f"{path}: entry {i} is not a prompt ({str(p)[:80]}); expected {PROMPTS_FORMAT}")
    if categories:
        wanted = {ALIASES.get(c.strip(), c.strip()) for c in categories.split(",")}
        unknown = wanted - {p["category"] for p in prompts}
        if unknown:
            raise ValueError(f"no prompts of categories {sorted(unknown)} in {path} (it has "
                             f"{sorted({p['category'] for p in prompts})})")
        prompts = [p for p in prompts if p["category"] in wanted]
    if per_category:
        kept, seen = [], defaultdict(int)
        for p in prompts:
            seen[p["category"]] += 1
            if seen[p["category"]] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit else prompts


def order_by_category(prompts: list[dict]) -> list[dict]:
    """Round-robin over categories (first of each, then second of each...), so the first few
    prompts of a short run cover every kind of text."""
    by_category = defaultdict(list)
    for p in prompts:
        by_category[p["category"]].append(p)
    rounds = max((len(ps) for ps in by_category.values()), default=0)
    return [ps[i] for i in range(rounds) for ps in by_category.values() if i < len(ps)]


def encode(tokenizer, prompt: dict, chat: bool = True, max_tokens: int | None = None) -> list[int]:
    """Token ids of a prompts.json entry: its messages, or its text as one user message, through
    the chat template (`chat=False`: a text prompt's plain tokens). `max_tokens` keeps the last
    ones (dry runs: tiny models have short position tables)."""
    if chat or "messages" in prompt:
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt["prompt"])["input_ids"]
    return list(ids[-max_tokens:]) if max_tokens else list(ids)


def print_table(rows: list[dict], columns: list[tuple]) -> None:
    """columns: (key, header, format: a format spec or a function of the value, as
    harness.figures); a missing or None value prints as "-"."""
    def cell(value, fmt) -> str:
        return "-" if value is None else fmt(value) if callable(fmt) else format(value, fmt)

    cells = [[h for _, h, _ in columns]] + [[cell(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for i, line in enumerate(cells):
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


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
    outside them is the engine's own Python and tensor bookkeeping. The wrappers are instance
    attributes over the classes' methods; whatever was patched is undone on the way out, also
    when the engine's internals no longer match and patching fails half way."""
    from csd_engine.drafters.mag import MaG
    patched = []  # (object, attribute, its own earlier instance value or None)

    def patch(obj, name, part_of):
        earlier = vars(obj).get(name)
        setattr(obj, name, stopwatch.wrap(getattr(obj, name), part_of))
        patched.append((obj, name, earlier))

    assert "chain" not in vars(engine.verifier), "instrumented() does not nest"
    try:
        for runner in [engine.target] + [d for d in engine.drafters if not isinstance(d, MaG)]:
            part = "target" if runner is engine.target else "drafters"
            patch(runner, "forward", lambda batch, part=part: part if batch.need_logits else "prefill")
        for mag in (d for d in engine.drafters if isinstance(d, MaG)):
            for method in ("propose", "extend"):
                patch(mag, method, lambda *a, **kw: "mag")
        patch(engine.verifier, "chain", lambda logits, *a, **kw: "verify" if logits.shape[1] > 1 else "sample")
        patch(engine.verifier, "tree", lambda *a, **kw: "verify")
        yield
    finally:
        for obj, name, earlier in reversed(patched):
            if earlier is None:
                delattr(obj, name)  # back to the class's method
            else:
                setattr(obj, name, earlier)


if __name__ == "__main__":  # a module, not a script: say which to run
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness import not_a_script
    not_a_script(__file__)
