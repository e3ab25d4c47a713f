"""A real text corpus that exists offline on every machine: Python's own standard library.

Every machine that runs this project has a Python install, and every Python install
ships the pure-Python sources of its standard library: real English docstrings and
comments mixed with code. Reading a fixed list of those files gives a training corpus
with no download, no network and no random bytes, on a laptop and on a GPU node alike.

The text is byte-level (vocab 256): no tokenizer to ship or version. The bytes differ
between Python versions, so `Corpus` carries its provenance (which files, how many
bytes, their sha256) and a receipt can say exactly what text was trained on.

Shape legend
    N   corpus length in bytes    B   batch size    T   sequence length
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Well-known pure-Python modules, sorted. Chosen because they are long-lived single
# files in every CPython from 3.10 on (e.g. `string` and `pathlib` are avoided: they
# turned into packages in 3.14 and 3.13). A file a given Python lacks is skipped.
STDLIB_FILES: tuple[str, ...] = (
    "argparse.py",
    "calendar.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "email/message.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "http/client.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "tempfile.py",
    "textwrap.py",
)

# Below this the files found are too few to be a fair training set: a few hundred kB
# is what a small byte-level model cannot memorise within a benchmark run.
# (max_bytes may still cut the corpus shorter on purpose, e.g. in tests.)
MIN_CORPUS_BYTES = 200_000


@dataclass
class Corpus:
    data: torch.Tensor  # (N,) uint8, the bytes trained on
    source: str  # where the bytes came from, in words
    files: list[str]  # paths relative to the stdlib root, in concatenation order
    n_bytes: int  # len(data)
    sha256: str  # hex digest of exactly the bytes in `data`


def load_corpus(max_bytes: int | None = None) -> Corpus:
    """Concatenate STDLIB_FILES (UTF-8 bytes, in order) and keep the first max_bytes."""
    if max_bytes is not None and max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes}: need at least 2 bytes for one (x, y) pair")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    files: list[str] = []
    for rel in STDLIB_FILES:
        path = stdlib / rel
        if not path.is_file():
            continue  # this Python lacks it (or ships only bytecode): skip, the size check below guards
        chunks.append(path.read_bytes())
        files.append(rel)
    raw = b"".join(chunks)
    if len(raw) < MIN_CORPUS_BYTES:
        raise RuntimeError(
            f"stdlib corpus under {stdlib} gave only {len(raw)} bytes from {len(files)} of "
            f"{len(STDLIB_FILES)} files; need at least {MIN_CORPUS_BYTES}. Is this Python "
            "install missing its .py sources?"
        )
    if max_bytes is not None:
        raw = raw[:max_bytes]  # a prefix: the sha256 below covers exactly what is kept
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (N,)
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(
        data=data,
        source=f"CPython {version} stdlib sources at {stdlib} ({len(files)} files)",
        files=files,
        n_bytes=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def split_tail(corpus: Corpus, heldout_frac: float) -> tuple[Corpus, Corpus]:
    """(train, held-out): the held-out part is the corpus's last `heldout_frac` of bytes, never trained on."""
    cut = int(corpus.n_bytes * (1 - heldout_frac))
    train = dataclasses.replace(corpus, data=corpus.data[:cut], n_bytes=cut)
    return train, dataclasses.replace(corpus, data=corpus.data[cut:], n_bytes=corpus.n_bytes - cut)


def prompts(heldout: Corpus, count: int, length: int, part: str) -> torch.Tensor:
    """`count` windows of `length` bytes, evenly spaced over the first ("distill") or second ("eval") half
    of the held-out bytes: (count, length) int64. A ValueError (one line) when that half is too short."""
    half = heldout.n_bytes // 2
    lo, hi = (0, half) if part == "distill" else (half, heldout.n_bytes)
    if hi - lo < length + count:
        raise ValueError(f"the held-out corpus half ({hi - lo} bytes) is too short for {count} prompts of {length}")
    starts = torch.linspace(lo, hi - length - 1, count).long()  # (count,)
    return heldout.data[starts[:, None] + torch.arange(length)].long()  # (count, length)


def batch_at(
    corpus: Corpus, step: int, *, batch_size: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch for `step`: B random windows of T+1 bytes, split into (x, y).

    A pure function of (seed, step): every implementation, run, and machine sees the same
    bytes at the same step, with no data-loader state to keep in sync.
    Returns x, y: (B, T) int64 on CPU, where y[:, t] == x[:, t + 1] (the next byte).
    """
    n = corpus.n_bytes
    if seq_len + 1 > n:
        raise ValueError(f"seq_len={seq_len} does not fit a corpus of {n} bytes")
    gen = torch.Generator().manual_seed(_mix(seed, step))
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=gen)  # (B,)
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    windows = corpus.data[starts[:, None] + offsets].long()  # (B, T+1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)


def _mix(seed: int, step: int) -> int:
    """One 63-bit generator seed per (seed, step); hashing keeps nearby pairs unrelated."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
