"""The command line: bad input exits with status 2 and a message naming the problem."""
import json
import subprocess
import sys

import pytest

import csd_engine
from csd_engine import AutoCascade, Cascade, Pearl, Speculative, Staged
from csd_engine import cli
from csd_engine.cli import main, make_strategy, parse_strategy_config
from tests.tiny_models import VOCAB, tiny_llama


def test_cli_reports_bad_input_clearly(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_llama(seed=1).save_pretrained(folder)  # a model folder without a tokenizer
    assert main(["generate", "--target", str(folder), "--prompt", "hello"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["generate", "--target", str(folder), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--target", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    # a drafter's typo or missing path is refused before the target loads (its weights take seconds)
    loads = []
    monkeypatch.setattr(csd_engine.engine, "load_runner", lambda *args, **kwargs: loads.append(args))
    for drafter, words in (("magg", "did you mean 'mag'"), (str(tmp_path / "nowhere"), "no such file or folder")):
        assert main(["generate", "--target", str(folder), "--drafter", drafter, "--prompt", "x"]) == 2
        assert words in capsys.readouterr().err and not loads
    monkeypatch.undo()
    for drafters, words in ((["mag", str(folder)], "--drafter mag must come last"),
                            ([str(folder), "mag", "mag"], "--drafter mag is given twice")):
        assert main(["generate", "--target", str(folder), *sum((["--drafter", d] for d in drafters), []),
                     "--prompt", "x"]) == 2
        assert words in capsys.readouterr().err


def test_ctrl_c_ends_with_a_line_and_status_130(tmp_path, capsys, monkeypatch):
    folder = _tiny_folder(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.Engine, "generate", interrupted)
    assert main(["generate", "--target", folder, "--prompt", "ab", "--max-new-tokens", "4"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "csd-engine: interrupted"


def test_cli_cascade_options_are_checked(tmp_path, capsys):
    """Malformed --k-matrix JSON and --lenience without a K matrix are clear errors (exit 2)."""
    folder = tmp_path / "tiny"
    tiny_llama(seed=2).save_pretrained(folder)
    common = ["generate", "--target", str(folder), "--drafter", str(folder), "--drafter", "mag", "--json",
              "--max-new-tokens", "6", "--max-seq-len", "64"]
    assert main(common + ["--prompt", "x", "--strategy", "cascade", "--k-matrix", "[[2,4],[0,4]"]) == 2
    assert "--k-matrix must be JSON, e.g. '[[2,4],[0,4]]'" in capsys.readouterr().err
    assert main(common + ["--prompt", "x", "--strategy", "cascade", "--tree", "xx"]) == 2
    assert "--tree must be JSON, e.g. '[3,2]';" in capsys.readouterr().err
    assert main(common + ["--prompt", "x", "--strategy", "cascade", "--lenience", "2", "--tree", "[3]"]) == 2
    err = capsys.readouterr().err
    assert "--lenience needs --k-matrix" in err and "--tree" not in err.split("needs")[0]


def _tiny_folder(tmp_path, seed=3):
    """A tiny model folder with a character-level tokenizer over its VOCAB printable characters."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tiny"
    tiny_llama(seed=seed).save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({chr(32 + i): i for i in range(VOCAB)}, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(folder)
    return str(folder)


def _generate(argv, capsys) -> list[int]:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


def test_every_strategy_through_its_json_config_gives_greedy_tokens(tmp_path, capsys):
    """--strategy-config builds StrategyClass(**options) (JSON lists as tuples) for every strategy
    name; each one's greedy tokens equal plain autoregressive decoding's."""
    folder = _tiny_folder(tmp_path)
    common = ["generate", "--target", folder, "--drafter", folder, "--drafter", "mag", "--json",
              "--max-new-tokens", "6", "--max-seq-len", "64", "--prompt", "x"]
    reference = _generate(["generate", "--target", folder, "--json", "--max-new-tokens", "6", "--max-seq-len", "64",
                           "--prompt", "x", "--strategy", "autoregressive"], capsys)
    configs = [{"autoregressive": {}},
               {"speculative": {"k": 3}},
               {"speculative": {"k": 3, "min_confidence": 0.2}},
               {"speculative_auto": {"max_tokens": 3, "min_confidence": 0.4, "model_cost": 0.1}},
               {"cascade": {"k_matrix": [[2, 4], [0, 4]], "lenience": 2, "mag_tokens": 3, "tree": [2, 2]}},
               {"cascade_auto": {"lenience": 2, "max_tokens": 4}},
               {"staged": {"branching": [3, 2, 1], "mag_tokens": 2}},
               {"pearl": {"gamma": 3, "adaptive": False}}]
    for config in configs:
        assert _generate(common + ["--strategy-config", json.dumps(config)], capsys) == reference, config
    # --cuda-graphs reaches the engine (on a CPU its steps run eagerly: the same tokens)
    assert _generate(common + ["--strategy", "speculative", "--cuda-graphs", "step"], capsys) == reference
    with pytest.raises(SystemExit):
        main(common + ["--cuda-graphs", "always"])
    assert "invalid choice: 'always'" in capsys.readouterr().err


def test_json_configs_become_the_strategy_dataclasses():
    assert make_strategy("staged", {"branching": [3, 2, 1], "mag_tokens": 2}) == Staged(branching=(3, 2, 1), mag_tokens=2)
    assert make_strategy("cascade", {"k_matrix": [[2, 4], [0, 4]], "lenience": 2}) == \
        Cascade(k_matrix=((2, 4), (0, 4)), lenience=2)
    assert make_strategy("cascade_auto", {"lenience": 3, "max_tokens": 5}) == AutoCascade(lenience=3, max_tokens=5)
    assert make_strategy("pearl", {"gamma": 5}) == Pearl(gamma=5)
    assert make_strategy("speculative_auto", {"min_confidence": 0.4}) == Speculative.auto(min_confidence=0.4)
    assert parse_strategy_config('{"speculative": {"k": 2}}') == ("speculative", {"k": 2})


@pytest.mark.parametrize("config, message", [
    ('{"medusa": {}}', "unknown strategy 'medusa'; strategies: autoregressive, speculative, speculative_auto, cascade, cascade_auto"),
    ('{"staged": {"k": 3}}', "staged has no option 'k'; its options: branching, drafter, mag_tokens, mag_review"),
    ('{"staged": {"branching": []}}', "Staged.branching must be a non-empty tuple"),
    ('{"cascade": {"k_matrix": [[2, 4], [0, 4]], "lenience": 0.5}}', "Cascade(lenience=...) must be a number >= 1"),
    ('{"pearl": {"gamma": 0}}', "Pearl.gamma must be an int in [1, 64]"),
    ('{"cascade": {"k_matrix": [[2, 4], [1, 4]]}}', "K must be upper-triangular"),
    ('["cascade"]', "--strategy-config must be a JSON object with one key"),
    ('{"speculative": {"k": 2}, "pearl": {}}', "--strategy-config must be a JSON object with one key"),
    ('{"speculative": 2}', "the options of 'speculative' must be a JSON object"),
    ('{"speculative": ', "--strategy-config must be JSON, e.g. '{\"cascade\": {\"k_matrix\""),
])
def test_bad_strategy_configs_exit_2_naming_the_problem(tmp_path, capsys, config, message):
    folder = _tiny_folder(tmp_path)
    argv = ["generate", "--target", folder, "--drafter", folder, "--drafter", "mag", "--max-new-tokens", "4",
            "--max-seq-len", "64", "--prompt", "x", "--strategy-config", config]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "pearl", "--k", "3"], "--strategy pearl does not take --k (its flags: --gamma)"),
    (["--strategy", "staged", "--lenience", "2"], "--strategy staged does not take --lenience (its flags: --branching, --mag-tokens)"),
    (["--strategy", "speculative", "--mag-tokens", "2"], "--strategy speculative does not take --mag-tokens"),
    (["--k", "3", "--gamma", "2"], "--strategy speculative does not take --gamma"),
    (["--strategy", "cascade", "--lenience", "2"], "--lenience needs --k-matrix"),
    (["--strategy", "pearl", "--strategy-config", '{"speculative": {}}'], "--strategy pearl contradicts --strategy-config"),
    (["--k", "3", "--strategy-config", '{"speculative": {}}'], "put --k in it instead"),
])
def test_flags_a_strategy_does_not_take_are_refused(tmp_path, capsys, flags, message):
    folder = _tiny_folder(tmp_path)
    argv = ["generate", "--target", folder, "--drafter", folder, "--max-new-tokens", "4", "--max-seq-len", "64",
            "--prompt", "x"] + flags
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_tree_without_a_k_matrix_is_cascade_auto_s(tmp_path, capsys, monkeypatch):
    """--tree without --k-matrix reaches Cascade.auto() (the tree each row may choose), with
    --strategy cascade or cascade_auto, and decodes plain greedy decoding's tokens."""
    folder = _tiny_folder(tmp_path)
    common = ["generate", "--target", folder, "--drafter", folder, "--drafter", "mag", "--json",
              "--max-new-tokens", "5", "--max-seq-len", "64", "--prompt", "x"]
    reference = _generate(common + ["--strategy", "autoregressive"], capsys)
    built, build = [], cli.build_strategy
    monkeypatch.setattr(cli, "build_strategy", lambda args: built.append(build(args)) or built[-1])
    for strategy in ("cascade", "cascade_auto"):
        assert _generate(common + ["--strategy", strategy, "--tree", "[3,2]"], capsys) == reference
        assert built.pop() == AutoCascade(tree=(3, 2))


def test_simple_flags_reach_their_strategy(tmp_path, capsys):
    """--branching and --mag-tokens configure Staged, --gamma Pearl (no flag is silently dropped)."""
    folder = _tiny_folder(tmp_path)
    common = ["generate", "--target", folder, "--drafter", folder, "--drafter", "mag", "--json",
              "--max-new-tokens", "5", "--max-seq-len", "64", "--prompt", "x"]
    reference = _generate(common + ["--strategy", "autoregressive"], capsys)
    assert _generate(common + ["--strategy", "staged", "--branching", "[2,1]", "--mag-tokens", "2"], capsys) == reference
    assert _generate(common + ["--strategy", "pearl", "--gamma", "2"], capsys) == reference
    assert _generate(common + ["--strategy", "speculative", "--k", "2"], capsys) == reference



def test_threads_is_checked_and_set_for_generate(tmp_path, capsys, monkeypatch):
    """--threads sets torch's CPU threads for generate as for serve; below 1 it exits 2 naming it."""
    folder = _tiny_folder(tmp_path)
    common = ["generate", "--target", folder, "--max-new-tokens", "2", "--max-seq-len", "64", "--prompt", "x"]
    assert main(common + ["--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    set_to = []
    monkeypatch.setattr(cli.torch, "set_num_threads", set_to.append)
    assert main(common + ["--threads", "3"]) == 0 and set_to == [3]

def test_version_and_python_m(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"csd-engine {csd_engine.__version__}"
    out = subprocess.run([sys.executable, "-m", "csd_engine", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"csd-engine {csd_engine.__version__}", out.stderr


def test_stream_prints_the_same_text_as_generate_and_stop_cuts_it(tmp_path, capsys):
    folder = _tiny_folder(tmp_path)
    common = ["generate", "--target", folder, "--max-new-tokens", "12", "--max-seq-len", "64", "--prompt", "ab"]
    assert main(common + ["--json"]) == 0
    reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--stream", "--drafter", "mag", "--strategy", "speculative"]) == 0
    assert capsys.readouterr().out == "ab" + reference["text"] + "\n"
    stop = reference["text"][3:5]
    assert main(common + ["--stream", "--stop", stop]) == 0
    assert capsys.readouterr().out == "ab" + reference["text"][:reference["text"].find(stop)] + "\n"
    assert main(common + ["--stream", "--prompt", "cd"]) == 2
    assert "--stream prints one prompt's text" in capsys.readouterr().err
