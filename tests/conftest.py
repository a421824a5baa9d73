import collections
import os
import shutil

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this must run before any
# csd_engine.kernels module is imported. Without a GPU the kernels run in the interpreter.
# With CSD_COMPILE_FOR=80,90 (tests/gpu_compile.py) each launch is compiled for those GPUs, then interpreted.
if shutil.which("nvidia-smi") is None and not os.environ.get("CSD_COMPILE_FOR"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CSD_DEBUG", "1")  # runners check the host-side attention bounds

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("CSD_COMPILE_FOR"):
    from tests.gpu_compile import install
    install([int(arch) for arch in os.environ["CSD_COMPILE_FOR"].split(",")], os.environ.get("CSD_COMPILE_LOG"))
elif os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interpreter
    interpreter.install()  # the language patched once per launch, not at every helper call

if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one thread each, no oversubscription
    torch.set_num_threads(1)


COMPILE_FILE, COMPILE_TEST = "tests/kernels/test_compiles.py", "test_every_kernel_compiles_for_sm80_and_sm90"


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the items that will run
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    compile_check = f"{COMPILE_FILE}::{COMPILE_TEST}"
    if not os.environ.get("CSD_COMPILE_FOR") and any(item.nodeid == compile_check for item in items):
        from tests.gpu_compile import COMPILED_TESTS
        rerun = pytest.mark.skip(reason=f"runs in {COMPILE_TEST}'s compiled run, checked there")
        for item in items:
            if item.nodeid.startswith(COMPILED_TESTS) and not item.nodeid.startswith(COMPILE_FILE):
                item.add_marker(rerun)
        # the suite's longest test (one process, 5-10 minutes) first, so that the other workers share
        # out the rest while it runs (started late, it ran on alone at the end); then the files with
        # the most tests, as xdist would order them (scripts/test.sh turns its own ordering off)
        per_file = collections.Counter(item.nodeid.split("::")[0] for item in items)
        items.sort(key=lambda item: (not item.nodeid.startswith(COMPILE_FILE), -per_file[item.nodeid.split("::")[0]]))
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


if os.environ.get("CSD_MUTATION"):  # tests/mutations.py: an injected mistake the suite must catch
    from tests.mutations import apply
    apply(os.environ["CSD_MUTATION"])
