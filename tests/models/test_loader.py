"""The loader: end-of-sequence ids from every source, hub revisions, and a `.gguf` path that
loads exactly like the zoo's folder built from the same GGUF."""
import pytest
import torch
from transformers import AutoTokenizer

from csd_engine import Engine, SamplingParams
from csd_engine.models import zoo
from csd_engine.models.llama import LlamaRunner
from csd_engine.models.loader import _split_revision, eos_token_ids, load_runner
from tests.tiny_models import tiny_llama


class _Tokenizer:
    def __init__(self, eos):
        self.eos_token_id = eos


def test_eos_ids_come_from_the_tokenizer_and_the_generation_config():
    model = tiny_llama(seed=1)
    assert eos_token_ids(model) == ()
    model.generation_config.eos_token_id = [7, 3]
    model.config.eos_token_id = 3
    assert eos_token_ids(model, _Tokenizer(9)) == (3, 7, 9)
    model.generation_config.eos_token_id = 5
    assert eos_token_ids(model, _Tokenizer(None)) == (3, 5)
    runner, _ = load_runner(model, torch.device("cpu"), torch.float32)
    assert runner.eos_token_ids == (3, 5)


def test_hub_ids_take_a_revision():
    assert _split_revision("org/name") == ("org/name", {})
    assert _split_revision("org/name@v1.0") == ("org/name", {"revision": "v1.0"})
    with pytest.raises(ValueError, match="'org/name@revision'"):
        _split_revision("org/name@")


@pytest.mark.slow
def test_a_gguf_path_loads_like_the_zoo_folder():
    """Same dequantization, same EOS repair: the engine's target from the GGUF and from the
    zoo's bfloat16 folder built from it hold equal weights, EOS ids and tokens generated."""
    gguf, folder = zoo.fetch_gguf("smollm2-135m"), zoo.resolve("smollm2-135m")
    engines = [Engine(str(path), dtype=torch.bfloat16, max_batch_size=1, max_seq_len=64, verify_backend="torch")
               for path in (gguf, folder)]
    runners = [engine.target for engine in engines]
    assert all(isinstance(r, LlamaRunner) for r in runners)
    for name in ("embed", "lm_head", "final_norm"):
        assert torch.equal(getattr(runners[0], name), getattr(runners[1], name)), name
    for i, (a, b) in enumerate(zip(runners[0].layers, runners[1].layers)):
        for name in a:
            assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), (i, name)
    assert engines[0].tokenizer.eos_token_id == AutoTokenizer.from_pretrained(folder).eos_token_id
    assert runners[0].eos_token_ids == runners[1].eos_token_ids
    assert engines[0].tokenizer.eos_token_id in runners[0].eos_token_ids

    results = [engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))[0] for engine in engines]
    assert results[0].token_ids == results[1].token_ids and results[0].text == results[1].text
