"""csd_engine: lossless speculative decoding (cascade, staged tree, PEARL) on static caches."""
import os

import torch  # noqa: F401  (load torch before the compiled extension)

# An install maps the top-level kernels/ to csd_engine.kernels (setup.py's package_dir); run from
# a source checkout, this package finds it there too, so the checkout imports as it installs.
if not os.path.isdir(os.path.join(__path__[0], "kernels")) and \
        os.path.isfile(os.path.join(os.path.dirname(__path__[0]), "kernels", "__init__.py")):
    __path__.append(os.path.dirname(__path__[0]))

from csd_engine._version import __version__
from csd_engine.engine import Engine
from csd_engine.params import SamplingParams
from csd_engine.scheduler import GenerationResult, Metrics
from csd_engine.strategies import AutoCascade, Autoregressive, AutoSpeculative, Cascade, Pearl, Speculative, Staged

__all__ = ["__version__", "Engine", "GenerationResult", "Metrics", "SamplingParams", "Autoregressive", "Speculative", "AutoSpeculative", "Cascade", "AutoCascade", "Staged", "Pearl"]
