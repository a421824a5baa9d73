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
