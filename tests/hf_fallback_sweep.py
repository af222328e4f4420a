"""The transformers fallback over transformers' causal-LM model types: each type made
tiny (its default config with small dims, as transformers' own tiny test configs are),
saved as a folder a user downloads, trained 5 steps of ``recipe=sft/lora`` and of
``recipe=dpo/full`` with ``model=hf``, exported and reloaded by transformers with the
same logits. :func:`sweep_type` gives one type's row, :func:`write_table` the docs page
(docs/models/fallback.md)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from hf_folders import VOCAB, write_chat_records, write_preference_records, write_tokenizer
from tiny import QUIET_OVERRIDES

from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.models.families import FAMILIES
from recipes_lib.models.hf_fallback import is_multimodal

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# small dims under every name configs use for them; only names a config has are set
TINY_DIMS: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "n_positions": 512,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    # latent attention (DeepSeek-V2/V3 and their kin), partial rotary of GPT-J and CodeGen
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,  # qk_nope_head_dim + qk_rope_head_dim
    "rotary_dim": 8,
    # grouped routing over the few experts left, and another name of the top-k
    "num_expert_group": 1,
    "num_experts_per_token": 2,
    # the key selector of sparse attention (DeepSeek-V3.2, GLM-5), linear-attention heads
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 8,
    "linear_head_dim": 16,
    "embedding_dim": 64,  # xLSTM's width
    "n_group": 1,
    "topk_group": 1,
    "shared_expert_intermediate_size": 32,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "is_decoder": True,
    "tie_word_embeddings": True,
}
# what a type's default config needs besides the common dims to build tiny: sizes
# its own checks tie together, and a hybrid's layer of each kind within two layers
TYPE_TINY: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 1},
    "bamba": {
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "attn_layer_indices": [1],
    },
    "granitemoehybrid": {
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "layer_types": ["mamba", "attention"],
    },
    "zaya": {"num_experts_per_tok": 1},  # its only routing
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "dots1": {"n_shared_experts": 1},
    "qwen4_exp": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "gemma4": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
}
TYPE_TINY["dots3_note"] = {"head_dim": 16}  # its windowed layers' nope + rope widths
TYPE_TINY["dots3_note_text"] = TYPE_TINY["dots3_note"]
TYPE_TINY["qwen4_exp_text"] = TYPE_TINY["qwen4_exp"]
TYPE_TINY["gemma4_text"] = TYPE_TINY["gemma4"]
MAX_TINY_PARAMS = 5_000_000  # a type whose default config does not shrink is skipped
SECONDS_PER_TYPE = 240
UNPACKED = ["data.document_mask=false", "data.chat.packing=false"]  # a row each
SHORT = ["trainer=cpu", "trainer.max_steps=5", "scheduler.warmup=1", "trainer.val_check_interval=5"]
# the model types a native family reads, image-text folders included (the families'
# own declaration)
NATIVE = {t for family in FAMILIES.values() for t in family.hf_model_types} | {
    family.image_text.model_type for family in FAMILIES.values() if family.image_text
}


class Skip(Exception):
    """A type that cannot be made tiny here (extra dependencies, a nested config)."""


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _kept_layers(values: list[Any], layers: int) -> list[int]:
    """Which layers of a deeper model's per-layer list ``values`` a model of ``layers``
    layers keeps: the first of each kind it holds first (a hybrid keeps both kinds),
    then as the list goes on."""
    if not all(isinstance(v, str | int | float | bool) for v in values):
        return list(range(min(layers, len(values))))
    firsts = sorted({v: i for i, v in reversed(list(enumerate(values)))}.values())
    if len(firsts) == len(values):  # every entry its own (indices): the first ones
        return list(range(min(layers, len(values))))
    chosen = firsts[:layers]
    return chosen + [chosen[-1]] * (layers - len(chosen))


def _per_layer(values: list[Any], layers: int) -> list[Any]:
    """A per-layer list of a deeper model for ``layers`` layers (:func:`_kept_layers`)."""
    return [values[i] for i in _kept_layers(values, layers)]


def _per_layer_config(entries: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    """A deeper model's ``per_layer_config`` (overrides keyed by layer index, Gemma 4's
    wider global heads) for the layers ``kept``, renumbered, its sizes made tiny."""
    out = {}
    for new, old in enumerate(kept):
        entry = entries.get(f"{old:02d}", entries.get(str(old)))
        if isinstance(entry, dict):
            tiny = {k: TINY_DIMS.get(k, v) for k, v in entry.items()}
            if "kv_lora_rank" in entry and "num_key_value_heads" in entry:  # latent
                tiny["num_key_value_heads"] = TINY_DIMS["num_attention_heads"]
            out[f"{new:02d}"] = tiny
    return out


def _shrink(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    depth = next((values[k] for k in LAYER_COUNT_KEYS if isinstance(values.get(k), int)), None)
    kinds = values.get("layer_types")
    kept = _kept_layers(kinds, 2) if isinstance(kinds, list) and len(kinds) > 2 else [0, 1]
    if isinstance(values.get("per_layer_config"), dict):
        out["per_layer_config"] = _per_layer_config(values["per_layer_config"], kept)
    for key, value in values.items():
        if isinstance(value, dict) and ("hidden_size" in value or "vocab_size" in value):
            out[key] = _shrink(value)  # a text or vision tower's own config
        elif key in TINY_DIMS:
            out[key] = TINY_DIMS[key]
        elif isinstance(value, list) and depth and len(value) == depth and depth > 2:
            out[key] = _per_layer(value, 2)  # layer_types and its kin
    if "kv_lora_rank" in values:  # latent attention: a key and value per query head
        if "qk_rope_head_dim" in values and "head_dim" in values:  # its RoPE width
            out["head_dim"] = TINY_DIMS["qk_rope_head_dim"]
        if "num_key_value_heads" in values:
            out["num_key_value_heads"] = TINY_DIMS["num_attention_heads"]
    return out


def tiny_config(model_type: str):
    """transformers' config of ``model_type`` with :data:`TINY_DIMS`.

    Raises:
        Skip: the type cannot be built here (its reason).
    """
    import transformers

    try:
        default = transformers.AutoConfig.for_model(model_type).to_dict()
        values = _shrink(default)
        shape = values["text_config"] if is_multimodal(values) else values
        shape.update(TYPE_TINY.get(model_type, {}))
        values.pop("model_type", None)
        for key in ("transformers_version", "architectures", "_name_or_path"):
            values.pop(key, None)
        return transformers.AutoConfig.for_model(model_type, **values)
    except ImportError as err:
        raise Skip(f"needs {str(err).splitlines()[0][:80]}") from err
    except Exception as err:  # noqa: BLE001 - any reason a config does not build is recorded
        raise Skip(f"config: {type(err).__name__}: {str(err).splitlines()[0][:80]}") from err


def make_tiny_folder(model_type: str, folder: Path) -> int:
    """Save a tiny ``model_type`` model (seed 0) with a tokenizer into ``folder``;
    return its parameter count.

    Raises:
        Skip: it cannot be built tiny here.
    """
    import transformers

    config = tiny_config(model_type)
    try:
        with torch.device("meta"):
            shapes = transformers.AutoModelForCausalLM.from_config(config)
        count = sum(p.numel() for p in shapes.parameters())
        if count > MAX_TINY_PARAMS:
            raise Skip(f"does not shrink with the common dims ({count / 1e6:.0f}M parameters)")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(folder)
    except Skip:
        raise
    except ImportError as err:
        raise Skip(f"needs {str(err).splitlines()[0][:80]}") from err
    except Exception as err:  # noqa: BLE001 - recorded as the type's reason
        raise Skip(f"build: {type(err).__name__}: {str(err).splitlines()[0][:80]}") from err
    write_tokenizer(folder, stdlib_instruction_records(200))
    return count


def _timeout(signum, frame):  # noqa: ARG001 - signal handler signature
    raise TimeoutError(f"over {SECONDS_PER_TYPE} s")


def _run(recipe: str, folder: Path, data: Path, out: Path, extra: Iterable[str] = ()):
    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    overrides = [
        f"recipe={recipe}",
        "model=hf",
        f"stage.init_from={folder}",
        f"data.path={data}",
        "data.seq_len=128",
        *SHORT,
        *QUIET_OVERRIDES,
        f"run.dir={out / 'run'}",
        f"data.cache_dir={out / 'cache'}",
        *extra,
    ]
    return run(compose_config(overrides))


def _reloads_same(result) -> float:
    """transformers' logits of the exported hf/ against the run's own weights, built as
    the fallback builds them; the largest difference."""
    import transformers

    from recipes_lib.export import load_checkpoint

    ours, config = load_checkpoint(result.output_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(result.hf_path).eval()
    x = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs_logits = theirs(input_ids=x, use_cache=False).logits
        return float((ours.float().eval()(x) - theirs_logits).abs().max())


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:140] if text else ''}"


def sweep_type(model_type: str, tmp: Path) -> dict[str, Any]:
    """One type's row: ``status`` (``ok`` | ``partial`` | ``skipped`` | ``failed``),
    what passed and why anything did not."""
    row: dict[str, Any] = {
        "model_type": model_type,
        "path": "native" if model_type in NATIVE else "fallback",
    }
    folder = tmp / "folder"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(SECONDS_PER_TYPE)
    started = time.perf_counter()
    try:
        row["params"] = make_tiny_folder(model_type, folder)
        chat = write_chat_records(tmp / "chat.jsonl", 40)
        pairs = write_preference_records(tmp / "pairs.jsonl", 40)
        row["packing"] = _packs(folder)
        rows = UNPACKED if row["packing"] == "no" else []
        for recipe, data in (("sft/lora", chat), ("dpo/full", pairs)):
            key = recipe.replace("/", "_")
            try:
                result = _run(recipe, folder, data, tmp / key, ["stage.export_hf=true", *rows])
                assert result.global_step == 5 and result.hf_path is not None
                row[key] = "ok"
                row[f"{key}_load_check"] = (result.load_check or {}).get("difference")
                row[f"{key}_reload"] = _reloads_same(result)
                if row[f"{key}_reload"] > 1e-4:
                    row[key] = f"reloaded logits differ by {row[f'{key}_reload']:.1e}"
            except TimeoutError:
                raise
            except Exception as err:  # noqa: BLE001 - the row records why
                row[key] = _first_line(err)
        passed = [row.get(k) == "ok" for k in ("sft_lora", "dpo_full")]
        row["status"] = "ok" if all(passed) else "partial" if any(passed) else "failed"
    except Skip as err:
        row.update(status="skipped", reason=str(err))
    except Exception as err:  # noqa: BLE001 - a timeout or a crash outside a recipe
        row.update(status="failed", reason=_first_line(err))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _packs(folder: Path) -> str:
    """How the fallback keeps the documents of a packed row apart (probed at build)."""
    from recipes_lib.checkpoint.hf_files import read_folder_config
    from recipes_lib.models.hf_fallback import build_hf_model, fallback_model_config

    model = build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder)
    if not model.attention_backend.packs_documents:
        return "no"  # trained a row per example
    return "position ids" if model.packing == "positions" else "4-D mask"


def causal_lm_types() -> list[str]:
    from recipes_lib.models.hf_fallback import causal_lm_types as types

    return sorted(types())


HEADER = """# The transformers fallback: every causal-LM model type

<!-- generated by tests/integration/test_hf_fallback_sweep.py; do not edit -->

A Hugging Face folder whose `model_type` has no native family trains as transformers' own
`AutoModelForCausalLM` (`model.family=hf`), chosen on its own with one line saying so;
`model=hf` chooses it for any folder. See [Models](../models.md#the-transformers-fallback).

Each model type of transformers {version}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` was made tiny
(its default config with 2 layers of width 64, a 512-token vocabulary; for a few types also
the sizes their own checks tie together, `TYPE_TINY`), saved with a
tokenizer, then trained through the fallback (`model=hf`) 5 steps of `recipe=sft/lora` and
5 of `recipe=dpo/full` on the CPU; each run exported `hf/` with `save_pretrained`, and
transformers' reload of it gave the run's own logits within 1e-4. *load check*: the
largest difference between the library's first-batch loss and transformers' own.
*packing*: how packed rows keep their documents apart (position ids restarting per
document, else a 4-D block mask; *no*: the model keeps no documents apart, such as a
state-space or linear-attention model, and trains one example per row with
`data.chat.packing=false data.document_mask=false`).

**{ok} of {total} types pass both recipes**, {partial} pass one, {failed} fail, {skipped}
cannot be made tiny here (extra dependencies or a config that does not shrink).

*speed*, for a type with a native family: the native path's training tokens/s over
transformers' own model's, each measured on the GPU named, in one call, on a preset of
that family (`benchmarks/results/pretrain_throughput_*.json`); and the fallback's over
the native path's where both were measured (`benchmarks/results/hf_fallback_*.json`).
*transformers eager*: transformers' side ran uncompiled, as a second command of the same
call (`<file>_hf_eager_<card>.json`; compiling Qwen3.5 per layer outlasts a call). Empty:
no result file holds both sides. The page is written again from the rows
of its last sweep and the result files by `python tests/hf_fallback_sweep.py`; a test
fails when it is stale.

| model type | path | sft/lora | dpo/full | load check | packing | speed | note |
|---|---|---|---|---|---|---|---|
"""


def _cell(value: Any) -> str:
    if value == "ok":
        return "yes"
    if value is None:
        return ""
    return "no"


def _card(device: str) -> str:
    """``H100`` of ``NVIDIA H100 80GB HBM3``: the card's model name."""
    return next((w for w in device.split() if w[:1] == "H" and w[1:].isdigit()), device)


def _family_of(preset: str) -> str | None:
    """The family of ``conf/model/<preset>.yaml`` (None: no such preset here)."""
    from omegaconf import OmegaConf

    file = ROOT / "conf" / "model" / f"{preset}.yaml"
    return str(OmegaConf.load(file).get("family", "llama")) if file.is_file() else None


EAGER_SIDE = "_hf_eager_"  # <stem>_hf_eager_<card>.json: transformers' side, eager


def _at(report: dict[str, Any], key: str | tuple[str, str]) -> Any:
    """``report[key]``, or ``report[a][b]`` for ``key = (a, b)``; None where missing."""
    if isinstance(key, str):
        return report.get(key)
    return (report.get(key[0]) or {}).get(key[1])


def _sides(file: Path, report: dict[str, Any]) -> list[tuple[str, float, float, str]]:
    """``(preset, ours, theirs, label)`` of each model that ``file`` (read: ``report``)
    measured on both sides. A file of the library's side alone reads transformers' side
    from its sibling ``<stem>_hf_eager_<card>.json``, when that exists and ran on the
    same card: the two commands of one call, transformers' model uncompiled (where
    compiling it per layer takes longer than a call, as Qwen3.5's torch rule does)."""
    stem, _, card = file.stem.rpartition("_")
    sibling = file.with_name(f"{stem}{EAGER_SIDE}{card}.json")
    eager = json.loads(sibling.read_text()) if sibling.is_file() else {}
    same_run = ("device", ("settings", "seq_len"))
    if any(_at(eager, key) not in (None, _at(report, key)) for key in same_run):
        eager = {}  # another card or length: not the same call's other side
    found = []
    for preset, entry in report.get("models", {}).items():
        trainers = entry.get("trainers", {})
        ours = (trainers.get("recipes_lib") or {}).get("tokens_per_sec")
        theirs = (trainers.get("hf_transformers") or {}).get("tokens_per_sec")
        label = "transformers"
        eager_entry = eager.get("models", {}).get(preset, {})
        if not theirs and eager_entry.get("batch_size") == entry.get("batch_size"):
            eager_trainers = eager_entry.get("trainers", {})
            theirs = (eager_trainers.get("hf_transformers") or {}).get("tokens_per_sec")
            label = "transformers eager"
        if ours and theirs:
            found.append((preset, ours, theirs, label))
    return found


def measured_speeds(results: Path = RESULTS) -> dict[str, list[str]]:
    """Each native family's measured speed ratios, as the page writes them: the native
    path against transformers' own model (``pretrain_throughput_*.json`` files holding
    both, or a file and its ``_hf_eager_`` sibling), and the fallback against the native
    path (``hf_fallback_*.json``)."""
    speeds: dict[str, list[str]] = {}
    for file in sorted(results.glob("pretrain_throughput_*.json")):
        if EAGER_SIDE in file.name:
            continue
        report = json.loads(file.read_text())
        for preset, ours, theirs, label in _sides(file, report):
            family = _family_of(preset)
            if family is not None:
                speeds.setdefault(family, []).append(
                    f"{ours / theirs:.2f}x {label} ({preset}, {_card(report['device'])})"
                )
    for file in sorted(results.glob("hf_fallback_*.json")):
        report = json.loads(file.read_text())
        for family, entry in report.get("families", {}).items():
            if entry.get("ratio"):
                speeds.setdefault(family, []).append(
                    f"fallback {entry['ratio']:.2f}x native ({_card(report['device'])})"
                )
    return speeds


def type_speeds(results: Path = RESULTS) -> dict[str, str]:
    """The *speed* cell of each model type a measured native family reads."""
    by_family = measured_speeds(results)
    cells: dict[str, str] = {}
    for name, family in FAMILIES.items():
        types = list(family.hf_model_types)
        if family.image_text:
            types.append(family.image_text.model_type)
        for model_type in types:
            if by_family.get(name):
                cells[model_type] = "; ".join(by_family[name])
    return cells


def write_table(
    rows: list[Mapping[str, Any]], path: Path, version: str, results: Path = RESULTS
) -> dict[str, int]:
    """Write the docs page of a sweep's ``rows`` under transformers ``version``, with the
    speeds of the result files in ``results``, and the rows beside it (``.json``);
    return the counts by status."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_table(rows, version, results))
    sweep = {"transformers": version, "rows": list(rows)}
    path.with_suffix(".json").write_text(json.dumps(sweep, indent=1) + "\n")
    return status_counts(rows)


def read_sweep(path: Path) -> tuple[list[dict[str, Any]], str]:
    """The rows and transformers version of the sweep written beside the page ``path``."""
    sweep = json.loads(path.with_suffix(".json").read_text())
    return sweep["rows"], sweep["transformers"]


def status_counts(rows: list[Mapping[str, Any]]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in rows) for s in ("ok", "partial", "failed", "skipped")}


def render_table(rows: list[Mapping[str, Any]], version: str, results: Path = RESULTS) -> str:
    """The docs page of a sweep's ``rows`` under transformers ``version``, with the speeds
    of the result files in ``results``."""
    counts = status_counts(rows)
    speeds = type_speeds(results)
    lines = [HEADER.format(version=version, total=len(rows), **counts)]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        checks = [r.get("sft_lora_load_check"), r.get("dpo_full_load_check")]
        worst = max((c for c in checks if c is not None), default=None)
        notes = [r.get("reason")] + [
            f"{k.replace('_', '/')}: {r[k]}"
            for k in ("sft_lora", "dpo_full")
            if r.get(k) not in (None, "ok")
        ]
        note = "; ".join(n for n in notes if n).replace("|", "\\|")
        lines.append(
            f"| `{r['model_type']}` | {r['path']} | {_cell(r.get('sft_lora'))} | "
            f"{_cell(r.get('dpo_full'))} | {'' if worst is None else f'{worst:.0e}'} | "
            f"{r.get('packing', '')} | {speeds.get(r['model_type'], '')} | {note} |\n"
        )
    return "".join(lines)


if __name__ == "__main__":  # the page again from its last sweep's rows and the result files
    page = ROOT / "docs" / "models" / "fallback.md"
    sweep_rows, sweep_version = read_sweep(page)
    write_table(sweep_rows, page, sweep_version)
    print(f"wrote {page}")
