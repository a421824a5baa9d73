"""build_tree_mask: the compiled op (CPU; CUDA on a GPU) against the PyTorch reference, both
against a brute-force walk up the parent pointers, bad trees, torch.compile support, the
fallback without the extension, and the nvcc compile check of csrc/*.cu."""
import glob
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

from csd_engine import ops

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_extension = pytest.mark.skipif(
    not ops.HAS_EXTENSION, reason=f"the extension csd_engine._C is not built: {ops._MISSING_REASON}")


@pytest.fixture
def seed():
    return time.time_ns() % 2**31


def random_forests(generator, batch, nodes, device="cpu"):
    """Parent arrays [batch, nodes] of random forests with a random number of padded nodes per
    row. Half the rows favour near parents (deep chains), the others uniform parents (bushy)."""
    index = torch.arange(nodes)
    steepness = torch.where(torch.rand(batch, 1, generator=generator) < 0.5, 1.0, 4.0)
    offset = (torch.rand(batch, nodes, generator=generator) ** steepness * (index + 1)).long()
    parents = index - 1 - offset  # in [-1, index - 1]
    real_nodes = torch.randint(0, nodes + 1, (batch, 1), generator=generator)
    parents[index >= real_nodes] = ops.PADDING
    return parents.to(device)


def walk_up(parents):
    """The definition, node by node: mask, depth and path from following parent pointers."""
    batch, nodes = parents.shape
    mask = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
    depth = torch.zeros(batch, nodes, dtype=torch.int64)
    paths = torch.full((batch, nodes, nodes), -1, dtype=torch.int64)
    for row, row_parents in enumerate(parents.tolist()):
        for node in range(nodes):
            mask[row, node, node] = True
            if row_parents[node] == ops.PADDING:
                continue
            chain = [node]
            while row_parents[chain[-1]] != ops.ROOT:
                chain.append(row_parents[chain[-1]])
            mask[row, node, chain] = True
            depth[row, node] = len(chain) - 1
            paths[row, node, :len(chain)] = torch.tensor(chain[::-1])
    return mask, depth, paths


def assert_same(actual, expected, context):
    for name, got, want in zip(("mask", "depth", "paths"), actual, expected):
        got, want = got.cpu(), want.cpu()
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{name}: {got.dtype} {list(got.shape)}; {context}"
        assert torch.equal(got, want), f"{name} differs at {(got != want).nonzero()[:5].tolist()}; {context}"


def test_reference_matches_walk_up(seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(20):
        batch, nodes = torch.randint(1, 4, ()).item(), torch.randint(1, 13, ()).item()
        parents = random_forests(generator, batch, nodes)
        assert_same(ops.build_tree_mask_ref(parents), walk_up(parents), f"parents={parents.tolist()} seed={seed}")


@needs_extension
def test_op_matches_walk_up_and_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    for batch in range(1, 6):
        for nodes in (1, 2, 3, 7, 16, 31, 40):
            parents = random_forests(generator, batch, nodes)
            actual = torch.ops.csd_engine.build_tree_mask(parents)
            context = f"batch={batch} nodes={nodes} seed={seed}"
            assert_same(actual, ops.build_tree_mask_ref(parents), context)
            if nodes <= 16:
                assert_same(actual, walk_up(parents), context)


@needs_extension
def test_op_handles_empty_and_strided_input(seed):
    for shape in ((0, 5), (3, 0), (0, 0)):
        parents = torch.empty(shape, dtype=torch.int64)
        assert_same(torch.ops.csd_engine.build_tree_mask(parents), ops.build_tree_mask_ref(parents), f"shape={shape}")
    parents = random_forests(torch.Generator().manual_seed(seed), 4, 5).t().contiguous().t()  # column-major
    assert not parents.is_contiguous()
    assert_same(torch.ops.csd_engine.build_tree_mask(parents), walk_up(parents), f"seed={seed}")


@needs_extension
def test_opcheck(seed):
    generator = torch.Generator().manual_seed(seed)
    for batch, nodes in ((1, 1), (3, 9), (2, 24)):
        torch.library.opcheck(torch.ops.csd_engine.build_tree_mask, (random_forests(generator, batch, nodes),))


@needs_extension
def test_public_function_compiles_without_graph_break(seed):
    parents = random_forests(torch.Generator().manual_seed(seed), 3, 10)
    compiled = torch.compile(ops.build_tree_mask, backend="eager", fullgraph=True)
    assert_same(compiled(parents), walk_up(parents), f"seed={seed}")


def corrupt(kind, generator, batch, nodes):
    """A valid batch with one node (returned with it) broken in the given way."""
    parents = random_forests(generator, batch, nodes)
    row = torch.randint(0, batch, ()).item()
    node = torch.randint(1, nodes, ()).item()
    if kind == "parent is the node itself":
        parents[row, node] = node
    elif kind == "parent after the node":
        parents[row, node] = torch.randint(node + 1, nodes + 3, ()).item()
    elif kind == "parent below -2":
        parents[row, node] = torch.randint(-9, -2, ()).item()
    else:  # a real node after padding: pad the row from a random earlier node on
        first_pad = torch.randint(0, node, ()).item()
        parents[row, first_pad:] = ops.PADDING
        parents[row, node] = ops.ROOT
    return parents, row, node


BAD_TREES = ("parent is the node itself", "parent after the node", "parent below -2", "real node after padding")


@pytest.mark.parametrize("kind", BAD_TREES)
def test_bad_tree_raises_naming_row_and_node(kind, seed):
    generator = torch.Generator().manual_seed(seed)
    parents, row, node = corrupt(kind, generator, batch=3, nodes=8)
    rule = "padded nodes .parent -2. must come after" if kind == "real node after padding" else (
        r"parent must be -1 \(root\), -2 \(padding\) or an index smaller than the node")
    expected = f"row {row}, node {node} has parent {parents[row, node].item()}.*{rule}"
    implementations = [ops.build_tree_mask_ref, ops.build_tree_mask]
    if ops.HAS_EXTENSION:
        implementations.append(torch.ops.csd_engine.build_tree_mask)
    for build in implementations:
        with pytest.raises(ValueError, match=expected):
            build(parents)


@pytest.mark.parametrize("implementation", ["reference", "op"])
def test_bad_layout_raises(implementation):
    if implementation == "op" and not ops.HAS_EXTENSION:
        pytest.skip(f"the extension csd_engine._C is not built: {ops._MISSING_REASON}")
    build = ops.build_tree_mask_ref if implementation == "reference" else torch.ops.csd_engine.build_tree_mask
    with pytest.raises(TypeError, match="parents must be int64"):
        build(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(ValueError, match="2-D"):
        build(torch.tensor([-1, 0]))


def test_falls_back_to_reference_with_one_warning(seed, monkeypatch):
    """The public function on a device the extension has no kernel for (here: pretend CPU)."""
    monkeypatch.setattr(ops, "_TREE_MASK_DEVICES", frozenset())
    ops._warn_fallback.cache_clear()
    parents = random_forests(torch.Generator().manual_seed(seed), 2, 11)
    with pytest.warns(RuntimeWarning, match="PyTorch reference"):
        assert_same(ops.build_tree_mask(parents), walk_up(parents), f"seed={seed}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        ops.build_tree_mask(parents)
    ops._warn_fallback.cache_clear()


def test_package_imports_without_extension():
    """Blocks `csd_engine._C` in a fresh interpreter: the package still imports and the public
    function warns once and answers with the reference."""
    program = """
import sys, warnings
sys.modules["csd_engine._C"] = None  # makes `from csd_engine import _C` raise ImportError
import torch
from csd_engine import ops
assert not ops.HAS_EXTENSION
parents = torch.tensor([[-1, 0, 0, 1, -2]])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = ops.build_tree_mask(parents)
    second = ops.build_tree_mask(parents)
assert len(caught) == 1 and "csd_engine._C did not import" in str(caught[0].message), caught
assert all(torch.equal(a, b) for a, b in zip(first, ops.build_tree_mask_ref(parents)))
assert first[2][0, 3].tolist() == [0, 1, 3, -1, -1]
# an engine on the CPU says so once: it runs PyTorch's ops, and bf16 exactness needs batch_invariant
from csd_engine import Engine
from tests.tiny_models import tiny_llama
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Engine(tiny_llama(), max_batch_size=1, max_seq_len=16)
    Engine(tiny_llama(), max_batch_size=1, max_seq_len=16)
said = [w for w in caught if "PyTorch's ops instead of its kernels" in str(w.message)]
assert len(said) == 1 and "batch_invariant=True" in str(said[0].message), caught
assert said[0].filename == "<string>", said[0].filename  # the caller's line, not the engine's
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not ops.cpu_layer_ops_run(), reason="csd_engine._C has no CPU layer ops")
def test_an_extension_from_older_sources_is_told_apart():
    """The CPU layer ops are used only where the built op has the arguments the runner passes:
    an extension built before decode_attention took tree_mask would fail every forward, so the
    package then keeps them off (with a warning to rebuild) instead."""
    assert ops._has_argument("csd_engine::decode_attention", "tree_mask")
    assert not ops._has_argument("csd_engine::decode_attention", "no_such_argument")
    assert not ops._has_argument("csd_engine::no_such_op", "tree_mask")


@pytest.mark.gpu
@needs_extension
def test_cuda_matches_cpu(seed):
    generator = torch.Generator().manual_seed(seed)
    for batch in (1, 3, 5):
        for nodes in (1, 5, 33, 40, 200):
            parents = random_forests(generator, batch, nodes)
            assert_same(torch.ops.csd_engine.build_tree_mask(parents.cuda()),
                        torch.ops.csd_engine.build_tree_mask(parents), f"batch={batch} nodes={nodes} seed={seed}")
    for kind in BAD_TREES:
        parents, row, node = corrupt(kind, generator, batch=4, nodes=12)
        with pytest.raises(ValueError) as cpu_error:
            torch.ops.csd_engine.build_tree_mask(parents)
        with pytest.raises(ValueError, match=re.escape(str(cpu_error.value).splitlines()[0])):
            torch.ops.csd_engine.build_tree_mask(parents.cuda())


def find_nvcc():
    candidates = [shutil.which("nvcc")] + sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (PATH, /usr/local/cuda*/bin)")
def test_cuda_sources_compile_with_nvcc():
    result = subprocess.run(["bash", "scripts/nvcc_check.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "NVCC": find_nvcc(), "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled cleanly" in result.stdout, result.stdout
