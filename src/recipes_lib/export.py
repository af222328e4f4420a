"""Any checkpoint as a Hugging Face folder, checked against transformers: ``recipes-export``
and the ``hf/`` folder a stage writes at its end (``stage.export_hf``).

    recipes-export checkpoint=outputs/sft-full out=my-model
    recipes-export checkpoint=runs/tiny/checkpoints/last.ckpt out=tiny-hf dtype=bfloat16

``checkpoint`` is a run folder, its ``model.safetensors``, a stage's ``manifest.json``, a
Lightning ``.ckpt`` or a sharded checkpoint folder (what ``stage.init_from`` takes). The
folder written is the model's own family (``config.json``, safetensors weights, the
tokenizer and its chat template), which ``transformers.AutoModelForCausalLM``, vLLM and
PEFT load. A LoRA stage's weights are already merged; its ``adapter/`` loads over the
folder the stage started from.

After writing, transformers loads the folder and its float32 logits on a few tokens must
match this library's within 1e-4, or the export fails with one line.

A model of the transformers fallback (``model.family=hf``) is written by transformers'
own ``save_pretrained``, so the folder has the format of the one it came from. A run
that started from an image-text folder (Gemma 3's ``Gemma3ForConditionalGeneration``,
its text tower trained) writes that folder back, the vision tower copied through.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import Tensor

from recipes_lib.checkpoint.hf import empty_model, load_hf_checkpoint
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.hf_files import HF_CONFIG_NAME, read_hf_config
from recipes_lib.checkpoint.hf_image_text import image_text_base, image_text_dtype
from recipes_lib.checkpoint.hf_tokenizer import (
    HF_TOKENIZER_CONFIG_NAME,
    first_special_token,
    hf_chat_template,
    read_json,
    token_text,
)
from recipes_lib.checkpoint.layout import CHECKPOINTS_DIR, RunDir
from recipes_lib.checkpoint.source import read_init_source
from recipes_lib.checkpoint.weights import load_state_into, load_weights
from recipes_lib.config.commands import ExportConfig
from recipes_lib.config.schema import ModelConfig, RunConfig
from recipes_lib.config.store import as_config
from recipes_lib.data.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer_folder,
    tokenizer_vocab_size,
)
from recipes_lib.errors import CheckpointError, DataError
from recipes_lib.models import Transformer
from recipes_lib.models.hf_fallback import HFCausalLM, build_hf_model, is_fallback
from recipes_lib.models.rope import rope_tables

log = logging.getLogger(__name__)

PARITY_TOLERANCE = 1e-4  # float32 logits, absolute and relative
_PARITY_SHAPE = (2, 16)  # rows and tokens of the parity check


def load_checkpoint(source: str | Path) -> tuple[Transformer | HFCausalLM, ModelConfig]:
    """The model a checkpoint holds, in its stored dtype on the CPU, and its shape.

    Raises:
        CheckpointError: the path is missing, records no model shape, or its weights do
            not fit that shape.
    """
    found = read_init_source(source, "checkpoint")
    fallback = found.model is not None and is_fallback(found.model)
    if found.kind == "hf" and not fallback:
        return load_hf_checkpoint(found.path)
    if found.model is None:
        raise CheckpointError(
            f"checkpoint={str(source)!r}: no manifest.json or config.yaml beside the weights "
            "says the model's shape"
        )
    config = as_config(ModelConfig, found.model, f"checkpoint={str(source)!r} model")
    if fallback:  # transformers' own model, its weights under transformers' names
        folder = found.path if found.kind == "hf" else None
        model = build_hf_model(config, folder=folder, where=f"checkpoint={str(source)!r}")
        if folder is None:
            load_state_into(model, load_weights(found.weights), f"checkpoint={str(source)!r}")
        return model.eval(), config
    state = load_weights(found.weights)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    native = empty_model(config, dtype=dtype)
    load_state_into(native, state, f"checkpoint={str(source)!r}")
    return native.eval(), config


def tokenizer_of(source: str | Path) -> Path:
    """The ``tokenizer.json`` a checkpoint was trained with: beside its weights, or in
    the run folder above ``checkpoints/``.

    Raises:
        DataError: none is found (the places looked at are named).
    """
    path = Path(source).expanduser()
    folder = path if path.is_dir() else path.parent
    folders = [folder, folder.parent] if folder.name == CHECKPOINTS_DIR else [folder]
    for candidate in (f / TOKENIZER_FILE for f in folders):
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(f / TOKENIZER_FILE) for f in folders)
    raise DataError(
        f"checkpoint={str(source)!r}: no tokenizer (looked for {looked}); pass tokenizer=PATH"
    )


def check_against_transformers(folder: Path, model: Transformer, config: ModelConfig) -> float:
    """Load ``folder`` with transformers and compare its float32 logits on a few tokens
    with ``model``'s (as exported); return the largest difference.

    Raises:
        CheckpointError: transformers is missing or cannot load the folder, or the
            logits differ by more than :data:`PARITY_TOLERANCE`.
    """
    try:
        import transformers
    except ImportError as err:
        raise CheckpointError(
            f"'{folder}' is written but not checked: the check loads it with transformers, "
            "which is not installed (pip install transformers)"
        ) from err
    rows, length = _PARITY_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(
        0, config.vocab_size, (rows, min(length, config.max_seq_len)), generator=generator
    )
    score = config.head == "score"
    pad = read_hf_config(folder).get("pad_token_id")
    if score and pad is not None:  # transformers reads a score at the last token not padding
        x[x == pad] = (pad + 1) % config.vocab_size
    with torch.no_grad():
        ours = model.float()(x)
        ours = ours[:, -1] if score else ours
    auto = (
        transformers.AutoModelForSequenceClassification
        if score
        else transformers.AutoModelForCausalLM
    )
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a bar per load at a run's end is noise
    try:
        theirs_model = auto.from_pretrained(folder, attn_implementation="eager").float().eval()
    except Exception as err:  # transformers raises many kinds; the first line says which
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"transformers cannot load '{folder}': {reason}") from err
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    with torch.no_grad():
        theirs: Tensor = theirs_model(input_ids=x).logits
    difference = float((ours - theirs).abs().max())
    if not torch.allclose(ours, theirs, atol=PARITY_TOLERANCE, rtol=PARITY_TOLERANCE):
        raise CheckpointError(
            f"'{folder}': transformers' float32 logits differ from the checkpoint's by up to "
            f"{difference:.2e}, more than {PARITY_TOLERANCE:g}"
        )
    return difference


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    *,
    dtype: torch.dtype | None = None,
    check: bool = True,
    base: str | Path | None = None,
) -> Path:
    """Write the model ``source`` holds as a Hugging Face folder in ``out_dir``.

    Args:
        source: a run folder, its weights, a manifest, a ``.ckpt`` or a sharded folder.
        out_dir: the folder to write (created if needed).
        tokenizer: a tokenizer.json or a folder holding one; default the one beside
            ``source`` (its tokenizer_config.json's chat template and EOS come along).
        dtype: the dtype to store; default the checkpoint's (an image-text base's
            text tower's, which no other may replace).
        check: load the folder with transformers and compare logits after writing.
        base: where the model started from; default ``source``. When it is an
            image-text folder, or a run whose ``stage.init_from`` (recorded in its
            ``config.yaml``, run after run) leads to one, that folder is written back
            in its own format (``export_hf_checkpoint``'s ``base``).

    Raises:
        CheckpointError: an unreadable checkpoint, a model transformers cannot hold, or
            logits that differ.
        DataError: no tokenizer found.
    """
    base = _image_text_origin(base if base is not None else source)  # None: not one
    tokenizer_path = Path(tokenizer).expanduser() if tokenizer is not None else tokenizer_of(source)
    model, config = load_checkpoint(source)
    if isinstance(model, HFCausalLM):
        return export_fallback(model, config, Path(out_dir), tokenizer_path, dtype, check)
    if base is not None:  # an image-text folder: written in its own dtype, and checked so
        if dtype is not None:
            raise CheckpointError(
                f"dtype={dtype}: the image-text folder '{base}' is written back in the dtype "
                "it stores its text tower in; leave dtype out"
            )
        dtype = image_text_dtype(base)
    if dtype is not None:
        model = model.to(dtype)
        for name, table in rope_tables(config, model.head_dim).items():  # float32, as loaded
            setattr(model, name, table)
    folder = export_hf_checkpoint(model, config, out_dir, tokenizer_path, base=base)
    if check:
        difference = check_against_transformers(folder, model, config)
        log.info("%s: transformers' logits match within %.1e", folder, difference)
    return folder


def _image_text_origin(start: str | Path) -> str | Path | None:
    """The image-text folder ``start`` is, or the one the runs before it started from
    (each run folder's ``config.yaml`` records its ``stage.init_from``), or None."""
    path: str | Path | None = start
    seen: set[str] = set()
    while path is not None and str(path) not in seen:
        seen.add(str(path))
        if image_text_base(path) is not None:
            return path
        path = _recorded_init_from(path)
    return None


def _recorded_init_from(source: str | Path) -> str | None:
    """The ``stage.init_from`` the run folder of ``source`` records, or None."""
    path = Path(source).expanduser()
    folder = path if path.is_dir() else path.parent
    if folder.name == CHECKPOINTS_DIR:
        folder = folder.parent
    try:
        init_from = OmegaConf.select(OmegaConf.load(RunDir(folder).config), "stage.init_from")
    except Exception:  # noqa: BLE001 - no readable record only means "not known"
        return None
    return str(init_from) if init_from is not None else None


def export_fallback(
    model: HFCausalLM,
    config: ModelConfig,
    out_dir: Path,
    tokenizer_path: Path,
    dtype: torch.dtype | None,
    check: bool,
) -> Path:
    """Write a model of the transformers fallback with transformers' ``save_pretrained``
    (and the tokenizer beside it), then check transformers' float32 logits of the folder
    against the model's.

    Raises:
        CheckpointError: a tokenizer larger than the vocabulary, or logits that differ.
    """
    tokenizer = load_tokenizer(tokenizer_path, key="tokenizer_path")
    if tokenizer_vocab_size(tokenizer) > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer '{tokenizer_path}' has {tokenizer_vocab_size(tokenizer)} tokens, "
            f"more than the model's vocab_size={config.vocab_size}"
        )
    folder = out_dir.expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    hf = model.hf
    if dtype is not None:
        hf.to(dtype)
    hf.save_pretrained(folder)
    beside = resolve_tokenizer_file(tokenizer_path, key="tokenizer_path").parent
    eos = token_text(read_json(beside / HF_TOKENIZER_CONFIG_NAME).get("eos_token"))
    save_tokenizer_folder(
        folder,
        tokenizer_path,
        eos_token=eos or first_special_token(tokenizer),
        chat_template=hf_chat_template(beside),
        model_max_length=config.max_seq_len,
    )
    if check:
        difference = check_fallback_export(folder, model, config)
        log.info("%s: transformers' logits match within %.1e", folder, difference)
    return folder


def check_fallback_export(folder: Path, model: HFCausalLM, config: ModelConfig) -> float:
    """transformers' float32 logits of ``folder`` against ``model``'s on a few tokens;
    the largest difference.

    Raises:
        CheckpointError: transformers cannot load the folder, or the logits differ by
            more than :data:`PARITY_TOLERANCE`.
    """
    import transformers

    rows, length = _PARITY_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(
        0, config.vocab_size, (rows, min(length, config.max_seq_len)), generator=generator
    )
    try:
        theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, trust_remote_code=config.trust_remote_code
        ).eval()
    except Exception as err:  # transformers raises many kinds; the first line says which
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"transformers cannot load '{folder}': {reason}") from err
    with torch.no_grad():
        ours = model.float().eval().logits(x)
        theirs: Tensor = theirs_model(input_ids=x, use_cache=False).logits
    difference = float((ours - theirs).abs().max())
    if not torch.allclose(ours, theirs, atol=PARITY_TOLERANCE, rtol=PARITY_TOLERANCE):
        raise CheckpointError(
            f"'{folder}': transformers' float32 logits differ from the checkpoint's by up to "
            f"{difference:.2e}, more than {PARITY_TOLERANCE:g}"
        )
    return difference


def wants_hf_export(cfg: RunConfig) -> bool:
    """``stage.export_hf``, or when it is None (auto) whether the stage starts from a
    Hugging Face folder or from a stage that wrote one."""
    if cfg.stage.export_hf is not None:
        return cfg.stage.export_hf
    if cfg.stage.init_from is None:
        return False
    path = Path(cfg.stage.init_from).expanduser()
    folder = path if path.is_dir() else path.parent
    if folder.name == CHECKPOINTS_DIR:
        folder = folder.parent
    return (folder / HF_CONFIG_NAME).is_file() or RunDir(folder).hf.is_dir()


def export_run(cfg: RunConfig, out: Path) -> Path | None:
    """Write a finished run's output weights as ``hf/`` in its folder when the stage
    asks for it (:func:`wants_hf_export`); return the folder, or None.

    With ``stage.export_hf=true`` a failure is an error; when the stage chose it on its
    own, a warning names what failed and the run's outputs stand.

    Raises:
        CheckpointError, DataError: ``stage.export_hf=true`` and the export failed.
    """
    if not wants_hf_export(cfg):
        return None
    run_dir = RunDir(out)
    try:
        base = cfg.stage.init_from
        return export_checkpoint(run_dir.root, run_dir.hf, run_dir.tokenizer, base=base)
    except Exception as err:  # chosen by the stage: the run's own outputs stand
        if cfg.stage.export_hf:
            raise
        log.warning("stage.export_hf: %s is not written: %s", run_dir.hf, err)
        return None


# ------------------------------------------------------------------------- CLI
def command(cfg: ExportConfig) -> None:
    """The body of ``recipes-export`` (a Hydra app in :mod:`recipes_lib.cli`): write the
    folder and print where it is.

    Raises:
        RecipesError: a bad checkpoint or tokenizer, or a failed check.
    """
    folder = export_checkpoint(
        cfg.checkpoint, cfg.out, cfg.tokenizer, dtype=cfg.dtype.torch_dtype(), check=cfg.check
    )
    print(f"wrote {folder} (transformers, vLLM and PEFT load it)")
