import random

import lightning as L
import numpy as np
import pytest
import torch
from tiny import quiet_trainer, step_checkpoints, step_loader, tiny_model_config
from torch.utils.data import DataLoader

from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
from recipes_lib.errors import CheckpointError, ConfigError, UnsupportedKernelError
from recipes_lib.training import CausalLMModule

VOCAB = 64
SEQ_LEN = 16


def make_module(total_steps=60, lr=1e-2, warmup=5, kernels=None, cls=CausalLMModule, **kwargs):
    return cls(
        tiny_model_config(vocab_size=VOCAB),
        kernels or KernelsConfig(),
        OptimConfig(lr=lr, weight_decay=0.01),
        SchedulerConfig(name="cosine", warmup=warmup, min_lr_ratio=0.1),
        total_steps=total_steps,
        tokens_per_step=4 * SEQ_LEN,
        **kwargs,
    )


def pattern_batches(n_batches: int, batch_size: int = 4, period: int = 7, seed: int = 0):
    """Rows cut from one repeating cycle of ``period`` tokens at varied offsets."""
    gen = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(VOCAB, generator=gen)[:period]
    batches = []
    for _ in range(n_batches):
        offsets = torch.randint(0, period, (batch_size, 1), generator=gen)
        positions = (offsets + torch.arange(SEQ_LEN + 1)) % period  # (B, T + 1)
        tokens = cycle[positions]
        doc_ids = torch.zeros(batch_size, SEQ_LEN, dtype=torch.int32)
        doc_ids[:, SEQ_LEN // 2 :] = 1
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": doc_ids})
    return batches


def loader(batches):
    # Its own generator: iterating the loader leaves the global torch RNG untouched.
    return DataLoader(batches, batch_size=None, shuffle=False, generator=torch.Generator())


def trainer(max_steps: int, **kwargs) -> L.Trainer:
    return quiet_trainer(max_steps, **{"num_sanity_val_steps": 0, **kwargs})


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_trains_tiny_model_on_repeating_pattern():
    L.seed_everything(0)
    module = make_module(total_steps=60)
    recorder = LossRecorder()
    trainer(60, callbacks=[recorder]).fit(module, loader(pattern_batches(8)))
    assert len(recorder.losses) == 60
    assert recorder.losses[0] > 3.5  # about ln(64) at init
    assert np.mean(recorder.losses[-5:]) < 0.1  # the pattern is learnt
    assert module.tokens_seen == 60 * 4 * SEQ_LEN
    assert module.trainer.callback_metrics["train/tokens_seen"].item() == 60 * 4 * SEQ_LEN


def test_validation_logs_loss_and_perplexity():
    L.seed_everything(0)
    module = make_module(total_steps=4, warmup=0)
    batches = pattern_batches(3)
    result = trainer(4, limit_val_batches=3).validate(module, loader(batches), verbose=False)[0]
    assert result["val/ppl"] == pytest.approx(np.exp(result["val/loss"]), rel=1e-5)
    with torch.no_grad():
        losses = [module.compute_loss(b)[0].item() for b in batches]
    assert result["val/loss"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_configure_model_is_idempotent_and_seeded(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    first, second = make_module(), make_module()
    first.configure_model()
    built = first.model
    first.configure_model()
    assert first.model is built
    torch.manual_seed(123)  # the global stream does not matter, the run's seed does
    second.configure_model()
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_document_mask_passes_doc_ids_to_the_model():
    batch = pattern_batches(1)[0]
    masked = make_module(document_mask=True, kernels=KernelsConfig(attention="flex"))
    masked.configure_model()
    seen = {}
    original = masked.model.forward

    def spy(input_ids, doc_ids=None, **kwargs):
        seen["doc_ids"] = doc_ids
        return original(input_ids, doc_ids, **kwargs)

    masked.model.forward = spy
    with torch.no_grad():
        masked_loss = masked.compute_loss(batch)[0]
        assert seen["doc_ids"] is batch["doc_ids"]
        masked.document_mask = False
        causal_loss = masked.compute_loss(batch)[0]
        assert seen["doc_ids"] is None
    assert not torch.allclose(masked_loss, causal_loss)  # the mask changes what is attended
    masked.document_mask = True
    with pytest.raises(ConfigError, match="data.document_mask is true but the batch carries no"):
        masked.compute_loss({k: v for k, v in batch.items() if k != "doc_ids"})


def test_unsupported_document_mask_fails_before_the_first_step():
    module = make_module(document_mask=True, kernels=KernelsConfig(attention="sdpa"))
    recorder = LossRecorder()
    with pytest.raises(UnsupportedKernelError, match="sdpa"):
        trainer(2, callbacks=[recorder]).fit(module, loader(pattern_batches(2)))
    assert recorder.losses == []


def test_compile_wraps_each_block_in_place():
    module = make_module(kernels=KernelsConfig(compile=True))
    module.configure_model()
    assert all(block._compiled_call_impl is not None for block in module.model.layers)
    assert module.model._compiled_call_impl is None  # blocks, not the whole model
    plain = make_module()
    plain.configure_model()
    assert module.model.state_dict().keys() == plain.model.state_dict().keys()


def test_chunked_loss_matches_full_loss():
    batch = pattern_batches(1)[0]
    plain, chunked = make_module(), make_module(kernels=KernelsConfig(loss_chunk_size=10))
    plain.configure_model()
    chunked.configure_model()
    chunked.model.load_state_dict(plain.model.state_dict())
    plain_loss = plain.compute_loss(batch)[0]
    chunked_loss = chunked.compute_loss(batch)[0]
    plain_loss.backward()
    chunked_loss.backward()
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain.model.parameters(), chunked.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)


def test_bad_schedule_fails_at_construction():
    with pytest.raises(ConfigError, match="scheduler.warmup"):
        make_module(total_steps=3, warmup=10)


def test_hyperparameters_rebuild_the_module():
    module = make_module(document_mask=True)
    rebuilt = CausalLMModule(**module.hparams)
    assert rebuilt.model_config == module.model_config
    assert rebuilt.scheduler_config == module.scheduler_config
    assert rebuilt.document_mask is True


def test_init_from_loads_weights_and_reports_mismatch(tmp_path):
    source = make_module()
    source.configure_model()
    path = tmp_path / "weights.pt"
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in source.model.state_dict().items()}}, path
    )
    target = make_module(init_from=str(path))
    target.configure_model()
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="does not fit the configured model"):
        bigger = CausalLMModule(
            tiny_model_config(vocab_size=VOCAB, dim=64),
            KernelsConfig(),
            OptimConfig(),
            SchedulerConfig(),
            total_steps=10,
            tokens_per_step=1,
            init_from=str(path),
        )
        bigger.configure_model()
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        make_module(init_from=str(tmp_path / "missing.pt")).configure_model()


class NoisyCausalLM(CausalLMModule):
    """Draws from every RNG each step, so the weights depend on the restored RNG states."""

    def compute_loss(self, batch):
        loss, metrics = super().compute_loss(batch)
        noise = torch.rand(()) + random.random() + float(np.random.rand())
        return loss + 0.05 * noise * self.model.norm.weight.square().sum(), metrics


def test_resume_reproduces_uninterrupted_run(tmp_path):
    batches = pattern_batches(5)  # an epoch is 5 steps
    L.seed_everything(3)
    straight = make_module(total_steps=20, cls=NoisyCausalLM)
    checkpoints = step_checkpoints(tmp_path, every=10)
    straight_trainer = trainer(20, callbacks=[checkpoints])
    straight_trainer.fit(straight, loader(batches))
    ckpt = tmp_path / "step10.ckpt"
    assert ckpt.is_file()

    L.seed_everything(99)  # a different seed: everything must come from the checkpoint
    resumed = make_module(total_steps=20, cls=NoisyCausalLM)
    resumed_trainer = trainer(20)
    resumed_trainer.fit(resumed, loader(batches), ckpt_path=str(ckpt))

    assert resumed_trainer.global_step == 20
    assert resumed.tokens_seen == straight.tokens_seen == 20 * 4 * SEQ_LEN
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    straight_lrs = [g["lr"] for g in straight_trainer.optimizers[0].param_groups]
    resumed_lrs = [g["lr"] for g in resumed_trainer.optimizers[0].param_groups]
    assert resumed_lrs == pytest.approx(straight_lrs)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["tokens_seen"] == 10 * 4 * SEQ_LEN
    assert saved["last_lr"] == saved["lr_schedulers"][0]["_last_lr"][0]  # torch's own record
    assert saved["hyper_parameters"]["model"]["dim"] == 32


class GradNormAfterClipping(CausalLMModule):
    """Records the global gradient norm that reaches the optimizer (after clipping)."""

    norms: list[float]

    def configure_gradient_clipping(self, optimizer, *args, **kwargs):
        super().configure_gradient_clipping(optimizer, *args, **kwargs)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


def test_gradient_clipping_bounds_the_global_norm():
    L.seed_everything(0)
    module = make_module(total_steps=5, cls=GradNormAfterClipping, gradient_clip_val=0.05)
    module.norms = []
    trainer(5).fit(module, loader(pattern_batches(5)))
    assert len(module.norms) == 5
    assert max(module.norms) <= 0.05 * (1 + 1e-4)


class GradientsAtForward(CausalLMModule):
    """Records whether any gradient exists when each micro-batch's forward pass begins."""

    seen: list[bool]

    def micro_batch_loss(self, batch, into_step):
        self.seen.append(any(p.grad is not None for p in self.parameters()))
        return super().micro_batch_loss(batch, into_step)


def test_gradients_are_freed_before_the_next_forward():
    """The forward pass that follows an optimizer step runs without the last step's
    gradients; inside an optimizer step of two micro-batches they are kept."""
    module = make_module(total_steps=3, warmup=1, cls=GradientsAtForward)
    module.seen = []
    trainer(3).fit(module, step_loader(pattern_batches(6), 2))
    assert module.seen == [False, True] * 3
