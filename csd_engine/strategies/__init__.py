from csd_engine.strategies.autoregressive import Autoregressive

__all__ = ["Autoregressive"]
