"""Pictures of a bench JSON, drawn beside it as PNGs (the bench scripts call this after writing
their JSON; run it alone to redraw recorded ones, e.g. the README's):

    python bench/plot.py bench/measured/compare-qwen-bf16-cpu-2026-11-22-run2.json
    python bench/plot.py bench/results/*.json

* compare JSON -> X-speedup.png: speedup over transformers' `generate` per method, one bar per
  prompt category and one for all prompts; X-acceptance.png: acceptance rate by draft position
  per csd_engine method (JSON recorded since 2026-11-23 only).
* gpu JSON -> X-step-split.png: ms per target step split into target, drafters, verify,
  sample, MaG and other, one stacked bar per strategy and split variant; beside it, tokens/s
  relative to autoregressive decoding per strategy and variant (step graphs at batch 1 and 8).
* forward-cost JSON -> X-forward-cost.png: cost of an n-token forward relative to one token.
* serve JSON -> X-latency.png: per strategy, tokens/s served (and offline), time to first token
  and inter-token latency (p50 and p99).
* draft-policy JSON -> X-policies.png: tokens per cost of each replayed draft policy, per category.
* tune JSON -> X-configs.png: tokens/s per configuration of the grid, Autoregressive and
  Cascade.auto() (highlighted).
* autoregressive JSON -> X-tokens.png: tokens/s per method.
* batch JSON -> X-batch.png: tokens/s over Autoregressive's per strategy, one bar per batch size.

Every file that can be read is drawn; one that cannot (missing, empty, not JSON) or that none
of these pictures is drawn from is named, and the exit status is then 1. Needs matplotlib (in
requirements-ci.txt); without it, says so and draws nothing.
"""
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/plot.py`: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ALIASES  # noqa: E402

SPLIT_PARTS = ("target", "drafters", "verify", "sample", "mag", "other")
# Fonts with CJK glyphs, tried after DejaVu Sans (matplotlib falls back glyph by glyph): prompt
# categories and labels in Chinese, Japanese or Korean are drawn where one of these is installed,
# as matplotlib's placeholder glyphs where none is.
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Sans CJK KR", "Source Han Sans SC",
             "Source Han Sans", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "Droid Sans Fallback", "AR PL UMing CN",
             "Microsoft YaHei", "SimHei", "PingFang SC", "Hiragino Sans", "Yu Gothic", "Malgun Gothic")


def draw(json_path) -> list[Path]:
    """Draws every picture the JSON has data for; returns the PNG paths."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no pictures (pip install matplotlib, then python bench/plot.py JSON)",
              file=sys.stderr)
        return []
    matplotlib.use("Agg")
    from matplotlib import font_manager
    installed = {font.name for font in font_manager.fontManager.ttflist}
    matplotlib.rcParams["font.family"] = ["DejaVu Sans", *(name for name in CJK_FONTS if name in installed)]
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    stem = json_path.with_suffix("")
    pictures = []
    if "per_prompt" in data and data.get("rows") and all("key" in row for row in data["rows"]):  # compare
        pictures.append(speedup_by_category(data, Path(f"{stem}-speedup.png")))
        pictures.append(acceptance_by_position(data, Path(f"{stem}-acceptance.png")))
    if "sections" in data:
        pictures.append(step_split(data, Path(f"{stem}-step-split.png")))
    if data.get("rows") and "native_ms" in data["rows"][0]:
        pictures.append(forward_cost(data, Path(f"{stem}-forward-cost.png")))
    if data.get("rows") and "ttft_p50_ms" in data["rows"][0]:
        pictures.append(serve_latency(data, Path(f"{stem}-latency.png")))
    if data.get("rows") and "launches_per_step" in data["rows"][0]:
        pictures.append(host_work(data, Path(f"{stem}-launches.png")))
    if "policies" in data:
        pictures.append(draft_policies(data, Path(f"{stem}-policies.png")))
    if data.get("rows") and "auto" in data and "best" in data:
        pictures.append(tune_configs(data, Path(f"{stem}-configs.png")))
    if data.get("rows") and "identical_outputs" in data:
        pictures.append(autoregressive(data, Path(f"{stem}-tokens.png")))
    if data.get("rows") and {"batch", "same_as_ar"} <= set(data["rows"][0]):
        pictures.append(by_batch_size(data, Path(f"{stem}-batch.png")))
    return [p for p in pictures if p]


# -- compare --------------------------------------------------------------------------------------
def method_labels(data: dict) -> dict:
    """key -> label, in the run's order."""
    return data.get("methods") or {row["key"]: row["method"] for row in data["rows"]}


def speedups(data: dict) -> dict[str, dict[str, float]]:
    """category (and "all prompts") -> method key -> speedup over "hf". JSON from before
    2026-11-23 has no per-category block: there it is rebuilt from the per-prompt tokens/s
    (every prompt generated the same number of tokens, so summed seconds = a harmonic mean)."""
    keys = list(method_labels(data))
    if "per_category" in data:
        table = {ALIASES.get(c, c): {k: cell["speedup"] for k, cell in cells.items()}
                 for c, cells in data["per_category"].items()}
        table["all prompts"] = {k: cell["speedup"] for k, cell in data["overall"].items()}
        return table
    by_category = {}
    for row in data["per_prompt"]:
        by_category.setdefault(ALIASES.get(row["category"], row["category"]), []).append(row)
    by_category["all prompts"] = data["per_prompt"]
    table = {}
    for category, rows in by_category.items():
        seconds_per_token = {k: sum(1 / r[k]["tokens_per_s"] for r in rows) for k in keys}
        table[category] = {k: seconds_per_token["hf"] / seconds_per_token[k] for k in keys}
    return table


def speedup_by_category(data: dict, png: Path) -> Path | None:
    labels = method_labels(data)
    if "hf" not in labels:
        print(f"{png.name}: no transformers generate baseline in the run, no speedup picture", file=sys.stderr)
        return None
    keys = [k for k in labels if k != "hf"]
    names = {k: labels[k].replace("csd_engine ", "").replace("transformers ", "HF ") for k in keys}
    return grouped_bars(speedups(data), names, "speedup over transformers generate (1.0 = dashed line)",
                        title(data, "speedup per method and prompt category"), png)


def grouped_bars(table: dict[str, dict[str, float]], names: dict[str, str], ylabel: str, heading: str,
                 png: Path) -> Path:
    """One group of bars per key of `names` (its label), one bar per group of `table` (category ->
    key -> value); the group "all prompts" in black; a dashed line at 1."""
    import matplotlib.pyplot as plt
    keys, groups = list(names), list(table)
    width = 0.8 / len(groups)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(keys) + 2), 5.5))
    for g, group in enumerate(groups):
        xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(keys))]
        values = [table[group].get(k) or 0.0 for k in keys]
        overall = group == "all prompts"
        ax.bar(xs, values, width, label=group, color="black" if overall else colors(g % 10),
               alpha=1.0 if overall else 0.85)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([wrap(names[k], 18) for k in keys], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(heading, fontsize=10)
    ax.legend(ncols=min(len(groups), 4), fontsize=8, loc="upper left")
    ax.set_ylim(0, max(max(v or 0 for v in row.values()) for row in table.values()) * 1.25)
    return save(fig, png)


def acceptance_by_position(data: dict, png: Path) -> Path | None:
    import matplotlib.pyplot as plt
    labels = method_labels(data)
    lines = {k: cell.get("acceptance_by_position") for k, cell in data.get("overall", {}).items()}
    lines = {k: v for k, v in lines.items() if v and k != "ar"}
    if not lines:
        why = ("the run has no csd_engine speculative method" if "per_category" in data
               else "the JSON has no acceptance by draft position (recorded since 2026-11-23)")
        print(f"{png.name}: {why}, no acceptance picture", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, rates in lines.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=labels[key].replace("csd_engine ", ""))
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("acceptance rate by the target (mean over prompts)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title(data, "acceptance by draft position"), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, png)


# -- draft policy ---------------------------------------------------------------------------------
def draft_policies(data: dict, png: Path) -> Path:
    costs = data["costs"]
    table = {c: {p: cell["tokens_per_cost"] for p, cell in cells.items()} for c, cells in data["per_category"].items()}
    table["all prompts"] = {p: cell["tokens_per_cost"] for p, cell in data["overall"].items()}
    return grouped_bars(table, {p: p for p in data["policies"]}, "tokens per cost (x plain decoding)",
                        title(data, f"draft policies replayed on recorded acceptance (drafter {costs['drafter']:.2f}, "
                                    f"step {costs['step']:.2f} of a target forward)"), png)


# -- gpu ------------------------------------------------------------------------------------------
def step_split(data: dict, png: Path) -> Path | None:
    """Left: ms per target step split into its parts, one stacked bar per strategy of the split
    variants (eager, forward graphs). Right: every variant's tokens/s relative to autoregressive
    decoding in the same variant (one graph per step too, batch 1 and 8), grouped by variant."""
    import matplotlib.pyplot as plt
    rows = data["sections"].get("step_split")
    if not isinstance(rows, list) or not rows:
        print(f"{png.name}: the JSON has no step_split rows", file=sys.stderr)
        return None
    rows = [row for row in rows if "tokens_per_s" in row]  # a failed row has its error only
    split = [row for row in rows if "target_ms" in row]
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    strategies = list(dict.fromkeys(row["strategy"] for row in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(min(22, max(10, 1.1 * len(split) + 0.9 * len(rows) + 2)), 5.5),
                                      gridspec_kw={"width_ratios": [max(len(split), 1), max(len(rows), 1)]})
    bottoms = [0.0] * len(split)
    for part in SPLIT_PARTS:
        values = [max(row.get(f"{part}_ms", 0.0), 0.0) for row in split]
        left.bar(range(len(split)), values, 0.6, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, row in enumerate(split):
        left.text(i, bottoms[i], f"{row['tokens_per_s']:.0f} tok/s\nMAT {row['mean_accepted']:.2f}",
                  ha="center", va="bottom", fontsize=7)
    left.set_xticks(range(len(split)))
    left.set_xticklabels([f"{wrap(row['strategy'], 16)}\n({row['variant']})" for row in split], fontsize=7)
    left.set_ylabel("ms per target step (a run with a sync around each part)")
    left.set_ylim(0, max(bottoms + [1.0]) * 1.2)
    left.legend(fontsize=7)
    left.set_title("where a step's time goes", fontsize=9)
    width = 0.8 / max(len(strategies), 1)
    for j, strategy in enumerate(strategies):
        xs, ys = [], []
        for i, variant in enumerate(variants):
            mine = [r for r in rows if r["variant"] == variant and r["strategy"] == strategy]
            base = [r for r in rows if r["variant"] == variant and r["strategy"] == "autoregressive"]
            if mine and base:
                xs.append(i - 0.4 + (j + 0.5) * width)
                ys.append(mine[0]["tokens_per_s"] / base[0]["tokens_per_s"])
        right.bar(xs, ys, width, label=strategy)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(variants)))
    right.set_xticklabels([wrap(v, 18) for v in variants], fontsize=7)
    right.set_ylabel("tokens/s / autoregressive's, same variant")
    right.legend(fontsize=7)
    right.set_title("speculation against plain decoding", fontsize=9)
    device = data.get("device") or data.get("versions", {}).get("device", "?")
    fig.suptitle(f"speculative steps, {device}, {data.get('date', '')}", fontsize=10)
    return save(fig, png)


# -- forward cost ---------------------------------------------------------------------------------
def forward_cost(data: dict, png: Path) -> Path:
    import matplotlib.pyplot as plt
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    paths = [key[:-len("_vs_1")] for key in rows[0] if key.endswith("_vs_1")]
    labels = data.get("paths", {})
    for model, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["dtype"]) == (model, dtype)]
        for path in (p for p in paths if f"{p}_vs_1" in mine[0]):  # a drafter row has the native path only
            ax.plot([r["n"] for r in mine], [r[f"{path}_vs_1"] for r in mine], marker="o",
                    label=f"{model} {dtype} {labels.get(path, path)}")
    ax.set_xticks(sorted({r["n"] for r in rows}))
    ax.set_xlabel("new tokens in one forward (n)")
    ax.set_ylabel("time / time of a 1-token forward")
    context = data.get("args", {}).get("context", "?")
    ax.set_title(f"what a forward of n tokens costs after {context} cached tokens\n{hardware_name(data)}, "
                 f"{data.get('date', '')}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, png)


def serve_latency(data: dict, png: Path) -> Path:
    import matplotlib.pyplot as plt
    rows = data["rows"]
    names = [wrap(str(r["strategy"]), 28) for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
    panels = [("tokens/s", [("tokens_per_s", "served"), ("offline_tokens_per_s", "offline")]),
              ("time to first token (ms)", [("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")]),
              ("inter-token latency (ms)", [("itl_p50_ms", "p50"), ("itl_p99_ms", "p99")])]
    for ax, (what, series) in zip(axes, panels):
        for i, (key, label) in enumerate(series):
            ax.bar([p + 0.4 * i - 0.2 for p in x], [r.get(key) or 0 for r in rows], width=0.4, label=label)
        ax.set_xticks(list(x), names, fontsize=7)
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    args = data.get("args", {})
    fig.suptitle(f"served under Poisson arrivals: {args.get('requests', '?')} requests at {args.get('rate', '?')}/s, "
                 f"{args.get('max_batch_size', '?')} rows\n{args.get('target', '?')} <- {args.get('drafter', '?')}, "
                 f"{args.get('dtype', '?')}; {hardware_name(data)}; {data.get('date', '')}", fontsize=10)
    return save(fig, png)


# -- host work ------------------------------------------------------------------------------------
def host_work(data: dict, png: Path) -> Path:
    """Kernel launches per step besides the model forwards (bench/host_work.py), batch 1, per mode."""
    import matplotlib.pyplot as plt
    rows = [r for r in data["rows"] if r["batch"] == min(r["batch"] for r in data["rows"])]
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(names) + 2), 5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = {r["strategy"]: r["launches_per_step"] for r in rows if r["mode"] == mode}
        ax.bar([j + (i - (len(modes) - 1) / 2) * width for j in range(len(names))],
               [values.get(n, 0) for n in names], width, label=mode)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([wrap(n, 14) for n in names], fontsize=8)
    ax.set_ylabel("kernel launches per step, model forwards excluded")
    ax.set_title(f"host work of a decoding step (batch {rows[0]['batch']}): what a GPU waits on unless the step "
                 f"is one graph\n{hardware_name(data)}; {data.get('date', '')}", fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, png)


# -- tune and autoregressive ----------------------------------------------------------------------
def tune_configs(data: dict, png: Path) -> Path:
    """Tokens/s of every grid configuration (fastest first), then Autoregressive and Cascade.auto()."""
    rows = data["rows"] + [data["autoregressive"], data["auto"]]
    colors = ["tab:blue"] * len(data["rows"]) + ["grey", "tab:red"]
    quantize = data.get("args", {}).get("quantize")
    return bars([r["config"] for r in rows], [r["tokens_per_s"] for r in rows], colors,
                title(data, "tokens/s per configuration: the grid (blue), Autoregressive (grey), Cascade.auto() (red)"
                      + (f"; {quantize} drafter" if quantize else "")), png)


def autoregressive(data: dict, png: Path) -> Path:
    rows = data["rows"]
    return bars([r["method"] for r in rows], [r["tokens_per_s"] for r in rows], ["tab:blue"] * len(rows),
                title(data, f"autoregressive decoding, batch 1, {data.get('prompts', '?')} prompts"), png)


def by_batch_size(data: dict, png: Path) -> Path:
    table = {}
    for row in data["rows"]:
        table.setdefault(f"batch {row['batch']}", {})[row["strategy"]] = row["speedup"]
    names = {r["strategy"]: r["strategy"] for r in data["rows"] if r["strategy"] != "autoregressive"}
    return grouped_bars(table, names, "x autoregressive at the same batch size (1.0 dashed)",
                        title(data, f"tokens/s by batch size, {data.get('prompts', '?')} prompts"), png)


def bars(names: list[str], values: list[float], colors: list[str], heading: str, png: Path) -> Path:
    """One horizontal bar of tokens/s per name, the first on top, each with its value."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.38 * len(names)))
    ys = range(len(names))
    ax.barh(ys, values, color=colors)
    for y, value in zip(ys, values):
        ax.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s")
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title(heading, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    return save(fig, png)


# -- shared ---------------------------------------------------------------------------------------
def title(data: dict, what: str) -> str:
    args = data.get("args", {})
    pair = f"{args.get('target', '?')} <- {args['drafter']}" if "drafter" in args else args.get("target", "?")
    run = f"{pair}, {args.get('dtype', '?')}"
    if args.get("dry_run"):
        run = f"DRY RUN (tiny random models, numbers mean nothing), {args.get('dtype', '?')}"
    sampled = ""
    if args.get("temperature"):  # a sampled run (compare.py --temperature): a line of its own
        sampled = f"\nsampled at temperature {args['temperature']:g}" + "".join(
            f", {name} {args[key]:g}" for key, name, off in (("top_k", "top-k", 0), ("top_p", "top-p", 1.0))
            if args.get(key, off) != off)
    return (f"{what}\n{run}, {args.get('max_new_tokens', '?')} new tokens; {hardware_name(data)}; "
            f"{data.get('date', '')}{sampled}")


def hardware_name(data: dict) -> str:
    """The GPU or CPU a run measured (JSON before 2026-11-23: one descriptive string)."""
    hardware = data.get("hardware", "?")
    return hardware.get("gpu") or hardware.get("cpu") if isinstance(hardware, dict) else hardware


def wrap(text: str, width: int) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


def save(fig, png: Path) -> Path:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return png


def main(argv=None):
    """Draws every readable file's pictures; then exit status 1 naming the files that could not be
    read as a bench JSON or had nothing to draw, if any."""
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench JSON files")
    unreadable, undrawn = [], []
    for json_path in ap.parse_args(argv).json:
        why, text = None, ""
        try:
            text = Path(json_path).read_text()
            data = json.loads(text)
        except OSError as exc:
            why = f"cannot be read ({exc.strerror or exc})"
        except ValueError as exc:
            why = f"not JSON ({exc})" if text.strip() else "an empty file"
        else:
            if not isinstance(data, dict):
                why = "not a bench JSON (a JSON object with the script's results)"
        if why:
            print(f"{json_path}: {why}", file=sys.stderr)
            unreadable.append(json_path)
            continue
        pictures = draw(json_path)
        for picture in pictures:
            print(f"wrote {picture}")
        if not pictures:
            undrawn.append(json_path)
    problems = []
    if unreadable:
        problems.append(f"could not read {', '.join(unreadable)} (above)")
    if undrawn:
        problems.append(f"no picture drawn from {', '.join(undrawn)}: the data it needs is not there (above), or it "
                        "is not the JSON of a bench script this draws (compare, gpu, forward_cost, serve, host_work, "
                        "draft_policy, tune, autoregressive)")
    if problems:
        sys.exit("; ".join(problems))


if __name__ == "__main__":
    from bench import harness
    harness.run(main)
