"""The distillation stage's checks: a teacher with the student's vocabulary, valid
settings, and no sharded strategy."""

from __future__ import annotations

import pytest
from tiny import tiny_model_config

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.models import Transformer
from recipes_lib.objectives.distill import DistillSettings, check_distill
from recipes_lib.preflight import check_strategy


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    config = tiny_model_config(vocab_size=320)
    folder = tmp_path_factory.mktemp("teacher")
    export_hf_checkpoint(Transformer(config), config, folder)
    return str(folder)


def test_the_teacher_must_share_the_students_vocabulary(teacher):
    check_distill(DistillSettings(teacher_from=teacher), student_vocab=320)
    with pytest.raises(ConfigError, match=r"stage.distill.teacher_from=.* 320 tokens .* 512"):
        check_distill(DistillSettings(teacher_from=teacher), student_vocab=512)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "needs stage.distill.teacher_from"),
        ({"loss": "reverse"}, "stage.distill.loss='reverse' is not one of"),
        ({"beta": 1.5}, r"stage.distill.beta=1.5 must be in \[0, 1\]"),
        ({"temperature": 0.0}, "stage.distill.temperature=0.0 must be positive"),
    ],
)
def test_bad_settings_are_named(teacher, settings, message):
    settings = {"teacher_from": teacher, **settings} if settings else {}
    with pytest.raises(ConfigError, match=message):
        check_distill(DistillSettings(**settings), student_vocab=320)


def test_a_missing_teacher_is_refused_and_fsdp_is_not(tmp_path, teacher):
    with pytest.raises(CheckpointError, match="stage.distill.teacher_from="):
        check_distill(DistillSettings(teacher_from=str(tmp_path / "nowhere")), student_vocab=320)
    cfg = to_run_config(
        compose_config(
            ["recipe=distill/tiny", f"stage.distill.teacher_from={teacher}", "strategy=fsdp"]
        )
    )
    check_strategy(cfg)  # the divergence is computed inside the sharded head's forward


def test_the_teacher_is_frozen_and_outside_the_students_state_and_parameters(teacher):
    from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
    from recipes_lib.objectives.distill import DistillModule

    module = DistillModule(
        tiny_model_config(vocab_size=320),
        KernelsConfig(),
        OptimConfig(),
        SchedulerConfig(name="constant"),
        total_steps=2,
        tokens_per_step=8,
        settings=DistillSettings(teacher_from=teacher),
    )
    module.configure_model()
    assert module.teacher is not None and not module.teacher.training
    assert not any(p.requires_grad for p in module.teacher.parameters())
    assert not any(key.startswith("teacher") for key in module.state_dict())
    teacher_ids = {id(p) for p in module.teacher.parameters()}
    assert not teacher_ids & {id(p) for p in module.parameters()}
