"""The bench harness and prompts, in process (no models but the tiny ones)."""
import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import csd_engine
from bench import compare, harness, tune
from bench.common import encode, load_prompts, order_by_category
from bench.tiny import VOCAB, tiny_tokenizer

CATEGORIES = ("coding", "chat", "translation", "summarization", "qa", "math", "rag")


def test_prompts_cover_every_category_with_text_or_chat_messages():
    prompts = load_prompts()
    counts = Counter(p["category"] for p in prompts)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 4, counts
    for p in prompts:
        assert ("prompt" in p) != ("messages" in p), p
        if "messages" in p:
            assert p["messages"][-1]["role"] == "user"
            assert {m["role"] for m in p["messages"]} <= {"system", "user", "assistant"}
    assert any(len(p.get("messages", [])) >= 3 for p in prompts if p["category"] == "chat")
    rag_words = [len(p["prompt"].split()) for p in prompts if p["category"] == "rag"]
    assert min(rag_words) > 450 and max(rag_words) < 950  # 600-1200 tokens with Qwen's tokenizer (~1.3 per word)


def test_prompt_selection():
    assert [p["category"] for p in order_by_category(load_prompts(per_category=1))] == list(
        dict.fromkeys(p["category"] for p in load_prompts()))
    assert Counter(p["category"] for p in load_prompts(per_category=2, categories="qa,rag")) == {"qa": 2, "rag": 2}
    assert load_prompts(categories="summarisation") == load_prompts(categories="summarization")  # old spelling
    with pytest.raises(ValueError, match=r"no prompts of categories \['poetry'\]"):
        load_prompts(categories="poetry")
    assert load_prompts(categories="qa, rag") == load_prompts(categories="qa,rag")  # spaces after commas


def test_a_prompts_file_that_is_not_a_list_says_what_it_holds(tmp_path):
    for content, words in (('{"prompts": []}', "holds an object, not a list of prompts"),
                           ("[]", "holds no prompts"), ('"abc"', "holds a string, not a list")):
        path = tmp_path / "mine.json"
        path.write_text(content)
        with pytest.raises(ValueError, match=words):
            load_prompts(path=path)


def test_chat_messages_go_through_the_template():
    tok = tiny_tokenizer()
    assert len(tok) == VOCAB
    chat = next(p for p in load_prompts(categories="chat") if "messages" in p)
    text = tok.decode(encode(tok, chat))
    assert text.endswith("<assistant>") and text.count("<user>") == sum(m["role"] == "user" for m in chat["messages"])
    ids = encode(tok, {"prompt": "abc"}, chat=False)
    assert tok.decode(ids) == "abc"
    assert len(encode(tok, load_prompts(categories="rag")[0], max_tokens=48)) == 48


def test_record_names_never_repeat_and_carry_the_header(tmp_path):
    args = argparse.Namespace(out=str(tmp_path), dry_run=True)
    first, second = harness.record_path("x", args), harness.record_path("x", args)
    assert first != second and first.name.startswith("x-dry-run-")
    harness.write_record(first, {"rows": []}, args)
    harness.write_record(first, {"rows": [1]}, args)  # rewritten whole, through a temporary file
    record = first.read_text()
    for key in ('"git"', '"commit"', '"dirty"', '"versions"', '"transformers"', '"csd_engine"', '"hardware"', '"date"'):
        assert key in record
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


def test_ctrl_c_ends_a_script_with_one_line_and_status_130(monkeypatch, capsys):
    def main(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["bench/x.py"])
    monkeypatch.setattr(harness, "_written", [])
    with pytest.raises(SystemExit) as exc:
        harness.run(main)
    assert exc.value.code == 130 and capsys.readouterr().err == "x.py: interrupted\n"


INTERRUPTED = """
import argparse, sys
from bench import harness
args = argparse.Namespace(out=sys.argv[1], dry_run=True)

def main(argv=None):
    harness.write_record(harness.record_path("kept", args), {"rounds_done": 1}, args)
    harness.record_path("never-written", args)  # reserved, then the run is cut short
    raise KeyboardInterrupt

harness.run(main)
"""


def test_an_interrupted_run_names_what_it_saved_and_leaves_no_empty_record(tmp_path):
    """In a process of its own: the empty file that held a name is gone once the process ends."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    [kept] = tmp_path.glob("*.json")
    assert kept.name.startswith("kept-dry-run-") and '"rounds_done": 1' in kept.read_text()
    assert done.returncode == 130 and done.stderr.splitlines() == [
        f"-c: interrupted; the results it saved so far are in {kept}"], done.stderr


def test_figures_keep_three_significant_digits():
    assert [harness.figures(v) for v in (0.0123456, 0.5, 1.23456, 45.67, 123.4, 1234.5, 0.0)] == [
        "0.0123", "0.500", "1.23", "45.7", "123", "1234", "0"]
    assert harness.spread([0.12, 0.3456], harness.figures) == "0.120-0.346"


def test_repeat_and_spread():
    calls = []
    out, timing = harness.repeat(lambda: calls.append(1) or len(calls), repeats=3, warmup=1)
    assert out == 4 and len(timing.seconds) == 3 and timing.min <= timing.median <= timing.max
    assert harness.spread([2.0, 1.0, 3.0]) == "1.00-3.00" and harness.spread([1.0]) == "-"


def test_compare_summary_keeps_the_median_and_sums_tokens_over_seconds():
    prompts = [{"category": "a"}, {"category": "a"}, {"category": "b"}]
    encoded = [[1, 2], [3], [4, 5, 6]]
    seconds = {"hf": [[1.0, 3.0], [2.0, 2.0], [1.0, 1.0]], "ar": [[1.0, 1.0], [1.0, 3.0], [0.5, 0.5]]}
    first = {"hf": [[0.2, 0.4], [0.1, 0.1], [0.3, 0.3]], "ar": [[0.5, 0.1], [0.2, 0.2], [0.2, 0.2]]}
    runs = [{key: {"seconds": seconds[key][i], "first_token_s": first[key][i], "tokens": 10, "output": [i],
                   "target_forwards": 5 if key == "ar" else None,
                   "acceptance_by_position": [1.0, 0.5] if key == "ar" and i == 0 else None}
             for key in seconds} | {"reference": [i]} for i in range(3)]
    summary = compare.summarize(prompts, encoded, runs, ["hf", "ar"], {"hf": "HF", "ar": "AR"})
    a = summary["per_category"]["a"]
    assert a["hf"]["tokens_per_s"] == pytest.approx(20 / 4.0)  # medians 2 + 2
    assert a["ar"]["tokens_per_s"] == pytest.approx(20 / 3.0)  # medians 1 + 2
    assert a["ar"]["speedup"] == pytest.approx(4.0 / 3.0)
    assert a["hf"]["first_token_s"] == pytest.approx((0.3 + 0.1) / 2)  # per prompt the median, then the mean
    assert summary["overall"]["ar"]["first_token_s"] == pytest.approx((0.3 + 0.2 + 0.2) / 3)
    assert (a["hf"]["min_tokens_per_s"], a["hf"]["max_tokens_per_s"]) == pytest.approx((20 / 5.0, 20 / 3.0))
    assert summary["overall"]["ar"]["mean_accepted"] == pytest.approx(2.0)
    assert summary["overall"]["ar"]["acceptance_by_position"] == [1.0, 0.5]
    assert summary["overall"]["hf"]["identical"] == "3/3"
    assert summary["overall"]["hf"]["same_as_ar"] == "3/3"  # both output [i] on prompt i
    assert [row["key"] for row in summary["rows"]] == ["hf", "ar"]
    sampled = compare.summarize(prompts, encoded, [{k: v for k, v in run.items() if k != "reference"} for run in runs],
                                ["hf", "ar"], {"hf": "HF", "ar": "AR"})  # a sampled run keeps no greedy reference
    assert all(sampled["overall"][key]["identical"] is None and sampled["overall"][key]["same_as_ar"] is None
               for key in ("hf", "ar"))
    assert sampled["overall"]["ar"]["tokens_per_s"] == summary["overall"]["ar"]["tokens_per_s"]


def test_every_compare_method_has_a_label_and_a_factory():
    args = compare.parse_args(["--dry-run"])
    for key, (label, factory) in compare.METHODS.items():
        assert label.format(**vars(args)) and callable(factory), key


def test_compare_methods_carry_their_own_settings():
    args = compare.parse_args(["--dry-run", "--methods", "ar,cascade-int4:K=[[3, 4],[0,4]]:l=3,cascade:m=6"])
    keys = compare.split_methods(args.methods)
    assert keys == ["ar", "cascade-int4:K=[[3, 4],[0,4]]:l=3", "cascade:m=6"]
    name, own = compare.method_args(args, keys[1])
    assert (name, own.k_matrix, own.lenience, own.mag_tokens) == ("cascade-int4", "[[3,4],[0,4]]", 3.0, 4)
    assert args.k_matrix == "[[2,4],[0,4]]" and args.lenience == 2.0  # the shared arguments stay
    assert compare.label(keys[1], name, own) == "csd_engine Cascade(0.5B int4+MaG, K=[[3,4],[0,4]], l=3)"
    name, own = compare.method_args(args, keys[2])
    assert compare.label(keys[2], name, own).endswith("l=2) [m=6]")  # m is not in the label: appended


def test_compare_self_tuning_methods_take_their_draft_cap():
    """`max` (--auto-max-tokens) reaches the strategy's max_tokens; unset, the strategy keeps its own."""
    args = compare.parse_args(["--dry-run", "--methods", "spec-auto-int4,spec-auto-int4:max=10,cascade-auto:max=3"])
    built = {key: strategy for key, (_, _, strategy) in compare.strategies(args).items()}
    assert built["spec-auto-int4"].max_tokens == csd_engine.Speculative.auto().max_tokens
    assert built["spec-auto-int4:max=10"].max_tokens == 10 and built["cascade-auto:max=3"].max_tokens == 3
    name, own = compare.method_args(args, "spec-auto-int4:max=10")
    assert compare.label("spec-auto-int4:max=10", name, own) == "csd_engine Speculative.auto(0.5B int4) [max=10]"


@pytest.mark.parametrize("methods, message", [
    ("ar,cascade:x=1", "'x=1' is not a setting"), ("ar,cascade:K=[[1,2]", "unbalanced brackets"),
    ("ar,cascade:l=two", "l='two' is not a valid value"), ("ar,nope", "unknown method 'nope'"),
    ("ar,ar", "each once"), ("ar:k=3", "ar does not read k; its settings: none"),
    ("cascade-int4:cost=0.3", "cascade-int4 does not read cost; its settings: K, l, m")])
def test_compare_refuses_bad_method_settings(methods, message, capsys):
    with pytest.raises(SystemExit):
        compare.parse_args(["--dry-run", "--methods", methods])
    assert message in capsys.readouterr().err


def test_tune_grid_takes_the_values_given():
    args = argparse.Namespace(quick=False, quantize="int4", a=[3, 4], b=[8], m=[4], lenience_values=[2.0])
    configs, skipped = tune.grid(args)
    labels = [label for label, _, _ in configs if label.startswith("Cascade(0.5B")]
    assert labels == ["Cascade(0.5B int4+MaG, K=[[3,8],[0,4]], l=2)",
                      "Cascade(0.5B int4+MaG, K=[[4,8],[0,4]], l=2)"] and skipped == []


def test_tune_dry_run_grid_cuts_only_the_values_not_given():
    """`--dry-run --a 2,3,4 --b 2,4,8`: all nine (a, b) points, m and lenience at the quick grid's
    first value, one Speculative and one MaG-only point."""
    args = argparse.Namespace(quick=True, quantize=None, a=[2, 3, 4], b=[2, 4, 8], m=None, lenience_values=None)
    configs, skipped = tune.grid(args, first_only=True)
    labels = [label for label, _, _ in configs]
    assert labels[:2] == ["Speculative(0.5B, k=2)", "Cascade(MaG, K=[[8]])"] and skipped == []
    assert labels[2:] == [f"Cascade(0.5B+MaG, K=[[{a},{b}],[0,4]], l=1)" for a in (2, 3, 4) for b in (2, 4, 8)]
    full = argparse.Namespace(quick=True, quantize=None, a=None, b=None, m=None, lenience_values=None)
    assert len(tune.grid(full, first_only=True)[0]) == 3 and len(tune.grid(full)[0]) == tune.grid_size(tune.QUICK)


class Runner:
    def forward(self, batch):
        return batch


class OldVerifier:  # no `tree`: internals that moved on since bench.common.instrumented was written
    def chain(self, logits):
        return logits


def test_profile_warns_and_undoes_its_patches_when_the_engine_internals_changed(capsys):
    import torch

    engine = argparse.Namespace(target=Runner(), drafters=[Runner()], verifier=OldVerifier(), device=torch.device("cpu"))
    method = compare.EngineMethod(engine, strategy=None)
    assert compare.profile_methods({"ar": method}, {"ar": "AR"}, [1, 2], 4) == []
    assert "warning: no profile for AR" in capsys.readouterr().err
    for obj in (engine.target, engine.drafters[0], engine.verifier):
        assert not {"forward", "chain", "tree"} & set(vars(obj)), "every patch is undone"


def test_compare_samples_every_method_alike_and_reproducibly():
    """With --temperature, transformers' and csd_engine's methods both sample (their tokens differ
    from their greedy ones) and draw the same tokens on every call (each round times the same work)."""
    sampled = compare.parse_args(["--dry-run", "--temperature", "1.5", "--seed", "3", "--methods", "hf,ar"])
    greedy = compare.parse_args(["--dry-run", "--methods", "hf,ar"])
    tokenizer, target, drafter = harness.load_pair(sampled)
    ids = list(range(5, 37))
    outputs = {}
    for name, args in (("sampled", sampled), ("greedy", greedy)):
        setup = compare.Setup(args, tokenizer, target, drafter, max_seq_len=128)
        for key in ("hf", "ar"):
            name_, own = compare.method_args(args, key)
            method = compare.METHODS[name_][1](setup, own)
            outputs[name, key] = [method(ids, 24).tokens for _ in range(2)]
    for key in ("hf", "ar"):
        first, again = outputs["sampled", key]
        assert first == again, f"{key}: a seeded sampled run drew other tokens the second time"
        assert first != outputs["greedy", key][0], f"{key}: sampled at temperature 1.5 but decoded greedily"
        assert outputs["greedy", key][0] == outputs["greedy", key][1]


def test_quantized_drafters_take_the_int4_group_their_widths_allow():
    """Groups of 128 inputs where every width allows (the Qwen pair), else the largest that
    divides them (SmolLM2's 576: 64), as the bench scripts' int4 drafters: not a crash after load."""
    from tests.tiny_models import tiny_llama
    runner = harness.quantized_drafter(tiny_llama(hidden=192), "cpu", torch.bfloat16, "int4")
    assert runner.quantize == "int4g64"
    assert harness.quantized_drafter(tiny_llama(hidden=256), "cpu", torch.bfloat16, "int4").quantize == "int4"


def test_compare_labels_name_the_drafter_given():
    own = compare.parse_args(["--dry-run", "--drafter", "smollm2-135m", "--methods", "spec-model,hf-assisted"])
    assert compare.label("spec-model", "spec-model", own) == "csd_engine Speculative(smollm2-135m, k=4)"
    default = compare.parse_args(["--dry-run", "--methods", "spec-model"])
    assert compare.label("spec-model", "spec-model", default) == "csd_engine Speculative(0.5B, k=4)"
