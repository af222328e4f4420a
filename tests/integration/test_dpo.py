"""DPO end to end: a short pretraining run hands its weights to DPO runs on stdlib pairs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from lightning.pytorch.callbacks import Callback
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES, StopAtStep

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.objectives.reward import sequence_scores
from recipes_lib.train import run


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, shared_cache):
    result = run(compose_config(tiny_overrides(tmp_path_factory.mktemp("pre"), shared_cache)))
    assert result.weights_path is not None and result.tokenizer_path is not None
    return result


def dpo_overrides(run_dir, cache_dir, pretrained, *extra: str, recipe="dpo/tiny") -> list[str]:
    return [
        f"recipe={recipe}",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache_dir}",
        f"stage.init_from={pretrained.weights_path}",
        f"data.tokenizer.path={pretrained.tokenizer_path}",
        *SMALL_VOCAB_OVERRIDES,
        "data.seq_len=128",
        "data.batch_size=4",
        "data.sources.stdlib_dpo.max_documents=400",
        "optim.lr=1e-3",
        "scheduler.warmup=2",
        "trainer.max_steps=16",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
        *extra,
    ]


@pytest.mark.slow
def test_dpo_from_pretrained_weights_learns_held_out_preferences(
    tmp_path, shared_cache, pretrained
):
    result = run(
        compose_config(
            dpo_overrides(tmp_path, shared_cache, pretrained, "stage.dpo.precompute_reference=true")
        )
    )
    assert result.global_step == 16
    rows = read_metrics(result.output_dir)
    accuracy = metric_series(rows, "val/rewards/accuracy")
    margin = metric_series(rows, "val/rewards/margin")
    assert [step for step, _ in margin] == [3, 7, 11, 15]
    # the policy starts as the reference (margin 0, no pair preferred); the margin grows
    assert margin[-1][1] > margin[0][1] > 0
    assert accuracy[-1][1] > 0.6
    chosen = metric_series(rows, "val/rewards/chosen")[-1][1]
    rejected = metric_series(rows, "val/rewards/rejected")[-1][1]
    assert chosen - rejected == pytest.approx(margin[-1][1], abs=1e-5)
    # the output is the trained policy, a full state dict of the decoder
    output = load_weights(result.weights_path)
    start = load_weights(pretrained.weights_path)
    assert output.keys() == start.keys()
    assert any(not torch.equal(output[k], start[k]) for k in output)


def test_lora_dpo_trains_adapters_over_the_frozen_reference(tmp_path, shared_cache, pretrained):
    result = run(
        compose_config(
            dpo_overrides(
                tmp_path,
                shared_cache,
                pretrained,
                "trainer.max_steps=4",
                "trainer.val_check_interval=4",
                "trainer.limit_val_batches=2",
                recipe="dpo/lora_tiny",
            )
        )
    )
    assert result.global_step == 4
    assert result.metrics["train/rewards/accuracy"] >= 0
    config = json.loads((result.output_dir / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8
    # merged output: only the adapted linears moved, the frozen rest is the start
    output, start = load_weights(result.weights_path), load_weights(pretrained.weights_path)
    assert output.keys() == start.keys()
    moved = {k for k in output if not torch.equal(output[k], start[k])}
    assert moved and all(
        k.rsplit(".", 2)[-2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for k in moved
    )


def test_dpo_from_weights_without_a_known_tokenizer_stops_before_training(
    tmp_path, shared_cache, pretrained
):
    alone = tmp_path / "alone"  # the weights without the tokenizer a run writes beside them
    alone.mkdir()
    shutil.copyfile(pretrained.weights_path, alone / "model.safetensors")
    overrides = dpo_overrides(tmp_path, shared_cache, pretrained)
    overrides.remove(f"data.tokenizer.path={pretrained.tokenizer_path}")
    overrides = [o.replace(str(pretrained.weights_path), str(alone)) for o in overrides]
    with pytest.raises(ConfigError, match="no tokenizer.json beside it"):
        run(compose_config(overrides))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("recipe", ["simpo/tiny", "orpo/tiny"])
def test_reference_free_objectives_learn_held_out_preferences(
    tmp_path, shared_cache, pretrained, recipe
):
    """SimPO and ORPO build no reference model and learn the held-out pairs: more of them
    ranked right, SimPO's margin of mean log-probs per token wider, ORPO's loss lower
    (measured, seed 0: SimPO margin 0.36 -> 0.74, ORPO loss 5.21 -> 4.94)."""
    built = {}

    class NoReference(Callback):
        def on_fit_start(self, trainer, pl_module):
            built["reference"] = pl_module.reference

    result = run(
        compose_config(dpo_overrides(tmp_path, shared_cache, pretrained, recipe=recipe)),
        callbacks=[NoReference()],
    )
    assert result.global_step == 16 and built["reference"] is None
    rows = read_metrics(result.output_dir)
    margin = metric_series(rows, "val/rewards/margin")
    accuracy = metric_series(rows, "val/rewards/accuracy")
    assert [step for step, _ in margin] == [3, 7, 11, 15]
    assert accuracy[-1][1] >= accuracy[0][1] and accuracy[-1][1] > 0.6
    if recipe == "simpo/tiny":  # the gap SimPO pushes past gamma widens steadily
        assert margin[-1][1] > margin[1][1] > margin[0][1]
    else:  # ORPO's loss, its chosen answers' NLL plus the odds-ratio term, falls
        loss = [value for _, value in metric_series(rows, "val/loss")]
        assert loss[-1] < loss[1] < loss[0]


def test_kto_learns_to_tell_desirable_from_undesirable_completions(
    tmp_path, shared_cache, pretrained
):
    """KTO on the built-in unpaired examples, from pretrained weights that are also its
    reference: the held-out margin between desirable and undesirable rewards starts near
    0 and grows, and the KL estimate stays non-negative."""
    overrides = [
        o.replace("stdlib_dpo.max_documents=400", "stdlib_kto.max_documents=800")
        for o in dpo_overrides(tmp_path, shared_cache, pretrained, recipe="kto/tiny")
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 16
    rows = read_metrics(result.output_dir)
    margin = metric_series(rows, "val/rewards/margin")
    assert [step for step, _ in margin] == [3, 7, 11, 15]
    assert margin[-1][1] > margin[0][1] and margin[-1][1] > 0.1
    assert all(value >= 0 for _, value in metric_series(rows, "val/kl"))
    desirable = metric_series(rows, "val/rewards/desirable")[-1][1]
    undesirable = metric_series(rows, "val/rewards/undesirable")[-1][1]
    assert desirable - undesirable == pytest.approx(margin[-1][1], abs=1e-5)


def test_distillation_into_a_smaller_student_lowers_the_held_out_divergence(
    tmp_path, shared_cache, pretrained
):
    """A half-width student from scratch learns the pretrained teacher's next-token
    distributions on the built-in instructions: the held-out forward KL falls."""
    result = run(
        compose_config(
            [
                "recipe=distill/tiny",
                f"stage.distill.teacher_from={pretrained.output_dir}",
                f"data.tokenizer.path={pretrained.tokenizer_path}",
                f"run.dir={tmp_path}",
                f"data.cache_dir={shared_cache}",
                *SMALL_VOCAB_OVERRIDES,
                "data.seq_len=128",
                "data.batch_size=4",
                "data.sources.stdlib_sft.max_documents=300",
                "scheduler.warmup=2",
                "trainer.max_steps=16",
                "trainer.val_check_interval=4",
                "trainer.limit_val_batches=4",
                *QUIET_OVERRIDES,
                "callbacks=minimal",
            ]
        )
    )
    assert result.global_step == 16
    val = [value for _, value in metric_series(read_metrics(result.output_dir), "val/loss")]
    assert len(val) == 4 and val[-1] < 0.8 * val[0]


def test_a_reward_model_learns_to_score_held_out_chosen_responses_higher(
    tmp_path, shared_cache, pretrained
):
    """A score head on the pretrained body, trained with the Bradley-Terry loss on the
    built-in pairs: the held-out accuracy rises from about chance and the margin grows.
    Exported with the run's tokenizer, transformers' AutoModelForSequenceClassification
    scores right-padded texts as the library does."""
    from transformers import AutoModelForSequenceClassification

    overrides = [
        o.replace("stdlib_dpo.max_documents=400", "stdlib_dpo.max_documents=800")
        for o in dpo_overrides(
            tmp_path / "run",
            shared_cache,
            pretrained,
            "optim.lr=3e-4",
            "trainer.limit_val_batches=8",
            recipe="reward/tiny",
        )
    ]
    cfg = compose_config(overrides)
    result = run(cfg)
    assert result.global_step == 16
    rows = read_metrics(result.output_dir)
    accuracy = metric_series(rows, "val/rewards/accuracy")
    margin = metric_series(rows, "val/rewards/margin")
    assert [step for step, _ in accuracy] == [3, 7, 11, 15]
    # 28 held-out pairs: 0.57 -> 0.79 accuracy, the margin 0.003 -> 0.05
    assert accuracy[-1][1] >= 0.7 and accuracy[-1][1] > accuracy[0][1]
    values = [value for _, value in margin]
    assert values == sorted(values) and values[-1] > 5 * max(values[0], 0.001)

    model_config = to_run_config(cfg).model
    folder = export_hf_checkpoint(
        load_weights(result.weights_path), model_config, tmp_path / "hf", result.output_dir
    )
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    pad = hf.config.pad_token_id  # the data's padding: the EOS token
    assert pad is not None and pad == hf.config.eos_token_id
    texts = ["def add(a, b):\n    return a + b\n", "x = 1", "print('hello, world')\n"]
    encoded = [tokenizer.encode(text).ids for text in texts]
    width = max(map(len, encoded))
    ids = torch.tensor([e + [pad] * (width - len(e)) for e in encoded])
    last = torch.tensor([row * width + len(e) - 1 for row, e in enumerate(encoded)])
    native = Transformer(model_config)
    native.load_state_dict(load_weights(result.weights_path))
    with torch.no_grad():
        ours = sequence_scores(native.eval(), ids, None, last)
        theirs = hf(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


# a reward the pretrained tiny model earns now and then: GRPO must make it more often
RETURN_REWARD = {
    "has_return": {
        "weight": 1.0,
        "fn": {"_target_": "recipes_lib.rewards.format_match", "pattern": ".*return.*"},
    }
}


def grpo_config(run_dir, cache_dir, pretrained, *extra: str):
    cfg = compose_config(
        [
            "recipe=grpo/tiny",
            f"run.dir={run_dir}",
            f"data.cache_dir={cache_dir}",
            f"stage.init_from={pretrained.weights_path}",
            f"data.tokenizer.path={pretrained.tokenizer_path}",
            *SMALL_VOCAB_OVERRIDES,
            "data.seq_len=128",
            "data.sources.stdlib_grpo.max_documents=300",
            "stage.grpo.max_new_tokens=32",
            "stage.grpo.completions_per_prompt=4",
            "trainer.log_every_n_steps=1",
            *QUIET_OVERRIDES,
            "callbacks=minimal",
            *extra,
        ]
    )
    cfg.stage.grpo.rewards = RETURN_REWARD
    return cfg


def test_grpo_raises_a_verifiable_reward(tmp_path, shared_cache, pretrained):
    """Sampled completions scored by a reward, group-normalised advantages and the
    clipped objective over two updates per batch: the reward rises, on the training
    samples and on greedy completions of held-out prompts."""
    cfg = grpo_config(
        tmp_path,
        shared_cache,
        pretrained,
        "trainer.max_steps=48",
        "trainer.val_check_interval=24",
        "trainer.limit_val_batches=4",
        "optim.lr=5e-4",
        "+callbacks.validate_at_start={_target_:recipes_lib.callbacks.ValidateAtStart}",
    )
    result = run(cfg)
    assert result.global_step == 48
    rows = read_metrics(result.output_dir)
    val = metric_series(rows, "val/reward")
    train = [value for _, value in metric_series(rows, "train/reward")]
    assert [step for step, _ in val] == [0, 23, 47]
    assert val[-1][1] > val[0][1]
    assert sum(train[-8:]) > sum(train[:8]) + 1


def test_a_grpo_run_resumed_between_two_updates_of_a_batch_matches_the_uninterrupted_one(
    tmp_path, shared_cache, pretrained
):
    """Stopped after the first of a batch's two updates, the run resumes with the
    completions it had sampled (kept in the checkpoint) and the reference of its KL term,
    and ends with the same weights."""
    settings = (
        "trainer.max_steps=6",
        "run.checkpoint_every_n_steps=3",
        "trainer.limit_val_batches=0",
        "stage.grpo.kl_coef=0.05",  # the reference too: rebuilt from the checkpoint's source
    )
    straight = run(grpo_config(tmp_path / "straight", shared_cache, pretrained, *settings))
    split_dir = tmp_path / "split"
    first = run(
        grpo_config(split_dir, shared_cache, pretrained, *settings), callbacks=[StopAtStep(3)]
    )
    assert first.global_step == 3
    resume = grpo_config(split_dir, shared_cache, pretrained, *settings, "run.ckpt_path=last")
    resume.stage.init_from = None
    resumed = run(resume)
    assert resumed.global_step == straight.global_step == 6
    assert resumed.tokens_seen == straight.tokens_seen
    expected, got = load_weights(straight.weights_path), load_weights(resumed.weights_path)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
