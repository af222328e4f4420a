"""Tiny Hugging Face model folders made by transformers, as a user downloads them: the
model's config.json and safetensors weights, a tokenizer.json with its
tokenizer_config.json (EOS and pad tokens, a chat template of its own), and chat and
preference records in JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from recipes_lib.data.instructions import stdlib_instruction_records
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer

VOCAB = 512
EOS = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# the folder's own template (not one of the library's built-in ones)
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(folder: Path, records: list[dict]) -> None:
    """A byte-level BPE trained on ``records`` with the chat tokens, and its config."""
    texts = [r["prompt"] + r["response"] for r in records]
    tokenizer = train_bpe_tokenizer(texts, VOCAB - len(CHAT_TOKENS), EOS)
    tokenizer.add_special_tokens(list(CHAT_TOKENS))
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def make_hf_folder(folder: Path, model_type: str = "qwen2", **config) -> Path:
    """A tiny model of ``model_type`` saved by transformers into ``folder``, with a
    tokenizer and a chat template; ``config`` overrides the transformers config."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    settings.update(config)
    torch.manual_seed(0)
    model_cls(config_cls(**settings)).eval().save_pretrained(folder)
    write_tokenizer(folder, stdlib_instruction_records(300))
    return folder


def write_chat_records(path: Path, n: int = 120) -> Path:
    """``n`` conversations (``messages``: user prompt, assistant answer) in JSON lines."""
    with open(path, "w") as f:
        for r in stdlib_instruction_records(n):
            turns = [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def write_preference_records(path: Path, n: int = 120) -> Path:
    """``n`` pairs: the real function body chosen, its lines reversed rejected."""
    with open(path, "w") as f:
        for r in stdlib_instruction_records(n):
            rejected = "\n".join(reversed(r["response"].splitlines()))
            if rejected == r["response"]:
                rejected += "\n    return None"
            record = {"prompt": r["prompt"], "chosen": r["response"], "rejected": rejected}
            f.write(json.dumps(record) + "\n")
    return path
