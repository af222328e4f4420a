"""Text generation: greedy or nucleus sampling with a KV cache, and ``recipes-generate``.

    recipes-generate checkpoint=runs/tiny/checkpoints/last.ckpt prompt="def " \\
        max_new_tokens=64 temperature=0.8 top_p=0.95 seed=0

``checkpoint`` is a Lightning ``.ckpt`` of a :class:`~recipes_lib.training.CausalLMModule`,
a stage output folder (``model.safetensors`` with the run's ``config.yaml`` or a
``manifest.json``), or a Hugging Face folder (``config.json``). The tokenizer is found
beside it (for a ``.ckpt``: in its folder or the run folder above) unless
``tokenizer=PATH`` names one. A run of the transformers fallback (``model.family=hf``),
or a folder no native family reads, generates as transformers' own model.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer
from torch import Tensor

from recipes_lib.checkpoint.hf import empty_model, load_hf_checkpoint
from recipes_lib.checkpoint.hf_files import HF_CONFIG_NAME
from recipes_lib.checkpoint.hf_tokenizer import hf_eos_token_ids, load_hf_tokenizer, read_json
from recipes_lib.checkpoint.layout import (
    CHECKPOINTS_DIR,
    CONFIG_NAME,
    MANIFEST_NAME,
    RunDir,
)
from recipes_lib.checkpoint.source import InitSource, read_init_source
from recipes_lib.checkpoint.weights import (
    load_state_into,
    load_weights,
)
from recipes_lib.config.commands import GenerateConfig
from recipes_lib.config.schema import ModelConfig, TokenizerConfig
from recipes_lib.config.store import as_config
from recipes_lib.data.tokenizer import TOKENIZER_FILE
from recipes_lib.errors import CheckpointError, ConfigError, DataError
from recipes_lib.models import Transformer
from recipes_lib.models.hf_fallback import HFCausalLM, build_hf_model, is_fallback
from recipes_lib.models.rope import longrope_restarts
from recipes_lib.models.sampling import check_sampling, decoding_cache, sample_next


# -------------------------------------------------------------------- sampling
def sample_token(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """One token from next-token ``logits`` ``(V,)``, as
    :func:`~recipes_lib.models.sampling.sample_next` draws it, on the CPU (so a seed
    gives the same tokens on any device)."""
    return int(sample_next(logits[None].float().cpu(), temperature, top_p, generator)[0])


@torch.no_grad()
def generate(
    model: Transformer | HFCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | Collection[int] | None = None,
    seed: int | None = None,
    *,
    use_cache: bool = True,
) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    With ``use_cache`` the prompt is run once into a :class:`KVCache` and each new token
    costs one position's forward pass; without, the whole sequence is recomputed for
    every token (the reference the cache is tested against).

    Args:
        model: the decoder (put in eval mode for the call).
        prompt_ids: at least one token id.
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus sampling mass (1: the whole distribution).
        eos_id: token id(s) that end generation; the one produced is included.
        seed: seeds the sampling generator; None draws from torch's global one.
        use_cache: decode with a KV cache.

    Returns:
        The new token ids (not the prompt).

    Raises:
        ConfigError: an empty prompt, bad sampling settings, or a prompt plus new tokens
            longer than ``model.max_seq_len``.
    """
    check_sampling(temperature, top_p, max_new_tokens)
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ConfigError("generation needs a prompt of at least one token")
    # the positions the model runs over: the last new token is never fed back
    positions = max(len(prompt), len(prompt) + max_new_tokens - 1)
    if positions > model.config.max_seq_len:
        raise ConfigError(
            f"a prompt of {len(prompt)} tokens and max_new_tokens={max_new_tokens} need "
            f"{positions} positions, more than model.max_seq_len={model.config.max_seq_len}"
        )
    if max_new_tokens == 0:
        return []
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    device = model.tok_embeddings.weight.device
    was_training = model.training
    model.eval()
    cache = decoding_cache(model, 1, positions) if use_cache else None

    def next_logits(tokens: list[int], start_pos: int | None = None) -> Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=device)  # (1, T)
        # the model's own forward: the transformers fallback's head may do more than
        # the product with the hidden states
        return model(ids, cache=cache, start_pos=start_pos, last_only=True)[0, -1]  # (V,)

    new: list[int] = []
    try:
        logits = next_logits(prompt)
        while True:
            token = sample_token(logits, temperature, top_p, generator)
            new.append(token)
            if token in stop or len(new) == max_new_tokens:
                return new
            if cache is not None and not longrope_restarts(
                model.config, cache.length, cache.length + 1
            ):
                logits = next_logits([token])
            else:  # uncached, or a longrope model's cache written with its short factors
                logits = next_logits(prompt + new, start_pos=0 if use_cache else None)
    finally:
        model.train(was_training)


# --------------------------------------------------------------------- loading
@dataclass
class GenerationModel:
    """A model ready to generate with, and what it needs around it.

    Attributes:
        model: the decoder, in eval mode.
        config: its shape.
        tokenizer: the tokenizer it was trained with.
        eos_ids: the ids that end a generation (empty: none known).
        chat_template: a Jinja chat template, when the tokenizer folder has one.
        source: the checkpoint it came from.
        kind: ``lightning`` | ``native`` | ``hf``.
    """

    model: Transformer | HFCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_ids: list[int]
    chat_template: str | None
    source: Path
    kind: str


def _read_run_config(folder: Path) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` in ``folder`` as plain data ({} if none)."""
    file = RunDir(folder).config
    if not file.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except Exception as err:  # omegaconf and yaml raise several error types
        raise CheckpointError(f"'{file}' is not a readable run config: {err}") from err
    # a run config's keys are strings
    return cast(dict[str, Any], data) if isinstance(data, dict) else {}


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    data = _read_run_config(folder).get("data") or {}
    return data.get("tokenizer") or {}


def _tokenizer_candidates(folders: Sequence[Path]) -> list[Path]:
    """Where a tokenizer for a checkpoint in ``folders`` may be, most specific first."""
    candidates = []
    for folder in folders:
        candidates.append(folder / TOKENIZER_FILE)
        manifest_tokenizer = (read_json(RunDir(folder).manifest).get("tokenizer") or {}).get("path")
        if manifest_tokenizer:
            candidates.append(folder / manifest_tokenizer)  # absolute stays absolute
        configured = _tokenizer_config(folder).get("path")
        if isinstance(configured, str) and "${" not in configured:
            candidates.append(Path(configured).expanduser())
    return candidates


def _native_tokenizer(
    source: Path, folders: Sequence[Path], explicit: str | Path | None
) -> tuple[Tokenizer, str | None, list[int]]:
    """The tokenizer of a native checkpoint, its chat template and its EOS id."""
    if explicit is not None:
        tokenizer, template = load_hf_tokenizer(explicit)
    else:
        candidates = _tokenizer_candidates(folders)
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            looked = ", ".join(str(c) for c in candidates)
            raise DataError(
                f"no tokenizer found for checkpoint '{source}' (looked for {looked}); "
                "pass tokenizer=PATH"
            )
        tokenizer, template = load_hf_tokenizer(found)
    eos_token = next(
        (t for f in folders if (t := _tokenizer_config(f).get("eos_token"))),
        TokenizerConfig().eos_token,
    )
    eos_id = tokenizer.token_to_id(eos_token)
    return tokenizer, template, [] if eos_id is None else [eos_id]


def _build(config: ModelConfig, state: dict[str, Tensor], label: str, device, dtype, attention):
    dtype = dtype or state["tok_embeddings.weight"].dtype
    model = empty_model(config, attention, dtype=dtype, device=device)
    load_state_into(model, state, label)
    return model.eval()


def _fallback(found: InitSource, path: Path, device, dtype) -> tuple[HFCausalLM, ModelConfig]:
    """transformers' own model of a checkpoint of the transformers fallback, with its
    weights (a Hugging Face folder's, or the run's under transformers' names)."""
    where = f"checkpoint='{path}'"
    config = as_config(ModelConfig, found.model, f"{where} model")
    folder = found.path if found.kind == "hf" else None
    with torch.device(device):
        model = build_hf_model(config, folder=folder, where=where)
    if folder is None:
        load_state_into(model, load_weights(path), where)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), config


def load_for_generation(
    source: str | Path,
    tokenizer: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention: str = "sdpa",
) -> GenerationModel:
    """Load a model and its tokenizer from a checkpoint, to generate with.

    Args:
        source: a Lightning ``.ckpt`` of a ``CausalLMModule`` (the model config comes
            from its hyperparameters), a folder (or ``.safetensors`` file) of native
            weights with the run's ``config.yaml`` or a stage ``manifest.json`` beside
            them, or a Hugging Face folder with ``config.json``.
        tokenizer: a tokenizer.json or a folder holding one; default: found beside the
            checkpoint (for a ``.ckpt``, also in the run folder above ``checkpoints/``).
        device: where the model lives.
        dtype: the parameters' dtype; default as stored.
        attention: the attention backend of the (uncached) forward pass.

    Raises:
        CheckpointError: a missing or unrecognised checkpoint, or weights that do not fit.
        DataError: no tokenizer found (the places looked at are named).
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint={str(source)!r}: no such file or folder")
    found = read_init_source(path, "checkpoint")
    fallback = found.model is not None and is_fallback(found.model)
    model: Transformer | HFCausalLM
    hf_folder = path.is_dir() and (path / HF_CONFIG_NAME).is_file()
    if hf_folder:
        if fallback:  # no native family reads it: transformers' own model
            model, config = _fallback(found, path, device, dtype)
        else:
            model, config = load_hf_checkpoint(path, attention, dtype=dtype, device=device)
        hf_tokenizer, template = load_hf_tokenizer(tokenizer if tokenizer is not None else path)
        eos_ids = hf_eos_token_ids(path, hf_tokenizer)
        return GenerationModel(model, config, hf_tokenizer, eos_ids, template, path, "hf")

    if found.model is None:
        raise CheckpointError(
            f"'{path}': no {MANIFEST_NAME} or {CONFIG_NAME} beside the weights says the "
            "model's shape"
        )
    config = as_config(ModelConfig, found.model, f"checkpoint={str(source)!r} model")
    folder = path if path.is_dir() else path.parent
    folders = [folder]
    if folder.name == CHECKPOINTS_DIR:
        folders.append(folder.parent)  # the run folder
    kind = "lightning" if found.kind in ("checkpoint", "sharded") else "native"
    if fallback:
        model, config = _fallback(found, path, device, dtype)
    else:
        state = load_weights(path)
        model = _build(config, state, f"checkpoint='{path}'", device, dtype, attention)
        del state
    native_tokenizer, template, eos_ids = _native_tokenizer(path, folders, tokenizer)
    return GenerationModel(model, config, native_tokenizer, eos_ids, template, path, kind)


# ------------------------------------------------------------------------- CLI
def command(cfg: GenerateConfig) -> None:
    """The body of ``recipes-generate`` (a Hydra app in :mod:`recipes_lib.cli`): print
    the prompt and its continuation.

    Raises:
        RecipesError: a bad checkpoint, tokenizer or sampling setting.
    """
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_for_generation(
        cfg.checkpoint, cfg.tokenizer, device=device, dtype=cfg.dtype.torch_dtype()
    )
    prompt_ids = loaded.tokenizer.encode(cfg.prompt).ids
    if not prompt_ids and loaded.eos_ids:
        prompt_ids = loaded.eos_ids[:1]  # documents start after an end-of-document token
    new_ids = generate(
        loaded.model,
        prompt_ids,
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        eos_id=loaded.eos_ids,
        seed=cfg.seed,
    )
    print(loaded.tokenizer.decode(prompt_ids + new_ids))
