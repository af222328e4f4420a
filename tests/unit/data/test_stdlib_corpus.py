import pytest

from recipes_lib.data.corpus import (
    builtin_fingerprint,
    iter_stdlib_documents,
    stdlib_files,
    stdlib_root,
)
from recipes_lib.errors import DataError


def test_stdlib_documents_are_sorted_source_files_without_site_packages():
    docs = list(iter_stdlib_documents(max_bytes=500_000))
    paths = [d.path for d in docs]
    assert paths == sorted(paths)
    assert all(p.endswith(".py") for p in paths)
    assert not any("site-packages" in p for p in paths)
    first = docs[0]
    assert first.text == (stdlib_root() / first.path).read_text(encoding="utf-8")


def test_stdlib_byte_cap_and_determinism():
    docs = list(iter_stdlib_documents(max_bytes=300_000))
    total = sum(len(d.text.encode()) for d in docs)
    assert 0 < total <= 300_000
    assert [d.path for d in iter_stdlib_documents(max_bytes=300_000)] == [d.path for d in docs]


def test_stdlib_test_suites_are_optional():
    without = {p.relative_to(stdlib_root()).parts[0] for p in stdlib_files()}
    assert "test" not in without
    with_tests = stdlib_files(include_tests=True)
    assert len(with_tests) >= len(stdlib_files())


def test_unknown_builtin_corpus_names_the_key():
    with pytest.raises(DataError, match=r"data\.sources\.x\.builtin='wikipedia'"):
        builtin_fingerprint("wikipedia", "data.sources.x.builtin")
