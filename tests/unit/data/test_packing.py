import numpy as np
import pytest
import torch
from data_helpers import synthetic_documents

from recipes_lib.data.text.packing import PackedSequenceDataset
from recipes_lib.data.text.shard_writer import write_split_shards
from recipes_lib.data.text.shards import TokenShard
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import DataError


@pytest.fixture(scope="module")
def shard(tmp_path_factory, small_tokenizer_path) -> TokenShard:
    docs = synthetic_documents(40, min_words=3, max_words=60)
    pair = write_split_shards(
        docs,
        tmp_path_factory.mktemp("packing") / "s",
        load_tokenizer(small_tokenizer_path),
        0,
        num_documents=len(docs),
        val_fraction=0.0,
        seed=0,
        meta={"source": "tiny"},
        progress=False,
    )
    return pair.train


def test_windows_are_contiguous_with_next_token_labels(shard):
    seq_len = 16
    dataset = PackedSequenceDataset(shard, seq_len)
    assert len(dataset) == (shard.n_tokens - 1) // seq_len
    tokens = torch.from_numpy(shard.tokens.astype(np.int64))
    for i in (0, 1, len(dataset) // 2, len(dataset) - 1):
        item = dataset[i]
        assert item["input_ids"].dtype == torch.long and item["labels"].dtype == torch.long
        assert item["doc_ids"].dtype == torch.int32
        assert item["input_ids"].shape == item["labels"].shape == item["doc_ids"].shape == (16,)
        assert torch.equal(item["input_ids"], tokens[i * seq_len : (i + 1) * seq_len])
        assert torch.equal(item["labels"], tokens[i * seq_len + 1 : (i + 1) * seq_len + 1])
    last = dataset[len(dataset) - 1]
    assert int(last["labels"][-1]) == int(tokens[len(dataset) * seq_len])
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_doc_ids_follow_doc_offsets_and_eos_ends_its_document(shard):
    seq_len = 32
    dataset = PackedSequenceDataset(shard, seq_len)
    offsets = shard.doc_offsets
    eos_seen = 0
    for i in range(len(dataset)):
        item = dataset[i]
        for t in range(seq_len):
            position = i * seq_len + t
            doc = int(item["doc_ids"][t])
            assert offsets[doc] <= position < offsets[doc + 1]
            if int(item["input_ids"][t]) == shard.eos_id:
                assert position == offsets[doc + 1] - 1  # the EOS is its document's last token
                eos_seen += 1
    assert eos_seen > 10  # windows really cross document boundaries


def test_shard_too_small_names_source_and_sizes(shard):
    with pytest.raises(DataError, match=rf"source tiny.*{shard.n_tokens} tokens.*seq_len=\d+"):
        PackedSequenceDataset(shard, shard.n_tokens)
    assert len(PackedSequenceDataset(shard, shard.n_tokens - 1)) == 1
