"""A tiny model folder the server loads like a real one: random llama weights and the dry runs'
character tokenizer (bench/tiny.py, with a chat template), saved with save_pretrained.

The token of NAN_CHARACTER has a NaN embedding in the target, so a prompt holding it fails with
non-finite logits while other requests go on. (Not token 0: prefill pads with it.) Neither model
ever proposes that token itself (a drafted one would poison the target's verification forward):
one residual dimension is written by no layer and is 0.2 in every embedding, so it stays positive
after the final norm, and the token's logit is -1000 times it. Sampled requests therefore never
stumble on the NaN.
"""
import torch

from bench.tiny import tiny_tokenizer
from tests.tiny_models import perturbed, tiny_llama

NAN_CHARACTER = "|"


def _never_generated(model, token: int) -> None:
    dim = 0
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[dim] = 0.0
            layer.mlp.down_proj.weight[dim] = 0.0
        model.model.embed_tokens.weight[:, dim] = 0.2
        model.model.norm.weight[dim] = 1.0
        model.lm_head.weight[token] = 0.0
        model.lm_head.weight[token, dim] = -1000.0


def write_folders(root, seed: int = 3) -> tuple[str, str]:
    """(target folder with the tokenizer, drafter folder): the drafter is the target plus noise."""
    tokenizer = tiny_tokenizer()
    nan_token = tokenizer.convert_tokens_to_ids(NAN_CHARACTER)
    model = tiny_llama(seed=seed)
    drafter = perturbed(model, noise=0.1, seed=seed + 1)
    for m in (model, drafter):
        _never_generated(m, nan_token)
    with torch.no_grad():
        model.model.embed_tokens.weight[nan_token] = float("nan")
    target, drafter_folder = root / "tiny", root / "tiny-drafter"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    drafter.save_pretrained(drafter_folder)
    return str(target), str(drafter_folder)
