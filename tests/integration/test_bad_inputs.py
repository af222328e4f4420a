"""Each bad input stops before training with one message naming the path, key or value."""

from __future__ import annotations

import json

import pytest

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.corpus import iter_stdlib_documents
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer
from recipes_lib.errors import CheckpointError, ConfigError, DataError
from recipes_lib.train import run


def test_missing_data_path(tiny_cfg, tmp_path):
    missing = tmp_path / "no_such_corpus"
    cfg = tiny_cfg("data=local_text", f"data.sources.main.path={missing}")
    with pytest.raises(DataError, match=str(missing)) as info:
        run(cfg)
    assert "data.sources.main.path" in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_empty_dataset(tiny_cfg, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = tiny_cfg("data=local_text", f"data.sources.main.path={empty}")
    with pytest.raises(DataError, match="empty|no documents|no records"):
        run(cfg)


def test_tokenizer_vocabulary_larger_than_model(tiny_cfg, tmp_path):
    texts = [doc.text for doc in iter_stdlib_documents(max_bytes=400_000)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=700)
    assert tokenizer.get_vocab_size() > 512
    tok_dir = save_tokenizer(tokenizer, tmp_path / "tok")
    cfg = tiny_cfg(f"data.tokenizer.path={tok_dir}", "model.vocab_size=512")
    with pytest.raises(ConfigError, match="model.vocab_size") as info:
        run(cfg)
    assert "512" in str(info.value)


def test_trained_tokenizer_vocabulary_larger_than_model(tiny_cfg):
    with pytest.raises(ConfigError, match=r"data.tokenizer.vocab_size=1024.*model.vocab_size=512"):
        run(tiny_cfg("data.tokenizer.vocab_size=1024"))


def test_sequence_length_above_model_maximum(tiny_cfg):
    with pytest.raises(ConfigError, match=r"data.seq_len=2048.*model.max_seq_len=1024"):
        run(tiny_cfg("data.seq_len=2048"))


def test_unknown_config_option_is_named():
    with pytest.raises(ConfigError, match="trainer.max_stepz"):
        to_run_config(compose_config(["recipe=pretrain/tiny", "+trainer.max_stepz=3"]))


def test_unknown_attention_backend_lists_choices(tiny_cfg):
    with pytest.raises(ConfigError, match=r"kernels.attention.*sdpa.*flex"):
        run(tiny_cfg("kernels.attention=fast"))


def test_unknown_experts_path_lists_choices(tiny_cfg):
    with pytest.raises(ConfigError, match=r"kernels.experts='fast' is not one of auto"):
        run(tiny_cfg("kernels.experts=fast"))


def test_lora_on_the_experts_is_refused_where_it_cannot_work(tiny_cfg):
    lora = ("adapter=lora", "adapter.target_modules=[wq,experts]", "adapter.dropout=0")
    with pytest.raises(ConfigError, match="experts with strategy=deepspeed_zero3: adapters"):
        run(tiny_cfg("model=moe_tiny", *lora, "strategy=deepspeed_zero3"))
    with pytest.raises(ConfigError, match="experts with strategy.expert_parallel=true"):
        run(tiny_cfg("model=moe_tiny", *lora, "strategy=fsdp", "strategy.expert_parallel=true"))
    with pytest.raises(ConfigError, match="experts with kernels.compile=true"):
        run(tiny_cfg("model=moe_tiny", *lora, "kernels.compile=true"))
    with pytest.raises(ConfigError, match="experts, and this model has none"):
        run(tiny_cfg(*lora))


def test_document_mask_on_a_backend_without_it(tiny_cfg):
    with pytest.raises(ConfigError, match="kernels.attention=flex"):
        run(tiny_cfg("data.document_mask=true", "kernels.attention=sdpa"))


def test_missing_resume_checkpoint(tiny_cfg, tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointError, match=str(missing)):
        run(tiny_cfg(f"run.ckpt_path={missing}"))


def test_existing_checkpoints_are_never_overwritten(tiny_cfg, tmp_path):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    earlier = ckpt_dir / "last.ckpt"
    earlier.write_bytes(b"an earlier run's checkpoint")
    with pytest.raises(CheckpointError, match="run.ckpt_path=last"):
        run(tiny_cfg())
    assert earlier.read_bytes() == b"an earlier run's checkpoint"


def test_malformed_record_names_index_and_field(tiny_cfg, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"text") as info:
        run(tiny_cfg("data=local_text", f"data.sources.main.path={corpus}"))
    assert "1" in str(info.value)
