"""lm-evaluation-harness over the native model: :class:`RecipesLM` and task loading.

lm-eval (``pip install 'recipes-lib[eval]'``, 0.4.x) owns the tasks: their prompts,
few-shot examples, filters and metrics. This module gives it a model: log-likelihoods
from :func:`~recipes_lib.evaluation.scoring.score_requests` (batched, only the
continuation's logits formed) and generation from
:func:`~recipes_lib.models.sampling.sample_completions` (batched, with the KV cache),
both on the native :class:`~recipes_lib.models.Transformer` of any checkpoint the
library loads.

Tasks are lm-eval task names (their data must be where ``datasets`` finds it) or local
task folders: lm-eval task YAMLs with their data files beside them, relative paths in
``dataset_kwargs.data_files`` being relative to the YAML's folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.tasks import TaskManager, get_task_dict
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from recipes_lib.data.chat.template import compile_template
from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.scoring import (
    DEFAULT_BATCH_TOKENS,
    Request,
    Score,
    score_requests,
)
from recipes_lib.models.sampling import sample_completions

if TYPE_CHECKING:
    from recipes_lib.models.transformer import Transformer

DEFAULT_MAX_GEN_TOKS = 256


class RecipesLM(TemplateLM):
    """An lm-eval model over a native decoder and its tokenizer.

    Args:
        model: the :class:`~recipes_lib.models.Transformer`, on its device.
        tokenizer: its ``tokenizers.Tokenizer``.
        eos_ids: the token ids that end a document (the first is lm-eval's end token).
        prefix_id: the token put before an empty context (BOS where the model has one,
            else the end token), as lm-eval's Hugging Face backend does.
        chat_template: Jinja text of the model's chat template, if it has one.
        batch_size: rows per forward pass of log-likelihoods and of generation.
        max_tokens: padded tokens per forward pass of log-likelihoods (None: no limit).
        name: how lm-eval names the model in its results.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any,
        eos_ids: Sequence[int],
        *,
        prefix_id: int | None = None,
        chat_template: str | None = None,
        batch_size: int = 256,
        max_tokens: int | None = DEFAULT_BATCH_TOKENS,
        name: str = "recipes_lib",
    ) -> None:
        super().__init__()
        if not eos_ids:
            raise ConfigError("the model's tokenizer names no end-of-sequence token")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self._prefix_id = prefix_id if prefix_id is not None else self.eos_ids[0]
        self._chat_template = chat_template
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.name = name

    # ------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special).ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------- log-likelihood
    def _score(self, requests: Sequence[Request]) -> list[Score]:
        return score_requests(
            self.model, requests, batch_size=self.batch_size, max_tokens=self.max_tokens
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[Score]:
        scores = self._score([Request(tuple(c), tuple(x)) for _, c, x in requests])
        for (key, _, _), score in zip(requests, scores, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in windows of the model's context length
        that each predict tokens no other window does (lm-eval's rolling windows)."""
        windows: list[Request] = []
        owners: list[int] = []
        for index, (text,) in enumerate(r.args for r in requests):
            for context, target in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append(Request(tuple(context), tuple(target)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ----------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, where a task asks) continuations, cut at the first of the
        task's stop strings; requests with the same settings are decoded in batches."""
        eos_text = self.tok_decode(self.eos_ids[:1])
        groups: dict[str, list[int]] = {}
        settings: dict[str, tuple[list[str], int, float]] = {}
        for index, request in enumerate(requests):
            _, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            key = repr((until, max_new, temperature))
            groups.setdefault(key, []).append(index)
            settings[key] = (until, max_new, temperature)
        out = [""] * len(requests)
        for key, indices in groups.items():
            until, max_new, temperature = settings[key]
            if max_new >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks={max_new} leaves no room for a context in "
                    f"model.max_seq_len={self.max_length}"
                )
            keep = self.max_length - max_new  # as lm-eval's Hugging Face backend keeps
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [self._prompt(requests[i].args[0])[-keep:] for i in chunk]
                drawn = sample_completions(
                    self.model,
                    prompts,
                    max_new,
                    temperature=temperature,
                    stop_ids=self.eos_ids,
                )
                for i, tokens in zip(chunk, drawn.tokens, strict=True):
                    # special tokens dropped, as lm-eval's Hugging Face backend decodes
                    text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
                    for stop in until:
                        if stop and stop in text:
                            text = text[: text.index(stop)]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _prompt(self, context: str) -> list[int]:
        ids = self.tok_encode(context)
        return ids or [self.prefix_token_id]

    # --------------------------------------------------------- chat template
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt=True):
        if self._chat_template is None:
            raise ConfigError("chat_template=true, but the model's tokenizer has no chat template")
        return compile_template(self._chat_template).render(
            messages=chat_history,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.tok_decode(self.eos_ids[:1]),
            bos_token="",
        )


# ------------------------------------------------------------------------ tasks
@contextlib.contextmanager
def _working_directory(folder: Path) -> Iterator[None]:
    """``folder`` as the working directory inside the block (``contextlib.chdir`` is
    Python 3.11's)."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def lm_eval_task_names(folder: Path | None = None) -> list[str]:
    """The task (and group) names lm-eval knows: its own, or a folder's alone."""
    if folder is None:
        return list(TaskManager().all_tasks)
    with _working_directory(folder):
        return list(TaskManager(include_path=str(folder), include_defaults=False).all_tasks)


def build_lm_eval_tasks(names: Sequence[str], folder: Path | None) -> dict[str, Any]:
    """lm-eval task objects by name, their datasets loaded; a folder's tasks are built
    with the folder as the working directory, so that the relative data files of its
    YAMLs are found beside them."""
    if folder is None:
        return get_task_dict(list(names), TaskManager())
    with _working_directory(folder):
        manager = TaskManager(include_path=str(folder), include_defaults=False)
        return get_task_dict(list(names), manager)


def run_lm_eval(
    lm: RecipesLM,
    tasks: Sequence[Any],
    *,
    limit: int | None,
    num_fewshot: int | None,
    chat_template: bool,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Evaluate built tasks; returns task -> metric -> value (lm-eval's ``metric,filter``
    names, with the default filter's ``,none`` left off; standard errors left out)."""
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        # the tasks are built: an empty manager spares indexing lm-eval's whole registry
        task_manager=TaskManager(include_defaults=False),
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=chat_template,
        log_samples=False,
        bootstrap_iters=0,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    metrics: dict[str, dict[str, float]] = {}
    for task, values in (results or {}).get("results", {}).items():
        kept = {}
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, int | float):
                continue
            metric, _, filter_name = key.partition(",")
            kept[metric if filter_name == "none" else key] = float(value)
        metrics[task] = kept
    return metrics
