import hashlib

import pytest
import torch

from posttrainllm.model import corpus as corpus_mod
from posttrainllm.model.corpus import MIN_CORPUS_BYTES, STDLIB_FILES, batch_at, load_corpus


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_is_deterministic_and_hash_matches_bytes(corpus):
    again = load_corpus()
    assert again.sha256 == corpus.sha256
    assert torch.equal(again.data, corpus.data)
    raw = bytes(corpus.data.tolist())
    assert hashlib.sha256(raw).hexdigest() == corpus.sha256
    assert corpus.n_bytes == len(raw) == corpus.data.numel() >= MIN_CORPUS_BYTES
    assert corpus.data.dtype == torch.uint8 and corpus.data.dim() == 1


def test_corpus_provenance_lists_the_files_in_order(corpus):
    assert corpus.files, "no stdlib files found"
    assert list(STDLIB_FILES) == sorted(STDLIB_FILES)
    assert [f for f in STDLIB_FILES if f in corpus.files] == corpus.files
    assert "stdlib" in corpus.source


def test_corpus_is_real_text(corpus):
    raw = bytes(corpus.data.tolist())
    printable = sum(1 for b in raw if 32 <= b < 127 or b in (9, 10, 13))
    assert printable / len(raw) > 0.99
    for word in (b" the ", b" of ", b" and ", b"return", b"def "):
        assert raw.count(word) > 100, word


def test_max_bytes_keeps_a_prefix(corpus):
    small = load_corpus(max_bytes=10_000)
    assert small.n_bytes == 10_000
    assert torch.equal(small.data, corpus.data[:10_000])
    assert small.sha256 == hashlib.sha256(bytes(small.data.tolist())).hexdigest()
    assert small.sha256 != corpus.sha256


def test_missing_files_are_skipped_but_too_little_text_raises(monkeypatch):
    monkeypatch.setattr(corpus_mod, "STDLIB_FILES", ("no_such_module_xyz.py", "textwrap.py"))
    with pytest.raises(RuntimeError, match="at least"):
        load_corpus()


def test_batch_at_is_deterministic_and_y_is_x_shifted(corpus):
    kw = dict(batch_size=4, seq_len=32, seed=7)
    x, y = batch_at(corpus, 3, **kw)
    x2, y2 = batch_at(corpus, 3, **kw)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, batch_at(corpus, 4, **kw)[0])
    assert not torch.equal(x, batch_at(corpus, 3, batch_size=4, seq_len=32, seed=8)[0])
    raw = bytes(corpus.data.tolist())
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert bytes(row_x + row_y[-1:]) in raw  # each row is a real window of T+1 bytes
