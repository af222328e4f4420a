"""The DPO stage: its reference (live, precomputed, or the base under LoRA) and its loss."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tiny import quiet_trainer, tiny_model_config

from recipes_lib.adapters import has_adapter
from recipes_lib.checkpoint.weights import read_checkpoint, save_weights
from recipes_lib.config.schema import (
    AdapterConfig,
    ChatFormatConfig,
    DataConfig,
    KernelsConfig,
    OptimConfig,
    SchedulerConfig,
    SourceConfig,
    TokenizerConfig,
)
from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.data.preference.module import PreferenceDataModule
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.objectives import pairs as pair_parts
from recipes_lib.objectives.dpo import DPOSettings
from recipes_lib.objectives.kto import KTOModule, KTOSettings
from recipes_lib.objectives.orpo import ORPOSettings
from recipes_lib.objectives.pairs import pair_logprobs
from recipes_lib.objectives.preference import PreferenceModule
from recipes_lib.objectives.simpo import SimPOSettings

VOCAB = 320
MODEL = tiny_model_config(vocab_size=VOCAB, n_kv_heads=None, max_seq_len=64)


@pytest.fixture(autouse=True)
def run_seed(monkeypatch):
    """The run's seed, as ``lightning.seed_everything`` sets it: the policy and a separate
    reference are both built under it (without it each draws on from the global RNG,
    and the two differ unless an earlier test in the process happened to set it)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")


def pair_objective(loss: str = "sigmoid", **settings) -> dict:
    """The objective and settings of a pair ``loss``: DPO's losses, SimPO or ORPO."""
    if loss == "simpo":
        return {"objective": "simpo", "settings": SimPOSettings(**settings)}
    if loss == "orpo":
        weight = settings.pop("beta", 0.1)
        return {"objective": "orpo", "settings": ORPOSettings(weight, **settings)}
    return {"objective": "dpo", "settings": DPOSettings(loss=loss, **settings)}


def make_module(kernels: KernelsConfig | None = None, **kwargs) -> PreferenceModule:
    return PreferenceModule(
        MODEL,
        kernels or KernelsConfig(),
        OptimConfig(lr=kwargs.pop("lr", 1e-2), weight_decay=0.0),
        SchedulerConfig(name="constant", warmup=0),
        total_steps=kwargs.pop("total_steps", 4),
        tokens_per_step=256,
        **pair_objective(**kwargs.pop("preference", {})),
        **kwargs,
    )


def random_batch(n_pairs: int = 3, seed: int = 0) -> dict:
    """Pairs of random tokens sharing a prompt, batched without packing."""
    items = [{**item, "index": i} for i, item in enumerate(random_pair_items(n_pairs, seed))]
    return collate_pairs(items, pad_id=0)


def random_pair_items(n_pairs: int, seed: int) -> list[dict]:
    """Chosen and rejected random responses to a shared random prompt, unbatched."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n_pairs):
        length = int(torch.randint(2, 6, (1,), generator=gen))
        prompt = torch.randint(0, VOCAB, (length,), generator=gen)
        item = {}
        for side in ("chosen", "rejected"):
            n = int(torch.randint(2, 9, (1,), generator=gen))
            item[f"{side}_ids"] = torch.cat([prompt, torch.randint(0, VOCAB, (n,), generator=gen)])
            item[f"{side}_mask"] = torch.arange(len(item[f"{side}_ids"])) >= len(prompt)
        items.append(item)
    return items


def kto_module(**preference) -> KTOModule:
    return KTOModule(
        MODEL,
        KernelsConfig(),
        OptimConfig(),
        SchedulerConfig(name="constant"),
        total_steps=2,
        tokens_per_step=8,
        settings=KTOSettings(**preference),
    )


def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def test_pair_logprobs_sum_each_sequence_of_the_batch():
    batch = random_batch()
    logits = torch.randn(*batch["input_ids"].shape, VOCAB)
    out = pair_logprobs(logits, batch["labels"], batch["sequence_ids"], 3)
    logprobs = torch.log_softmax(logits, -1)
    for row in range(6):
        labels = batch["labels"][row]
        counted = labels != -100
        expected = logprobs[row][counted].gather(1, labels[counted, None]).sum()
        assert out[row % 3, row // 3].item() == pytest.approx(expected.item(), abs=1e-5)


def test_precomputed_reference_gives_the_live_reference_loss():
    torch.manual_seed(0)
    module = make_module()
    module.configure_model()
    perturb(module.model)  # policy and reference now differ
    batch = random_batch()
    live_loss, live_metrics = module.compute_loss(batch)
    assert abs(live_loss.item() - 0.6931) > 1e-3  # not the trivial policy == reference value

    table = module.reference.precompute_table(module, [random_batch(seed=0)], n_pairs=3)
    module.reference.free()
    assert module.reference.model is None  # a separate reference is freed after precomputing
    batch["reference_logps"] = table[batch["pair_index"]]
    loss, metrics = module.compute_loss(batch)
    assert abs(loss.item() - live_loss.item()) < 1e-6
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"):
        assert abs(metrics[name].item() - live_metrics[name].item()) < 1e-6


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_policy_equal_to_reference_has_zero_rewards(loss):
    torch.manual_seed(0)
    module = make_module(preference={"loss": loss, "beta": 0.5})
    module.configure_model()
    loss_value, metrics = module.compute_loss(random_batch())
    assert metrics["rewards/chosen"].item() == 0 and metrics["rewards/margin"].item() == 0
    assert metrics["rewards/accuracy"].item() == 0  # ties are not preferences
    expected = {"sigmoid": 0.6931472, "ipo": 1.0, "hinge": 1.0}[loss]  # (0 - 1/(2*0.5))^2 = 1
    assert loss_value.item() == pytest.approx(expected, abs=1e-6)


def test_the_reference_gets_no_gradient_and_is_outside_the_optimizer_and_state():
    torch.manual_seed(0)
    module = make_module()
    module.configure_model()
    reference = module.reference.built().model
    assert not reference.training
    loss, _ = module.compute_loss(random_batch())
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in reference.parameters())
    assert all(p.grad is not None for p in module.model.parameters())
    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in reference.parameters()}
    assert in_optimizer == {id(p) for p in module.model.parameters()}
    assert all(name.startswith("model.") for name in module.state_dict())
    assert len(module.state_dict()) == len(module.model.state_dict())


def test_reference_is_loaded_from_its_source(tmp_path):
    torch.manual_seed(0)
    start, other = Transformer(MODEL), Transformer(MODEL)
    save_weights(start.state_dict(), tmp_path / "start.safetensors")
    save_weights(other.state_dict(), tmp_path / "other.safetensors")
    x = torch.randint(0, VOCAB, (2, 10))

    module = make_module(init_from=str(tmp_path / "start.safetensors"))
    module.configure_model()
    torch.testing.assert_close(module.reference.built().logits(x, None), start(x), atol=0, rtol=0)

    module = make_module(
        init_from=str(tmp_path / "start.safetensors"),
        preference={"reference_from": str(tmp_path / "other.safetensors")},
    )
    module.configure_model()
    torch.testing.assert_close(module.reference.built().logits(x, None), other(x), atol=0, rtol=0)
    torch.testing.assert_close(module.model(x), start(x), atol=0, rtol=0)


def test_a_reference_of_the_policys_source_is_copied_from_it_not_read_again(tmp_path, monkeypatch):
    """The default reference (the weights the policy starts from) is copied from the
    just-loaded policy: the same tensors a second read would give, stored apart, so
    training the policy leaves it where it started."""
    torch.manual_seed(0)
    start = Transformer(MODEL)
    save_weights(start.state_dict(), tmp_path / "start.safetensors")
    reads: list[str] = []
    import recipes_lib.training.build as build
    import recipes_lib.training.reference as reference_module

    load = build.load_model_weights

    def counted(model, source, *args):
        reads.append(source)
        return load(model, source, *args)

    for where in (build, reference_module):
        monkeypatch.setattr(where, "load_model_weights", counted)
    module = make_module(init_from=str(tmp_path / "start.safetensors"))
    module.configure_model()
    assert len(reads) == 1  # the policy's read only
    reference = module.reference.built().model
    for (name, ours), theirs in zip(
        reference.state_dict().items(), start.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs.to(ours.dtype)), name
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1.0)  # the policy moves; its copy does not
    x = torch.randint(0, VOCAB, (2, 10))
    torch.testing.assert_close(reference(x), start(x), atol=0, rtol=0)


def test_with_lora_the_reference_is_the_base_model_without_a_second_copy(tmp_path):
    torch.manual_seed(0)
    base = Transformer(MODEL)
    save_weights(base.state_dict(), tmp_path / "base.safetensors")
    module = make_module(
        init_from=str(tmp_path / "base.safetensors"),
        adapter=AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0),
    )
    module.configure_model()
    assert has_adapter(module.model)
    frozen = module.reference.built()
    assert frozen.shares_policy and frozen.model is None
    perturb(module.model)  # only the LoRA factors are trainable: the adapters now matter
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = base(x)
        assert not torch.allclose(module.model(x), expected, atol=1e-4)
    torch.testing.assert_close(
        module.reference.built().logits(x, None), expected, atol=1e-5, rtol=1e-5
    )
    # bypassing the adapters for the reference leaves the policy as it was
    trainable = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not torch.allclose(module.model(x), expected, atol=1e-4)
    loss, _ = module.compute_loss(random_batch())
    loss.backward()
    assert all(p.grad is None for n, p in module.model.named_parameters() if "lora_" not in n)


def test_bad_preference_settings_fail_at_construction():
    with pytest.raises(ConfigError, match="stage.dpo.loss='kto'"):
        make_module(preference={"loss": "kto"})
    with pytest.raises(ConfigError, match="stage.dpo.beta=0"):
        make_module(preference={"beta": 0.0})
    with pytest.raises(ConfigError, match="stage.orpo.odds_ratio_weight=0"):
        make_module(preference={"loss": "orpo", "beta": 0.0})
    with pytest.raises(TypeError):  # SimPO has no reference to precompute
        make_module(preference={"loss": "simpo", "precompute_reference": True})


@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_the_fused_head_gives_the_materialised_heads_loss_gradients_and_reference(loss):
    """``kernels.loss_chunk_size``: the policy's and the reference's log-probs come from
    the head fused with the loss, a few rows at a time, and match the full logits'."""
    batch = random_batch()
    results = []
    for chunk in (None, 5):
        module = make_module(KernelsConfig(loss_chunk_size=chunk), preference={"loss": loss})
        module.configure_model()
        perturb(module.model)  # the policy away from its reference
        value, metrics = module.compute_loss(batch)
        value.backward()
        grads = [p.grad.clone() for p in module.model.parameters()]
        reference = module.reference.logprobs(module, batch) if module.reference else None
        results.append((value, metrics["logps/chosen"], grads, reference))
    (full, full_logps, full_grads, full_ref), (fused, fused_logps, fused_grads, fused_ref) = results
    torch.testing.assert_close(fused, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_logps, full_logps, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fused_grads, full_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    if full_ref is not None:
        torch.testing.assert_close(fused_ref, full_ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- under a Trainer
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    rows = []
    for i in range(24):
        words = [WORDS[(i + k) % len(WORDS)] for k in range(4)]
        rows.append(
            {
                "prompt": f"list {i}: " + " ".join(words[:2]),
                "chosen": " ".join(words),
                "rejected": " ".join(reversed(words)),
            }
        )
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [" ".join(r.values()) for r in rows] * 4
    tokenizer = save_tokenizer(train_bpe_tokenizer(texts, vocab_size=VOCAB), folder)
    return path, tokenizer


def data_module(pairs_data, tmp_path, total: int) -> PreferenceDataModule:
    path, tokenizer = pairs_data
    config = DataConfig(
        sources={"pairs": SourceConfig(path=str(path))},
        tokenizer=TokenizerConfig(path=str(tokenizer)),
        seq_len=48,
        batch_size=4,
        val_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
        seed=0,
        chat=ChatFormatConfig(chat_template="plain", packing=False),
    )
    return PreferenceDataModule(config, VOCAB, MODEL.max_seq_len, total_train_samples=total)


class RecordReferenceUse(Callback):
    def __init__(self):
        self.had_table = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.had_table.append("reference_logps" in batch)


def fit(module, datamodule, tmp_path, steps, callbacks=(), ckpt_path=None) -> L.Trainer:
    trainer = quiet_trainer(
        steps,
        callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=steps,
        default_root_dir=tmp_path,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def test_precomputed_training_frees_the_reference_and_checkpoints_only_the_policy(
    pairs_data, tmp_path
):
    torch.manual_seed(0)
    start = Transformer(MODEL)
    save_weights(start.state_dict(), tmp_path / "start.safetensors")
    init = str(tmp_path / "start.safetensors")
    module = make_module(init_from=init, preference={"precompute_reference": True})
    datamodule = data_module(pairs_data, tmp_path, total=12)
    record = RecordReferenceUse()
    trainer = fit(module, datamodule, tmp_path, steps=3, callbacks=[record])
    assert record.had_table == [True, True, True]
    assert module.reference.model is None
    # the stored table is the start weights' log-probs, whatever order pairs come in
    batch = next(iter(datamodule.reference_dataloader("train")))
    live = make_module(init_from=init)
    live.configure_model()
    torch.testing.assert_close(
        batch["reference_logps"], live.reference.logprobs(live, batch), atol=1e-5, rtol=0
    )
    assert "val/rewards/accuracy" in trainer.callback_metrics

    path = tmp_path / "dpo.ckpt"
    trainer.save_checkpoint(path)
    state = read_checkpoint(path)["state_dict"]
    assert set(state) == {f"model.{k}" for k in start.state_dict()}
    assert not torch.equal(state["model.norm.weight"], start.state_dict()["norm.weight"])

    # a resumed run (no stage.init_from) rebuilds the reference from the recorded source
    resumed = make_module(total_steps=5)
    fit(resumed, data_module(pairs_data, tmp_path, total=20), tmp_path, 5, ckpt_path=path)
    assert resumed.reference.source == str(tmp_path.resolve() / "start.safetensors")
    x = torch.randint(0, VOCAB, (2, 10))
    torch.testing.assert_close(resumed.reference.built().logits(x, None), start(x), atol=0, rtol=0)
    assert not torch.allclose(resumed.model(x), start(x))


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_build_no_reference_and_train_the_policy(loss):
    module = make_module(preference={"loss": loss, "beta": 1.0})
    module.configure_model()
    assert module.reference is None
    value, metrics = module.compute_loss(random_batch())
    value.backward()
    assert torch.isfinite(value)
    assert all(p.grad is not None for p in module.model.parameters() if p.requires_grad)
    assert metrics["rewards/chosen"].shape == ()


def test_kto_takes_only_its_own_loss_and_non_negative_weights():
    kto = kto_module
    assert kto().reference is not None
    with pytest.raises(TypeError):  # KTO has no choice of loss
        kto(loss="sigmoid")
    with pytest.raises(ConfigError, match="stage.kto.undesirable_weight=-1.0 must be >= 0"):
        kto(undesirable_weight=-1.0)
    with pytest.raises(ConfigError, match="stage.dpo.loss='kto' is not one of"):
        make_module(preference={"loss": "kto"})


def kto_batch(n: int = 6, seed: int = 0) -> dict:
    """Labelled completions with their twins, packed into rows of 32 tokens."""
    items = []
    for index, item in enumerate(random_pair_items(n, seed)):
        items.append({**item, "index": index, "desirable": index % 2 == 0})
    return collate_pairs(items, pad_id=0, packing=True, seq_len=32)


def test_kto_runs_the_twins_apart_without_a_gradient_and_trains_as_one_pass_does(monkeypatch):
    batch = kto_batch()
    split, ids, n = batch["twin_rows"], batch["sequence_ids"], batch["pair_index"].numel()
    assert 0 < split < ids.shape[0]  # the completions' rows, then the twins' own
    assert (ids[:split] < n).all() and ((ids[split:] >= n) | (ids[split:] < 0)).all()
    module = kto_module()
    module.configure_model()
    perturb(module.model)
    calls = []
    rows_logprobs = pair_parts.rows_logprobs

    def recorded(owner, model, rows):
        calls.append((rows.input_ids.shape[0], torch.is_grad_enabled()))
        return rows_logprobs(owner, model, rows)

    # every pass, the policy's and the reference's, runs the model through it
    monkeypatch.setattr(pair_parts, "rows_logprobs", recorded)

    def step(b: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        module.model.zero_grad()
        loss, _ = module.compute_loss(b)
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in module.model.named_parameters()}

    loss, grads = step(batch)
    rows = ids.shape[0]
    assert calls == [(split, True), (rows - split, False), (rows, False)]  # then the reference
    calls.clear()
    one_pass = step({k: v for k, v in batch.items() if k != "twin_rows"})
    assert calls == [(rows, True), (rows, False)]
    torch.testing.assert_close(loss, one_pass[0], atol=1e-6, rtol=1e-6)
    assert grads.keys() == one_pass[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_pass[1][name], atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in grads.values())
