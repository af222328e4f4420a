"""How a stage starts from an earlier one: its weights, or its weights and AdamW moments."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny import quiet_trainer, tiny_model_config
from torch.utils.data import DataLoader

from recipes_lib.checkpoint.weights import save_weights
from recipes_lib.config.schema import (
    KernelsConfig,
    OptimConfig,
    RunConfig,
    SchedulerConfig,
    StageConfig,
)
from recipes_lib.config.validate import check_values
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.optim import build_lr_lambda
from recipes_lib.preflight import check_stage_io
from recipes_lib.training import CausalLMModule

VOCAB, SEQ_LEN = 64, 16


def make_module(lr=1e-2, weight_decay=0.01, dim=32, decay_embeddings=False, **kwargs):
    model = tiny_model_config(vocab_size=VOCAB, dim=dim)
    optim = OptimConfig(lr=lr, weight_decay=weight_decay, decay_embeddings=decay_embeddings)
    return CausalLMModule(
        model,
        KernelsConfig(),
        optim,
        SchedulerConfig(name="cosine", warmup=2, min_lr_ratio=0.1),
        total_steps=kwargs.pop("total_steps", 8),
        tokens_per_step=4 * SEQ_LEN,
        **kwargs,
    )


def batches(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (4, SEQ_LEN + 1), generator=gen)
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return DataLoader(out, batch_size=None, shuffle=False, generator=torch.Generator())


def trainer(max_steps: int, **kwargs) -> L.Trainer:
    return quiet_trainer(max_steps, num_sanity_val_steps=0, **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A module trained 6 steps and its Lightning checkpoint (weights, optimizer, schedule)."""
    folder = tmp_path_factory.mktemp("source")
    L.seed_everything(0)
    module = make_module()
    saver = ModelCheckpoint(dirpath=folder, filename="source", every_n_train_steps=6)
    fit = trainer(6, callbacks=[saver])
    fit.fit(module, batches(6))
    ckpt = folder / "source.ckpt"
    assert ckpt.is_file()
    return module, ckpt, fit.optimizers[0].param_groups[0]["lr"]


class OptimizerAtStart(L.Callback):
    """The optimizer state and learning rates a fit starts its first step with."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
        self.groups = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        self.base_lrs = list(trainer.lr_scheduler_configs[0].scheduler.base_lrs)


def test_weights_init_gives_the_source_weights_from_every_format(source, tmp_path):
    trained, ckpt, _ = source
    save_weights(trained.model.state_dict(), tmp_path / "export" / "model.safetensors")
    for init_from in (ckpt, tmp_path / "export" / "model.safetensors", tmp_path / "export"):
        L.seed_everything(123)  # another seed: the weights must come from the file
        target = make_module(init_from=str(init_from))
        target.configure_model()
        for (name, a), b in zip(trained.named_parameters(), target.parameters(), strict=True):
            assert torch.equal(a, b), (init_from, name)
    # weights only: the optimizer starts empty
    record = OptimizerAtStart()
    trainer(1, callbacks=[record]).fit(make_module(init_from=str(ckpt)), batches(1))
    assert all(not state for state in record.state)


def test_weights_and_optimizer_init_carries_moments_with_the_new_lr(source):
    trained, ckpt, source_lr = source
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["optimizer_states"][0]
    assert saved["param_groups"][0]["initial_lr"] == pytest.approx(1e-2)

    new_lr = 2e-3
    target = make_module(lr=new_lr, weight_decay=0.05, init_from=str(ckpt), init_optimizer=True)
    record = OptimizerAtStart()
    trainer(1, callbacks=[record]).fit(target, batches(1))

    saved_order = [i for g in saved["param_groups"] for i in g["params"]]
    assert len(record.state) == len(saved_order)
    for state, index in zip(record.state, saved_order, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], saved["state"][index][key]), key
        assert state["step"].item() == 6
    # learning rates and the schedule are the new run's: warmup from the new peak
    assert record.base_lrs == [new_lr] * len(record.groups)
    first_factor = build_lr_lambda(target.scheduler_config, 8, 4 * SEQ_LEN)(0)
    assert 0 < first_factor < 1  # in warmup
    for group in record.groups:
        assert group["initial_lr"] == new_lr
        assert group["lr"] == pytest.approx(new_lr * first_factor)
        assert group["lr"] != pytest.approx(source_lr)
    decay_group = next(g for g in record.groups if g["name"] == "decay")
    assert decay_group["weight_decay"] == 0.05


def test_bad_shapes_name_the_first_mismatches(source):
    _, ckpt, _ = source
    wider = make_module(dim=64, init_from=str(ckpt))
    with pytest.raises(CheckpointError) as info:
        wider.configure_model()
    message = str(info.value)
    assert f"stage.init_from='{ckpt}' does not fit the configured model" in message
    assert "tok_embeddings.weight: checkpoint (64, 32) vs model (64, 64)" in message


def test_optimizer_init_refuses_other_parameter_groups_and_weight_files(source, tmp_path):
    trained, ckpt, _ = source
    regrouped = make_module(decay_embeddings=True, init_from=str(ckpt), init_optimizer=True)
    regrouped.configure_model()
    with pytest.raises(CheckpointError, match="parameter groups of sizes"):
        regrouped.configure_optimizers()

    weights_only = save_weights(trained.model.state_dict(), tmp_path / "model.safetensors")
    module = make_module(init_from=str(weights_only), init_optimizer=True)
    module.configure_model()
    with pytest.raises(CheckpointError, match="holds 0 optimizer states"):
        module.configure_optimizers()
    # init_optimizer without init_from is refused by the pre-flight (below)


def _check(cfg: RunConfig) -> None:
    check_values(cfg)  # each value on its own
    check_stage_io(cfg)  # the stage's keys together (the pre-flight)


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        (StageConfig(init_optimizer=True), "needs stage.init_from"),
        (StageConfig(init_optimizer=True, init_from="w.safetensors"), "needs a Lightning .ckpt"),
        (StageConfig(average_last_k=0), "average_last_k=0 must be 1 or more"),
        (StageConfig(ema_decay=1.0), "ema_decay=1.0 must lie strictly between 0 and 1"),
        (StageConfig(average_last_k=2, ema_decay=0.9), "set one of them"),
    ],
)
def test_stage_io_settings_are_validated(stage, message):
    with pytest.raises(ConfigError, match=message):
        _check(RunConfig(stage=stage))


def test_optimizer_init_needs_a_checkpoint_not_a_folder(tmp_path):
    stage = StageConfig(init_optimizer=True, init_from=str(tmp_path))
    with pytest.raises(ConfigError, match="holds weights only"):
        _check(RunConfig(stage=stage))
    _check(RunConfig(stage=StageConfig(init_optimizer=True, init_from="a.ckpt")))
