"""The reward stage: whole-sequence pair batches, the Bradley-Terry loss, the score head
and how it starts from a language model's weights."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model_config

from recipes_lib.adapters import apply_adapter, merge_adapter, save_adapter
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.source import load_model_weights
from recipes_lib.checkpoint.weights import save_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.config.model import field_differences
from recipes_lib.config.schema import AdapterConfig, KernelsConfig, OptimConfig, SchedulerConfig
from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.losses.reward import bradley_terry_loss
from recipes_lib.models import Transformer
from recipes_lib.objectives.reward import RewardModule, RewardSettings, sequence_scores
from recipes_lib.preflight import check_head

VOCAB = 64
PAD = 0
MODEL = tiny_model_config(vocab_size=VOCAB, head="score", tie_embeddings=True)


def pair_items(seed: int = 0, n_pairs: int = 3, end_with_pad: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for index in range(n_pairs):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 5, (1,), generator=gen)),))
        item = {"index": index}
        for side in ("chosen", "rejected"):
            response = torch.randint(1, VOCAB, (int(torch.randint(2, 7, (1,), generator=gen)),))
            if end_with_pad:
                response[-1] = PAD  # the EOS token, which the data pads with
            ids = torch.cat([prompt, response])
            item[f"{side}_ids"] = ids
            item[f"{side}_mask"] = torch.arange(len(ids)) >= len(prompt)
        items.append(item)
    return items


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("end_with_pad", [False, True])
def test_unshifted_batches_read_each_score_at_its_last_token_before_padding(packing, end_with_pad):
    items = pair_items(end_with_pad=end_with_pad)
    batch = collate_pairs(items, PAD, packing=packing, seq_len=32, shifted=False)
    flat_ids, flat_seq = batch["input_ids"].flatten(), batch["sequence_ids"].flatten()
    sequences = [it["chosen_ids"] for it in items] + [it["rejected_ids"] for it in items]
    assert batch["num_tokens"] == sum(len(ids) for ids in sequences)  # every token an input
    assert (batch["labels"] == -100).all()
    for s, ids in enumerate(sequences):
        assert torch.equal(flat_ids[flat_seq == s], ids)  # the whole sequence, in order
        last = len(ids) - (2 if end_with_pad else 1)  # transformers' rule: before the pad
        position = batch["score_index"][s]
        assert flat_seq[position] == s and flat_ids[position] == ids[last]
        assert (flat_seq == s).nonzero()[last] == position


def test_bradley_terry_loss_is_the_chosen_sides_negative_log_likelihood():
    chosen = torch.tensor([1.0, -0.5, 2.0])
    rejected = torch.tensor([0.0, 0.5, 2.5])
    expected = -F.logsigmoid(chosen - rejected).mean()
    assert torch.allclose(bradley_terry_loss(chosen, rejected), expected)
    centred = bradley_terry_loss(chosen, rejected, center_coef=0.1)
    assert torch.allclose(centred, expected + 0.1 * (chosen + rejected).pow(2).mean())
    with pytest.raises(ValueError, match="differ"):
        bradley_terry_loss(chosen, rejected[:2])


def make_module(model=MODEL, **kwargs) -> RewardModule:
    return RewardModule(
        model,
        KernelsConfig(),
        OptimConfig(lr=1e-2, weight_decay=0.0),
        SchedulerConfig(name="constant", warmup=0),
        total_steps=4,
        tokens_per_step=256,
        **kwargs,
    )


def test_the_reward_loss_trains_the_score_head_and_the_body():
    """The score head is untied from the embeddings; the loss reaches both, and its
    accuracy and margin describe the batch's scores."""
    module = make_module()
    module.configure_model()
    model = module.model
    assert model.output.weight.shape == (1, MODEL.dim)
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    batch = collate_pairs(pair_items(), PAD, shifted=False)
    loss, metrics = module.compute_loss(batch)
    scores = model(batch["input_ids"]).flatten()[batch["score_index"]]
    chosen, rejected = scores[:3], scores[3:]
    assert torch.allclose(loss, -F.logsigmoid(chosen - rejected).mean())
    assert metrics["rewards/accuracy"] == (chosen > rejected).float().mean()
    assert torch.allclose(metrics["rewards/margin"], (chosen - rejected).mean())
    loss.backward()
    assert model.output.weight.grad.abs().sum() > 0
    assert model.tok_embeddings.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="score_index"):
        module.compute_loss(collate_pairs(pair_items(), PAD))  # shifted batches


def test_the_reward_objective_refuses_a_language_model_head_and_bad_settings():
    with pytest.raises(ConfigError, match="set model.head=score"):
        make_module(model=dataclasses.replace(MODEL, head="lm"))
    with pytest.raises(ConfigError, match="center_coef"):
        make_module(settings=RewardSettings(center_coef=-1.0))
    with pytest.raises(ConfigError, match="model.head='bogus'"):
        Transformer(dataclasses.replace(MODEL, head="bogus"))


def test_a_score_model_loads_a_language_models_body_and_keeps_its_fresh_head(tmp_path):
    lm_config = dataclasses.replace(MODEL, head="lm")
    lm = Transformer(lm_config)
    save_weights(lm.state_dict(), tmp_path / "lm.safetensors")
    torch.manual_seed(3)
    reward = Transformer(MODEL)
    head = reward.output.weight.detach().clone()
    load_model_weights(reward, tmp_path / "lm.safetensors")
    assert torch.equal(reward.output.weight, head)
    assert torch.equal(reward.tok_embeddings.weight, lm.tok_embeddings.weight)
    assert torch.equal(reward.layers[1].attention.wq.weight, lm.layers[1].attention.wq.weight)
    # and back: a language model does not start from a reward model's weights
    save_weights(reward.state_dict(), tmp_path / "reward.safetensors")
    with pytest.raises(CheckpointError, match="output.weight"):
        load_model_weights(Transformer(lm_config), tmp_path / "reward.safetensors")


def test_only_a_score_head_starting_from_a_language_model_may_change_the_head():
    lm = dataclasses.replace(MODEL, head="lm", tie_embeddings=True)
    untied_reward = dataclasses.replace(MODEL, tie_embeddings=False)
    assert field_differences(untied_reward, lm, "shape") == []
    assert field_differences(lm, MODEL, "shape") == [("head", "lm", "score")]
    deeper = dataclasses.replace(MODEL, n_layers=3)
    assert field_differences(deeper, lm, "shape") == [("n_layers", 3, 2)]


def test_lora_on_a_reward_model_trains_the_score_head_whole():
    model = apply_adapter(
        Transformer(MODEL), AdapterConfig(kind="lora", r=4, alpha=8, target_modules=["wq", "wv"])
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "output.weight" in trainable
    assert all(".lora_" in name for name in trainable - {"output.weight"})
    with torch.no_grad():
        model.output.weight.add_(1.0)
    merged = merge_adapter(model)
    assert torch.equal(merged["output.weight"], model.output.weight.detach())


def test_the_preflight_pairs_the_score_head_with_the_reward_objective():
    cfg = to_run_config(compose_config(["recipe=reward/tiny"]))
    check_head(cfg)
    lm_reward = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head="lm"))
    with pytest.raises(ConfigError, match="model.head=lm with stage.objective=reward"):
        check_head(lm_reward)
    sft = to_run_config(compose_config(["recipe=sft/tiny", "model.head=score"]))
    with pytest.raises(ConfigError, match="model.head=score with stage.objective=sft"):
        check_head(sft)
    fused = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, loss_chunk_size=8))
    with pytest.raises(ConfigError, match="kernels.loss_chunk_size=8"):
        check_head(fused)


def test_a_reward_models_adapter_loads_in_peft_over_the_language_model_it_started_from(
    tmp_path,
):
    """The PEFT folder of a LoRA reward model holds the factors and the score head (as
    ``modules_to_save``): over transformers' sequence classifier of the language model
    the stage started from, it gives the library's scores."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    lm_config = dataclasses.replace(MODEL, head="lm", tie_embeddings=False)
    lm = Transformer(lm_config)
    base_dir = export_hf_checkpoint(lm, lm_config, tmp_path / "base")
    reward = Transformer(dataclasses.replace(MODEL, tie_embeddings=False))
    reward.load_state_dict(
        {**lm.state_dict(), "output.weight": reward.output.weight.detach()}, strict=True
    )
    adapter = AdapterConfig(kind="lora", r=4, alpha=8, dropout=0.0, target_modules=["wq", "wv"])
    reward = apply_adapter(reward, adapter)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reward.parameters():
            if p.requires_grad:  # the LoRA factors and the head
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    folder = save_adapter(
        reward, tmp_path / "adapter", adapter, base_model_name_or_path=str(base_dir)
    )
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]
    hf = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=1, pad_token_id=PAD
    )
    hf = PeftModel.from_pretrained(hf, folder).eval()
    rows = pair_items(seed=4)
    ids = torch.nn.utils.rnn.pad_sequence(
        [it["chosen_ids"] for it in rows], batch_first=True, padding_value=PAD
    )
    last = torch.tensor([r * ids.shape[1] + len(it["chosen_ids"]) - 1 for r, it in enumerate(rows)])
    with torch.no_grad():
        ours = sequence_scores(reward.eval(), ids, None, last)
        theirs = hf(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def small_tokenizer_file(tmp_path_factory):
    from recipes_lib.data.chat.instructions import stdlib_instruction_records
    from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer

    texts = [r["prompt"] + r["response"] for r in stdlib_instruction_records(60)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400)
    return save_tokenizer(tokenizer, tmp_path_factory.mktemp("tokenizer"))


def test_a_reward_models_folder_is_a_grpo_reward(tmp_path, small_tokenizer_file):
    """grpo.rewards can name a trained reward model: it scores the prompt and the
    completion rendered with the folder's template, as the model scores that text."""
    from recipes_lib.data.chat.template import ChatRenderer
    from recipes_lib.data.tokenizer import load_tokenizer
    from recipes_lib.rewards import build_rewards, score_completions

    config = dataclasses.replace(MODEL, vocab_size=512, max_seq_len=128)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.output.weight.normal_()
    folder = export_hf_checkpoint(
        model, config, tmp_path / "reward", small_tokenizer_file, chat_template="plain"
    )
    node = {"_target_": "recipes_lib.rewards.RewardModelScore", "path": str(folder)}
    rewards = build_rewards({"preference": {"weight": 2.0, "fn": node}})
    records = [{"prompt": "Add two numbers."}, {"prompt": "Say hello."}]
    completions = ["def add(a, b):\n    return a + b", "hello"]
    total, each = score_completions(rewards, completions, records, ["p:1", "p:2"])
    renderer = ChatRenderer(load_tokenizer(small_tokenizer_file), "plain")
    for i, (record, completion) in enumerate(zip(records, completions, strict=True)):
        turns = [{"role": "user", "content": record["prompt"]}]
        ids = renderer.render([*turns, {"role": "assistant", "content": completion}]).input_ids
        pad = renderer.tokenizer.token_to_id("<|endoftext|>")  # the export's padding
        last = max(j for j, token in enumerate(ids) if token != pad)  # transformers' rule
        with torch.no_grad():
            expected = model(torch.tensor([list(ids)]))[0, last, 0]
        assert each["preference"][i].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.allclose(total, 2.0 * each["preference"])
    lm = dataclasses.replace(config, head="lm")
    export_hf_checkpoint(Transformer(lm), lm, tmp_path / "lm", small_tokenizer_file)
    with pytest.raises(ConfigError, match=r"grpo\.rewards\.x\.fn: path=.*not a reward model"):
        build_rewards({"x": {"fn": {**node, "path": str(tmp_path / "lm")}}})
