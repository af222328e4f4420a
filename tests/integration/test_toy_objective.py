"""An objective added from outside the library: its module (here), its YAML (written in a
temporary config folder) and this test are all it takes. The run schema, the pre-flight,
the memory estimate and ``train.run`` learn of it from its spec alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from integration_helpers import tiny_overrides
from torch import Tensor

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config import objectives as schema_settings
from recipes_lib.errors import ConfigError
from recipes_lib.launch_check.memory import estimate_memory
from recipes_lib.objectives import registry
from recipes_lib.objectives.pretrain import pretrain_data
from recipes_lib.objectives.registry import FrozenModel, ObjectiveSpec, register_objective
from recipes_lib.preflight import check_run
from recipes_lib.train import run
from recipes_lib.training.module import Batch, CausalLMModule

TOY_YAML = """\
# @package _global_
stage:
  objective: toy
  toy:
    weight: 0.5
"""


@dataclass
class ToySettings:
    weight: float = 1.0  # the next-token loss times this
    reference: bool = False  # keep a frozen copy of the policy (to test what is counted)
    max_steps_allowed: int = 100


class ToyModule(CausalLMModule):
    """Next-token prediction with its loss scaled by ``stage.toy.weight``."""

    def __init__(self, *args: Any, settings: ToySettings, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().compute_loss(batch)
        return self.settings.weight * loss, {**metrics, "unscaled": loss.detach()}


def _frozen(cfg, settings: ToySettings) -> tuple[FrozenModel, ...]:
    return (FrozenModel("reference", cfg.model, sharded=True),) if settings.reference else ()


def _check(cfg, settings: ToySettings) -> None:
    if cfg.trainer.max_steps > settings.max_steps_allowed:
        raise ConfigError("trainer.max_steps above stage.toy.max_steps_allowed")


TOY = ObjectiveSpec(
    name="toy",
    module=ToyModule.from_run_config,
    data=pretrain_data,
    batch="as pretraining's",
    loss="causal_lm_loss times stage.toy.weight",
    settings=ToySettings,
    frozen_models=_frozen,
    check=_check,
)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy objective registered for one test (the registries restored after it), and
    a config folder holding its ``stage`` option."""
    builtins = {name: registry.get_objective(name) for name in registry.objective_names()}
    monkeypatch.setattr(registry, "_REGISTRY", builtins)
    monkeypatch.setattr(schema_settings, "_SETTINGS", dict(schema_settings.declared_settings()))
    register_objective(TOY)
    conf = tmp_path / "conf"
    (conf / "stage").mkdir(parents=True)
    (conf / "stage" / "toy.yaml").write_text(TOY_YAML)
    return f"hydra.searchpath=[file://{conf}]"


def toy_config(tmp_path, cache, searchpath, *extra: str):
    return compose_config(
        tiny_overrides(
            tmp_path,
            cache,
            searchpath,
            "stage=toy",
            "trainer.max_steps=3",
            "scheduler.warmup=1",
            *extra,
        )
    )


def test_a_toy_objective_trains_from_its_module_and_yaml_alone(toy, tmp_path, shared_cache):
    cfg = toy_config(tmp_path, shared_cache, toy, "trainer.val_check_interval=null")
    typed = to_run_config(cfg)
    assert typed.stage.toy == ToySettings(weight=0.5)  # typed from its YAML
    result = run(cfg)
    assert result.global_step == 3 and result.weights_path is not None
    # its loss is the unscaled loss times stage.toy.weight
    metrics = result.metrics
    assert metrics["train/loss"] == pytest.approx(0.5 * metrics["train/unscaled"], rel=1e-5)


def test_its_settings_are_typed_and_checked_like_any_key(toy, tmp_path, shared_cache):
    with pytest.raises(Exception, match="stage.toy.weightt"):
        toy_config(tmp_path, shared_cache, toy, "stage.toy.weightt=1")
    with pytest.raises(Exception, match="stage.toy.weight"):
        toy_config(tmp_path, shared_cache, toy, "stage.toy.weight=heavy")
    # its own cross-key rule, asked by the pre-flight
    cfg = to_run_config(toy_config(tmp_path, shared_cache, toy, "stage.toy.max_steps_allowed=2"))
    with pytest.raises(ConfigError, match="stage.toy.max_steps_allowed"):
        check_run(cfg, registry.objective_names())


def test_the_memory_estimate_counts_the_frozen_models_its_spec_declares(
    toy, tmp_path, shared_cache
):
    alone = estimate_memory(to_run_config(toy_config(tmp_path, shared_cache, toy)), 1)
    cfg = to_run_config(toy_config(tmp_path, shared_cache, toy, "stage.toy.reference=true"))
    beside = estimate_memory(cfg, 1)
    policy_bytes = alone.parameters
    assert beside.parameters == pytest.approx(2 * policy_bytes, rel=0.01)  # its own weights
