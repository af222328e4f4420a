"""Evaluation on a GPU: RecipesLM on CUDA (graphed greedy decoding for generation tasks)
against lm-eval's Hugging Face backend on the same card, and the in-loop scorer under
bf16 autocast against fp32."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from eval_tasks import assert_same_results, both_backends, export_with_tasks

from recipes_lib.evaluation.builtin import stdlib_bodies
from recipes_lib.evaluation.choice import score_choice_task
from recipes_lib.evaluation.scoring import score_requests

pytestmark = pytest.mark.gpu
lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_with_tasks(tmp_path_factory.mktemp("parity_gpu"))


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_eval_on_cuda_matches_lm_evals_hugging_face_backend(exported):
    ours, theirs = both_backends(*exported, "cuda")
    assert assert_same_results(ours, theirs, 1e-3) >= 12 * 3 + 4


def test_bf16_scores_pick_the_fp32_choices(exported):
    from recipes_lib.generate import load_for_generation

    folder, _ = exported
    loaded = load_for_generation(folder, device="cuda", dtype=torch.float32)
    task = stdlib_bodies().head(40)
    fp32 = score_choice_task(task, loaded.tokenizer, partial(score_requests, loaded.model))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = score_choice_task(
            task, loaded.tokenizer, partial(score_requests, loaded.model, greedy=False)
        )
    for metric in ("acc", "acc_norm"):
        assert abs(bf16[metric] - fp32[metric]) <= 2 / 40  # a near-tie may flip
