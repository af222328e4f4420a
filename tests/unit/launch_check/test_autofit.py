"""Auto-fit as a function of the memory estimate: which configuration each budget gets,
and the one line when none fits (no data, no weights, no GPU)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.errors import ConfigError
from recipes_lib.launch_check.autofit import FIT_SHARE, candidates, choose, fit_memory
from recipes_lib.launch_check.budget import step_flops
from recipes_lib.launch_check.memory import GIB, estimate_memory

# 8 layers, so every 4th, 3rd and 2nd block are three different selections
LAYERS = "model.n_layers=8"


@functools.cache
def cfg_of(*overrides: str):
    base = ("recipe=sft/tiny", "trainer.accelerator=cpu", LAYERS)
    return to_run_config(compose_config([*base, *overrides]))


def fake_estimate(cfg) -> int:
    """GiB: 1 fixed, 1 per block that keeps its activations at 8 rows (a recomputed one
    keeps an eighth), and a quarter per 1,024 rows of loss chunk, all per row."""
    rows = cfg.data.batch_size / 8
    stride = cfg.kernels.checkpoint_stride()
    recomputed = 0 if stride == 0 else -(-cfg.model.n_layers // stride)
    stored = cfg.model.n_layers - recomputed
    blocks = rows * (stored + recomputed / 8)
    chunk = (cfg.kernels.loss_chunk_size or 0) / 1024 / 4
    return int((1 + blocks + chunk) * GIB)


def test_auto_is_the_post_training_recipes_default_and_pretraining_keeps_off():
    assert cfg_of().kernels.activation_checkpointing == "auto"
    pretrain = to_run_config(compose_config(["recipe=pretrain/tiny"]))
    assert pretrain.kernels.activation_checkpointing == "off"
    legacy = to_run_config(compose_config(["kernels.activation_checkpointing=true"]))
    assert legacy.kernels.activation_checkpointing == "full"
    assert legacy.kernels.checkpoint_stride() == 1


def test_candidates_run_from_the_fastest_to_the_smallest():
    plain = [c for c in candidates(cfg_of()) if not c.offload]
    order = [(c.batch_size, c.stride, c.loss_chunk_size) for c in plain]
    assert order[:4] == [(8, 0, 1024), (8, 0, 256), (8, 4, 1024), (8, 4, 256)]
    assert [s for b, s, c in order if b == 8 and c == 256] == [0, 4, 3, 2, 1]
    assert order[-1] == (1, 1, 256)
    # the rows of an optimizer step stay the same
    assert {c.batch_size * c.accumulate for c in candidates(cfg_of())} == {8}


@pytest.mark.parametrize(
    "budget_gib, expected",
    [
        (40.0, (0, 1024, 8, 1)),  # everything fits: no recomputation, the largest chunk
        (10.2, (0, 256, 8, 1)),  # the configured chunk before any recomputation
        (8.4, (4, 1024, 8, 1)),  # two of eight blocks recomputed
        (8.2, (4, 256, 8, 1)),
        (6.6, (2, 1024, 8, 1)),  # every 2nd block
        (3.0, (1, 1024, 8, 1)),  # every block
        (2.0, (1, 1024, 4, 2)),  # then a smaller micro-batch with twice the accumulation
    ],
)
def test_each_budget_gets_the_first_candidate_that_fits(budget_gib, expected):
    choice = choose(cfg_of(), int(budget_gib * GIB), fake_estimate)
    got = (choice.stride, choice.loss_chunk_size, choice.batch_size, choice.accumulate)
    assert got == expected
    assert choice.estimate <= FIT_SHARE * budget_gib * GIB
    applied = choice.apply(cfg_of())
    assert fake_estimate(applied) == choice.estimate
    assert applied.data.batch_size * applied.trainer.accumulate_grad_batches == 8


def test_the_line_names_the_choice_and_the_estimate():
    choice = choose(cfg_of(), int(6.6 * GIB), fake_estimate)
    assert choice.line() == (
        "auto-fit: activation checkpointing every 2nd block, loss chunk 1024, 8 x 256 rows: "
        "est. 5.8 of 6.6 GiB (run.memory_budget_gib)"
    )
    record = choice.as_dict()
    assert record["activation_checkpointing"] == "selective"
    assert record["checkpoint_every"] == 2
    assert record["estimate_gib"] == 5.75


def test_a_budget_nothing_fits_is_one_line_naming_the_smallest():
    cfg = cfg_of("run.memory_budget_gib=1")
    with pytest.raises(ConfigError) as err:
        choose(cfg, 1 * GIB, fake_estimate)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        "run.memory_budget_gib=1: the smallest configuration (activation checkpointing every "
        "block, loss chunk 256, 1 x 256 rows with 8 accumulation steps) needs an estimated "
        "1.2 GiB"
    )


def test_the_refusal_names_other_numerics_that_would_fit():
    """A budget only bf16 weights fit: the line says so, with their estimate; one that
    8-bit moments fit too names both; one that nothing fits names neither."""
    cfg = cfg_of("precision=bf16-mixed", "run.memory_budget_gib=100")
    smallest = list(candidates(cfg))[-1].apply(cfg)
    fp32 = estimate_memory(smallest).total
    bf16 = estimate_memory(replace(smallest, precision=replace(cfg.precision, name="bf16-true")))
    adam8 = estimate_memory(replace(smallest, optim=replace(cfg.optim, name="adamw_8bit")))
    assert bf16.total < adam8.total < fp32
    between = (bf16.total + adam8.total) / 2 / FIT_SHARE / GIB
    with pytest.raises(ConfigError) as err:
        fit_memory(cfg_of("precision=bf16-mixed", f"run.memory_budget_gib={between}"))
    assert str(err.value).endswith(
        f"or train with precision=bf16-true (est. {bf16.total / GIB:.1f} GiB)"
    )
    roomy = (adam8.total + fp32) / 2 / FIT_SHARE / GIB
    with pytest.raises(ConfigError, match=r"adamw_8bit \(est\. .*\) or precision=bf16-true"):
        fit_memory(cfg_of("precision=bf16-mixed", f"run.memory_budget_gib={roomy}"))
    with pytest.raises(ConfigError) as err:
        fit_memory(cfg_of("precision=bf16-mixed", "run.memory_budget_gib=0.0001"))
    assert "train with" not in str(err.value)


def test_on_a_cpu_without_a_budget_auto_is_off():
    cfg, choice = fit_memory(cfg_of())
    assert cfg.kernels.activation_checkpointing == "off"
    assert (cfg.data.batch_size, cfg.kernels.loss_chunk_size) == (8, 256)
    assert choice.line() == (
        "auto-fit: no CUDA card and no run.memory_budget_gib: activation checkpointing off"
    )


def test_a_budget_on_the_cpu_is_fitted_with_the_real_estimate():
    cfg = cfg_of("run.memory_budget_gib=0.001")
    with pytest.raises(ConfigError, match=r"^run.memory_budget_gib=0.001: the smallest"):
        fit_memory(cfg)
    fitted, choice = fit_memory(cfg_of("run.memory_budget_gib=4"))
    assert choice.stride == 0 and fitted.kernels.activation_checkpointing == "off"
    assert choice.estimate == estimate_memory(fitted).total


def test_a_budget_without_auto_is_refused():
    cfg = cfg_of("run.memory_budget_gib=4", "kernels.activation_checkpointing=full")
    with pytest.raises(ConfigError, match="only with kernels.activation_checkpointing=auto"):
        fit_memory(cfg)


def test_selective_checkpointing_sits_between_off_and_full():
    off, half, full = (
        cfg_of("precision=bf16-mixed", f"kernels.activation_checkpointing={mode}")
        for mode in ("off", "selective", "full")
    )
    sizes = [estimate_memory(c).activations for c in (off, half, full)]
    assert sizes[0] > sizes[1] > sizes[2]
    flops = [step_flops(c) for c in (off, half, full)]
    assert flops[0] < flops[1] < flops[2]
    assert flops[1] - flops[0] == pytest.approx((flops[2] - flops[0]) / 2)


def test_a_bad_checkpointing_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="kernels.activation_checkpointing='sometimes'"):
        to_run_config(compose_config(["kernels.activation_checkpointing=sometimes"]))


def offload_aware_estimate(cfg) -> int:
    """``fake_estimate`` where offloading takes the recomputed blocks' share away."""
    if not cfg.kernels.activation_offload:
        return fake_estimate(cfg)
    rows = cfg.data.batch_size / 8
    stored = cfg.model.n_layers - (-(-cfg.model.n_layers // cfg.kernels.checkpoint_stride()))
    return int((1 + rows * stored + (cfg.kernels.loss_chunk_size or 0) / 1024 / 4) * GIB)


def test_offload_is_tried_only_when_nothing_else_fits():
    plain = [c for c in candidates(cfg_of()) if not c.offload]
    moved = [c for c in candidates(cfg_of()) if c.offload]
    assert candidates(cfg_of()) == plain + moved  # every plain candidate first
    assert moved and {c.stride for c in moved} == {1}  # every block recomputed
    # full checkpointing of a micro-batch of one needs 1.19 GiB without offload: within
    # 90% of 1.4, not of 1.2, where all eight rows fit with offload
    first = choose(cfg_of(), int(1.4 * GIB), offload_aware_estimate)
    assert (first.offload, first.batch_size) == (False, 1)
    choice = choose(cfg_of(), int(1.2 * GIB), offload_aware_estimate)
    assert (choice.offload, choice.stride, choice.batch_size) == (True, 1, 8)
    assert "their inputs offloaded to host memory" in choice.line()
    assert choice.as_dict()["activation_offload"] is True
    assert choice.apply(cfg_of()).kernels.activation_offload


def test_offload_asked_for_is_kept_in_every_candidate():
    cfg = cfg_of("kernels.activation_offload=true")
    assert {c.offload for c in candidates(cfg)} == {True}


def test_the_estimate_drops_offloaded_block_inputs():
    # 64 blocks: their kept inputs make the forward the peak
    base = ("precision=bf16-mixed", "kernels.activation_checkpointing=full", "model.n_layers=64")
    kept = estimate_memory(cfg_of(*base))
    offloaded = estimate_memory(cfg_of(*base, "kernels.activation_offload=true"))
    inputs = 8 * 256 * cfg_of().model.dim * 4  # 8 x 256 tokens, fp32 under autocast
    assert kept.phase == "forward" and offloaded.phase == "backward end"
    assert kept.activations > 62 * inputs > offloaded.activations
    assert offloaded.allocated < kept.allocated
    assert any("pinned host memory" in note for note in offloaded.notes)


def test_the_estimate_counts_a_rank_share_of_split_rows():
    one = cfg_of("precision=bf16-mixed", "kernels.activation_checkpointing=full")
    two = cfg_of(
        "precision=bf16-mixed",
        "kernels.activation_checkpointing=full",
        "strategy=ddp",
        "strategy.context_parallel=2",
    )
    whole, split = estimate_memory(one), estimate_memory(two, world_size=2)
    assert split.activations < whole.activations
    # the dense boolean mask of a rank's half of each 256-token row, broadcast over rows
    assert split.buffers - whole.buffers == 128 * 256
    assert any("strategy.context_parallel=2" in note for note in split.notes)
