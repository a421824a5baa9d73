"""csd_engine: lossless speculative decoding (cascade, staged tree, PEARL) on static caches."""
import torch  # noqa: F401  (load torch before the compiled extension)

from csd_engine._version import __version__
from csd_engine.engine import Engine
from csd_engine.params import SamplingParams
from csd_engine.scheduler import GenerationResult, Metrics
from csd_engine.strategies import AutoCascade, Autoregressive, AutoSpeculative, Cascade, Pearl, Speculative, Staged

__all__ = ["__version__", "Engine", "GenerationResult", "Metrics", "SamplingParams", "Autoregressive", "Speculative", "AutoSpeculative", "Cascade", "AutoCascade", "Staged", "Pearl"]
