"""Native runner vs transformers: logits within float32 error, cache writes and rollback."""
import pytest
import torch
import torch.nn.functional as F

from csd_engine import ops
from csd_engine.kernels.mask import attention_mask
from csd_engine.models.loader import load_runner
from csd_engine.models.llama import LlamaRunner, one_query_attention
from csd_engine.models.runner import ForwardBatch
from tests.tiny_models import VOCAB, tiny_llama, tiny_qwen2


def _native_logits_in_steps(runner, ids, splits):
    """Feed `ids` [B, L] in consecutive chunks through the static cache; return all logits."""
    runner.allocate(ids.shape[0], 64)
    out, start = [], 0
    for end in splits + [ids.shape[1]]:
        chunk = ids[:, start:end]
        out.append(runner(ForwardBatch.chain(chunk, runner.cache.lengths, end)))
        runner.cache.advance(torch.full((ids.shape[0],), end - start, device=runner.cache.lengths.device))
        start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_llama(tie=True, kv_heads=4), tiny_qwen2],
                         ids=["llama-gqa", "llama-tied", "qwen2-bias"])
def test_logits_match_transformers_within_float32_error(make):
    model = make()
    ids = torch.randint(0, VOCAB, (3, 17))
    with torch.no_grad():
        ref64 = model.double()(ids).logits
        hf32 = model.float()(ids).logits.double()
    runner = LlamaRunner(model, "cpu", torch.float32)
    ours = _native_logits_in_steps(runner, ids, splits=[5, 6, 11]).double()  # prefill, decode, verify-sized chunks
    hf_err = (hf32 - ref64).abs().max().item()
    our_err = (ours - ref64).abs()
    print(f"transformers fp32 max err {hf_err:.2e}; native max {our_err.max():.2e} mean {our_err.mean():.2e}")
    assert our_err.max().item() <= 4 * hf_err + 1e-6


def test_rollback_is_a_length_update_and_rewrites_match():
    model = tiny_llama(seed=3)
    runner, _ = load_runner(model, "cpu", torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12))
    full = _native_logits_in_steps(runner, ids, splits=[8])
    # Write 4 wrong tokens after the first 8, roll back by length, then write the real ones.
    runner.allocate(2, 64)
    runner(ForwardBatch.chain(ids[:, :8], runner.cache.lengths, 8))
    runner.cache.advance(torch.full((2,), 8))
    wrong = (ids[:, 8:] + 1) % VOCAB
    runner(ForwardBatch.chain(wrong, runner.cache.lengths, 12))
    runner.cache.advance(torch.tensor([4, 2]))
    runner.cache.rollback(torch.tensor([8, 8]))
    assert runner.cache.lengths.tolist() == [8, 8]
    again = runner(ForwardBatch.chain(ids[:, 8:], runner.cache.lengths, 12))
    torch.testing.assert_close(again, full[:, 8:], rtol=0, atol=1e-5)


def test_ragged_rows_match_each_row_alone():
    """Rows at different cache lengths in one forward give each row's own logits."""
    model = tiny_qwen2(seed=5)
    runner = LlamaRunner(model, "cpu", torch.float32)
    ids = torch.randint(0, VOCAB, (2, 10))
    runner.allocate(2, 64)
    runner(ForwardBatch.chain(ids, runner.cache.lengths, 10, need_logits=False))
    runner.cache.reset(torch.tensor([4, 7]))
    nxt = torch.stack([ids[0, 4:7], ids[1, 7:10]])
    logits = runner(ForwardBatch.chain(nxt, runner.cache.lengths, 10))
    with torch.no_grad():
        ref0 = model(ids[:1, :7]).logits[0, 4:7]
        ref1 = model(ids[1:, :10]).logits[0, 7:10]
    torch.testing.assert_close(logits[0], ref0, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits[1], ref1, rtol=0, atol=1e-4)


def test_tree_mask_forward_equals_each_path_as_a_chain():
    """A tree of new tokens in one forward gives, at every node, the logits of its root path."""
    model = tiny_llama(seed=7)
    runner = LlamaRunner(model, "cpu", torch.float32)
    prefix = torch.randint(0, VOCAB, (1, 5))
    parents = [-1, 0, 0, 1, 2, 2]
    tokens = torch.randint(0, VOCAB, (1, 6))
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(1, 6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    runner.allocate(1, 64)
    runner(ForwardBatch.chain(prefix, runner.cache.lengths, 5, need_logits=False))
    runner.cache.advance(torch.tensor([5]))
    positions = 5 + torch.tensor([depth])
    logits = runner(ForwardBatch(tokens, positions, 11, mask))
    for node in range(6):
        path, j = [], node
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        seq = torch.cat([prefix, tokens[:, path]], dim=1)
        with torch.no_grad():
            ref = model(seq).logits[0, -1]
        torch.testing.assert_close(logits[0, node], ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_give_the_plain_path_logits(dtype):
    """fused=True (the default: Triton add+RMSNorm and RoPE+cache write on CUDA; on the CPU the
    extension's C++ ops, with the activation and one-token attention) against the PyTorch path,
    through prefill, one-token steps and verify-sized chunks; the caches must agree too."""
    model = tiny_qwen2(seed=11)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = LlamaRunner(model, device, dtype, fused=False)
    fused = LlamaRunner(model, device, dtype, fused=True)
    assert fused.cpu_layer_ops == (device == "cpu" and ops.cpu_layer_ops_run())
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(11)).to(device)
    ours, ref = (_native_logits_in_steps(r, ids, splits=[5, 6, 7, 8, 11]) for r in (fused, plain))
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours, ref, **tol)
        torch.testing.assert_close(fused.cache.k, plain.cache.k, **tol)
        torch.testing.assert_close(fused.cache.v, plain.cache.v, **tol)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    else:  # bf16 roundings differ between the paths (attention among them): each as close to the truth
        with torch.no_grad():
            truth = model.to(device).double()(ids).logits
        err, plain_err = ((x.double() - truth).abs() for x in (ours, ref))
        assert err.max() <= 1.5 * plain_err.max() and err.mean() <= 1.1 * plain_err.mean(), \
            f"fused max {err.max():.3f} mean {err.mean():.4f}, plain {plain_err.max():.3f} {plain_err.mean():.4f}"
        for cache in ("k", "v"):
            torch.testing.assert_close(getattr(fused.cache, cache), getattr(plain.cache, cache), rtol=0.05, atol=0.05)


@pytest.mark.skipif(not (ops.cpu_layer_ops_run() and ops.bf16_kernel_pays()),
                    reason="needs csd_engine's CPU layer ops and bf16 kernel (x86 with AVX2)")
@pytest.mark.parametrize("make", [lambda: tiny_llama(seed=4, hidden=256, heads=4, kv_heads=2),
                                  lambda: tiny_qwen2(seed=3, hidden=256, heads=8, kv_heads=2)],
                         ids=["llama", "qwen2"])
def test_a_tokens_bf16_logits_do_not_depend_on_the_forward_width(make):
    """On the CPU a bf16 token's logits are bit for bit the same whether it is decoded alone or
    verified inside a wider chain forward (every matmul on csd_engine's kernel, whose rows are
    computed alone; attention by ops.decode_attention, each token as if alone): so greedy
    speculative decoding emits exactly plain decoding's tokens there, near-ties included. Random
    bf16 weights put near-ties everywhere; before this held, no row of this test matched."""
    model = make().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    one = _native_logits_in_steps(LlamaRunner(model, "cpu", torch.bfloat16), ids, list(range(20, 40)))
    wide = _native_logits_in_steps(LlamaRunner(model, "cpu", torch.bfloat16), ids, [20, 21, 25, 33])  # 1, 4, 8, 7
    assert torch.equal(one[:, 20:], wide[:, 20:])


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 16), (14, 2, 64), (12, 2, 128)])
def test_one_query_attention_is_sdpa_in_float32(heads, kv_heads, dim):
    """The CPU decoding path (one new token per row) computes what SDPA computes, GQA and ragged
    rows included: float32 to rounding, bf16 as close to the float64 truth as SDPA is."""
    g = torch.Generator().manual_seed(heads)
    lengths = torch.tensor([0, 37, 90])  # committed tokens per row; the new token sits at slot lengths[b]
    mask = attention_mask(lengths, 1, 96, None)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((3, 1, heads, dim), (3, kv_heads, 96, dim), (3, kv_heads, 96, dim)))
    truth = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                           enable_gqa=heads != kv_heads).transpose(1, 2)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, None)):
        q_, k_, v_ = (x.to(dtype) for x in (q, k, v))
        ours = one_query_attention(q_, k_, v_, mask)
        sdpa = F.scaled_dot_product_attention(q_.transpose(1, 2), k_, v_, attn_mask=mask,
                                              enable_gqa=heads != kv_heads).transpose(1, 2)
        assert ours.dtype == dtype and ours.shape == q.shape
        err, sdpa_err = ((x.double() - truth).abs().max().item() for x in (ours, sdpa))
        if tolerance:
            assert err < tolerance and (ours - sdpa).abs().max().item() < tolerance
        else:  # one bf16 rounding of the output, as SDPA's
            assert err <= max(sdpa_err, 2 ** -8 * truth.abs().max().item()), f"{err:.2e} vs SDPA's {sdpa_err:.2e}"
