"""The package as a user gets it: built from this repository's source distribution into a fresh
virtual environment (no editable install, no source tree on the path), imported, and generating
greedily; and the checkout itself, which Python imports first when run inside it.

The new environment sees this environment's packages (torch, transformers, the build tools)
through a .pth file, so nothing is downloaded; `csd_engine` itself comes only from what pip
builds (from a copy of the repository, so the build leaves nothing in the checkout)."""
import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import csd_engine
from csd_engine import Engine, SamplingParams
from tests.tiny_models import tiny_llama

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 3, 42]

SCRIPT = """
import json, pathlib, sys
import csd_engine, csd_engine.kernels.attention, csd_engine.ops
from csd_engine import Engine, SamplingParams
package = pathlib.Path(csd_engine.__file__).parent
assert package.is_relative_to(pathlib.Path(sys.prefix)), (package, sys.prefix)
result = Engine(sys.argv[1], max_batch_size=1, max_seq_len=64).generate([json.loads(sys.argv[2])],
                                                                        SamplingParams(max_new_tokens=8))[0]
print(json.dumps({"version": csd_engine.__version__, "typed": (package / "py.typed").is_file(),
                  "extension": csd_engine.ops.HAS_EXTENSION, "token_ids": result.token_ids}))
"""

CHECKOUT_SCRIPT = """
import json, pkgutil
import csd_engine, csd_engine.kernels.attention, csd_engine.ops
assert {m.name for m in pkgutil.iter_modules(csd_engine.__path__)}.isdisjoint({"setup", "bench", "tests"})
print(json.dumps({"package": csd_engine.__file__, "kernels": csd_engine.kernels.attention.__file__,
                  "extension": csd_engine.ops.HAS_EXTENSION, "not built": "not built" in csd_engine.ops._MISSING_REASON}))
"""


def _run(command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_built_package_installs_imports_and_generates(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", ".pytest_cache", "bench"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = pathlib.Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # from the source distribution, which must hold everything the build reads (csrc's headers too)
    _run([venv / "bin" / "python", "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=source)
    sdist, = (tmp_path / "dist").glob("csd_engine-*.tar.gz")
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(sdist)],
         cwd=tmp_path)

    model = tmp_path / "tiny"
    tiny_llama(seed=4).save_pretrained(model)
    out = _run([venv / "bin" / "python", "-c", SCRIPT, str(model), str(PROMPT)], cwd=tmp_path)
    installed = json.loads(out.strip().splitlines()[-1])

    expected = Engine(str(model), max_batch_size=1, max_seq_len=64).generate([PROMPT], SamplingParams(max_new_tokens=8))[0]
    assert installed == {"version": csd_engine.__version__, "typed": True, "extension": True,
                         "token_ids": expected.token_ids}
    assert _run([venv / "bin" / "csd-engine", "--version"], cwd=tmp_path).strip() == f"csd-engine {csd_engine.__version__}"

    # Run inside a checkout, Python imports the checkout's package (before the installed one): it
    # imports whole (its kernels from the top-level kernels/) and says its extension is not built.
    out = _run([venv / "bin" / "python", "-c", CHECKOUT_SCRIPT], cwd=source)
    assert json.loads(out.strip().splitlines()[-1]) == {"package": str(source / "csd_engine" / "__init__.py"),
                                                       "kernels": str(source / "kernels" / "attention.py"),
                                                       "extension": False, "not built": True}
