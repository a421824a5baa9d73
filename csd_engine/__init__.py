"""csd_engine: lossless speculative decoding (cascade, staged tree, PEARL) on static caches."""
import importlib.util
import os
import sys

import torch  # noqa: F401  (load torch before the compiled extension)

# An install maps the top-level kernels/ to csd_engine.kernels (setup.py's package_dir); run from
# a source checkout, the package loads it from there, so the checkout imports as it installs.
_checkout_kernels = os.path.join(os.path.dirname(__path__[0]), "kernels")
if not os.path.isdir(os.path.join(__path__[0], "kernels")) and "csd_engine.kernels" not in sys.modules and \
        os.path.isfile(os.path.join(_checkout_kernels, "__init__.py")):
    _spec = importlib.util.spec_from_file_location("csd_engine.kernels", os.path.join(_checkout_kernels, "__init__.py"),
                                                   submodule_search_locations=[_checkout_kernels])
    kernels = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(kernels)

from csd_engine._version import __version__
from csd_engine.engine import Engine
from csd_engine.params import SamplingParams
from csd_engine.scheduler import GenerationResult, Metrics
from csd_engine.strategies import AutoCascade, Autoregressive, AutoSpeculative, Cascade, Pearl, Speculative, Staged

__all__ = ["__version__", "Engine", "GenerationResult", "Metrics", "SamplingParams", "Autoregressive", "Speculative", "AutoSpeculative", "Cascade", "AutoCascade", "Staged", "Pearl"]
