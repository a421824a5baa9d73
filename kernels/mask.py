"""The attention visibility mask of a forward over new tokens on a static cache.

Shared by the models' SDPA path and the PyTorch reference of `kernels/attention.py`, so it
lives on the kernels side: models import kernels, kernels never import models.
"""
import torch


def attention_mask(lengths: torch.Tensor, n: int, kv_bound: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, n, kv_bound] bool: query i of row b sees its committed prefix (slots < lengths[b])
    and the new tokens it may attend to (itself and earlier ones, or its tree ancestors)."""
    slots = torch.arange(kv_bound, device=lengths.device)
    rel = slots[None, None, :] - lengths[:, None, None]  # slot index relative to the first new token
    query = torch.arange(n, device=lengths.device)[None, :, None]
    if tree_mask is None:
        visible = rel <= query
    else:
        new = (rel >= 0) & (rel < n)
        idx = rel.clamp(0, n - 1).expand(-1, n, -1)
        visible = (rel < 0) | (new & torch.gather(tree_mask, 2, idx))
    return visible[:, None]
