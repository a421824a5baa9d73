"""Turn what the user passed as a model into a runner (and its tokenizer, if any).

Accepted: a zoo name (see `zoo.MODELS`; its bfloat16 folder, cast to the dtype asked for), a
Hugging Face folder, a `.gguf` file (dequantized exactly as the zoo converts its GGUFs), a hub
id when a hub is reachable (`org/name`, or `org/name@revision` for a branch, tag or commit), an
already-loaded `transformers` causal LM, or a `Runner`; a path may be a `pathlib.Path` or start
with `~`. Llama-family models get the native runner, but for what it cannot compute
(`llama.unsupported`: a non-SiLU MLP, MLP biases, a quantized checkpoint's layers);
everything else the generic one. Without
a network, a hub id loads from the local hub cache only. Each loaded runner carries
`eos_token_ids`.

A string spec may end in suffixes for the native runner, in this order (see `split_spec`):
`:int8` / `:int4` / `:int4gG` quantizes its weights (models/quant.py), `[:L]` keeps only its
first L layers (an early-exit drafter, `LlamaRunner.truncated`): "qwen2.5-coder-0.5b:int4[:12]".
A spec loads its own copy of the model; to share weights with a runner already loaded, pass
`runner.truncated(L)` itself (a Runner is accepted wherever a spec is).
"""
import copy
import difflib
import itertools
import logging
import os
import pathlib
import re
import socket
import struct
from urllib.parse import urlparse

import torch

from csd_engine.models.hf import HFRunner
from csd_engine.models.llama import NATIVE_MODEL_TYPES, LlamaRunner, nonstock, unsupported
from csd_engine.models.quant import parse_scheme
from csd_engine.models.runner import Runner

log = logging.getLogger(__name__)


def _split_revision(hub_id: str) -> tuple[str, dict]:
    """"org/name@rev" -> ("org/name", {"revision": "rev"}); a plain id has no revision."""
    name, at, revision = hub_id.partition("@")
    if not at:
        return hub_id, {}
    if not name or not revision:
        raise ValueError(f"{hub_id!r}: a hub id with a revision is 'org/name@revision' (branch, tag or commit)")
    return name, {"revision": revision}


_SUFFIXES = re.compile(r"^(?P<model>.+?)(?::(?P<quantize>int\w+))?(?:\[:(?P<layers>-?\d+)\])?$", re.IGNORECASE)


def split_spec(spec: str) -> tuple[str, str | None, int | None]:
    """(model, quantize scheme or None, early-exit layers or None) of a string spec. A spec that
    names an existing file or folder is taken whole."""
    spec = os.path.expanduser(spec)
    match = _SUFFIXES.match(spec)
    if os.path.exists(spec) or match is None:
        return spec, None, None
    quantize, layers = match["quantize"], match["layers"]
    if (re.search(r":[^/]*$", match["model"]) or "[:" in match["model"]) and not os.path.exists(match["model"]):
        # "name: int4", "name[:4]:int8": a suffix that is neither a scheme nor in order
        raise ValueError(f"{spec!r}: cannot read its suffix; a spec is MODEL[:int8 | :int4 | :int4gG][[:L]] "
                         "(quantization first, then the early exit's layers)")
    if quantize is not None:
        quantize = quantize.lower()
        parse_scheme(quantize)
    return match["model"], quantize, None if layers is None else int(layers)


def _is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the model hub answers at all (HF_HUB_OFFLINE says it cannot): without a network,
    transformers retries for most of a minute before failing."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
    except OSError:
        return False
    return True


def check_spec(spec) -> None:
    """Refuse at once, before anything loads, a string spec that cannot name a model: a typo of
    a zoo name or 'mag', a path that does not exist, a folder without config.json, a file that
    is neither a folder nor a .gguf. Other specs (models, runners) are checked as they load."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str) and spec.lower() != "mag":
        check_model_name(split_spec(spec)[0])


def check_model_name(spec: str) -> None:
    """check_spec for a spec without its suffixes."""
    from csd_engine.models import zoo

    if zoo.is_zoo_name(spec):
        return
    if _is_gguf(spec):
        if not os.path.isfile(spec):
            raise ValueError(f"GGUF file not found: {spec!r}")
    elif os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"{spec!r} is a folder but not a model folder (no config.json)")
    elif os.path.exists(spec):
        raise ValueError(f"{spec!r} is a file but not a model: pass a model folder or a .gguf file")
    elif spec.startswith(("/", "./", "../", "~")):
        raise ValueError(f"{spec!r}: no such file or folder (a model folder, a .gguf file, a zoo name or a hub id)")
    else:
        near = difflib.get_close_matches(spec.lower(), [*zoo.MODELS, "mag"], n=1, cutoff=0.8)
        if near and "/" not in spec:  # a typo, not a hub id: say so now, not after the hub's retries
            raise ValueError(f"{spec!r} is not a model: did you mean {near[0]!r}? (zoo names: {', '.join(zoo.MODELS)}; "
                             "'mag' for the MaG drafter; or a model folder, a .gguf file or a hub id)")


def _load_hf(spec: str, dtype: torch.dtype, with_tokenizer: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from csd_engine.models import zoo

    folder, extra = spec, {}
    check_model_name(spec)
    if zoo.is_zoo_name(spec):
        folder = str(zoo.resolve(spec))
    elif not os.path.exists(spec):  # a hub id
        folder, extra = _split_revision(spec)
        if not _hub_reachable():  # then only a model already in the hub's local cache loads
            extra["local_files_only"] = True
    try:
        if _is_gguf(spec):
            model, tokenizer = zoo.load_gguf(pathlib.Path(spec).resolve(), dtype)
            return model.eval(), tokenizer
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    except (OSError, ValueError, struct.error) as exc:  # struct: a GGUF cut short in its header
        offline = " (the hub is not reachable from here)" if extra.get("local_files_only") else ""
        raise ValueError(f"{spec!r} is not a model: expected a zoo name ({', '.join(zoo.MODELS)}), "
                         f"a model folder, a .gguf file or a reachable hub id{offline} ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else 'unreadable file'})") from None
    if not with_tokenizer:
        return model.eval(), None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # token-id prompts still work; results carry text=None
    return model.eval(), tokenizer


def eos_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """Every token id that ends a generation, sorted: the tokenizer's EOS, the model's
    `generation_config.eos_token_id` and its config's (each an int, a list or None). Instruct
    models often list several in the generation config (a chat turn's end beside the text's),
    which the tokenizer's single `eos_token_id` misses."""
    sources = (getattr(tokenizer, "eos_token_id", None),
               getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(getattr(model, "config", None), "eos_token_id", None))
    ids = set()
    for source in sources:
        if source is not None:
            ids.update(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    return tuple(sorted(ids))


def load_runner(spec, device, dtype: torch.dtype, native: bool | None = None,
                attention_backend: str = "sdpa", fused: bool | None = None,
                quantize: str | None = None, dense_rows: int = 0,
                with_tokenizer: bool = True) -> tuple[Runner, object]:
    """Returns (runner, tokenizer or None). native=None picks the native runner when it
    supports the architecture; True demands it; False forces the generic runner. `fused`:
    the native runner's fused norm / RoPE path (None: Triton kernels on CUDA where the head size
    allows, the extension's C++ ops on a CPU that has them; ignored by the generic runner).
    `quantize`: "int8", "int4" or "int4gG" weights (native runner only), as a `:int4` suffix does;
    `dense_rows`: quantized matrices also kept dense for calls of more rows (models/quant.py).
    with_tokenizer=False skips loading the tokenizer (a drafter's text is the target's; ~1 s).
    A runner built here has `eos_token_ids` set (see `eos_token_ids`); a Runner passed in is
    returned as it is."""
    if quantize is not None:
        parse_scheme(quantize)
    if isinstance(spec, Runner):
        if quantize is not None:
            raise ValueError("quantize applies when a model is loaded; this one is already a runner "
                             "(build it with LlamaRunner(..., quantize=...))")
        return spec, getattr(spec, "tokenizer", None)
    tokenizer, layers = None, None
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        spec, suffix_scheme, layers = split_spec(spec)
        if suffix_scheme is not None and quantize not in (None, suffix_scheme):
            raise ValueError(f"the spec asks for {suffix_scheme} weights and quantize for {quantize}: give one")
        quantize = quantize or suffix_scheme
        model, tokenizer = _load_hf(spec, dtype, with_tokenizer)
    elif isinstance(spec, torch.nn.Module) and hasattr(getattr(spec, "_orig_mod", spec), "config"):
        spec = getattr(spec, "_orig_mod", spec)  # torch.compile's wrapper: the model it compiles
        if not (hasattr(spec, "can_generate") and spec.can_generate()):
            raise TypeError(f"a transformers model must be a causal language model (what AutoModelForCausalLM "
                            f"loads, e.g. LlamaForCausalLM), got {type(spec).__name__}")
        unloaded = sorted({p.device.type for p in spec.parameters()} & {"meta"})
        if unloaded or getattr(spec, "hf_device_map", None) and any(
                d in ("disk", "meta") for d in spec.hf_device_map.values()):
            raise ValueError(f"this {type(spec).__name__}'s weights are not all loaded (on the meta device or "
                             "offloaded to disk by a device_map): load them into memory first")
        model = spec  # left in its mode: the native runner copies what it needs, the generic one runs in eval
    else:
        raise TypeError(f"a model must be a path, hub id, zoo name, transformers model or Runner; got {type(spec).__name__}")
    model_type = model.config.model_type
    reason = unsupported(model.config) or nonstock(model) if model_type in NATIVE_MODEL_TYPES else None
    if native is True and (model_type not in NATIVE_MODEL_TYPES or reason):
        raise ValueError(f"the native runner supports {NATIVE_MODEL_TYPES}, not {model_type!r}" if not reason else
                         f"the native runner cannot run this model: {reason} (the generic runner can: native=False)")
    if native is not False and model_type in NATIVE_MODEL_TYPES and not reason:
        runner = LlamaRunner(model, device, dtype, attention_backend, fused=fused, quantize=quantize,
                             dense_rows=dense_rows)
        runner = runner if layers is None else runner.truncated(layers)
    elif quantize is not None or layers is not None:
        raise ValueError(f"quantized weights and early exits ([:L]) need the native runner, which supports "
                         f"{NATIVE_MODEL_TYPES}; this model is {model_type!r}" +
                         (f" ({reason})" if reason else " and native=False" if native is False else ""))
    else:
        if reason:
            log.info("%s: the generic runner, since the native one cannot run %s", model_type, reason)
        device = torch.device(device)
        recast = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
        if model is spec and (recast or any(t.device != device for t in itertools.chain(model.parameters(),
                                                                                          model.buffers()))):
            model = copy.deepcopy(model)  # the caller's model stays as it was, as the native runner's copy leaves it
        model.to(device=device)
        for p in model.parameters():  # parameters only: buffers (RoPE's float32 inv_freq) stay as transformers has them
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        runner = HFRunner(model, device)
    runner.eos_token_ids = eos_token_ids(model, tokenizer)
    log.debug("%s (%s): %s on %s in %s, EOS ids %s", spec if isinstance(spec, str) else type(spec).__name__,
              model_type, type(runner).__name__, device, dtype, runner.eos_token_ids)
    return runner, tokenizer
