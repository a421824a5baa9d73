"""Every bench script answers --help and runs its --dry-run end to end (tiny random models), as
a subprocess from the repository root, the way its docstring says to run it."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("compare", "autoregressive", "forward_cost", "tune", "gpu", "plot", "serve", "host_work", "draft_policy",
           "batch")


def cpu_env() -> dict:
    """The environment of a CPU bench run: no Triton interpreter (gpu.py's dry run sets it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ""  # `python bench/X.py` must find `bench` by itself
    return env


def run(*argv, timeout=240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


HELP_ALL = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    for how, run in (("file", lambda: runpy.run_path(f"bench/{name}.py", run_name="__main__")),
                     ("module", lambda: runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True))):
        sys.argv = [name, "--help"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            run()
        assert "usage:" in out.getvalue() and (name == "plot" or "--dry-run" in out.getvalue()), (name, how)
        print(name, how, "ok")
"""


def test_every_script_answers_help_both_ways():
    """Each script's --help run as a file (python bench/X.py) and as a module (python -m
    bench.X), in one process: the imports, not the parsers, take the time. The dry runs below
    start `python bench/X.py` in processes of their own."""
    done = run("-c", HELP_ALL, *SCRIPTS)
    assert done.stdout.count(" ok") == 2 * len(SCRIPTS)


def only_json(folder: Path, prefix: str) -> dict:
    [path] = folder.glob(f"{prefix}*-dry-run-*[0-9].json")
    return json.loads(path.read_text())


def test_compare_takes_a_prompts_file_and_refuses_a_bad_one(tmp_path):
    """--prompts-file: the user's own prompts (text or chat messages) by their own categories;
    a file not in prompts.json's format is refused naming the entry and the format."""
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps([{"category": "legal", "prompt": "Summarise the clause."},
                                {"category": "support", "messages": [{"role": "user", "content": "Reset it?"}]}]))
    run("bench/compare.py", "--dry-run", "--prompts-file", str(mine), "--methods", "ar,cascade", "--rounds", "1",
        "--no-plot", "--out", str(tmp_path))
    assert list(only_json(tmp_path, "compare")["per_category"]) == ["legal", "support"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"category": "legal", "prompt": "ok"}, {"category": "legal", "text": "no"}]))
    done = subprocess.run([sys.executable, "bench/compare.py", "--dry-run", "--prompts-file", str(bad), "--out",
                           str(tmp_path)], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0 and f"{bad}: entry 1 is not a prompt" in done.stderr, done.stderr[-2000:]


def test_compare_dry_run(tmp_path):
    run("bench/compare.py", "--dry-run", "--prompts", "2", "--rounds", "2", "--profile", "--out", str(tmp_path))
    record = only_json(tmp_path, "compare")
    assert record["git"]["commit"] and record["versions"]["torch"] and record["hardware"]["cpu_count"]
    assert record["rounds_done"] == 2 and set(record["methods"]) == set(record["overall"])
    assert list(record["per_category"]) == ["coding", "chat"]  # round-robin over the categories
    for prompt in record["per_prompt"]:
        assert all(len(prompt[key]["seconds"]) == 2 for key in record["methods"])
        # every method's first token came within its own run (transformers' by the streamer, csd's by its metrics)
        assert all(0 < prompt[key]["first_token_s"] <= max(prompt[key]["seconds"]) for key in record["methods"])
    assert record["overall"]["hf"]["speedup"] == pytest.approx(1.0)
    assert record["overall"]["spec-model"]["acceptance_by_position"]
    if "ar" in record["methods"]:  # equality with csd's own plain decoding, per method
        assert record["overall"]["ar"]["same_as_ar"] == "2/2"
        assert all(record["overall"][key]["same_as_ar"] for key in record["methods"])
    else:
        assert all(record["overall"][key]["same_as_ar"] is None for key in record["methods"])
    assert record["profile"], "the profile ran (or warned) for the csd_engine methods"
    for row in record["profile"]:  # no remainder where the parts overlap (PEARL's concurrent rounds)
        assert (row["other_ms"] is None) == ("overlap=True" in row["method"]), row
    assert {p.name.rsplit("-", 1)[1] for p in tmp_path.glob("*.png")} == {"speedup.png", "acceptance.png"}


def test_autoregressive_dry_run(tmp_path):
    run("bench/autoregressive.py", "--dry-run", "--repeats", "2", "--out", str(tmp_path))
    record = only_json(tmp_path, "autoregressive")
    assert record["identical_outputs"] == record["prompts"] == 2
    assert all(len(p["csd_engine native"]["seconds"]) == 2 for p in record["per_prompt"])
    assert list(tmp_path.glob("autoregressive-*-tokens.png"))


def test_batch_dry_run(tmp_path):
    """Autoregressive first (the baseline) whatever --strategy lists, every strategy at every batch
    size, greedy outputs equal to Autoregressive's (tiny float32 models), and the picture."""
    run("bench/batch.py", "--dry-run", "--strategy", "speculative", "--strategy", "autoregressive", "--rounds", "2",
        "--dtype", "float32", "--out", str(tmp_path))
    record = only_json(tmp_path, "batch")
    assert [(row["batch"], row["strategy"]) for row in record["rows"]] == [
        (1, "autoregressive"), (1, "speculative"), (2, "autoregressive"), (2, "speculative")]
    for row in record["rows"]:
        assert row["same"] == "3/3" and len(row["seconds"]) == 2 and row["tokens_per_s"] > 0, row
    assert [row["speedup"] for row in record["rows"][::2]] == [1.0, 1.0]
    assert list(tmp_path.glob("batch-*-batch.png"))


def test_forward_cost_dry_run(tmp_path):
    run("bench/forward_cost.py", "--dry-run", "--dtypes", "float32", "--out", str(tmp_path))
    record = only_json(tmp_path, "forward-cost")
    assert [row["n"] for row in record["rows"]] == [1, 3]
    assert all(row["native_vs_1"] > 0 and row["hf_ms"] > 0 for row in record["rows"])
    assert list(tmp_path.glob("*-forward-cost.png"))


def test_tune_dry_run(tmp_path):
    """Every (a, b) given, the grid's other values at the quick grid's first (one Speculative and
    one MaG-only point, m = 4, l = 1), a point that could not decode skipped (and recorded as
    such), and the picture of tokens/s per configuration."""
    run("bench/tune.py", "--dry-run", "--a", "0,2", "--b", "0,4", "--out", str(tmp_path))
    record = only_json(tmp_path, "tune")
    assert record["auto"]["tokens_per_s"] > 0
    assert sorted(row["config"] for row in record["rows"]) == [
        "Cascade(0.5B+MaG, K=[[0,4],[0,4]], l=1)", "Cascade(0.5B+MaG, K=[[2,0],[0,4]], l=1)",
        "Cascade(0.5B+MaG, K=[[2,4],[0,4]], l=1)", "Cascade(MaG, K=[[8]])", "Speculative(0.5B, k=2)"]
    assert [reason.split(":")[0] for reason in record["skipped"]] == ["Cascade(0.5B+MaG, K=[[0,0],[0,4]], l=1)"]
    assert list(tmp_path.glob("tune-*-configs.png"))


@pytest.mark.parametrize("models", [[], ["--synthetic", "--strategy", "speculative"]], ids=["tiny-pair", "synthetic"])
def test_serve_dry_run(tmp_path, models):
    """Two strategies, each behind a server of its own: every streamed request arrives whole and
    equals the offline scheduler's greedy output (also with --synthetic's model, in its tiny
    shape, behind one server)."""
    run("bench/serve.py", "--dry-run", *models, "--out", str(tmp_path))
    record = only_json(tmp_path, "serve")
    expected = ["speculative"] if "--synthetic" in models else ["autoregressive", "speculative"]
    assert [row["strategy"] for row in record["rows"]] == expected
    for row in record["rows"]:
        assert row["errors"] == 0 and row["identical_to_offline"] == row["requests"] == 6, row
        assert row["offline_match"] == "6/6", row
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] > 0
        assert row["offline_tokens_per_s"] > 0 and len(row["per_request"]) == 6
        if row["strategy"] == "autoregressive":
            assert row["acceptance"] is None
        else:
            assert 0 <= row["acceptance"] <= 1


def test_draft_policy_dry_run(tmp_path):
    run("bench/draft_policy.py", "--dry-run", "--out", str(tmp_path))
    record = only_json(tmp_path, "draft-policy")
    assert list(record["overall"]) == record["policies"] and len(record["per_prompt"]) == 7
    for policy, cell in record["overall"].items():
        assert cell["tokens_per_cost"] > 0 and cell["tokens_per_forward"] >= 1, policy
    assert record["costs"]["drafter"] > 0 and record["costs"]["widths"][0] == [1, 1.0]
    assert list(tmp_path.glob("draft-policy-*-policies.png"))
    [recorded] = tmp_path.glob("draft-policy-*.json")
    run("bench/draft_policy.py", "--dry-run", "--replay", str(recorded), "--drafter-cost", "5", "--no-plot",
        "--out", str(tmp_path / "replayed"))
    replayed = only_json(tmp_path / "replayed", "draft-policy")
    assert replayed["traces"] == record["traces"] and replayed["costs"]["widths"] == record["costs"]["widths"]
    assert replayed["costs"]["drafter"] == 5.0  # a drafter dearer than the target: drafting cannot pay
    assert {k: replayed["args"][k] for k in ("target", "quantize", "per_category", "dry_run")} == {
        k: record["args"][k] for k in ("target", "quantize", "per_category", "dry_run")}
    assert replayed["overall"]["chain k=4"]["tokens_per_cost"] < min(1.0, record["overall"]["chain k=4"]["tokens_per_cost"])


def test_host_work_dry_run(tmp_path):
    """Counts, not timings: no strategy step reads the host, and a cascade launches more than
    autoregressive decoding (its reviews and MaG calls)."""
    run("bench/host_work.py", "--dry-run", "--threads", "2", "--out", str(tmp_path))
    record = only_json(tmp_path, "host-work")
    assert record["hardware"]["torch_threads"] == 2  # --threads as given
    assert all(row["host_reads_per_step"] == 0 for row in record["rows"])
    launches = {row["strategy"]: row["launches_per_step"] for row in record["rows"]}
    assert launches["cascade [[4,2],[0,4]] l=2"] > launches["autoregressive"] > 0
    assert list(tmp_path.glob("host-work-*-launches.png"))


def test_gpu_dry_run_on_the_cpu(tmp_path):
    """gpu.py's dry run: tiny shapes on the CPU, its kernels in Triton's interpreter (the copy
    bandwidth, the verification kernel, the quantized drafter and PEARL's two sides at once:
    the whole dry run takes about 40 s)."""
    run("bench/gpu.py", "--dry-run", "--sections", "verify,quantized_drafter,pearl", "--out", str(tmp_path))
    record = only_json(tmp_path, "gpu")
    assert isinstance(record["sections"]["verify_kernel"], list), record["sections"]["verify_kernel"]
    timed = {(r["scheme"], r["batch"], r["n"]) for r in record["sections"]["quantized_drafter"] if "graph_ms" in r}
    assert {("bf16", 1, 1), ("int8", 2, 5), ("int4g32", 2, 5)} <= timed, record["sections"]["quantized_drafter"]
    assert record["sections"]["copy_bandwidth"]["gb_per_s"] > 0
    [pearl] = [row for row in record["sections"]["pearl"] if row["strategy"].startswith("Pearl")]
    # recorded, not bounded (that would be a timed test): on a busy 2-core machine it came out at 1.37 once
    assert pearl["concurrent_ms"] > 0 and math.isfinite(pearl["overlap"]), pearl


def test_plot_redraws_recorded_json(tmp_path):
    """The README's pictures come from bench/measured/ JSON recorded before this harness."""
    for name in ("compare-qwen-bf16-cpu-2026-11-22-run2.json", "gpu-h100-2026-11-22-run1.json"):
        shutil.copy(ROOT / "bench" / "measured" / name, tmp_path)
    run("bench/plot.py", *map(str, sorted(tmp_path.glob("*.json"))))
    assert {p.name for p in tmp_path.glob("*.png")} == {"compare-qwen-bf16-cpu-2026-11-22-run2-speedup.png",
                                                        "gpu-h100-2026-11-22-run1-step-split.png"}
