"""An image-text folder in, the same folder out: a tiny ``Gemma3ForConditionalGeneration``
saved by transformers (Gemma 3 4B/12B/27B's format) reads as its ``gemma3_text`` tower
with transformers' logits, trains with SFT, and is written back as the image-text
model with the trained text weights, its vision tower and projector bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_folders import FAMILY_SETTINGS, TINY_HF, VOCAB, write_chat_records, write_tokenizer
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import QUIET_OVERRIDES

from recipes_lib.checkpoint.hf import load_hf_checkpoint
from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.hf_files import read_hf_config
from recipes_lib.checkpoint.source import fill_model_from_init, read_init_source
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.export import export_checkpoint
from recipes_lib.models import Transformer
from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")

TEXT = {**TINY_HF, **FAMILY_SETTINGS["gemma3_text"], "max_position_embeddings": 4096}
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
# the image tokens, inside the tiny vocabulary; the text-only inputs here avoid them
IMAGE_TOKENS = dict(
    boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1
)
PROCESSOR = {"processor_class": "Gemma3Processor", "image_seq_length": 4}
# how transformers 5 names the same tensors in memory (the published files use the first)
TRANSFORMERS5_NAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def text_ids(rows: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 8, (rows, length), generator=generator)


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.fixture(scope="module")
def image_text_folder(tmp_path_factory):
    """A tiny Gemma 3 image-text model saved by transformers, with a tokenizer, a chat
    template and a processor config."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-gemma3-it"
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, **IMAGE_TOKENS
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder, stdlib_instruction_records(300))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR))
    return folder, model


def renamed_folder(source, target, renames) -> None:
    """A copy of ``source`` with its tensors renamed by ``(old prefix, new prefix)``."""
    shutil.copytree(source, target)
    state = {}
    for name, tensor in tensors(source).items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        state[name] = tensor
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("naming", ["published", "transformers5"])
def test_the_text_tower_reads_with_transformers_logits(tmp_path, image_text_folder, naming):
    folder, hf_model = image_text_folder
    if naming == "transformers5":
        renamed_folder(folder, tmp_path / "renamed", TRANSFORMERS5_NAMES)
        folder = tmp_path / "renamed"
        assert any(name.startswith("model.language_model.") for name in tensors(folder))
    assert read_hf_config(folder)["model_type"] == "gemma3_text"
    model, config = load_hf_checkpoint(folder)
    assert config.family == "gemma3" and config.window_layers == [0]
    x = text_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(input_ids=x).logits, atol=1e-4, rtol=1e-4)


def test_sft_trains_the_text_tower_and_writes_the_image_text_folder_back(
    tmp_path, image_text_folder
):
    folder, hf_model = image_text_folder
    overrides = [
        "recipe=sft/full",
        "trainer=cpu",
        f"stage.init_from={folder}",
        f"data.path={write_chat_records(tmp_path / 'chat.jsonl', 60)}",
        "data.seq_len=128",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "scheduler.warmup=1",
        "optim.lr=1e-3",
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 3
    model = to_run_config(fill_model_from_init(compose_config(overrides))).model
    assert model.family == "gemma3"
    trained = Transformer(model).eval()
    trained.load_state_dict(load_weights(result.weights_path))
    x = text_ids()
    with torch.no_grad():
        ours = trained(x)
        assert not torch.allclose(ours, hf_model(input_ids=x).logits, atol=1e-3)  # it trained

    base, exported_by = tensors(folder), {}
    # the stage's own hf/, and recipes-export of the run's folder, which finds the folder
    # the run started from in its config.yaml
    cli = export_checkpoint(result.output_dir, tmp_path / "cli")
    for out in (result.hf_path, cli):
        assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
            assert (out / name).read_bytes() == (folder / name).read_bytes(), name
        written = tensors(out)
        assert list(written) == list(base)  # the same names, in the same order
        exported_by[out] = written
        reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=x).logits, ours, atol=1e-4, rtol=1e-4)
        vision = {
            k: v
            for k, v in reloaded.state_dict().items()
            if "vision_tower" in k or "multi_modal_projector" in k
        }
        assert vision and all(bitwise_equal(v, hf_model.state_dict()[k]) for k, v in vision.items())
    untouched = [n for n in base if not n.startswith("language_model.")]
    assert untouched and all(bitwise_equal(exported_by[cli][n], base[n]) for n in untouched)
    changed = [n for n in base if n.startswith("language_model.")]
    assert any(not torch.equal(exported_by[cli][n], base[n]) for n in changed)

    # a folder stored in bfloat16, as the published ones are: the text tower is written,
    # and checked against transformers, in bfloat16; another dtype is refused
    bf16 = tmp_path / "bf16"
    shutil.copytree(folder, bf16)
    cast = {n: t.to(torch.bfloat16) for n, t in base.items()}
    save_file(cast, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    written = tensors(export_checkpoint(result.output_dir, tmp_path / "bf16-out", base=bf16))
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    embeddings = trained.state_dict()["tok_embeddings.weight"].to(torch.bfloat16)
    assert torch.equal(written["language_model.model.embed_tokens.weight"], embeddings)
    with pytest.raises(CheckpointError, match="leave dtype out"):
        export_checkpoint(result.output_dir, tmp_path / "f16", dtype=torch.float16)
    assert not (tmp_path / "f16").exists()


@pytest.mark.slow  # two stages: about 20 s on CPU
def test_a_pipeline_writes_the_image_text_folder_back_at_every_stage(tmp_path, image_text_folder):
    """The second stage starts from the first's weights: its export still finds the
    image-text folder the first started from."""
    folder, _ = image_text_folder
    chat = write_chat_records(tmp_path / "chat.jsonl", 60)

    def stage(source: str) -> dict:
        return {
            "recipe": "sft/full",
            "from": source,
            "init": "weights",
            "data": {"seq_len": 128, "path": str(chat)},
            "scheduler": {"warmup": 1},
            "trainer": {"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
        }

    pipeline = {
        "name": "image-text",
        "dir": str(tmp_path / "pipe"),
        "overrides": ["trainer=cpu", f"data.cache_dir={tmp_path / 'cache'}", *QUIET_OVERRIDES],
        "stages": {"first": stage(str(folder)), "second": stage("first")},
    }
    result = run_pipeline(parse_pipeline(pipeline))
    for name in ("first", "second"):
        hf = result[name].manifest.directory / "hf"
        assert (hf / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def test_an_export_whose_model_is_not_the_folders_text_tower_writes_nothing(
    tmp_path, image_text_folder
):
    folder, _ = image_text_folder
    model, config = load_hf_checkpoint(folder)
    other = Transformer(type(config)(**{**config.__dict__, "ffn_dim": 96}))
    with pytest.raises(CheckpointError, match="not the text tower") as err:
        export_hf_checkpoint(other, other.config, tmp_path / "out", base=folder)
    assert str(folder) in str(err.value)
    assert not (tmp_path / "out").exists()
    # its own text tower is written, in the folder's own format
    out = export_hf_checkpoint(model, config, tmp_path / "out", base=folder)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3"

    # a folder that stores its tied head anyway gets the embeddings under that name
    stored = tmp_path / "stored-head"
    shutil.copytree(folder, stored)
    state = tensors(folder)
    state["language_model.lm_head.weight"] = state[
        "language_model.model.embed_tokens.weight"
    ].clone()
    save_file(state, str(stored / "model.safetensors"), metadata={"format": "pt"})
    written = tensors(export_hf_checkpoint(model, config, tmp_path / "head", base=stored))
    assert sorted(written) == sorted(state)
    assert torch.equal(written["language_model.lm_head.weight"], model.tok_embeddings.weight)


@pytest.mark.parametrize(
    "problem, message",
    [
        ("no_text_config", "has no text_config"),
        ("llama_text_tower", "text_config.model_type='llama'"),
        ("vision_weights_only", "holds no text tower's tensors"),
    ],
)
def test_a_folder_without_a_gemma3_text_tower_is_one_config_error(
    tmp_path, image_text_folder, problem, message
):
    folder, _ = image_text_folder
    bad = tmp_path / problem
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    if problem == "no_text_config":
        del config["text_config"]
    elif problem == "llama_text_tower":
        config["text_config"]["model_type"] = "llama"
    else:
        vision = {n: t for n, t in tensors(folder).items() if not n.startswith("language_model.")}
        save_file(vision, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_hf_checkpoint(bad)
    line = str(err.value)
    assert message in line and str(bad) in line and "\n" not in line
    if problem != "vision_weights_only":  # refused while the run is composed, before data
        overrides = ["recipe=sft/full", "trainer=cpu", f"stage.init_from={bad}"]
        with pytest.raises(ConfigError, match=message):
            run(compose_config([*overrides, f"run.dir={tmp_path / 'run'}"]))
        assert not (tmp_path / "run").exists()


def test_the_transformers_fallback_builds_the_whole_image_text_model(image_text_folder):
    """``model=hf`` builds transformers' own image-text model from the folder's whole
    config.json (its weights are that model's), reading the language shape from its
    ``text_config``; on text alone it gives transformers' logits."""
    from recipes_lib.checkpoint.hf_files import read_folder_config
    from recipes_lib.models.hf_fallback import build_hf_model, fallback_model_config

    folder, hf_model = image_text_folder
    source = read_init_source(folder, fallback=True)
    assert source.model["family"] == "hf"
    assert (source.model["vocab_size"], source.model["dim"]) == (
        TEXT["vocab_size"],
        TEXT["hidden_size"],
    )
    model = build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder)
    model.eval()
    x = text_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_model(input_ids=x).logits, atol=1e-4, rtol=1e-4)
    # the vision tower and projector, which text never reaches, are frozen; everything
    # left to train gets a gradient (what DDP needs)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all("vision" in n or "multi_modal" in n for n in frozen)
    model.train()
    model(x).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert read_init_source(folder).model["family"] == "gemma3"  # natively: its text tower
