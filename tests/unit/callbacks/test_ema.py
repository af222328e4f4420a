"""WeightEMA: the average it keeps, with accumulation, tied weights and resumption."""

import lightning as L
import pytest
import torch
from tiny import quiet_trainer, step_checkpoints, step_loader, tiny_model_config
from torch.utils.data import DataLoader

from recipes_lib.callbacks import WeightEMA
from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
from recipes_lib.training import CausalLMModule

VOCAB, SEQ_LEN = 64, 16


def make_module(**model_overrides) -> CausalLMModule:
    model = {"vocab_size": VOCAB, "n_layers": 1, "n_kv_heads": None, **model_overrides}
    return CausalLMModule(
        tiny_model_config(**model),
        KernelsConfig(),
        OptimConfig(lr=1e-2),
        SchedulerConfig(name="constant"),
        total_steps=20,
        tokens_per_step=4 * SEQ_LEN,
    )


def loader(n: int, accumulate: int | None = None):
    """``n`` random batches; with ``accumulate``, ``accumulate`` micro-batches per step."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (4, SEQ_LEN + 1), generator=gen)
        rows.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    if accumulate is not None:
        return step_loader(rows, accumulate)
    return DataLoader(rows, batch_size=None, shuffle=False, generator=torch.Generator())


class WeightsAfterEachStep(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.weights = [{n: p.detach().clone() for n, p in pl_module.model.named_parameters()}]
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            self.step = trainer.global_step
            self.weights.append(
                {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
            )


def test_average_follows_the_recurrence_once_per_optimizer_step():
    decay = 0.8
    L.seed_everything(0)
    module = make_module()
    ema, record = WeightEMA(decay), WeightsAfterEachStep()
    quiet_trainer(5, [record, ema]).fit(module, loader(10, accumulate=2))
    assert ema.updates == 5 and len(record.weights) == 6  # initial + one per step

    expected = dict(record.weights[0])
    for weights in record.weights[1:]:
        expected = {n: decay * expected[n] + (1 - decay) * weights[n] for n in expected}
    averaged = ema.averaged_state_dict(module.model)
    assert averaged.keys() == module.model.state_dict().keys()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name], value, atol=1e-6, rtol=0)
    # not simply the final weights
    final = record.weights[-1]["layers.0.attention.wq.weight"]
    assert not torch.allclose(averaged["layers.0.attention.wq.weight"], final)


def test_tied_weights_share_one_average():
    L.seed_everything(0)
    module = make_module(tie_embeddings=True)
    ema = WeightEMA(0.5)
    quiet_trainer(2, [ema]).fit(module, loader(2))
    averaged = ema.averaged_state_dict(module.model)
    assert averaged["output.weight"] is averaged["tok_embeddings.weight"]
    full = ema.averaged_state_dict(module)  # the LightningModule itself: prefixed names
    assert torch.equal(full["model.tok_embeddings.weight"], averaged["tok_embeddings.weight"])


def test_resumed_average_matches_an_uninterrupted_one(tmp_path):
    L.seed_everything(0)
    straight, straight_ema = make_module(), WeightEMA(0.7)
    saver = step_checkpoints(tmp_path, every=4)
    quiet_trainer(8, [straight_ema, saver]).fit(straight, loader(4))  # checkpoint at an epoch end
    assert (tmp_path / "step4.ckpt").is_file()

    L.seed_everything(5)
    resumed, resumed_ema = make_module(), WeightEMA(0.7)
    quiet_trainer(8, [resumed_ema]).fit(resumed, loader(4), ckpt_path=str(tmp_path / "step4.ckpt"))
    assert resumed_ema.updates == straight_ema.updates == 8
    a = straight_ema.averaged_state_dict(straight.model)
    b = resumed_ema.averaged_state_dict(resumed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-7, rtol=1e-6)

    saved = torch.load(tmp_path / "step4.ckpt", weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("WeightEMA")]
    assert state["updates"] == 4  # an average restarted at step 4 would not match above


def test_decay_must_lie_between_zero_and_one():
    with pytest.raises(ValueError, match="decay=1.0"):
        WeightEMA(1.0)
