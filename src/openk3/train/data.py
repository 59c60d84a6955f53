"""Training data: a built-in corpus, document loaders, sequence packing and resumable batching.

* :func:`default_corpus` -- real text present on every machine without downloads: the source files of
  the Python standard library.
* :func:`load_documents` -- documents from ``.txt`` / ``.jsonl`` / ``.parquet`` files, directories of
  them, or an iterable of records such as an HF ``datasets.Dataset``.
* :func:`pack_documents` -- token documents packed into fixed-length rows with ``cu_seqlens`` segment
  boundaries, next-token labels that never cross a document boundary, and per-segment positions.
* :class:`Batcher` -- an endless, seeded, exactly resumable stream of packed batches.
* :func:`train_val_split` -- deterministic hold-out of every N-th document.

Packing conventions (shared by :func:`pack_documents` and :class:`Batcher`): each document's tokens
are followed by ``eos`` and the result is laid end to end; rows are cut every ``seq_len`` tokens, so
a long document continues in the next row, where it starts a new segment. A segment is a maximal run
of one document's tokens inside one row; attention must not cross segments (the model's varlen path
takes them from ``cu_seqlens``). ``labels[t] = input_ids[t + 1]`` when ``t + 1`` is in the same
segment, else ``-100`` (the ignore index), and padding has label ``-100``. ``position_ids`` count from
0 at every segment start, matching what attention restricted to the segment sees. Empty documents are
skipped.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_CORPUS_BYTES",
    "default_corpus",
    "load_documents",
    "PackedRow",
    "PackedBatch",
    "pack_documents",
    "collate_rows",
    "Batcher",
    "train_val_split",
]

IGNORE_INDEX = -100

# Size cap of the corpus used by the default training run (about 8 MB of the ~11 MB the standard
# library of CPython 3.11 holds); ``default_corpus()`` itself is uncapped unless given ``max_bytes``.
DEFAULT_CORPUS_BYTES = 8_000_000

_EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_STDLIB_SPEC = "stdlib"
_FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")


# ---------------------------------------------------------------------------- corpus


def default_corpus(max_bytes: int | None = None) -> list[str]:
    """The Python standard library's own ``*.py`` sources, one document per file.

    Files are found recursively under ``sysconfig.get_paths()["stdlib"]``, skipping the directories
    ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idlelib``, ``lib2to3`` and
    ``__pycache__``, and ordered by relative path, so the result is the same on every run with the
    same Python version. Files are read as UTF-8 (undecodable bytes become U+FFFD); empty files are
    left out. With ``max_bytes``, documents are taken in order until their UTF-8 size reaches
    ``max_bytes``; the last one is cut (at a character boundary) so the total never exceeds it. The
    default training run uses ``max_bytes=DEFAULT_CORPUS_BYTES`` (8 MB).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"Python standard library not found at {root}; pass your own documents instead"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]  # prune, don't descend
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                if path.is_file():
                    files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda x: x[0])

    docs: list[str] = []
    total = 0
    for _, path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        size = len(text.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            room = max_bytes - total
            text = text.encode("utf-8")[:room].decode("utf-8", errors="ignore")
            if text.strip():
                docs.append(text)
            break
        docs.append(text)
        total += size
    if not docs:
        raise ValueError(f"no Python sources found under {root}; pass your own documents instead")
    return docs


# ---------------------------------------------------------------------------- loaders


def _record_text(record: Any, text_field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, Mapping):
        if text_field not in record:
            fields = ", ".join(map(str, list(record)[:10]))
            raise ValueError(f"{where}: no field {text_field!r} (fields: {fields}); pass text_field=...")
        value = record[text_field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string")
        return value
    raise ValueError(f"{where}: expected a string or a dict record, got {type(record).__name__}")


def _iter_txt(path: Path) -> Iterator[str]:
    yield path.read_bytes().decode("utf-8", errors="replace")


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            yield _record_text(record, text_field, f"{path}:{lineno}")


def _require_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet files needs pyarrow: pip install pyarrow") from None
    return pq


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    pq = _require_pyarrow()
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        names = ", ".join(pf.schema_arrow.names[:10])
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); pass text_field=...")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def _iter_file(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _iter_txt(path)
    if suffix == ".jsonl":
        return _iter_jsonl(path, text_field)
    if suffix == ".parquet":
        _require_pyarrow()
        return _iter_parquet(path, text_field)
    raise ValueError(f"unsupported data file {path} (suffix {suffix!r}); use .txt, .jsonl or .parquet")


def load_documents(source: Any, text_field: str = "text") -> Iterator[str]:
    """Documents (strings) from ``source``, lazily, in a fixed order.

    ``source`` may be:

    * a ``.txt`` file (the whole file is one document);
    * a ``.jsonl`` file (one JSON object per line; the document is its ``text_field``);
    * a ``.parquet`` file (the ``text_field`` column; needs ``pyarrow``);
    * a directory: every ``.txt`` / ``.jsonl`` / ``.parquet`` file below it, by sorted relative path;
    * ``"stdlib"`` or ``"stdlib:<max_bytes>"`` (when no such path exists): :func:`default_corpus`;
    * any other iterable of strings or dict records, e.g. an HF ``datasets.Dataset``.

    Empty documents are skipped. Raises ``FileNotFoundError`` for a missing path and ``ValueError``
    when the source holds no non-empty document (checked before returning).
    """
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        path = Path(name)
        if not path.exists() and isinstance(source, str) and name.split(":", 1)[0] == _STDLIB_SPEC:
            limit = name.partition(":")[2]
            if limit and not limit.isdigit():
                raise ValueError(f"bad corpus spec {name!r}; use 'stdlib' or 'stdlib:<max_bytes>'")
            docs: Iterable[str] = default_corpus(int(limit) if limit else None)
            label = name
        elif not path.exists():
            raise FileNotFoundError(
                f"data path {name!r} does not exist; pass a .txt/.jsonl/.parquet file, a directory of them, "
                f"or 'stdlib'"
            )
        elif path.is_dir():
            files = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_SUFFIXES),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if any(p.suffix.lower() == ".parquet" for p in files):
                _require_pyarrow()
            docs = itertools.chain.from_iterable(_iter_file(p, text_field) for p in files)
            label = f"data directory {name!r}"
        else:
            docs = _iter_file(path, text_field)
            label = f"data file {name!r}"
    elif isinstance(source, Iterable) and not isinstance(source, bytes | Mapping):
        docs = (_record_text(r, text_field, f"record {i}") for i, r in enumerate(source))
        label = f"data set {type(source).__name__}"
    else:
        raise TypeError(
            f"cannot load documents from {type(source).__name__}; pass a path or an iterable of records"
        )

    it = (d for d in docs if d)
    first = next(it, None)
    if first is None:
        raise ValueError(f"{label} is empty: it holds no non-empty document")
    return itertools.chain([first], it)


def train_val_split(documents: Sequence[Any], every: int = 50) -> tuple[list[Any], list[Any]]:
    """Deterministic split: documents ``every-1, 2*every-1, ...`` (every N-th) go to validation.

    Returns ``(train, val)``; raises ``ValueError`` when either part would be empty.
    """
    if every < 2:
        raise ValueError(f"every must be >= 2, got {every}")
    docs = list(documents)
    val = docs[every - 1 :: every]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    if not val or not train:
        raise ValueError(f"{len(docs)} documents are too few to hold out every {every}-th; lower every")
    return train, val


# ---------------------------------------------------------------------------- packing


@dataclass
class PackedRow:
    """One packed row of ``seq_len`` tokens.

    ``cu_seqlens`` (int32) holds segment boundaries: ``0 = cu[0] < cu[1] < ... < cu[-1] = seq_len``.
    Trailing padding, if any, is a segment of its own. ``num_tokens`` counts non-padding tokens.
    """

    input_ids: torch.Tensor  # [seq_len] int64
    labels: torch.Tensor  # [seq_len] int64, IGNORE_INDEX where there is no in-segment next token
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32
    position_ids: torch.Tensor  # [seq_len] int64, position within the segment
    num_tokens: int

    @property
    def seq_len(self) -> int:
        return self.input_ids.numel()


@dataclass
class PackedBatch:
    """``batch_size`` rows, both as a [batch_size, seq_len] batch and as one packed row.

    The packed form (``packed_*`` properties, shape [1, batch_size * seq_len], with ``cu_seqlens``)
    is what the model's varlen path takes; row boundaries are segment boundaries in it, so the two
    forms describe exactly the same attention pattern and loss.
    """

    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32, over the flattened B * L tokens
    max_seqlen: int  # longest segment
    num_tokens: int  # non-padding tokens

    @property
    def packed_input_ids(self) -> torch.Tensor:
        return self.input_ids.reshape(1, -1)

    @property
    def packed_labels(self) -> torch.Tensor:
        return self.labels.reshape(1, -1)

    @property
    def packed_position_ids(self) -> torch.Tensor:
        return self.position_ids.reshape(1, -1)

    @property
    def num_targets(self) -> int:
        """Number of positions with a label (what the mean loss divides by)."""
        return int((self.labels != IGNORE_INDEX).sum())


def _make_row(pieces: list[list[int]], seq_len: int, pad_id: int) -> PackedRow:
    """Build a row from the segments ``pieces`` (total length <= seq_len), padding the rest."""
    lengths = [len(p) for p in pieces]
    num_tokens = sum(lengths)
    tokens = list(itertools.chain.from_iterable(pieces))
    if num_tokens < seq_len:
        tokens.extend([pad_id] * (seq_len - num_tokens))
        lengths.append(seq_len - num_tokens)
    cu_list = [0, *itertools.accumulate(lengths)]
    input_ids = torch.tensor(tokens, dtype=torch.int64)
    position_ids = torch.tensor(list(itertools.chain.from_iterable(map(range, lengths))), dtype=torch.int64)
    cu = torch.tensor(cu_list, dtype=torch.int64)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    labels[:-1] = input_ids[1:]
    labels[cu[1:] - 1] = IGNORE_INDEX  # last token of each segment has no in-segment successor
    if num_tokens < seq_len:
        labels[num_tokens:] = IGNORE_INDEX
    return PackedRow(input_ids, labels, cu.to(torch.int32), position_ids, num_tokens)


def pack_documents(
    token_docs: Iterable[Sequence[int]],
    seq_len: int,
    eos_id: int,
    pad_id: int | None = None,
    drop_last: bool = False,
) -> Iterator[PackedRow]:
    """Pack token documents into rows of ``seq_len`` tokens (see the module docstring for the rules).

    Each non-empty document is followed by ``eos_id``. The final row is padded with ``pad_id``
    (``eos_id`` if None) unless ``drop_last`` drops it.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    pad = eos_id if pad_id is None else pad_id
    pieces: list[list[int]] = []
    room = seq_len
    for doc in token_docs:
        if len(doc) == 0:
            continue
        toks = doc.tolist() if hasattr(doc, "tolist") else list(doc)
        toks.append(eos_id)
        offset = 0
        while offset < len(toks):
            take = min(room, len(toks) - offset)
            pieces.append(toks[offset : offset + take])
            offset += take
            room -= take
            if room == 0:
                yield _make_row(pieces, seq_len, pad)
                pieces, room = [], seq_len
    if pieces and not drop_last:
        yield _make_row(pieces, seq_len, pad)


def collate_rows(rows: Sequence[PackedRow]) -> PackedBatch:
    """Stack rows of equal length into a :class:`PackedBatch` with combined ``cu_seqlens``."""
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    seq_len = rows[0].seq_len
    if any(r.seq_len != seq_len for r in rows):
        raise ValueError("all rows of a batch must have the same seq_len")
    cu_parts = [r.cu_seqlens[:-1].to(torch.int64) + i * seq_len for i, r in enumerate(rows)]
    cu_parts.append(torch.tensor([len(rows) * seq_len], dtype=torch.int64))
    cu = torch.cat(cu_parts)
    return PackedBatch(
        input_ids=torch.stack([r.input_ids for r in rows]),
        labels=torch.stack([r.labels for r in rows]),
        position_ids=torch.stack([r.position_ids for r in rows]),
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        num_tokens=sum(r.num_tokens for r in rows),
    )


# ---------------------------------------------------------------------------- batching


class Batcher:
    """Endless stream of :class:`PackedBatch` from a list of documents, exactly resumable.

    ``documents`` are strings (tokenized on the fly with ``encode``, a :class:`~openk3.train.tokenizer.
    Tokenizer` or any ``str -> list[int]`` callable) or already token lists (``encode=None``). Every
    epoch visits all documents, in an order shuffled with a seed derived from ``(seed, epoch)``
    (``shuffle=False`` keeps the given order); epochs repeat forever. Each batch is ``batch_size``
    rows of ``seq_len`` tokens packed as in :func:`pack_documents` (the stream never ends, so there
    is no padding).

    :meth:`state_dict` records the exact position (epoch, document cursor, token offset inside the
    current document, rows and batches produced); a new ``Batcher`` over the same documents with the
    same seed continues from there after :meth:`load_state_dict`. ``seq_len`` and ``batch_size`` may
    differ on resume.
    """

    STATE_VERSION = 1

    def __init__(
        self,
        documents: Sequence[str] | Sequence[Sequence[int]],
        seq_len: int,
        batch_size: int,
        encode: Callable[[str], list[int]] | Any = None,
        eos_id: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        if len(documents) == 0:
            raise ValueError("Batcher got an empty document list")
        if eos_id is None:
            eos_id = getattr(encode, "eos_id", None)
        if eos_id is None:
            raise ValueError("Batcher needs eos_id (or a tokenizer with eos_id as encode)")
        self.documents = documents
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.eos_id = int(eos_id)
        self.seed = seed
        self.shuffle = shuffle
        if encode is not None and hasattr(encode, "encode"):
            tok = encode
            self._encode: Callable[[str], list[int]] | None = lambda text: tok.encode(
                text, allow_special=False
            )
        else:
            self._encode = encode
        self._set_position(epoch=0, cursor=0, offset=0)
        self.rows = 0
        self.batches = 0

    # -------------------------------------------------------------- position
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.documents)))
        if self.shuffle:
            random.Random(f"openk3-data:{self.seed}:{epoch}").shuffle(order)
        return order

    def _set_position(self, epoch: int, cursor: int, offset: int) -> None:
        self.epoch, self.cursor, self.offset = epoch, cursor, offset
        self._order_cache = self._order(epoch)
        self._tokens: list[int] | None = None

    def _doc_tokens(self) -> list[int]:
        """Tokens (+ eos) of the document at the cursor, skipping empty documents."""
        skipped = 0
        while self._tokens is None:
            doc = self.documents[self._order_cache[self.cursor]]
            if self._encode is not None:
                ids = list(self._encode(doc))
            else:
                if isinstance(doc, str):
                    raise TypeError("documents are strings: pass encode= (a tokenizer or callable)")
                ids = doc.tolist() if hasattr(doc, "tolist") else list(doc)
            if ids:
                ids.append(self.eos_id)
                self._tokens = ids
            else:
                skipped += 1
                if skipped > len(self.documents):
                    raise ValueError("every document is empty; nothing to train on")
                self._advance_doc()
        return self._tokens

    def _advance_doc(self) -> None:
        if self.cursor + 1 < len(self.documents):
            self.cursor += 1
            self.offset = 0
            self._tokens = None
        else:
            self._set_position(self.epoch + 1, 0, 0)

    def _next_row(self) -> PackedRow:
        pieces: list[list[int]] = []
        room = self.seq_len
        while room > 0:
            toks = self._doc_tokens()
            take = min(room, len(toks) - self.offset)
            pieces.append(toks[self.offset : self.offset + take])
            self.offset += take
            room -= take
            if self.offset == len(toks):
                self._advance_doc()
        self.rows += 1
        return _make_row(pieces, self.seq_len, self.eos_id)

    # -------------------------------------------------------------- iteration
    def __iter__(self) -> Batcher:
        return self

    def __next__(self) -> PackedBatch:
        batch = collate_rows([self._next_row() for _ in range(self.batch_size)])
        self.batches += 1
        return batch

    def next_batch(self) -> PackedBatch:
        return next(self)

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, int | bool]:
        """Plain-int position of the stream (JSON- and torch.save-friendly)."""
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "offset": self.offset,
            "rows": self.rows,
            "batches": self.batches,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_documents": len(self.documents),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict` taken on a Batcher over the same documents and seed."""
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {self.STATE_VERSION}")
        for key, mine in (
            ("num_documents", len(self.documents)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"data state has {key}={state[key]!r} but this Batcher has {mine!r}; "
                    f"resume with the same documents, seed and shuffle setting"
                )
        epoch, cursor, offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])
        if not 0 <= cursor < len(self.documents) or epoch < 0 or offset < 0:
            raise ValueError(
                f"data state position (epoch={epoch}, cursor={cursor}, offset={offset}) is invalid"
            )
        self._set_position(epoch, cursor, offset)
        if offset and offset >= len(self._doc_tokens()):
            raise ValueError(f"data state offset {offset} is past the end of document at cursor {cursor}")
        self.rows = int(state["rows"])
        self.batches = int(state["batches"])
