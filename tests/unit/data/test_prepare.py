import logging
import shutil

import pytest
from data_helpers import data_config, synthetic_documents, write_jsonl

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.sources import resolve_cache_dir
from recipes_lib.data.text import prepare as prepare_module
from recipes_lib.data.text.prepare import prepare, resolve_sources
from recipes_lib.data.text.shards import TokenShard
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import ConfigError, DataError


@pytest.fixture()
def sources(tmp_path, stdlib_jsonl):
    chat = write_jsonl(tmp_path / "chat.jsonl", synthetic_documents(200))
    return {
        "code": SourceConfig(path=str(stdlib_jsonl), weight=3.0),
        "chat": SourceConfig(path=str(chat), weight=1.0),
    }


def test_prepare_trains_tokenizer_and_writes_shards_per_source(tmp_path, sources):
    config = data_config(tmp_path / "cache", sources)
    prepared = prepare(config, progress=False, quiet=True)
    assert prepared.tokenizer_path.is_file()
    assert prepared.tokenizer_path.is_relative_to(tmp_path / "cache" / "tokenizers")
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    assert tokenizer.get_vocab_size() <= 512 and prepared.eos_id == 0
    assert set(prepared.train_shards) == set(prepared.val_shards) == {"code", "chat"}
    assert prepared.weights == {"code": 3.0, "chat": 1.0}
    for name in ("code", "chat"):
        train = TokenShard.open(prepared.train_shards[name], verify=True)
        val = TokenShard.open(prepared.val_shards[name], verify=True)
        assert train.meta["fingerprint"] == prepared.fingerprints[name]
        assert train.meta["source"] == name
        assert train.meta["tokenizer_sha256"] == prepared.tokenizer_sha256
        assert val.n_docs >= 1 and train.n_docs > val.n_docs
    chat = TokenShard.open(prepared.train_shards["chat"])
    assert chat.n_docs + TokenShard.open(prepared.val_shards["chat"]).n_docs == 200


def test_second_prepare_reuses_everything_without_reading_text(tmp_path, sources, monkeypatch):
    config = data_config(tmp_path / "cache", sources)
    first = prepare(config, progress=False, quiet=True)

    def forbidden(*args, **kwargs):
        raise AssertionError("cached data was rebuilt")

    for name in ("load_source", "write_split_shards", "train_bpe_tokenizer"):
        monkeypatch.setattr(prepare_module, name, forbidden)
    assert prepare(config, progress=False, quiet=True) == first
    # another rank finds rank 0's files and returns at once
    assert prepare(config, progress=False, quiet=True, rank=1, wait_timeout_s=0) == first


def test_fingerprint_tracks_what_shapes_the_shards(tmp_path, sources, small_tokenizer_path):
    cache = tmp_path / "cache"
    given = prepare(data_config(cache, sources, small_tokenizer_path), progress=False, quiet=True)
    assert given.tokenizer_path == small_tokenizer_path
    resplit = data_config(cache, sources, small_tokenizer_path, val_fraction=0.2)
    other = prepare(resplit, progress=False, quiet=True)
    assert other.fingerprints["chat"] != given.fingerprints["chat"]
    reseeded = data_config(cache, sources, small_tokenizer_path, seed=1)
    assert prepare(reseeded, progress=False, quiet=True).fingerprints != given.fingerprints
    assert len(list((cache / "shards").iterdir())) == 6


def test_other_ranks_wait_for_rank_zero(tmp_path, sources):
    config = data_config(tmp_path / "cache", sources)
    with pytest.raises(DataError, match="timed out.*waiting for rank 0"):
        prepare(config, progress=False, quiet=True, rank=1, wait_timeout_s=0.2)
    assert not (tmp_path / "cache" / "shards").exists()


def test_builtin_stdlib_source_and_default(tmp_path, small_tokenizer_path):
    assert resolve_sources(DataConfig()) == {"stdlib": SourceConfig(builtin="stdlib")}
    sources = {"py": SourceConfig(builtin="stdlib", max_documents=30)}
    prepared = prepare(
        data_config(tmp_path, sources, small_tokenizer_path), progress=False, quiet=True
    )
    train = TokenShard.open(prepared.train_shards["py"])
    assert train.n_docs + TokenShard.open(prepared.val_shards["py"]).n_docs == 30
    assert train.meta["description"].startswith("builtin: stdlib")


def test_tokenizer_too_large_for_model(tmp_path, sources, small_tokenizer_path):
    config = data_config(tmp_path, sources, small_tokenizer_path)
    with pytest.raises(ConfigError, match=r"512 tokens.*model\.vocab_size=256"):
        prepare(config, model_vocab_size=256, progress=False, quiet=True)


def test_bad_config_values_fail_before_any_work(tmp_path, sources):
    sources["chat"].weight = 0.0
    with pytest.raises(ConfigError, match=r"data\.sources\.chat\.weight"):
        prepare(data_config(tmp_path, sources), quiet=True)
    sources["chat"].weight = 1.0
    with pytest.raises(ConfigError, match=r"data\.val_fraction"):
        prepare(data_config(tmp_path, sources, val_fraction=1.0), quiet=True)
    with pytest.raises(ConfigError, match=r"data\.seed"):
        prepare(data_config(tmp_path, sources, seed="${run.seed}"), quiet=True)
    missing = {"x": SourceConfig(path=str(tmp_path / "absent"))}
    with pytest.raises(DataError, match=r"data\.sources\.x\.path.*absent"):
        prepare(data_config(tmp_path, missing), quiet=True)
    assert not (tmp_path / "shards").exists() and not (tmp_path / "tokenizers").exists()


def test_cache_dir_expands_user_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_cache_dir("~/cache") == tmp_path / "cache"
    monkeypatch.setenv("RECIPES_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir("${oc.env:RECIPES_CACHE,'~/.cache/x'}") == tmp_path / "env"
    monkeypatch.delenv("RECIPES_CACHE")
    assert resolve_cache_dir("${oc.env:RECIPES_CACHE,'~/.cache/x'}") == tmp_path / ".cache/x"
    with pytest.raises(ConfigError, match=r"data\.cache_dir"):
        resolve_cache_dir("${run.dir}/cache")


def test_summary_is_printed(tmp_path, sources, small_tokenizer_path, capsys):
    prepare(data_config(tmp_path, sources, small_tokenizer_path), progress=False)
    out = capsys.readouterr().out
    assert "code" in out and "chat" in out and "written" in out
    prepare(data_config(tmp_path, sources, small_tokenizer_path), progress=False)
    assert "cached" in capsys.readouterr().out


def test_truncated_shard_is_moved_aside_and_rebuilt(
    tmp_path, sources, small_tokenizer_path, caplog
):
    # a given tokenizer: the shards are what is damaged and rebuilt here
    config = data_config(tmp_path / "cache", sources, small_tokenizer_path)
    first = prepare(config, progress=False, quiet=True)
    pair = first.train_shards["chat"].parent
    tokens = first.train_shards["chat"] / "tokens.bin"
    size = tokens.stat().st_size
    with tokens.open("r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(DataError, match=r"tokens\.bin is .*; prepare the data again"):
        TokenShard.open(first.train_shards["chat"])
    # other ranks wait for rank 0 to rebuild it rather than read it
    with pytest.raises(DataError, match="timed out.*waiting for rank 0"):
        prepare(config, progress=False, quiet=True, rank=1, wait_timeout_s=0.2)

    # the advice followed: preparing again sets the pair aside, says so, and rebuilds it
    with caplog.at_level(logging.WARNING, logger="recipes_lib.data.text.prepare"):
        again = prepare(config, progress=False, quiet=True)
    assert again == first
    TokenShard.open(again.train_shards["chat"], verify=True)
    (aside,) = pair.parent.glob(f"{pair.name}.corrupt-*")
    assert (aside / "train" / "tokens.bin").stat().st_size == size - 2  # kept, not deleted
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "source chat" in warning and str(aside) in warning


def test_deleting_one_split_folder_still_rebuilds(tmp_path, sources, small_tokenizer_path):
    # what earlier messages advised: an incomplete pair used to block its own rebuild
    # (OSError: Directory not empty) when the new pair was renamed onto it
    config = data_config(tmp_path / "cache", sources, small_tokenizer_path)
    first = prepare(config, progress=False, quiet=True)
    shutil.rmtree(first.train_shards["code"])
    assert prepare(config, progress=False, quiet=True) == first
    TokenShard.open(first.train_shards["code"], verify=True)
