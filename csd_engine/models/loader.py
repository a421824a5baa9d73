"""Turn what the user passed as a model into a runner (and its tokenizer, if any).

Accepted: a zoo name (see `zoo.MODELS`), a Hugging Face folder, a `.gguf` file, a hub id
(when the hub is reachable), an already-loaded `transformers` model, or a `Runner`.
Llama-family models get the native runner; everything else the generic one.

A string spec may end in suffixes for the native runner, in this order (see `split_spec`):
`:int8` / `:int4` / `:int4gG` quantizes its weights (models/quant.py), `[:L]` keeps only its
first L layers (an early-exit drafter, `LlamaRunner.truncated`): "qwen2.5-coder-0.5b:int4[:12]".
A spec loads its own copy of the model; to share weights with a runner already loaded, pass
`runner.truncated(L)` itself (a Runner is accepted wherever a spec is).
"""
import os
import re

import torch

from csd_engine.models.hf import HFRunner
from csd_engine.models.llama import NATIVE_MODEL_TYPES, LlamaRunner
from csd_engine.models.quant import parse_scheme
from csd_engine.models.runner import Runner

_SUFFIXES = re.compile(r"^(?P<model>.+?)(?::(?P<quantize>int\w+))?(?:\[:(?P<layers>-?\d+)\])?$")


def split_spec(spec: str) -> tuple[str, str | None, int | None]:
    """(model, quantize scheme or None, early-exit layers or None) of a string spec. A spec that
    names an existing file or folder is taken whole."""
    match = _SUFFIXES.match(spec)
    if os.path.exists(spec) or match is None:
        return spec, None, None
    quantize, layers = match["quantize"], match["layers"]
    if quantize is not None:
        parse_scheme(quantize)
    return match["model"], quantize, None if layers is None else int(layers)


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
                attention_backend: str = "sdpa", fused: bool = False,
                quantize: str | None = None) -> tuple[Runner, object]:
    """Returns (runner, tokenizer or None). native=None picks the native runner when it
    supports the architecture; True demands it; False forces the generic runner. `fused`:
    the native runner's fused Triton norm / RoPE kernels (ignored by the generic runner).
    `quantize`: "int8", "int4" or "int4gG" weights (native runner only), as a `:int4` suffix does."""
    if quantize is not None:
        parse_scheme(quantize)
    if isinstance(spec, Runner):
        if quantize is not None:
            raise ValueError("quantize applies when a model is loaded; this one is already a runner "
                             "(build it with LlamaRunner(..., quantize=...))")
        return spec, getattr(spec, "tokenizer", None)
    tokenizer, layers = None, None
    if isinstance(spec, str):
        spec, suffix_scheme, layers = split_spec(spec)
        if suffix_scheme is not None and quantize not in (None, suffix_scheme):
            raise ValueError(f"the spec asks for {suffix_scheme} weights and quantize for {quantize}: give one")
        quantize = quantize or suffix_scheme
        model, tokenizer = _load_hf(spec, dtype)
    elif isinstance(spec, torch.nn.Module) and hasattr(spec, "config"):
        model = spec.eval()
    else:
        raise TypeError(f"a model must be a path, hub id, zoo name, transformers model or Runner; got {type(spec).__name__}")
    model_type = model.config.model_type
    if native is True and model_type not in NATIVE_MODEL_TYPES:
        raise ValueError(f"the native runner supports {NATIVE_MODEL_TYPES}, not {model_type!r}")
    if native is not False and model_type in NATIVE_MODEL_TYPES:
        runner = LlamaRunner(model, device, dtype, attention_backend, fused=fused, quantize=quantize)
        return (runner if layers is None else runner.truncated(layers)), tokenizer
    if quantize is not None or layers is not None:
        raise ValueError(f"quantized weights and early exits ([:L]) need the native runner, which supports "
                         f"{NATIVE_MODEL_TYPES}; this model is {model_type!r}" +
                         (" and native=False" if native is False else ""))
    return HFRunner(model.to(device=device, dtype=dtype), device), tokenizer
