from csd_engine.strategies.autoregressive import Autoregressive
from csd_engine.strategies.cascade import Cascade
from csd_engine.strategies.cascade_auto import AutoCascade
from csd_engine.strategies.pearl import Pearl
from csd_engine.strategies.speculative import Speculative
from csd_engine.strategies.speculative_auto import AutoSpeculative
from csd_engine.strategies.staged import Staged

__all__ = ["Autoregressive", "Speculative", "AutoSpeculative", "Cascade", "AutoCascade", "Staged", "Pearl"]
