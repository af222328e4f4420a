"""A trained reward model as a GRPO reward: the hand-off from a ``reward`` stage.

:class:`RewardModelScore` loads a reward model (``model.head=score``: a reward stage's
output folder, or a Hugging Face ``...ForSequenceClassification`` folder) with the
tokenizer and chat template beside it, and scores a completion as the reward stage
scored its pairs: the prompt and the completion rendered as one conversation (a user
turn and an assistant turn), the score read at its last token that is not padding::

    grpo:
      rewards:
        preference:
          weight: 1.0
          fn: {_target_: recipes_lib.rewards.RewardModelScore, path: outputs/reward-full}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recipes_lib.checkpoint.hf_tokenizer import HF_TOKENIZER_CONFIG_NAME, read_json, token_text
from recipes_lib.checkpoint.source import load_model_weights, recorded_model_config
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.chat_records import tokenizer_chat_template
from recipes_lib.data.preference.collate import score_position
from recipes_lib.data.tokenizer import load_tokenizer, resolve_tokenizer_file
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer


class RewardModelScore:
    """``fn(completion, record) -> float``: a reward model's score of the record's prompt
    (``record[prompt_field]``: text, or messages) followed by the completion.

    Args:
        path: the reward model (a reward stage's folder, or a Hugging Face folder).
        prompt_field: the record field holding the prompt.
        device: where it runs (default: at the first call, this process's CUDA device,
            else the CPU).

    Raises:
        ConfigError: a model without a score head.
        CheckpointError, DataError: the folder, its weights or its tokenizer cannot be read.
    """

    def __init__(self, path: str, prompt_field: str = "prompt", device: str | None = None):
        key = "path"  # the registry names the reward before it
        config = recorded_model_config(path, key)
        if config.head != "score":
            raise ConfigError(
                f"{key}={path!r} holds a model with model.head={config.head}, not a reward "
                "model (train one with stage.objective=reward)"
            )
        self.device = torch.device(device) if device is not None else None
        self.model = Transformer(config).eval().requires_grad_(False)  # on the CPU until used
        load_model_weights(self.model, path, f"{key}={path!r}")
        tokenizer_file = resolve_tokenizer_file(path, key=key)
        self.tokenizer = load_tokenizer(tokenizer_file, key=key)
        folder = tokenizer_file.parent
        eos = token_text(read_json(folder / HF_TOKENIZER_CONFIG_NAME).get("eos_token"))
        self.renderer = ChatRenderer(
            self.tokenizer, tokenizer_chat_template(folder), eos_token=eos or "<|endoftext|>"
        )
        # the reward stage's batches pad with the EOS token, and read scores before it
        self.pad_id = self.tokenizer.token_to_id(eos) if eos is not None else None
        self.prompt_field = prompt_field

    def _placed(self) -> torch.device:
        """Move the model, at its first use, to ``device`` or this process's device."""
        if self.device is None:
            self.device = _default_device()
        if self.model.output.weight.device != self.device:
            self.model.to(self.device)
        return self.device

    @torch.no_grad()
    def __call__(self, completion: str, record: Mapping[str, Any]) -> float:
        prompt = record[self.prompt_field]
        turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        chat = self.renderer.render([*turns, {"role": "assistant", "content": completion}])
        ids = list(chat.input_ids)[-self.model.config.max_seq_len :]
        scores = self.model(torch.tensor([ids], device=self._placed()))  # (1, T, 1)
        return float(scores[0, score_position(ids, self.pad_id), 0])


def _default_device() -> torch.device:
    """This process's CUDA device when it has one (a trainer sets it per rank)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
