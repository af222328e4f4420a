"""The native model through RecipesLM against lm-eval's own Hugging Face backend, on a
tiny exported model and a local task folder: the same log-likelihoods (1e-4), the same
rolling log-likelihoods and the same greedy generations."""

import pytest
from eval_tasks import assert_same_results, both_backends, export_with_tasks

from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.run import EvalSettings, evaluate_checkpoint

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_with_tasks(tmp_path_factory.mktemp("parity"))


def test_native_lm_matches_lm_evals_hugging_face_backend(exported):
    ours, theirs = both_backends(*exported, "cpu")
    assert assert_same_results(ours, theirs, 1e-4) >= 12 * 3 + 4


def test_evaluate_checkpoint_runs_a_task_folder_and_a_builtin_task(exported):
    folder, tasks = exported
    report = evaluate_checkpoint(
        folder, EvalSettings(tasks=("stdlib_bodies", str(tasks)), limit=2, batch_size=8)
    )
    flat = report.flat()
    assert set(report.results) == {"stdlib_bodies", "parity_mc", "parity_rolling", "parity_gen"}
    for key in ("eval/stdlib_bodies/acc", "eval/parity_mc/acc_norm", "eval/parity_gen/exact_match"):
        assert 0.0 <= flat[key] <= 1.0
    assert flat["eval/parity_rolling/word_perplexity"] > 1.0
    assert report.examples == {"stdlib_bodies": 2}


def test_chat_prompts_render_as_transformers_renders_them(exported):
    from transformers import AutoTokenizer

    from recipes_lib.evaluation.harness import RecipesLM
    from recipes_lib.generate import load_for_generation

    folder, _ = exported
    loaded = load_for_generation(folder)
    lm = RecipesLM(
        loaded.model, loaded.tokenizer, loaded.eos_ids, chat_template=loaded.chat_template
    )
    messages = [
        {"role": "system", "content": "Answer with code."},
        {"role": "user", "content": "Write `add(a, b)`."},
    ]
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert lm.chat_template(True) == loaded.chat_template is not None
    assert lm.apply_chat_template(messages) == theirs
    no_template = RecipesLM(loaded.model, loaded.tokenizer, loaded.eos_ids)
    with pytest.raises(ConfigError, match="has no chat template"):
        no_template.apply_chat_template(messages)
