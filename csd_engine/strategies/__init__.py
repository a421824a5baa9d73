from csd_engine.strategies.autoregressive import Autoregressive
from csd_engine.strategies.cascade import Cascade
from csd_engine.strategies.speculative import Speculative

__all__ = ["Autoregressive", "Speculative", "Cascade"]
