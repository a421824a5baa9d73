"""Tiny randomly initialised models built inside the tests (no downloads).

The initialisation scale is raised from transformers' default so that logits are spread
out (top-2 gaps far above float32 noise): greedy comparisons are then decided by the model,
not by rounding. `perturbed` makes a drafter that agrees with its target most of the time.
"""
import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


def _finish(model, seed, scale):
    # No end-of-sequence token: transformers' generate must not stop where the engine goes on.
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
            elif "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_llama(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, tie=False, scale=1.5):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=tie, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return _finish(LlamaForCausalLM(cfg), seed, scale)


def tiny_qwen2(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, scale=1.5):
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=True)
    return _finish(Qwen2ForCausalLM(cfg), seed, scale)


def tiny_gpt2(seed=0, layers=2, hidden=64, heads=4, vocab=VOCAB, scale=1.5):
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512,
                     bos_token_id=0, eos_token_id=None)
    return _finish(GPT2LMHeadModel(cfg), seed, scale)


def perturbed(model, noise=0.05, seed=1):
    """A drafter: the target's weights plus noise, so it agrees with the target often but not always."""
    g = torch.Generator().manual_seed(seed)
    drafter = copy.deepcopy(model)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return drafter


def random_prompts(n, lo=2, hi=12, vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_greedy(model, prompt, n):
    """transformers' own greedy continuation of `prompt` (n tokens, no end token): the reference."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
