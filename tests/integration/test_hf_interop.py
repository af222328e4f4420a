"""A Hugging Face folder in, a Hugging Face folder out: SFT starts from a transformers-saved
Llama (``stage.init_from=<folder>``) with its tokenizer and chat template, and the run's
output, exported, renders conversations in transformers exactly as training did."""

from __future__ import annotations

import json

import pytest
import torch
from hf_folders import EOS, VOCAB, tiny_hf_model, write_tokenizer
from lightning.pytorch.callbacks import Callback
from tiny import QUIET_OVERRIDES

from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
from recipes_lib.checkpoint.weights import load_weights
from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.chat.messages import record_messages
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import ConfigError
from recipes_lib.models import Transformer
from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.train import run

transformers = pytest.importorskip("transformers")

# a template of the folder's own (not a built-in one): role tags, EOS after each turn
TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>\n' + m['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama of the `tiny` model's shape saved by transformers, with a byte-level
    BPE tokenizer trained on the instruction records (no chat tokens, no pad token) and a
    chat template; unlike the session's ``hf_folder`` (a Qwen2 with ChatML tokens)."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = tiny_hf_model(
        "llama",
        hidden_size=128,
        intermediate_size=384,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=0,
    )
    model.save_pretrained(folder)
    records = stdlib_instruction_records(200)
    write_tokenizer(folder, records, template=TEMPLATE, chat_tokens=(), pad_token=None)
    return folder, model


def sft_overrides(tmp_path, init_from, *extra: str) -> list[str]:
    return [
        "recipe=sft/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"stage.init_from={init_from}",
        "data.chat.chat_template=null",  # the folder's own template
        "data.sources.stdlib_sft.max_documents=120",
        "data.seq_len=128",
        "data.batch_size=4",
        "data.val_fraction=0.1",
        f"model.vocab_size={VOCAB}",
        f"data.tokenizer.vocab_size={VOCAB}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        *QUIET_OVERRIDES,
        "scheduler.warmup=1",
        "callbacks=minimal",
        *extra,
    ]


class FirstLogits(Callback):
    """The policy's logits on the first training batch, before any step."""

    def __init__(self):
        self.input_ids: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.logits is None:
            batch = batch[0] if isinstance(batch, list) else batch  # the step's first micro-batch
            self.input_ids = batch["input_ids"].clone()
            with torch.no_grad():
                self.logits = pl_module(batch["input_ids"]).clone()


def test_sft_from_a_hf_folder_starts_from_its_logits_and_exports_its_template(
    tmp_path, llama_folder
):
    folder, hf_model = llama_folder
    first = FirstLogits()
    result = run(compose_config(sft_overrides(tmp_path, folder)), callbacks=[first])
    assert result.global_step == 4
    with torch.no_grad():
        expected = hf_model(input_ids=first.input_ids).logits
    torch.testing.assert_close(first.logits, expected, atol=1e-4, rtol=1e-4)
    assert result.tokenizer_path == (folder / "tokenizer.json").resolve()

    # the output folder carries the tokenizer and the template the run rendered with
    out = result.output_dir
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == TEMPLATE and saved["eos_token"] == EOS

    # exported from the run's folder alone, transformers renders what training saw
    cfg = to_run_config(compose_config(sft_overrides(tmp_path, folder)))
    exported = export_hf_checkpoint(
        load_weights(result.weights_path), cfg.model, tmp_path / "export", tokenizer_path=out
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    renderer = ChatRenderer(load_tokenizer(out), None, tokenizer_template=TEMPLATE, eos_token=EOS)
    for index, record in enumerate(stdlib_instruction_records(40)):
        messages = record_messages(record, index, cfg.data.chat)
        ours = renderer.render(messages).input_ids
        theirs = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert list(theirs) == ours, record["source"]
    # and the exported weights are the trained ones
    trained = Transformer(cfg.model).eval()
    trained.load_state_dict(load_weights(result.weights_path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    x = first.input_ids[:1, :64]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, trained(x), atol=1e-4, rtol=1e-4)


def test_dpo_from_a_hf_folder_uses_it_as_policy_and_reference(tmp_path, llama_folder):
    folder, _ = llama_folder
    overrides = [
        "recipe=dpo/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"stage.init_from={folder}",
        "data.sources.stdlib_dpo.max_documents=60",
        "data.seq_len=128",
        "data.batch_size=2",
        f"model.vocab_size={VOCAB}",
        f"data.tokenizer.vocab_size={VOCAB}",
        "trainer.max_steps=2",
        "scheduler.warmup=1",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        *QUIET_OVERRIDES,
        "callbacks=minimal",
    ]
    result = run(compose_config(overrides))
    assert result.global_step == 2
    assert 0.0 <= result.metrics["val/rewards/accuracy"] <= 1.0
    assert (result.output_dir / "tokenizer_config.json").is_file()


def test_a_hf_config_that_differs_from_the_model_is_named_before_training(tmp_path, llama_folder):
    folder, _ = llama_folder
    overrides = sft_overrides(tmp_path, folder, "model.ffn_dim=256", "model.norm_eps=1e-6")
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:  # in the pre-flight, before any data
        run(cfg)
    message = str(err.value)
    assert f"stage.init_from='{folder}'" in message
    assert "the configured model does not fit it (2 difference(s))" in message
    assert "model.ffn_dim=256 vs intermediate_size=384" in message
    assert "model.norm_eps=1e-06 vs rms_norm_eps=1e-05" in message
    assert not list((tmp_path / "run").glob("checkpoints/*.ckpt"))


def test_a_pipeline_stage_starts_from_a_hf_folder(tmp_path, llama_folder):
    folder, hf_model = llama_folder
    first = FirstLogits()
    sft = {
        "recipe": "sft/tiny",
        "from": str(folder),
        "init": "weights",
        "data": {
            "seq_len": 128,
            "batch_size": 4,
            "sources": {"stdlib_sft": {"max_documents": 60}},
            "chat": {"chat_template": None},
        },
        "scheduler": {"warmup": 1},
        "trainer": {"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
    }
    pipeline = {
        "name": "hf",
        "dir": str(tmp_path / "pipe"),
        "overrides": [
            f"model.vocab_size={VOCAB}",
            f"data.tokenizer.vocab_size={VOCAB}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.enable_progress_bar=false",
            "callbacks=minimal",
        ],
        "stages": {"sft": sft},
    }
    result = run_pipeline(parse_pipeline(pipeline), stage_callbacks={"sft": [first]})
    with torch.no_grad():
        expected = hf_model(input_ids=first.input_ids).logits
    torch.testing.assert_close(first.logits, expected, atol=1e-4, rtol=1e-4)
    manifest = result["sft"].manifest
    assert manifest.upstream is not None and manifest.upstream["path"] == str(folder)
    assert manifest.tokenizer_path.read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (manifest.directory / "tokenizer_config.json").is_file()

    # a model that does not fit the folder's config.json stops the pipeline before training
    sft["model"] = {"ffn_dim": 256}
    with pytest.raises(ConfigError, match=r"stage sft: model\.ffn_dim=256 vs"):
        run_pipeline(parse_pipeline({**pipeline, "dir": str(tmp_path / "other")}))
    assert not (tmp_path / "other" / "sft").exists()
