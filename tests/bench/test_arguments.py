"""The bench scripts refuse bad input as argparse errors (exit status 2, a message naming the
problem) while parsing, before any model loads: in process, no models."""
import argparse
import dataclasses
import json
import time
from argparse import Namespace
from pathlib import Path

import pytest

from bench import autoregressive, batch, compare, draft_policy, forward_cost, gpu, host_work, plot, serve, tune
from bench.draft_policy import Trace

ROOT = Path(__file__).resolve().parents[2]


def refused(capsys, call, *argv) -> str:
    """The argparse error message of call(argv), which must exit with status 2."""
    with pytest.raises(SystemExit) as exc:
        call(list(argv))
    assert exc.value.code == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,cascade:l=0.5"], "method 'cascade:l=0.5': Cascade(lenience=...) must be a number >= 1"),
    (["--methods", "cascade:K=5"], "method 'cascade:K=5': k_matrix must be a square list of lists"),
    (["--methods", "cascade:m=0"], "method 'cascade:m=0': Cascade(mag_tokens=...) must be an int >= 1"),
    (["--methods", "cascade-tree:tree=[0]"], "method 'cascade-tree:tree=[0]': Cascade.tree must be a tuple"),
    (["--methods", "cascade-auto:cost=-1"], "method 'cascade-auto:cost=-1': Cascade.auto(model_cost=...) must be"),
    (["--methods", "spec-auto-int4:max=0"],
     "method 'spec-auto-int4:max=0': Speculative.auto(max_tokens=...) must be an int in [1, 64], got 0"),
    (["--methods", "cascade-auto", "--auto-max-tokens", "0"],
     "method 'cascade-auto': Cascade.auto(max_tokens=...) must be an int >= 1, got 0"),
    (["--methods", "cascade:K=[[0,0],[0,4]]"], "method 'cascade:K=[[0,0],[0,4]]': K row 0 sums to 0"),
    (["--methods", "cascade:K=[[4]]"], "K matrix must be 2x2"),
    (["--methods", "cascade-mag", "--k-mag-matrix", "[[2,4],[0,4]]"], "method 'cascade-mag': K matrix must be 1x1"),
    (["--methods", "cascade:l=2:l=3"], "method 'cascade:l=2:l=3': l is given twice"),
    (["--methods", "ar,spec-model", "--k", "0"], "method 'spec-model': Speculative.k must be an int in [1, 64]"),
    (["--methods", "spec-mag", "--k-mag", "0"], "method 'spec-mag': Speculative.k must be an int in [1, 64]"),
    (["--k-matrix", "garbage"], "argument --k-matrix: expected JSON"),
])
def test_compare_builds_every_method_strategy_while_parsing(argv, message, capsys):
    assert message in refused(capsys, compare.parse_args, *argv)


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "-1"], "argument --prompts: expected an int >= 1, got -1"),
    (["--prompts", "0"], "argument --prompts: expected an int >= 1, got 0"),
    (["--per-category", "0"], "argument --per-category: expected an int >= 1, got 0"),
    (["--per-category", "-1"], "argument --per-category: expected an int >= 1, got -1"),
    (["--per-category", "5"], "--per-category 5: category 'summarization' has 4 prompts"),
    (["--rounds", "0"], "argument --rounds: expected an int >= 1, got 0"),
    (["--threads", "0"], "argument --threads: expected an int >= 1, got 0"),
    (["--threads", "-2"], "argument --threads: expected an int >= 1, got -2"),
    (["--categories", "qa,poetry"], "no prompts of categories ['poetry']"),
    (["--prompts-file", "/nonexistent/mine.json"], "cannot read prompts from /nonexistent/mine.json"),
    (["--out", "/proc/nope"], "--out /proc/nope cannot hold the results"),
    (["--target", "/nonexistent"], "--target: '/nonexistent': no such file or folder"),
    (["--target", "qwen2.5-coder-1.5"], "--target: 'qwen2.5-coder-1.5' is not a model: did you mean "
                                        "'qwen2.5-coder-1.5b'?"),
    (["--drafter", "Qwen2.5-Coder-0.5B"], "did you mean 'qwen2.5-coder-0.5b'?"),
    (["--target", str(ROOT / "bench")], f"--target: '{ROOT / 'bench'}' is a folder but not a model folder"),
    (["--drafter", "qwen-typo"], "--drafter qwen-typo: no such model folder, and not a zoo name"),
])
def test_shared_options_are_checked_while_parsing(argv, message, capsys):
    assert message in refused(capsys, compare.parse_args, *argv)


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "20"], "--top-k and --top-p filter sampled tokens: give a --temperature > 0 with them"),
    (["--top-p", "0.9"], "--top-k and --top-p filter sampled tokens: give a --temperature > 0 with them"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "-1"], "argument --temperature: expected a finite number >= 0, got '-1'"),
    (["--temperature", "1e-9"], "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    (["--temperature", "0.7", "--top-k", "-3"], "argument --top-k: expected an int >= 0, got -3"),
    (["--temperature", "0.7", "--seed", "x"], "argument --seed: expected an int >= 0, got 'x'"),
])
def test_compare_checks_its_sampling_settings_while_parsing(argv, message, capsys):
    assert message in refused(capsys, compare.parse_args, *argv)


def test_out_must_be_a_folder(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert f"--out {taken} is a file, not a folder" in refused(capsys, compare.parse_args, "--out", str(taken))
    args = compare.parse_args(["--dry-run", "--out", str(tmp_path / "new" / "folder")])
    assert (tmp_path / "new" / "folder").is_dir() and args.out.endswith("folder")


def test_dry_run_values_give_way_to_the_options_given(tmp_path):
    ap = serve.parser()
    args = ap.parse_args(["--dry-run", "--out", str(tmp_path)])
    assert (args.rate, args.requests, args.threads, args.strategy) == (50.0, 6, 1, ["autoregressive", "speculative"])
    args = ap.parse_args(["--dry-run", "--rate", "3", "--requests", "10", "--strategy", "cascade", "--threads", "2",
                          "--out", str(tmp_path)])
    assert (args.rate, args.requests, args.threads, args.strategy) == (3.0, 10, 2, ["cascade"])
    assert serve.check_args(ap, args) == ["cascade"]
    assert ap.parse_args(["--out", str(tmp_path)]).rate == 2.0
    assert ("options not given then take --threads 1, --requests 6, --max-new-tokens 8, --rate 50.0, --max-seq-len "
            "128, --strategy autoregressive, --strategy speculative") in " ".join(ap.format_help().split())


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "speculative", "--strategy", "bogus"], "--strategy bogus: unknown strategy 'bogus'"),
    (["--strategy", '{"cascade": {"k_matrix": [[0, 0], [0, 4]]}}'], "K row 0 sums to 0"),
    (["--strategy", '{"cascade": {"k_matrix": [[2,4]'], "--strategy-config must be JSON"),
    (["--prefill-chunk", "0"], "argument --prefill-chunk: expected an int >= 1, got 0"),
    (["--temperature", "-1"], "argument --temperature: expected a finite number >= 0, got '-1'"),
    (["--temperature", "1e-9"], "--temperature 1e-09: temperature must be 0 (greedy) or a finite number >= 1e-06"),
    (["--max-batch-size", "0"], "argument --max-batch-size: expected an int >= 1, got 0"),
    (["--clients", "0"], "argument --clients: expected an int >= 1, got 0"),
    (["--requests", "0"], "argument --requests: expected an int >= 1, got 0"),
    (["--rate", "-1"], "argument --rate: expected a finite number >= 0, got '-1'"),
    (["--startup-timeout", "0"], "argument --startup-timeout: expected a finite number > 0, got '0'"),
    (["--target", "qwen2.5-coder-1.5"], "did you mean 'qwen2.5-coder-1.5b'?"),
    (["--url", "http://127.0.0.1:9", "--strategy", "autoregressive", "--strategy", "speculative"],
     "give at most one --strategy"),
    (["--url", "http://127.0.0.1:9", "--dry-run"], "--url measures a running server"),
    (["--url", "http://127.0.0.1:PORT"], "--url http://127.0.0.1:PORT: no server answers there (ConnectError"),
])
def test_serve_checks_every_strategy_and_option_before_starting_a_server(argv, message, capsys):
    port = str(serve.free_port())  # nothing listens there
    argv, message = [a.replace("PORT", port) for a in argv], message.replace("PORT", port)
    ap = serve.parser()
    assert message in refused(capsys, lambda a: serve.check_args(ap, ap.parse_args(a)), *argv)


def test_tune_refuses_or_skips_grid_points_that_cannot_decode(capsys):
    assert ("no cascade grid point can decode: Cascade(0.5B+MaG, K=[[0,0],[0,4]], l=1): K row 0 sums to 0"
            in refused(capsys, tune.main, "--a", "0", "--b", "0", "--m", "4"))
    configs, skipped = tune.grid(Namespace(quick=True, quantize=None, a=[0, 2], b=[0], m=[4], lenience_values=[2.0]))
    assert [label for label, _, _ in configs if label.startswith("Cascade(0.5B")] == [
        "Cascade(0.5B+MaG, K=[[2,0],[0,4]], l=2)"]
    assert skipped == ["Cascade(0.5B+MaG, K=[[0,0],[0,4]], l=2): K row 0 sums to 0: the target would never "
                       "receive a draft"]


@pytest.mark.parametrize("argv, message", [
    (["--a", "2,x"], "argument --a: expected comma-separated ints >= 0, each once; got '2,x'"),
    (["--lenience-values", "0.5"], "argument --lenience-values: expected comma-separated floats >= 1"),
    (["--m", "0"], "argument --m: expected comma-separated ints >= 1"),
    (["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
    (["--prompts", "99"], "--prompts 99: there are 31 prompts"),
])
def test_tune_refuses_bad_values(argv, message, capsys):
    assert message in refused(capsys, tune.main, *argv)


def test_tune_quick_help_counts_its_grid(capsys):
    for quick, values in ((True, tune.QUICK), (False, tune.FULL)):
        configs, _ = tune.grid(Namespace(quick=quick, quantize=None, a=None, b=None, m=None, lenience_values=None))
        assert len(configs) == tune.grid_size(values)
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    assert (f"a small grid: {tune.grid_size(tune.QUICK)} configurations instead of {tune.grid_size(tune.FULL)}"
            in " ".join(capsys.readouterr().out.split()))


@pytest.mark.parametrize("call, argv, message", [
    (forward_cost.main, ["--dtypes", "float16"], "argument --dtypes: expected comma-separated names out of float32, "
                                                 "bfloat16"),
    (forward_cost.main, ["--ns", "0,1"], "argument --ns: expected comma-separated ints >= 1, each once; got '0,1'"),
    (forward_cost.main, ["--ns", "2,4"], "--ns must include 1"),
    (forward_cost.main, ["--context", "0"], "argument --context: expected an int >= 1, got 0"),
    (forward_cost.main, ["--models", "/nonexistent"], "--models: '/nonexistent': no such file or folder"),
    (forward_cost.main, ["--models", "smollm2-135"], "did you mean 'smollm2-135m'?"),
    (forward_cost.main, ["--drafters", "/nonexistent:int4"], "--drafters: '/nonexistent': no such file or folder"),
    (host_work.main, ["--batches", "1,x"], "argument --batches: expected comma-separated ints >= 1"),
    (host_work.main, ["--batches", "0"], "argument --batches: expected comma-separated ints >= 1"),
    (host_work.main, ["--tokens", "0"], "argument --tokens: expected an int >= 1, got 0"),
    (host_work.main, ["--threads", "-2"], "argument --threads: expected an int >= 1, got -2"),
    (batch.main, ["--batch-sizes", "0,2"], "argument --batch-sizes: expected comma-separated ints >= 1, each once"),
    (batch.main, ["--prompts", "99"], "--prompts 99: bench/prompts.json has 31"),
    (batch.main, ["--prompts", "5", "--categories", "rag"], "--prompts 5: bench/prompts.json has 4 in --categories rag"),
    (batch.main, ["--strategy", "fast"], "--strategy fast: unknown strategy 'fast'"),
    (batch.main, ["--strategy", '{"speculative": {"k": 0}}'], "--strategy {\"speculative\": {\"k\": 0}}: "),
    (autoregressive.main, ["--prompts", "0"], "argument --prompts: expected an int >= 1, got 0"),
    (autoregressive.main, ["--prompts", "99"], "--prompts 99: bench/prompts.json has 31"),
    (gpu.main, ["--sections", "verify,foo"], "argument --sections: expected comma-separated names out of verify"),
    (gpu.main, ["--budget-s", "-5"], "argument --budget-s: expected a finite number > 0, got '-5'"),
    (gpu.main, ["--budget-s", "0"], "argument --budget-s: expected a finite number > 0, got '0'"),
    (gpu.main, ["--residual-scale", "-1"], "argument --residual-scale: expected a finite number >= 0, got '-1'"),
    (tune.main, ["--target", "qwen2.5-coder-1.5"], "did you mean 'qwen2.5-coder-1.5b'?"),
])
def test_other_scripts_refuse_bad_values(call, argv, message, capsys):
    assert message in refused(capsys, call, *argv)


def test_gpu_skips_the_sections_past_its_budget(tmp_path, capsys):
    """--budget-s is checked before every section: once it is spent, each section left is
    recorded as skipped, saying why (in process: nothing runs)."""
    import torch

    gpu.main(["--dry-run", "--budget-s", "1e-9", "--sections", "verify,pearl", "--threads",
              str(torch.get_num_threads()), "--no-plot", "--out", str(tmp_path)])
    [path] = tmp_path.glob("gpu-dry-run-*.json")
    sections = json.loads(path.read_text())["sections"]
    assert list(sections) == ["copy_bandwidth", "verify_kernel", "pearl"]
    assert all(section["skipped"].startswith("--budget-s 1e-09: 0 s spent") for section in sections.values())
    assert "pearl: skipped (--budget-s 1e-09" in capsys.readouterr().out


def test_forward_cost_is_relative_to_the_one_token_forward_wherever_it_is_in_ns():
    forwards = {"native": lambda ids: time.sleep(0.002 * ids.shape[1])}
    rows = forward_cost.timed_rows({}, forwards, 10, [3, 1], 1)
    assert [row["n"] for row in rows] == [3, 1]
    assert rows[1]["native_vs_1"] == 1.0 and rows[0]["native_vs_1"] > 1.5


def recording(tmp_path, dry_run=False):
    """A draft_policy JSON as the script writes it, one made-up trace."""
    path = tmp_path / "recorded.json"
    args = dict(target="qwen2.5-coder-1.5b", drafter="qwen2.5-coder-0.5b", dtype="float32", max_new_tokens=12,
                repeats=1, categories="qa", per_category=1, prompts_file=None, quantize="int8", dry_run=dry_run)
    trace = Trace("qa", runs=[0, 1, 0], mag_length=[0, 0, 0], mag_agree=[0, 0, 0], mag_match=[0, 0, 0])
    path.write_text(json.dumps({"args": args, "costs": {"widths": [[1, 1.0], [2, 1.1]], "drafter": 0.2, "step": 0.07},
                                "traces": [dataclasses.asdict(trace)]}))
    return path


def test_draft_policy_replay_takes_the_recordings_args_and_refuses_others(tmp_path, capsys):
    recorded = recording(tmp_path)
    args = draft_policy.parse_args(["--replay", str(recorded), "--drafter-cost", "0.5", "--out", str(tmp_path)])
    assert (args.target, args.dtype, args.quantize, args.categories, args.dry_run) == (
        "qwen2.5-coder-1.5b", "float32", "int8", "qa", False)
    for flags in (["--categories", "qa"], ["--per-category", "2"], ["--quantize", "none"], ["--dtype", "float32"]):
        message = refused(capsys, draft_policy.parse_args, "--replay", str(recorded), *flags)
        assert f"--replay re-prices a recorded run: {flags[0]} would change what it recorded" in message
    assert "is not the recording of a dry run" in refused(capsys, draft_policy.parse_args, "--replay", str(recorded),
                                                          "--dry-run")
    assert "--replay: cannot read /nonexistent.json" in refused(capsys, draft_policy.parse_args, "--replay",
                                                                 "/nonexistent.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    assert (f"--replay: {other} is not a recording of bench/draft_policy.py (it has no 'traces')"
            in refused(capsys, draft_policy.parse_args, "--replay", str(other)))


def test_plot_draws_what_it_can_read_then_names_the_rest(tmp_path, capsys):
    """An empty JSON (a run cut short before it wrote) or a file that is not JSON does not stop the
    others from being drawn: they are named after, with exit status 1."""
    recorded = tmp_path / "gpu.json"
    recorded.write_text((ROOT / "bench" / "measured" / "gpu-h100-2026-11-22-run1.json").read_text())
    empty, text, other = tmp_path / "empty.json", tmp_path / "text.json", tmp_path / "other.json"
    empty.write_text("")
    text.write_text("not JSON")
    other.write_text(json.dumps({"rows": [{"x": 1}]}))
    with pytest.raises(SystemExit) as exc:
        plot.main([str(empty), str(tmp_path / "none.json"), str(recorded), str(text), str(other)])
    assert (tmp_path / "gpu-step-split.png").is_file()
    message = exc.value.code  # a message: exit status 1
    assert isinstance(message, str) and f"could not read {empty}, {tmp_path / 'none.json'}, {text}" in message
    assert f"no picture drawn from {other}" in message
    err = capsys.readouterr().err
    assert f"{empty}: an empty file" in err and f"{text}: not JSON" in err
    with pytest.raises(SystemExit) as exc:  # no file at all: a usage error
        plot.main([])
    assert exc.value.code == 2


def test_every_option_with_a_default_says_it_in_help(monkeypatch):
    """--help shows each option's default (flags that are off by default aside)."""
    parsers = {}

    def caught(self, args=None, namespace=None):
        parsers[script] = self
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    for script, call in (("autoregressive", autoregressive.main), ("batch", batch.main), ("compare", compare.parse_args),
                         ("draft_policy", draft_policy.parse_args), ("forward_cost", forward_cost.main),
                         ("gpu", gpu.main), ("host_work", host_work.main), ("plot", plot.main), ("serve", serve.main),
                         ("tune", tune.main)):
        with pytest.raises(SystemExit):
            call([])
    assert len(parsers) == 10
    missing = [f"{script} {action.option_strings[-1]}" for script, parser in parsers.items()
               for action in parser._actions if action.option_strings
               and action.default not in (None, False, argparse.SUPPRESS) and "default" not in (action.help or "")]
    assert missing == [], missing


def test_compare_without_speculative_methods_says_so(tmp_path, capsys):
    data = {"methods": {"ar": "csd_engine Autoregressive"}, "per_category": {"qa": {}},
            "overall": {"ar": {"acceptance_by_position": []}}}
    assert plot.acceptance_by_position(data, tmp_path / "x-acceptance.png") is None
    assert "the run has no csd_engine speculative method" in capsys.readouterr().err
