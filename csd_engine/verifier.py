"""Which implementation verifies drafts: the Triton kernels or their PyTorch references.

Both give identical tokens for the same seeds. Default: Triton on a GPU and under the
Triton interpreter (tests), PyTorch on a plain CPU. `CSD_VERIFY_BACKEND=triton|torch` or the
engine's `verify_backend=` argument forces one. With models on two devices (PEARL with
`Engine(drafter_device=...)`), a call on CPU tensors outside the interpreter takes the
PyTorch reference even when the backend is Triton: the compiled kernels run on GPUs only.
Every entry point takes raw logits and samples from `top_at_zero`'s (kernels/sampling.py).
"""
import os

import torch

from csd_engine.kernels import use_kernels
from csd_engine.kernels.sampling import top_at_zero

BACKENDS = ("triton", "torch")
REFERENCE_HINTS = ("filtered", "max_top_k")  # host-known hints only the PyTorch references take
KERNEL_KNOBS = ("splits",)  # launch settings only the kernels take


def choose_backend(requested: str | None, device: torch.device) -> str:
    name = requested or os.environ.get("CSD_VERIFY_BACKEND") or None
    if name is None:
        name = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"verify backend must be one of {BACKENDS}, got {name!r}")
    return name


class Verifier:
    """`chain(...)`: kernels.verify semantics; `tree(...)`: kernels.tree_verify semantics;
    `emitted_distribution(...)`: kernels.emitted semantics.
    Either takes the union of both implementations' keyword options (`check_values`, the
    references' host-known hints, the kernels' `splits`); each implementation gets its own."""

    def __init__(self, backend: str):
        from csd_engine.kernels import verify
        self.backend = backend
        self._chain_kernel, self._chain_ref = verify.verify, verify.verify_ref
        self._sampled_distribution = verify.sampled_distribution

    def _kernel_for(self, tensor: torch.Tensor) -> bool:
        return self.backend == "triton" and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")

    def chain(self, logits, *args, **kwargs):
        kernel = self._kernel_for(logits)
        fn = self._chain_kernel if kernel else self._chain_ref
        return fn(_sampling_logits(logits, kwargs), *args, **_options_for(kernel, kwargs))

    def emitted_distribution(self, logits, draft_tokens, num_drafts, draft_probs, temperature, *args, **kwargs):
        """kernels.emitted semantics: the two-launch kernel on a GPU (the Triton backend), the
        PyTorch reference elsewhere (interpreted, the kernel would slow every sampling test;
        kernels.use_kernels)."""
        from csd_engine.kernels import emitted
        kernel = self.backend == "triton" and use_kernels(logits)
        return (emitted.emitted_distribution if kernel else emitted.emitted_distribution_ref)(
            top_at_zero(logits, temperature), draft_tokens, num_drafts, draft_probs, temperature, *args, **kwargs)

    def sampled_distribution(self, logits, temperature, result):
        """kernels.verify.sampled_distribution of a check this verifier made."""
        return self._sampled_distribution(top_at_zero(logits, temperature), temperature, result)

    def tree(self, logits, *args, **kwargs):
        from csd_engine.kernels import tree_verify
        kernel = self._kernel_for(logits)
        fn = tree_verify.tree_verify if kernel else tree_verify.tree_verify_ref
        return fn(_sampling_logits(logits, kwargs), *args, **_options_for(kernel, kwargs))


def _sampling_logits(logits: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """What a check samples from: top_at_zero's logits (the raw ones where every row is greedy)."""
    return logits if kwargs.get("all_greedy") else top_at_zero(logits, kwargs["temperature"])


def _options_for(kernel: bool, kwargs: dict) -> dict:
    dropped = REFERENCE_HINTS if kernel else KERNEL_KNOBS
    return {name: value for name, value in kwargs.items() if name not in dropped}
