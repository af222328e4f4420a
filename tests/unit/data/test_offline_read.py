"""Reading a user's local files sends nothing to the Hub: ``datasets`` counts a download
of its packaged loaders with an HTTP request on every ``load_dataset``, which
:func:`recipes_lib.data.sources.offline_read` turns off for local files."""

from __future__ import annotations

import json

import datasets
import datasets.load
import pytest

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.records import load_records
from recipes_lib.data.text.raw import iter_texts, load_source


@pytest.fixture
def pings(monkeypatch):
    """The requests ``datasets`` sends to count a download (none leave this process)."""
    sent: list[str] = []

    class Session:
        def head(self, url, **kwargs):
            sent.append(url)

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    monkeypatch.setattr(datasets.load, "get_session", Session)
    return sent


def _chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_datasets_itself_counts_a_download_for_a_local_file(pings, tmp_path):
    datasets.load_dataset("json", data_files=str(_chat_file(tmp_path)), split="train")
    assert pings  # what the tests below rule out


def test_local_records_and_documents_are_read_without_a_request(pings, tmp_path):
    records = load_records("chat", SourceConfig(path=str(_chat_file(tmp_path))), {})
    assert len(records) == 3
    text = tmp_path / "docs.txt"
    text.write_text("one document\n")
    assert list(iter_texts(load_source("docs", SourceConfig(path=str(text))))) == ["one document\n"]
    assert pings == []
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True  # the user's setting is back
