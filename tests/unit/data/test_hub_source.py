"""A `hub` source goes through datasets.load_dataset by name, exactly as for a hub dataset.

No network here: the name is a dataset repository laid out on disk the way the hub lays it
out (data/<split>-*.parquet), which load_dataset resolves by the same code path.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.text.raw import iter_texts, load_source
from recipes_lib.errors import DataError


@pytest.fixture
def hub_style_repo(tmp_path):
    repo = tmp_path / "org__corpus"
    (repo / "data").mkdir(parents=True)
    texts = [f"document number {i}\n" * 3 for i in range(30)]
    pq.write_table(pa.table({"text": texts[:20]}), repo / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": texts[20:]}), repo / "data" / "test-00000-of-00001.parquet")
    return repo, texts


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_source_loads_the_named_split(hub_style_repo, streaming):
    repo, texts = hub_style_repo
    source = SourceConfig(hub=str(repo), split="test", streaming=streaming)
    raw = load_source("web", source)
    assert list(iter_texts(raw)) == texts[20:]


def test_hub_source_caps_documents(hub_style_repo):
    repo, texts = hub_style_repo
    raw = load_source("web", SourceConfig(hub=str(repo), max_documents=5, streaming=True))
    assert list(iter_texts(raw)) == texts[:5]


def test_unknown_hub_split_is_named(hub_style_repo):
    repo, _ = hub_style_repo
    with pytest.raises(DataError, match=r"data.sources.web.*split=validation"):
        list(iter_texts(load_source("web", SourceConfig(hub=str(repo), split="validation"))))
