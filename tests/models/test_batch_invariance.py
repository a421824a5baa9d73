"""Engine(batch_invariant=True): a row's logits are bit for bit the same whatever else is in
the batch (other rows, more of them, a wider step), so a seeded request's tokens cannot
depend on its neighbours, also where BLAS or the attention split would pick other kernels."""
import pytest
import torch

from csd_engine import Engine, ops
from csd_engine.models import quant
from csd_engine.models.runner import ForwardBatch
from tests.tiny_models import tiny_llama

HIDDEN = 512  # wide enough that BLAS treats one row and several differently


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, hidden=HIDDEN, heads=8, kv_heads=4)


def logits_of(runner, rows: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh forward over `rows` [B, n] from empty caches."""
    runner.use_rows(rows.shape[0])
    runner.cache.reset()
    return runner(ForwardBatch.chain(rows, runner.cache.lengths, rows.shape[1]))


def worst_difference(runner, mine: torch.Tensor) -> float:
    """Largest change of row `mine`'s logits between alone and inside other batches / widths."""
    alone = logits_of(runner, mine[None])[0]
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for batch, position, extra in [(2, 1, 0), (5, 0, 0), (5, 3, 2), (8, 7, 3), (3, 2, 5)]:
        rows = torch.randint(0, 96, (batch, mine.shape[0] + extra), generator=g).to(mine.device)
        rows[position, :mine.shape[0]] = mine
        other = logits_of(runner, rows)[position, :mine.shape[0]]
        worst = max(worst, (other - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_a_rows_logits_do_not_depend_on_its_batch(model, attention):
    engine = Engine(model, max_batch_size=8, max_seq_len=48, batch_invariant=True, attention_backend=attention,
                    device="cpu")
    mine = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(1))
    assert worst_difference(engine.target, mine) == 0.0


@pytest.mark.skipif("cpu" not in ops._BF16_LINEAR_DEVICES, reason="csd_engine._C has no bf16_linear CPU kernel")
def test_bf16_rows_are_invariant_through_the_bf16_kernel_without_row_blocks(model, monkeypatch):
    """Where bf16 matmuls take csd_engine's CPU kernel at every width (a CPU without native bf16:
    every row computed alike), the batch-invariant mode skips the row padding and a row's bf16
    logits still do not move."""
    monkeypatch.setenv("CSD_BF16_LINEAR", "1")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    ops.bf16_kernel_pays.cache_clear()
    try:
        engine = Engine(model, max_batch_size=8, max_seq_len=48, batch_invariant=True, dtype=torch.bfloat16,
                        attention_backend="triton", device="cpu")
        rows = []
        real = quant.dense_linear
        monkeypatch.setattr(quant, "dense_linear", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a))
        mine = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(1))
        assert worst_difference(engine.target, mine) == 0.0
        assert 6 in rows and all(n % 16 for n in rows)  # unpadded: 6 rows alone, 12 to 48 in batches
    finally:
        monkeypatch.undo()
        ops.bf16_kernel_pays.cache_clear()


def width_difference(runner, prefix: torch.Tensor, tokens: torch.Tensor) -> float:
    """Largest change of any token's logits between one forward over all of `tokens` [1, n]
    after `prefix` [1, p] and decoding them one at a time after it."""
    def after_prefix():
        runner.use_rows(1)
        runner.cache.reset()
        runner(ForwardBatch.chain(prefix, runner.cache.lengths, prefix.shape[1], need_logits=False))
        runner.cache.advance(torch.tensor([prefix.shape[1]]))
    after_prefix()
    wide = runner(ForwardBatch.chain(tokens, runner.cache.lengths, prefix.shape[1] + tokens.shape[1]))[0]
    after_prefix()
    worst = 0.0
    for i in range(tokens.shape[1]):
        alone = runner(ForwardBatch.chain(tokens[:, i:i + 1], runner.cache.lengths, prefix.shape[1] + i + 1))[0, 0]
        runner.cache.advance(torch.tensor([1]))
        worst = max(worst, (wide[i] - alone).abs().max().item())
    return worst


@pytest.mark.parametrize("attention_op", [True, False])
def test_bf16_tokens_do_not_depend_on_the_forwards_width(model, attention_op):
    """bf16, batch-invariant: a token's logits in a forward of up to 33 new tokens (a draft's
    verification) are bit for bit those of the token decoded alone, with the extension's
    attention op (taken in this mode even with fused=False) and without it (each query its own
    SDPA call). SDPA over all of them moved a token by 0.03 at 17 tokens on an AVX-512 EPYC, and
    Staged((3, 2, 1, 1)) / Speculative(k=20) then emitted other tokens than plain decoding."""
    engine = Engine(model, max_batch_size=1, max_seq_len=96, batch_invariant=True, dtype=torch.bfloat16,
                    device="cpu", fused_kernels=False)
    runner = engine.target
    assert runner.cpu_attention == ops.cpu_layer_ops_run()
    runner.cpu_attention = runner.cpu_attention and attention_op
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 96, (1, 30), generator=g)
    for n in (2, 5, 9, 17, 21, 33):
        assert width_difference(runner, prefix, torch.randint(0, 96, (1, n), generator=g)) == 0.0, n


@pytest.mark.parametrize("attention_op", [True, False])
def test_bf16_forwards_wider_than_64_tokens_do_not_depend_on_their_width(model, attention_op):
    """Past CPU_ATTENTION_MAX_TOKENS too: Speculative(k=64) verifies 65 tokens per forward and a
    prefill chunk's width can depend on other requests. With SDPA over all of them there, a token
    moved by up to 0.03 and Speculative(k=64) emitted other tokens than plain decoding."""
    engine = Engine(model, max_batch_size=1, max_seq_len=200, batch_invariant=True, dtype=torch.bfloat16,
                    device="cpu", fused_kernels=False)
    runner = engine.target
    runner.cpu_attention = runner.cpu_attention and attention_op
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 96, (1, 30), generator=g)
    for n in (65, 90):
        assert width_difference(runner, prefix, torch.randint(0, 96, (1, n), generator=g)) == 0.0, n


def test_bf16_wide_speculation_emits_plain_decodings_tokens(model):
    """What the mode is for (README, "Where it holds"): bf16 greedy speculation whose steps are
    wider than the CPU kernels cover emits Autoregressive's tokens. A 24-node Staged tree and a
    21-token chain, on prompts where both emitted other tokens before the attention above."""
    from csd_engine import Autoregressive, SamplingParams, Speculative, Staged
    from tests.tiny_models import perturbed, random_prompts
    engine = Engine(model, drafters=[perturbed(model, noise=0.05, seed=4)], max_batch_size=1, max_seq_len=96,
                    batch_invariant=True, dtype=torch.bfloat16, device="cpu")
    for seed, strategy, tokens in ((4, Staged((3, 2, 1, 1)), 20), (7, Speculative(k=20), 40)):
        prompt, params = random_prompts(1, lo=4, hi=20, seed=seed)[0], SamplingParams(max_new_tokens=tokens)
        plain = engine.generate([prompt], params, strategy=Autoregressive())[0].token_ids
        assert engine.generate([prompt], params, strategy=strategy)[0].token_ids == plain, strategy


def test_generic_runner_is_refused_clearly(model):
    with pytest.raises(ValueError, match="batch_invariant=True needs the native runner, but the target runs on "
                                         "the generic transformers runner"):
        Engine(model, max_batch_size=2, max_seq_len=16, native=False, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        Engine(model, max_batch_size=2, max_seq_len=16, batch_invariant="yes")
    with pytest.raises(TypeError, match="fused_kernels must be None"):
        Engine(model, max_batch_size=2, max_seq_len=16, fused_kernels="on")
    # on a CPU the fused path is the extension's C++ ops, where it has them
    assert Engine(model, max_batch_size=2, max_seq_len=16, device="cpu").target.fused == ops.cpu_layer_ops_run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_logits_do_not_depend_on_its_batch_on_cuda(dtype):
    """The same on a GPU, where cuBLAS and the attention split pick kernels by batch size."""
    model = tiny_llama(seed=3, hidden=1024, heads=8, kv_heads=4, layers=2)
    engine = Engine(model, device="cuda", dtype=dtype, max_batch_size=8, max_seq_len=48, batch_invariant=True)
    mine = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(1)).cuda()
    default = Engine(model, device="cuda", dtype=dtype, max_batch_size=8, max_seq_len=48)
    print(f"default mode, {dtype}: worst logit change {worst_difference(default.target, mine):.3g}")
    assert worst_difference(engine.target, mine) == 0.0
