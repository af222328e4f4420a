import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import synthetic_documents, write_jsonl

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.sources import source_fingerprint
from recipes_lib.data.text.raw import iter_texts, load_source
from recipes_lib.errors import ConfigError, DataError


def load(tmp_path, **source):
    return load_source("src", SourceConfig(**source), cache_dir=tmp_path / "hf")


def test_txt_file_is_one_document(tmp_path):
    text = "line one\nline two\n\nparagraph two\n"
    (tmp_path / "a.txt").write_text(text)
    raw = load(tmp_path, path=str(tmp_path / "a.txt"))
    assert list(iter_texts(raw)) == [text]
    assert raw.num_documents == 1


def test_txt_directory_gives_one_document_per_file_in_sorted_order(tmp_path):
    data = tmp_path / "docs"
    (data / "sub").mkdir(parents=True)
    (data / "b.txt").write_text("bee\nbee")
    (data / "a.txt").write_text("ay\nay")
    (data / "sub" / "c.text").write_text("sea")
    (data / ".hidden.txt").write_text("hidden")
    raw = load(tmp_path, path=str(data))
    assert list(iter_texts(raw)) == ["ay\nay", "bee\nbee", "sea"]


def test_jsonl_records_with_custom_field_and_cap(tmp_path):
    docs = synthetic_documents(10)
    path = write_jsonl(tmp_path / "d.jsonl", docs, field="content")
    raw = load(tmp_path, path=str(path), text_field="content", max_documents=4)
    assert list(iter_texts(raw)) == docs[:4]


def test_parquet_file(tmp_path):
    docs = synthetic_documents(5)
    pq.write_table(pa.table({"text": docs, "id": list(range(5))}), tmp_path / "d.parquet")
    raw = load(tmp_path, path=str(tmp_path / "d.parquet"))
    assert list(iter_texts(raw)) == docs
    assert raw.description.startswith("parquet")


def test_directory_uses_its_dominant_kind(tmp_path):
    data = tmp_path / "mixed"
    data.mkdir()
    write_jsonl(data / "1.jsonl", ["one"])
    write_jsonl(data / "2.jsonl", ["two", "three"])
    (data / "readme.txt").write_text("not data")
    raw = load(tmp_path, path=str(data))
    assert list(iter_texts(raw)) == ["one", "two", "three"]


def test_builtin_stdlib_source(tmp_path):
    raw = load(tmp_path, builtin="stdlib", max_documents=3)
    texts = list(iter_texts(raw))
    assert len(texts) == 3 and all(texts)


def test_missing_path_names_path_and_key(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"data\.sources\.src\.path.*nope\.jsonl"):
        load(tmp_path, path=str(missing))


def test_directory_without_supported_files(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.sources\.src\.path.*no files with a supported"):
        load(tmp_path, path=str(tmp_path / "data"))


def test_empty_dataset_names_the_source(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"data\.sources\.src.*empty"):
        load(tmp_path, path=str(tmp_path / "empty.jsonl"))


def test_record_without_text_field_names_index_and_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n{"text": "d"}\n')
    with pytest.raises(DataError, match=r"record 2 has no field 'text'"):
        load(tmp_path, path=str(path))


def test_column_missing_everywhere(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["a", "b"], field="body")
    with pytest.raises(DataError, match=r"record 0 has no field 'text'.*body"):
        load(tmp_path, path=str(path))


def test_non_text_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": 1}\n')
    with pytest.raises(DataError, match="not text"):
        load(tmp_path, path=str(path))


def test_streamed_record_without_field_names_index(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    raw = load(tmp_path, path=str(path), streaming=True)
    assert raw.num_documents is None
    with pytest.raises(DataError, match=r"record 1 has no field 'text'"):
        list(iter_texts(raw))


def test_source_must_name_exactly_one_origin(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.sources\.src must set exactly one"):
        load(tmp_path, path="a", builtin="stdlib")
    with pytest.raises(ConfigError, match="got none"):
        load(tmp_path)


def test_fingerprint_changes_when_a_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["a", "b"])
    source = SourceConfig(path=str(path))
    before = source_fingerprint("src", source)
    assert source_fingerprint("src", SourceConfig(path=str(path), weight=3.0)) == before
    write_jsonl(path, ["a", "b", "c"])
    assert source_fingerprint("src", source) != before
