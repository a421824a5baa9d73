"""The kernels layer stands alone: no file in kernels/ imports the model, strategy or engine
layers (those import kernels, never the other way round)."""
import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
FORBIDDEN = ("csd_engine.models", "csd_engine.strategies", "csd_engine.engine")


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):  # walk: imports inside functions count too
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_kernels_import_no_higher_layer():
    files = sorted(KERNELS.glob("*.py"))
    assert files, f"no kernel sources found in {KERNELS}"
    offenders = [f"{path.name}: {module}" for path in files
                 for module in _imported_modules(ast.parse(path.read_text(), filename=str(path)))
                 if any(module == layer or module.startswith(layer + ".") for layer in FORBIDDEN)]
    assert not offenders, f"kernels/ must not import {', '.join(FORBIDDEN)}: {offenders}"
