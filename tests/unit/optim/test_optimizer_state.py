"""Each optimizer spec's state bytes equal the bytes of the state a real step makes, over
a model with every kind of parameter (matrices, biases, a norm gain, an embedding, a
stack of experts, an output head). 8-bit AdamW runs on CUDA only: tests/gpu has its twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from optimizer_probe import measured_and_estimated

from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim import OPTIMIZERS, ParameterInfo, get_optimizer_spec
from recipes_lib.optim.state import adamw_8bit_shared, adamw_8bit_state, adamw_state

CONF = Path(__file__).resolve().parents[3] / "conf" / "optim"


@pytest.mark.parametrize(
    "config",
    [
        OptimConfig(name="adamw", fused=False),
        OptimConfig(name="adamw", fused=True),
        OptimConfig(name="adamw", args={"amsgrad": True}),
        OptimConfig(name="adafactor"),
        OptimConfig(name="muon"),
        OptimConfig(name="muon", decay_embeddings=True),
        OptimConfig(name="SGD", args={"momentum": 0.9}),
        OptimConfig(name="SGD"),
        OptimConfig(name="RAdam"),
    ],
    ids=lambda c: f"{c.name}-{c.args}-fused={c.fused}-decay_emb={c.decay_embeddings}",
)
def test_the_estimate_is_the_state_a_step_makes(config):
    measured, estimated = measured_and_estimated(config)
    assert measured > 0 or config.name == "SGD"
    assert estimated == measured


@pytest.mark.parametrize("name", ["adamw", "adafactor", "muon"])
def test_bf16_parameters_keep_bf16_state(name):
    measured, estimated = measured_and_estimated(OptimConfig(name=name), dtype=torch.bfloat16)
    assert estimated == measured
    fp32, _ = measured_and_estimated(OptimConfig(name=name))
    assert measured < fp32


def test_the_choices_differ_as_their_state_does():
    """Per element of a large matrix: AdamW 8 bytes, 8-bit AdamW about 2, Muon 4 (its
    momentum), Adafactor a row and a column."""
    matrix = ParameterInfo((4096, 4096))
    per_element = {
        name: spec.state_bytes([matrix], {}) / matrix.numel for name, spec in OPTIMIZERS.items()
    }
    assert per_element["adamw"] == pytest.approx(8, abs=1e-6)
    assert per_element["adamw_8bit"] == pytest.approx(2 + 8 / 256, abs=1e-3)
    assert per_element["muon"] == pytest.approx(4, abs=1e-6)
    assert per_element["adafactor"] == pytest.approx(2 * 4 / 4096, abs=1e-6)
    # Muon leaves the embedding and head to AdamW
    head = ParameterInfo((4096, 4096), outer=True)
    assert OPTIMIZERS["muon"].state_bytes([head], {}) == adamw_state(head, {})


def test_8bit_state_below_and_above_min_8bit_size():
    small, large = ParameterInfo((64, 63)), ParameterInfo((64, 65))  # 4,032 and 4,160
    assert adamw_8bit_state(small, {}) == 2 * 4032 * 4
    assert adamw_8bit_state(large, {}) == 2 * 4160 + 2 * 17 * 4  # ceil(4160 / 256) blocks
    assert adamw_8bit_shared([small], {}) == 0
    assert adamw_8bit_shared([small, large], {}) == 2 * 256 * 4


def test_each_conf_optim_file_is_one_spec():
    files = {path.stem: yaml.safe_load(path.read_text())["name"] for path in CONF.glob("*.yaml")}
    assert files == {name: name for name in OPTIMIZERS}


def test_an_unknown_name_is_refused_listing_the_choices():
    with pytest.raises(ConfigError) as err:
        get_optimizer_spec("adam_8bit")
    message = str(err.value)
    assert "\n" not in message
    assert all(name in message for name in OPTIMIZERS)
