"""How a run spreads over devices and which number formats it computes in.

``strategy`` declares each strategy once (:class:`StrategySpec`: what it shards and
supports, how it builds the Lightning strategy and shards a model); ``fsdp`` shards the
decoder block by block (FSDP2); ``precision`` maps the ``precision`` group onto
Lightning; ``fp8`` converts Linear layers to float8 training through torchao.
"""

from recipes_lib.parallel.engines import FSDP2Strategy, ZeroStrategy
from recipes_lib.parallel.strategy import (
    STRATEGIES,
    StrategySpec,
    build_strategy,
    get_strategy,
    trainer_devices,
)

__all__ = [
    "STRATEGIES",
    "FSDP2Strategy",
    "StrategySpec",
    "ZeroStrategy",
    "build_strategy",
    "get_strategy",
    "trainer_devices",
]
