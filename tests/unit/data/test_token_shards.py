import json
import os

import numpy as np
import pytest
from data_helpers import synthetic_documents

from recipes_lib.data.sources import held_out_mask
from recipes_lib.data.text.shard_writer import _split_stream, write_split_shards
from recipes_lib.data.text.shards import SplitShards, TokenShard, token_dtype
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import DataError

DOCS = synthetic_documents(300)


@pytest.fixture(scope="module")
def tokenizer(small_tokenizer_path):
    return load_tokenizer(small_tokenizer_path)


def write(directory, tokenizer, texts=DOCS, **kwargs) -> SplitShards:
    settings = {"num_documents": len(DOCS), "val_fraction": 0.1, "seed": 0, "progress": False}
    settings.update(kwargs)
    return write_split_shards(
        texts, directory, tokenizer, 0, meta={"source": "synthetic", "fingerprint": "f"}, **settings
    )


def test_shard_holds_each_document_then_eos(tmp_path, tokenizer):
    shards = write(tmp_path / "s", tokenizer)
    mask = held_out_mask(len(DOCS), 0.1, 0)
    assert shards.val.n_docs == mask.sum() == 30
    assert shards.train.n_docs == len(DOCS) - 30
    for split, shard in (("train", shards.train), ("val", shards.val)):
        texts = [t for t, held in zip(DOCS, mask, strict=True) if held == (split == "val")]
        assert shard.tokens.dtype == np.uint16
        assert shard.doc_offsets[-1] == shard.n_tokens == len(shard.tokens)
        for i in (0, 7, shard.n_docs - 1):
            expected = tokenizer.encode(texts[i], add_special_tokens=False).ids + [0]
            assert shard.document(i).tolist() == expected
        meta = json.loads((shard.path / "meta.json").read_text())
        assert meta["split"] == split and meta["dtype"] == "uint16" and meta["eos_id"] == 0
        assert meta["n_docs"] == shard.n_docs and meta["source"] == "synthetic"
        TokenShard.open(shard.path, verify=True)


def test_single_threaded_encoding_gives_the_same_shard(tmp_path, tokenizer):
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    parallel = write(tmp_path / "a", tokenizer)
    single = write(tmp_path / "b", tokenizer, num_threads=1)
    assert parallel.train.meta["tokens_sha256"] == single.train.meta["tokens_sha256"]
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before  # restored


def test_dtype_by_vocabulary_size():
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


def test_hold_out_is_seeded_and_never_empty_or_total():
    assert (held_out_mask(100, 0.1, 1) == held_out_mask(100, 0.1, 1)).all()
    assert (held_out_mask(100, 0.1, 1) != held_out_mask(100, 0.1, 2)).any()
    assert held_out_mask(2, 0.01, 0).sum() == 1
    assert held_out_mask(1, 0.5, 0).sum() == 0
    assert held_out_mask(10, 0.0, 0).sum() == 0
    assert held_out_mask(3, 0.99, 0).sum() == 2
    streamed = list(_split_stream([f"d{i}" for i in range(5)], 0.001, 0))
    assert [t for t, _ in streamed] == [f"d{i}" for i in range(5)]
    assert sum(held for _, held in streamed) >= 1


def test_streamed_source_splits_without_a_length(tmp_path, tokenizer):
    shards = write(tmp_path / "s", tokenizer, texts=iter(DOCS), num_documents=None)
    assert shards.train.n_docs + shards.val.n_docs == len(DOCS)
    assert 10 <= shards.val.n_docs <= 55


def test_failure_mid_write_leaves_no_shard_and_keeps_earlier_ones(tmp_path, tokenizer):
    earlier = write(tmp_path / "earlier", tokenizer)

    def crashing_texts():
        for i, text in enumerate(DOCS):
            if i == 280:  # after several batches reached tokens.bin
                raise RuntimeError("simulated crash")
            yield text

    target = tmp_path / "target"
    with pytest.raises(RuntimeError, match="simulated crash"):
        write(target, tokenizer, texts=crashing_texts())
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]  # no temporaries left
    TokenShard.open(earlier.train.path, verify=True)
    assert write(target, tokenizer).train.n_docs == earlier.train.n_docs


def test_stale_temporary_of_a_dead_process_is_removed(tmp_path, tokenizer):
    from recipes_lib.data.text.shard_writer import _host_tag

    stale = tmp_path / f".target.tmp-{_host_tag()}-999999999-abcd"
    (stale / "train").mkdir(parents=True)
    write(tmp_path / "target", tokenizer)
    assert not stale.exists()


def test_empty_source_is_an_error_naming_it(tmp_path, tokenizer):
    with pytest.raises(DataError, match="synthetic is empty"):
        write(tmp_path / "s", tokenizer, texts=["", ""], num_documents=2)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def shard_dir(tmp_path, tokenizer):
    return write(tmp_path / "s", tokenizer).train.path


def test_truncated_tokens_file_is_named(shard_dir):
    tokens = shard_dir / "tokens.bin"
    size = tokens.stat().st_size
    with tokens.open("r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(DataError, match=rf"tokens\.bin is {size - 2} bytes, expected {size}"):
        TokenShard.open(shard_dir)


def test_missing_files_are_named(shard_dir):
    (shard_dir / "doc_offsets.npy").unlink()
    with pytest.raises(DataError, match=r"doc_offsets\.npy is missing or corrupt"):
        TokenShard.open(shard_dir)
    (shard_dir / "tokens.bin").unlink()
    with pytest.raises(DataError, match=r"tokens\.bin is missing"):
        TokenShard.open(shard_dir)
    (shard_dir / "meta.json").unlink()
    with pytest.raises(DataError, match=r"missing meta\.json"):
        TokenShard.open(shard_dir)


def test_corrupt_meta_and_offsets_are_named(shard_dir):
    offsets = np.load(shard_dir / "doc_offsets.npy")
    np.save(shard_dir / "doc_offsets.npy", offsets[:-1])
    with pytest.raises(DataError, match=r"doc_offsets\.npy does not match meta\.json"):
        TokenShard.open(shard_dir)
    (shard_dir / "meta.json").write_text("{truncated")
    with pytest.raises(DataError, match=r"meta\.json is corrupt"):
        TokenShard.open(shard_dir)


def test_flipped_bytes_fail_verification(shard_dir):
    TokenShard.open(shard_dir, verify=True)
    with (shard_dir / "tokens.bin").open("r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    TokenShard.open(shard_dir)  # sizes still match
    with pytest.raises(DataError, match=r"tokens\.bin is corrupt"):
        TokenShard.open(shard_dir, verify=True)


def test_shard_pickles_without_its_memory_map(shard_dir):
    import pickle

    shard = TokenShard.open(shard_dir)
    _ = shard.tokens
    clone = pickle.loads(pickle.dumps(shard))
    assert clone._tokens is None
    assert np.array_equal(clone.tokens, shard.tokens)
    assert len(pickle.dumps(shard)) < shard.n_tokens  # the tokens were not copied


def test_losing_a_race_keeps_the_winners_shard(tmp_path, tokenizer):
    target = tmp_path / "target"
    winner: list[SplitShards] = []

    def texts_while_another_writer_finishes():
        for i, text in enumerate(DOCS):
            if i == 10:
                winner.append(write(target, tokenizer))
            yield text

    result = write(target, tokenizer, texts=texts_while_another_writer_finishes())
    assert winner and result.train.path == winner[0].train.path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    TokenShard.open(result.train.path, verify=True)
