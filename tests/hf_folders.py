"""Tiny Hugging Face models and folders made by transformers, as a user downloads them: the
model's config.json and safetensors weights, a tokenizer.json with its
tokenizer_config.json (EOS and pad tokens, a chat template of its own), and chat and
preference records in JSON lines. transformers is imported only where a model is made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recipes_lib.data.chat.instructions import stdlib_instruction_records
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

# transformers' config and model classes of each model_type made here
HF_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# what each family's tiny model sets beyond TINY_HF: a small head_dim where the family
# has its own, its particular options on, and no padding row (transformers' defaults
# point past a tiny vocabulary)
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},
    "olmo2": {"pad_token_id": None},
    "olmo3": {
        "pad_token_id": None,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "rope_theta": 5e5,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        },
    },
    "smollm3": {"pad_token_id": None, "no_rope_layers": [1, 0]},
    "phi3": {"pad_token_id": None, "partial_rotary_factor": 0.5},
    "gemma3_text": {
        "pad_token_id": None,
        "head_dim": 16,
        "query_pre_attn_scalar": 12,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
}
# the shape every tiny transformers model starts from; a test sets what it needs on top
TINY_HF = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_hf_model(model_type: str = "qwen2", **config: Any):
    """A transformers model of ``model_type`` initialised from seed 0, in eval mode:
    :data:`TINY_HF` with ``config`` (any field of its transformers config) on top."""
    import transformers

    config_name, model_name = HF_FAMILIES[model_type]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(0)
    return model_cls(config_cls(**{**TINY_HF, **config})).eval()


def write_tokenizer(
    folder: Path,
    records: list[dict],
    *,
    template: str = TEMPLATE,
    chat_tokens: tuple[str, ...] = CHAT_TOKENS,
    pad_token: str | None = EOS,
) -> None:
    """A byte-level BPE of :data:`VOCAB` tokens trained on ``records`` (``chat_tokens``
    among them), and its config: the EOS token, ``pad_token`` unless None, ``template``."""
    texts = [r["prompt"] + r["response"] for r in records]
    tokenizer = train_bpe_tokenizer(texts, VOCAB - len(chat_tokens), EOS)
    if chat_tokens:
        tokenizer.add_special_tokens(list(chat_tokens))
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
    if pad_token is not None:
        settings["pad_token"] = pad_token
    settings["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def make_hf_folder(folder: Path, model_type: str = "qwen2", **config: Any) -> Path:
    """A tiny model of ``model_type`` saved by transformers into ``folder``, with a
    tokenizer and a chat template; ``config`` overrides the transformers config."""
    settings = {"max_position_embeddings": 4096, "tie_word_embeddings": True, **config}
    tiny_hf_model(model_type, **settings).save_pretrained(folder)
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


def write_unpaired_records(path: Path, n: int = 120) -> Path:
    """``n`` KTO examples as chat messages: the real function body desirable (even
    records), its lines reversed undesirable (odd records); no two share a prompt."""
    with open(path, "w") as f:
        for i, r in enumerate(stdlib_instruction_records(n)):
            completion = r["response"]
            if i % 2:
                completion = "\n".join(reversed(completion.splitlines())) + "\n    return None"
            record = {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": completion}],
                "label": i % 2 == 0,
            }
            f.write(json.dumps(record) + "\n")
    return path
