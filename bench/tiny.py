"""Tiny random models and a character tokenizer for `--dry-run`: every bench script runs end to
end in seconds, with no download and no real weights, to prove that it works (its numbers mean
nothing). The models follow tests/tiny_models.py (bench does not import tests): weights drawn
at a raised scale so logits are spread out, no end-of-sequence token, and a drafter that is
the target plus a little noise, so it agrees with the target often but not always.
"""
import copy
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# "\n" and the printable ASCII characters but "~", after <unk>: 96 ids, the tiny models' vocabulary
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 126)]
VOCAB = 1 + len(CHARACTERS)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_qwen2(seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               scale: float = 1.5) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    # No end-of-sequence token: transformers' generate must not stop where the engine goes on.
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def perturbed(model: torch.nn.Module, noise: float = 0.05, seed: int = 1) -> torch.nn.Module:
    """The model's weights plus noise: a drafter that agrees with its target often."""
    g = torch.Generator().manual_seed(seed)
    drafter = copy.deepcopy(model)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return drafter


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """One token per character (others: <unk>), with a chat template, so prompts.json's texts
    and chat messages encode as they do for a real model. A larger `vocab_size` adds
    placeholder tokens "<tN>" after the characters, so every id a bigger model emits decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARACTERS)}}
    vocab.update({f"<t{i}>": i for i in range(VOCAB, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_pair(folder) -> tuple[str, str]:
    """A tiny target (with the character tokenizer) and its drafter saved as model folders under
    `folder`, for scripts that hand models to another process by path (bench/serve.py)."""
    target = tiny_qwen2()
    paths = Path(folder) / "tiny-target", Path(folder) / "tiny-drafter"
    target.save_pretrained(paths[0])
    tiny_tokenizer().save_pretrained(paths[0])
    perturbed(target).save_pretrained(paths[1])
    return str(paths[0]), str(paths[1])


if __name__ == "__main__":  # a module, not a script: say which to run
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness import not_a_script
    not_a_script(__file__)
