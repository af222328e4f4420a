"""The causal-LM stage on a CUDA GPU: fused AdamW, bf16, compiled blocks, flex document
masking, CUDA RNG in checkpoints and MFU. Run with ``pytest -m gpu``."""

import csv

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from tiny import quiet_trainer, step_checkpoints
from torch.utils.data import DataLoader

from recipes_lib.callbacks import ThroughputMonitor
from recipes_lib.config.schema import KernelsConfig, ModelConfig, OptimConfig, SchedulerConfig
from recipes_lib.losses import (
    causal_lm_loss,
    chunked_cross_entropy,
    linear_token_logprobs,
    token_logprobs,
)
from recipes_lib.training import CausalLMModule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB, SEQ_LEN, BATCH = 256, 128, 8


def make_module(total_steps=40, kernels=None, cls=CausalLMModule, **kwargs):
    model = ModelConfig(
        vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256
    )
    return cls(
        model,
        kernels or KernelsConfig(),
        OptimConfig(lr=3e-3, weight_decay=0.01),
        SchedulerConfig(name="cosine", warmup=4),
        total_steps=total_steps,
        tokens_per_step=BATCH * SEQ_LEN,
        **kwargs,
    )


def pattern_loader(n_batches=8, period=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(VOCAB, generator=gen)[:period]
    batches = []
    for _ in range(n_batches):
        offsets = torch.randint(0, period, (BATCH, 1), generator=gen)
        tokens = cycle[(offsets + torch.arange(SEQ_LEN + 1)) % period]
        doc_ids = (torch.arange(SEQ_LEN) >= SEQ_LEN // 3).int().expand(BATCH, SEQ_LEN).contiguous()
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "doc_ids": doc_ids})
    return DataLoader(batches, batch_size=None, generator=torch.Generator())


def gpu_trainer(max_steps, **kwargs):
    defaults = dict(
        accelerator="gpu",
        precision="bf16-mixed",
        gradient_clip_val=1.0,  # with the fused AdamW used on CUDA
    )
    return quiet_trainer(max_steps, **{**defaults, **kwargs})


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_bf16_training_with_fused_adamw_and_mfu(tmp_path):
    L.seed_everything(0)
    module = make_module()
    recorder = LossRecorder()
    trainer = gpu_trainer(
        40,
        callbacks=[recorder, ThroughputMonitor(window=5)],
        logger=CSVLogger(tmp_path, name="run", version=0),
        log_every_n_steps=5,
    )
    trainer.fit(module, pattern_loader())
    assert trainer.optimizers[0].defaults["fused"] is True
    assert np.mean(recorder.losses[-5:]) < 0.2 * recorder.losses[0]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    mfu = [float(r["perf/mfu"]) for r in rows if r.get("perf/mfu")]
    name = torch.cuda.get_device_name()
    if any(key in name for key in ("H100", "H200", "A100")):
        assert mfu and all(0 < m < 1 for m in mfu)


def test_flex_document_mask_with_compiled_blocks_trains():
    L.seed_everything(0)
    kernels = KernelsConfig(attention="flex", compile=True)
    module = make_module(total_steps=30, kernels=kernels, document_mask=True)
    recorder = LossRecorder()
    gpu_trainer(30, callbacks=[recorder]).fit(module, pattern_loader())
    assert np.mean(recorder.losses[-5:]) < 0.3 * recorder.losses[0]


def test_chunked_loss_in_bf16_matches_full_loss():
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(32000, 256, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
    labels[::7] = -100
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = causal_lm_loss(h_ref @ w_ref.t(), labels)
    expected.backward()
    hidden.requires_grad_()
    weight.requires_grad_()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=512)
    peak = torch.cuda.max_memory_allocated() - before
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(hidden.grad.float(), h_ref.grad.float(), rtol=5e-2, atol=1e-4)
    torch.testing.assert_close(weight.grad.float(), w_ref.grad.float(), rtol=5e-2, atol=1e-4)
    full_fp32_logits = 4096 * 32000 * 4
    assert peak < full_fp32_logits / 2


def test_fused_label_logprobs_in_bf16_autocast_match_the_full_head():
    """The preference objectives' fused head under bf16 autocast on a GPU: values and
    both gradients as close to fp32's as the materialised bf16 logits give them, at a
    fraction of their memory."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", generator=gen)
    weight = torch.randn(32000, 256, device="cuda", generator=gen) * 0.05
    labels = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
    labels[::7] = -100
    upstream = torch.randn(4096, device="cuda", generator=gen)

    def head(fused: bool, autocast: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if fused:
                out = linear_token_logprobs(h, w, labels, chunk_size=512)
            else:
                out = token_logprobs(h @ w.t(), labels)
        (out * upstream).sum().backward()
        return out, h.grad, w.grad

    exact = head(fused=False, autocast=False)  # fp32
    materialised = head(fused=False, autocast=True)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fused = head(fused=True, autocast=True)
    peak = torch.cuda.max_memory_allocated() - before
    for ours, theirs, truth in zip(fused, materialised, exact, strict=True):
        ours_error = (ours.float() - truth).abs().max().item()
        their_error = (theirs.float() - truth).abs().max().item()
        assert ours_error <= 1.5 * their_error + 1e-6, (ours_error, their_error)
    full_fp32_logits = 4096 * 32000 * 4
    assert peak < full_fp32_logits / 2


class NoisyCausalLM(CausalLMModule):
    """Draws from the CUDA RNG each step, so the weights depend on its restored state."""

    def compute_loss(self, batch):
        loss, metrics = super().compute_loss(batch)
        noise = torch.rand((), device=self.device)
        return loss + 0.05 * noise * self.model.norm.weight.square().sum(), metrics


def test_resume_on_gpu_reproduces_uninterrupted_run(tmp_path):
    L.seed_everything(3)
    straight = make_module(total_steps=16, cls=NoisyCausalLM)
    checkpoints = step_checkpoints(tmp_path, every=8)
    kwargs = dict(precision="32-true")
    gpu_trainer(16, callbacks=[checkpoints], **kwargs).fit(straight, pattern_loader())
    L.seed_everything(99)
    resumed = make_module(total_steps=16, cls=NoisyCausalLM)
    gpu_trainer(16, **kwargs).fit(resumed, pattern_loader(), ckpt_path=str(tmp_path / "step8.ckpt"))
    assert resumed.tokens_seen == straight.tokens_seen
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
