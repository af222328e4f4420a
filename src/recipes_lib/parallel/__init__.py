"""How a run spreads over devices and which number formats it computes in.

``strategy`` builds the Lightning strategy of the ``strategy`` config group and checks
it; ``fsdp`` shards the decoder block by block (FSDP2); ``precision`` maps the
``precision`` group onto Lightning and checks it; ``fp8`` converts Linear layers to
float8 training through torchao.
"""

from recipes_lib.parallel.strategy import (
    SHARDED,
    STRATEGIES,
    FSDP2Strategy,
    ZeroStrategy,
    build_strategy,
    check_strategy,
    gather_full_state_dict,
    trainer_devices,
)

__all__ = [
    "SHARDED",
    "STRATEGIES",
    "FSDP2Strategy",
    "ZeroStrategy",
    "build_strategy",
    "check_strategy",
    "gather_full_state_dict",
    "trainer_devices",
]
