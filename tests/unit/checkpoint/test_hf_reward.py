"""Reward models (``model.head=score``) against transformers' ``...ForSequenceClassification``:
a folder transformers made loads with the same scores, an export reloads with them, and
a score head starts fresh on a language model's body."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_folders import FAMILY_SETTINGS, HF_FAMILIES, TINY_HF, VOCAB, tiny_hf_model

from recipes_lib.checkpoint.hf import load_hf_checkpoint, load_hf_weights_into
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint, hf_config_from_model
from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models import Transformer
from recipes_lib.objectives.reward import sequence_scores

PAD = 0
LENGTHS = [12, 7, 9, 3]


def hf_score_model(model_type: str, **config):
    """A tiny transformers ``...ForSequenceClassification`` with one label, seed 0, with
    every weight nudged off its init."""
    import transformers

    config_name, lm_name = HF_FAMILIES[model_type]
    name = lm_name.replace("ForCausalLM", "ForSequenceClassification")
    if model_type == "gemma3_text":
        name = "Gemma3TextForSequenceClassification"
    settings = {**TINY_HF, **FAMILY_SETTINGS.get(model_type, {}), **config}
    settings.update(num_labels=1, pad_token_id=PAD, max_position_embeddings=64)
    torch.manual_seed(0)
    model = getattr(transformers, name)(getattr(transformers, config_name)(**settings)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths padded on the right with :data:`PAD` (which no real
    token is), and each row's flat index of its last real token."""
    gen = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
    last = torch.arange(len(LENGTHS)) * width + torch.tensor(LENGTHS) - 1
    return ids, last


def hf_scores(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[:, 0].float()


def native_scores(model: Transformer, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return sequence_scores(model, ids, None, last)


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen3", "olmo3", "phi3", "gemma3_text", "mixtral"]
)
def test_a_reward_model_reads_and_exports_with_transformers_scores(tmp_path, model_type):
    """A ``...ForSequenceClassification`` folder loads as a score head with the same
    scores of right-padded rows (each read at its last token before padding); exported,
    transformers reloads it with the same scores again."""
    from transformers import AutoModelForSequenceClassification

    hf = hf_score_model(model_type)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_hf_checkpoint(tmp_path / "hf")
    assert config.head == "score" and tuple(model.output.weight.shape) == (1, config.dim)
    ids, last = right_padded()
    expected = hf_scores(hf, ids)
    torch.testing.assert_close(native_scores(model, ids, last), expected, atol=1e-4, rtol=1e-4)

    export_hf_checkpoint(model, config, tmp_path / "out")
    written = hf_config_from_model(config)
    assert written["architectures"] == [type(hf).__name__] and written["num_labels"] == 1
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", pad_token_id=PAD)
    assert type(back) is type(hf)
    torch.testing.assert_close(hf_scores(back.eval(), ids), expected, atol=1e-4, rtol=1e-4)


def test_a_score_head_starts_fresh_on_a_language_models_body(tmp_path):
    """A reward model started from a language model's folder (tied embeddings too)
    takes every body tensor and keeps its own freshly initialised head; a language
    model cannot start from a reward model's folder."""
    lm = tiny_hf_model("qwen3", tie_word_embeddings=True, max_position_embeddings=64)
    lm.save_pretrained(tmp_path / "lm")
    lm_model, lm_config = load_hf_checkpoint(tmp_path / "lm")
    reward_config = dataclasses.replace(lm_config, head="score")
    torch.manual_seed(0)
    reward = Transformer(reward_config)
    head = reward.output.weight.detach().clone()
    load_hf_weights_into(reward, tmp_path / "lm", "stage.init_from='lm'")
    assert torch.equal(reward.output.weight, head)
    body = {k: v for k, v in lm_model.state_dict().items() if k != "output.weight"}
    for name, tensor in body.items():
        assert torch.equal(reward.state_dict()[name], tensor), name

    export_hf_checkpoint(reward, reward_config, tmp_path / "reward")
    with pytest.raises(CheckpointError, match=r"model\.head='lm' vs architectures='score'"):
        load_hf_weights_into(Transformer(lm_config), tmp_path / "reward", "stage.init_from='r'")


def test_a_family_without_a_sequence_classifier_refuses_to_export_a_score_head(tmp_path):
    config = ModelConfig(
        family="olmoe", head="score", qk_norm="full", moe_experts=4, moe_renormalize=False
    )
    with pytest.raises(CheckpointError, match="no OlmoeForSequenceClassification"):
        export_hf_checkpoint(Transformer(config), config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
