"""A transformers mixture of experts through the fallback (model.family=hf): its router's
balance loss joins the training loss as transformers adds it."""

from __future__ import annotations

import logging

import pytest
import torch

from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.models.hf_fallback import (
    HFCausalLM,
    build_hf_model,
    fallback_model_config,
)

transformers = pytest.importorskip("transformers")

TINY_MOE = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def built(path, model_type, **config) -> HFCausalLM:
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY_MOE, **config})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    model = build_hf_model(fallback_model_config(read_folder_config(path)), folder=path)
    for module in model.modules():  # the same numbers in training mode as in eval
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, the library's labels (the next token) and transformers' (shifted inside)."""
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    return ids, labels, ids.clone()


# qwen2_moe has no native family; mixtral has one and is taken through model=hf
@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_training_loss_is_transformers_loss_with_the_balance_term(tmp_path, model_type, chunk):
    model = built(tmp_path, model_type)
    ids, labels, theirs_labels = batch()
    with torch.no_grad():
        theirs = model.hf(input_ids=ids, labels=theirs_labels, output_router_logits=True)
        without = model.hf(input_ids=ids, labels=theirs_labels).loss
        model.train()
        ours = model(ids, labels=labels, loss_chunk_size=chunk)
        model.eval()
        evaluated = model(ids, labels=labels, loss_chunk_size=chunk)
    assert float(theirs.aux_loss) > 0 and float(theirs.loss - without) > 0.1
    torch.testing.assert_close(ours, theirs.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(evaluated, without, atol=1e-5, rtol=1e-5)  # validation: CE
    check = model.first_batch_check(ids, None, labels, chunk)
    assert check["difference"] < 1e-5
    assert abs(check["library_loss"] - float(theirs.loss)) < 1e-5


def test_the_balance_loss_trains_the_routers(tmp_path):
    model = built(tmp_path, "qwen2_moe").train()
    ids, labels, _ = batch()
    model(ids, labels=labels, loss_chunk_size=8).backward()
    router = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    with_balance = router.grad.clone()
    model.zero_grad()
    model.router = None  # the cross-entropy alone
    model(ids, labels=labels, loss_chunk_size=8).backward()
    assert not torch.allclose(with_balance, router.grad)


def test_no_balance_loss_without_a_coefficient_and_a_line_for_per_token_losses(tmp_path, caplog):
    assert built(tmp_path / "off", "qwen2_moe", router_aux_loss_coef=0.0).router is None
    model = built(tmp_path / "on", "qwen2_moe").train()
    ids, labels, _ = batch()
    with caplog.at_level(logging.WARNING):
        model(ids, labels=labels, per_token=True, loss_chunk_size=8)
        model(ids, labels=labels, per_token=True, loss_chunk_size=8)
    lines = [r.getMessage() for r in caplog.records if "balance loss" in r.getMessage()]
    assert len(lines) == 1 and "router_aux_loss_coef=0.5" in lines[0]


def test_a_training_step_without_a_fused_head_adds_the_balance_loss(tmp_path):
    """kernels.loss_chunk_size=null (the default): the training module still takes the
    loss from the fallback's forward, balance term included, not from its logits."""
    from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
    from recipes_lib.training import CausalLMModule

    model = built(tmp_path, "qwen2_moe")
    module = CausalLMModule(
        model.config,
        KernelsConfig(loss_chunk_size=None),
        OptimConfig(lr=1e-3),
        SchedulerConfig(name="constant", warmup=0),
        total_steps=1,
        tokens_per_step=32,
    )
    module.model = model
    module.train()
    ids, labels, theirs_labels = batch()
    with torch.no_grad():
        loss, _ = module.compute_loss({"input_ids": ids, "labels": labels})
        theirs = model.hf(input_ids=ids, labels=theirs_labels, output_router_logits=True)
    torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=1e-5)
    assert model.load_check is not None and model.load_check["difference"] < 1e-5


@pytest.mark.parametrize("chunk", [None, 8])
def test_packed_rows_under_a_4d_mask_train_with_the_balance_loss(tmp_path, chunk):
    """A model packed through a 4-D document mask: the balance loss is added to the
    cross-entropy of each document alone (the causal LM's own forward would take the
    4-D mask for its balance loss's padding mask)."""
    model = built(tmp_path, "qwen2_moe").train()
    model._packing = "mask"
    ids, labels, _ = batch()
    doc_ids = torch.zeros_like(ids)
    doc_ids[:, 8:] = 1
    with torch.no_grad():
        ours = model(ids, doc_ids, labels=labels, loss_chunk_size=chunk)
        cross_entropy = model.eval()(ids, doc_ids, labels=labels, loss_chunk_size=chunk)
        hidden = model._base(**model._inputs(ids, doc_ids), output_router_logits=True)
    balance = model.router.loss(hidden.router_logits, None)
    torch.testing.assert_close(ours, cross_entropy + balance, atol=1e-5, rtol=1e-5)
    assert float(balance) > 0.1
