"""Turn what the user passed as a model into a runner (and its tokenizer, if any).

Accepted: a zoo name (see `zoo.MODELS`), a Hugging Face folder, a `.gguf` file, a hub id
(when the hub is reachable), an already-loaded `transformers` model, or a `Runner`.
Llama-family models get the native runner; everything else the generic one.
"""
import os

import torch

from csd_engine.models.hf import HFRunner
from csd_engine.models.llama import NATIVE_MODEL_TYPES, LlamaRunner
from csd_engine.models.runner import Runner


def _load_hf(spec: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from csd_engine.models import zoo

    folder, extra = spec, {}
    if zoo.is_zoo_name(spec):
        folder = str(zoo.resolve(spec))
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise ValueError(f"GGUF file not found: {spec!r}")
        folder, extra = os.path.dirname(os.path.abspath(spec)), {"gguf_file": os.path.basename(spec)}
    elif os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"{spec!r} is a folder but not a model folder (no config.json)")
    elif os.path.exists(spec):
        raise ValueError(f"{spec!r} is a file but not a model: pass a model folder or a .gguf file")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{spec!r} is not a model: expected a zoo name ({', '.join(zoo.MODELS)}), "
                         f"a model folder, a .gguf file or a reachable hub id ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:200]})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # token-id prompts still work; results carry text=None
    return model.eval(), tokenizer


def load_runner(spec, device, dtype: torch.dtype, native: bool | None = None,
                attention_backend: str = "sdpa", fused: bool = False) -> tuple[Runner, object]:
    """Returns (runner, tokenizer or None). native=None picks the native runner when it
    supports the architecture; True demands it; False forces the generic runner. `fused`:
    the native runner's fused Triton norm / RoPE kernels (ignored by the generic runner)."""
    if isinstance(spec, Runner):
        return spec, getattr(spec, "tokenizer", None)
    tokenizer = None
    if isinstance(spec, str):
        model, tokenizer = _load_hf(spec, dtype)
    elif isinstance(spec, torch.nn.Module) and hasattr(spec, "config"):
        model = spec.eval()
    else:
        raise TypeError(f"a model must be a path, hub id, zoo name, transformers model or Runner; got {type(spec).__name__}")
    model_type = model.config.model_type
    if native is True and model_type not in NATIVE_MODEL_TYPES:
        raise ValueError(f"the native runner supports {NATIVE_MODEL_TYPES}, not {model_type!r}")
    if native is not False and model_type in NATIVE_MODEL_TYPES:
        runner = LlamaRunner(model, device, dtype, attention_backend, fused=fused)
    else:
        runner = HFRunner(model.to(device=device, dtype=dtype), device)
    return runner, tokenizer
