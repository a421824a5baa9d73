"""The command line: bad input exits with status 2 and a message naming the problem."""
from csd_engine.cli import main
from tests.tiny_models import tiny_llama


def test_cli_reports_bad_input_clearly(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_llama(seed=1).save_pretrained(folder)  # a model folder without a tokenizer
    assert main(["generate", "--target", str(folder), "--prompt", "hello"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    assert main(["generate", "--target", str(folder), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--target", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "not a model" in capsys.readouterr().err


def test_cli_cascade_options_are_checked(tmp_path, capsys):
    """Malformed --k-matrix JSON and --tree without a K matrix are clear errors (exit 2)."""
    folder = tmp_path / "tiny"
    tiny_llama(seed=2).save_pretrained(folder)
    common = ["generate", "--target", str(folder), "--drafter", str(folder), "--drafter", "mag", "--json",
              "--max-new-tokens", "6", "--max-seq-len", "64"]
    assert main(common + ["--prompt", "x", "--strategy", "cascade", "--k-matrix", "[[2,4],[0,4]"]) == 2
    assert "--k-matrix must be JSON" in capsys.readouterr().err
    assert main(common + ["--prompt", "x", "--strategy", "cascade", "--tree", "[3]"]) == 2
    assert "--tree needs --k-matrix" in capsys.readouterr().err
