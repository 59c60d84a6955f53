"""Training data pipeline: corpus, tokenizers, loaders, packing and resumable batching."""

from __future__ import annotations

import base64
import json
import random
import sys

import pytest
import torch

from openk3.train.data import (
    IGNORE_INDEX,
    Batcher,
    PackedRow,
    collate_rows,
    default_corpus,
    load_documents,
    pack_documents,
    train_val_split,
)
from openk3.train.tokenizer import Tokenizer

UNSEEN_TEXT = (
    "Grüße aus Köln! 東京の天気は晴れ。 emoji: 🚀✨\n"
    "\tdef frobnicate(x):\n        return x ** 3 - 7  # odd   spacing\r\n"
    "Special-looking text <|eos|> stays text when allow_special=False.\n"
)


@pytest.fixture(scope="module")
def small_corpus() -> list[str]:
    return default_corpus(max_bytes=300_000)


@pytest.fixture(scope="module")
def bpe(small_corpus, tmp_path_factory) -> tuple[Tokenizer, object]:
    cache = tmp_path_factory.mktemp("bpe_cache")
    return Tokenizer.train_bpe(small_corpus, vocab_size=1024, cache_dir=cache), cache


# ---------------------------------------------------------------------------- corpus


def test_default_corpus_deterministic_and_capped():
    a = default_corpus(max_bytes=500_000)
    b = default_corpus(max_bytes=500_000)
    assert a == b
    assert len(a) > 5 and all(isinstance(d, str) and d for d in a)
    size = sum(len(d.encode("utf-8")) for d in a)
    assert 400_000 < size <= 500_000
    full = default_corpus()
    assert full[: len(a) - 1] == a[:-1]  # the cap only truncates the tail
    assert sum(len(d.encode("utf-8")) for d in full) > size


# ---------------------------------------------------------------------------- BPE


def _assert_batch_encode_matches(tok):
    """encode_batch (what the server uses) gives encode's ids, with and without special-token text."""
    texts = [UNSEEN_TEXT, "x<|eos|>y", "", "the thing  in\n\tthe <|eos|>", UNSEEN_TEXT[::-1]]
    for special in (True, False):
        assert tok.encode_batch(texts, special) == [tok.encode(t, special) for t in texts]
    assert tok.encode_batch(["<|eos|>"], True) != tok.encode_batch(["<|eos|>"], False)


def test_bpe_roundtrip_cache_and_vocab(small_corpus, bpe):
    tok, cache = bpe
    assert tok.vocab_size <= 1024
    assert tok.vocab_size > 900  # the corpus is large enough to fill the vocabulary
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = tok.encode(UNSEEN_TEXT, allow_special=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.eos_id not in ids
    assert tok.decode(ids) == UNSEEN_TEXT
    assert len(ids) < len(UNSEEN_TEXT.encode("utf-8"))  # merges compress
    assert tok.encode("<|eos|>", allow_special=True) == [tok.eos_id]
    _assert_batch_encode_matches(tok)

    entries = list(cache.iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    mtime = (entries[0] / "tokenizer.json").stat().st_mtime_ns
    again = Tokenizer.train_bpe(small_corpus, vocab_size=1024, cache_dir=cache)
    assert (entries[0] / "tokenizer.json").stat().st_mtime_ns == mtime  # loaded, not retrained
    assert again.encode(UNSEEN_TEXT) == tok.encode(UNSEEN_TEXT)
    assert again.eos_id == tok.eos_id and again.vocab_size == tok.vocab_size

    # deterministic: training again without the cache gives the same tokenizer
    fresh = Tokenizer.train_bpe(small_corpus[:20], vocab_size=600)
    fresh2 = Tokenizer.train_bpe(small_corpus[:20], vocab_size=600)
    assert fresh._hf.to_str() == fresh2._hf.to_str()


def test_tokenizer_save_load_and_chat(bpe, tmp_path):
    tok, _ = bpe
    tok.save(tmp_path / "tok")
    loaded = Tokenizer.from_file(tmp_path / "tok")
    assert loaded.encode(UNSEEN_TEXT) == tok.encode(UNSEEN_TEXT)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = loaded.apply_chat_template(messages)
    assert (
        prompt
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = loaded.encode(prompt)
    assert ids.count(loaded.token_to_id("<|im_start|>")) == 3
    with pytest.raises(ValueError, match="role"):
        loaded.apply_chat_template([{"content": "no role"}])

    # a chat_template in tokenizer_config.json takes over when jinja2 is there
    pytest.importorskip("jinja2")
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    cfg_path.write_text(json.dumps(cfg))
    templated = Tokenizer.from_file(tmp_path / "tok" / "tokenizer.json")
    assert templated.apply_chat_template(messages) == "[system]Be brief.[user]Hi<|eos|>"


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path)  # a directory without a tokenizer
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{ not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(bad_json)


def _write_ranks(path, merges):
    ranks = [bytes([b]) for b in range(256)] + merges
    path.write_bytes(
        b"".join(base64.b64encode(t) + b" " + str(i).encode() + b"\n" for i, t in enumerate(ranks))
    )
    return len(ranks)


def _assert_token_bytes_join(tok):
    """Each token's bytes (token_bytes) joined give the text's UTF-8 bytes, also where a character is split over
    tokens; a special token's bytes are its text."""
    text = "h\u00e9llo \U0001f600 \u65e5\u672c w\u00f6rld \U0001f680! " + UNSEEN_TEXT
    ids = tok.encode(text, allow_special=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    for i in tok.special_tokens.values():
        assert tok.token_bytes(i) == tok.decode([i]).encode("utf-8")


def test_token_bytes_of_the_trained_bpe(bpe):
    tok, _ = bpe
    _assert_token_bytes_join(tok)
    assert any(tok.decode([i]) == "\ufffd" for i in range(tok.vocab_size))  # byte tokens inside characters


def test_tiktoken_ranks_file(tmp_path):
    pytest.importorskip("tiktoken")
    merges = [b"th", b"he", b"the", b"in", b" the", b"ing", b"  "]
    n = _write_ranks(tmp_path / "tiktoken.model", merges)
    tok = Tokenizer.from_file(tmp_path / "tiktoken.model", special_tokens={"<|bos|>": n, "<|eos|>": n + 1})
    assert tok.backend == "tiktoken"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, None)
    assert tok.vocab_size == n + 2
    ids = tok.encode("the thing in the")
    assert 256 + merges.index(b"the") in ids and 256 + merges.index(b" the") in ids
    assert tok.decode(ids) == "the thing in the"
    assert tok.decode(tok.encode(UNSEEN_TEXT, allow_special=False)) == UNSEEN_TEXT
    assert tok.encode("x<|eos|>") == [ord("x"), n + 1]
    _assert_batch_encode_matches(tok)
    _assert_token_bytes_join(tok)

    # bos/eos/chat template from a tokenizer_config.json next to the file, as Kimi ships it
    config = {
        "added_tokens_decoder": {
            str(n): {"content": "[BOS]", "special": True},
            str(n + 1): {"content": "[EOS]"},
        },
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]"},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    kimi_like = Tokenizer.from_file(tmp_path)
    assert (kimi_like.bos_id, kimi_like.eos_id) == (n, n + 1)
    assert kimi_like.decode([n, 256 + merges.index(b"the"), n + 1]) == "[BOS]the[EOS]"

    # round trip through save()
    kimi_like.save(tmp_path / "copy")
    copy = Tokenizer.from_file(tmp_path / "copy")
    assert copy.encode(UNSEEN_TEXT) == kimi_like.encode(UNSEEN_TEXT)
    assert copy.eos_id == n + 1

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tiktoken.model").write_bytes(b"!!notbase64 1\n")
    with pytest.raises(ValueError, match="tiktoken ranks line"):
        Tokenizer.from_file(tmp_path / "broken" / "tiktoken.model")


def test_tiktoken_missing_message(tmp_path, monkeypatch):
    _write_ranks(tmp_path / "tiktoken.model", [])
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    with pytest.raises(ImportError, match="pip install tiktoken"):
        Tokenizer.from_file(tmp_path / "tiktoken.model")


# ---------------------------------------------------------------------------- loaders


def test_loaders(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nline two")
    assert list(load_documents(tmp_path / "a.txt")) == ["first document\nline two"]

    records = [{"body": "doc one", "id": 1}, {"body": "", "id": 2}, {"body": "doc three", "id": 3}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert list(load_documents(tmp_path / "b.jsonl", text_field="body")) == ["doc one", "doc three"]
    with pytest.raises(ValueError, match="text_field"):
        list(load_documents(tmp_path / "b.jsonl"))
    # a line that is JSON but not a record: a ValueError (the CLI's one-line error), not a TypeError traceback
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list.jsonl:1: expected a string or a dict record, got list"):
        list(load_documents(tmp_path / "list.jsonl"))

    sub = tmp_path / "dir"
    (sub / "nested").mkdir(parents=True)
    (sub / "z.txt").write_text("zzz")
    (sub / "nested" / "m.txt").write_text("mmm")
    (sub / "a.txt").write_text("aaa")
    (sub / "ignored.bin").write_bytes(b"\0")
    assert list(load_documents(sub)) == ["aaa", "mmm", "zzz"]

    # duck-typed data sets (e.g. datasets.Dataset): iterables of dicts
    assert list(load_documents([{"text": "x"}, {"text": "y"}])) == ["x", "y"]
    assert list(load_documents("stdlib:20000")) == default_corpus(20_000)

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_documents(tmp_path / "empty.jsonl")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        load_documents(tmp_path / "emptydir")
    with pytest.raises(ValueError, match="is empty"):
        load_documents([])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_documents(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(load_documents(tmp_path / "bad.jsonl"))


def test_parquet_loader(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "x.parquet").write_bytes(b"")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            load_documents(tmp_path / "x.parquet")
        return
    pq.write_table(pa.table({"text": ["p1", None, "p2"]}), tmp_path / "x.parquet")
    assert list(load_documents(tmp_path / "x.parquet")) == ["p1", "p2"]


def test_train_val_split():
    docs = [f"d{i}" for i in range(10)]
    train, val = train_val_split(docs, every=4)
    assert val == ["d3", "d7"]
    assert train == [d for d in docs if d not in val]
    assert train_val_split(docs, every=4) == (train, val)
    with pytest.raises(ValueError):
        train_val_split(docs[:2], every=4)


# ---------------------------------------------------------------------------- packing


def _random_docs(n: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(0, max_len))] for _ in range(n)]


def _check_row(row: PackedRow, seq_len: int, eos: int) -> list[list[int]]:
    """Validate one row; return its non-padding segments as token lists."""
    assert row.input_ids.shape == row.labels.shape == row.position_ids.shape == (seq_len,)
    assert row.input_ids.dtype == row.labels.dtype == torch.int64
    cu = row.cu_seqlens.tolist()
    assert row.cu_seqlens.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == seq_len
    assert all(a < b for a, b in zip(cu, cu[1:]))
    ids, labels, pos = row.input_ids.tolist(), row.labels.tolist(), row.position_ids.tolist()
    segments = []
    for a, b in zip(cu, cu[1:]):
        assert pos[a:b] == list(range(b - a))
        if a >= row.num_tokens:  # padding segment
            assert labels[a:b] == [IGNORE_INDEX] * (b - a)
            continue
        assert b <= row.num_tokens
        seg = ids[a:b]
        assert labels[a : b - 1] == seg[1:]  # next token, same segment
        assert labels[b - 1] == IGNORE_INDEX  # never across a boundary
        assert eos not in seg[:-1]  # one document per segment
        segments.append(seg)
    return segments


def test_pack_documents_invariants():
    eos, pad, seq_len = 1, 2, 16
    docs = _random_docs(60)
    rows = list(pack_documents(docs, seq_len, eos, pad))
    stream = [t for d in docs if d for t in d + [eos]]
    assert len(rows) == -(-len(stream) // seq_len)
    flat, segments = [], []
    for row in rows:
        segments.extend(_check_row(row, seq_len, eos))
        flat.extend(row.input_ids[: row.num_tokens].tolist())
    assert flat == stream
    assert rows[-1].input_ids[rows[-1].num_tokens :].eq(pad).all()
    assert all(r.num_tokens == seq_len for r in rows[:-1])

    # reconstruct the documents: consecutive segments join until one ends with eos
    rebuilt, cur = [], []
    for seg in segments:
        cur.extend(seg)
        if seg[-1] == eos:
            rebuilt.append(cur[:-1])
            cur = []
    assert cur == [] and rebuilt == [d for d in docs if d]

    assert len(list(pack_documents(docs, seq_len, eos, drop_last=True))) == len(stream) // seq_len


def test_collate_rows_cu_seqlens():
    eos, seq_len = 1, 8
    rows = list(pack_documents(_random_docs(20, seed=3, max_len=12), seq_len, eos))[:3]
    batch = collate_rows(rows)
    assert batch.input_ids.shape == (3, seq_len)
    assert batch.packed_input_ids.shape == (1, 3 * seq_len)
    cu = batch.cu_seqlens.tolist()
    expected = [0]
    for i, r in enumerate(rows):
        expected.extend(c + i * seq_len for c in r.cu_seqlens.tolist()[1:])
    assert cu == expected
    assert batch.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    assert batch.num_targets == int((batch.labels != IGNORE_INDEX).sum())


def test_batcher_stream_and_epochs():
    eos, seq_len, bs = 1, 12, 3
    docs = _random_docs(25, seed=1, max_len=20)
    b = Batcher(docs, seq_len, bs, eos_id=eos, seed=5)
    flat = []
    for _ in range(40):
        batch = next(b)
        assert batch.input_ids.shape == (bs, seq_len)
        assert batch.num_tokens == bs * seq_len  # endless stream: no padding
        flat.extend(batch.input_ids.flatten().tolist())
    # the stream is epoch 0's shuffled order, then epoch 1's different order, ...
    nonempty = [d for d in docs if d]
    epoch_len = sum(len(d) + 1 for d in nonempty)
    assert b.epoch >= 2
    epoch0 = flat[:epoch_len]
    order0 = Batcher(docs, seq_len, bs, eos_id=eos, seed=5)._order(0)
    assert epoch0 == [t for i in order0 if docs[i] for t in docs[i] + [eos]]
    assert Batcher(docs, seq_len, bs, eos_id=eos, seed=5)._order(1) != order0
    assert Batcher(docs, seq_len, bs, eos_id=eos, seed=6)._order(0) != order0


def test_batcher_resume_exact(small_corpus, bpe):
    tok, _ = bpe
    docs = small_corpus[:30]
    seq_len, bs, k = 64, 4, 7

    reference = Batcher(docs, seq_len, bs, encode=tok, seed=123)
    expected = [next(reference) for _ in range(k + 5)]

    first = Batcher(docs, seq_len, bs, encode=tok, seed=123)
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    assert state["batches"] == k and state["rows"] == k * bs

    resumed = Batcher(docs, seq_len, bs, encode=tok, seed=123)
    resumed.load_state_dict(state)
    for want in expected[k:]:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.labels, want.labels)
        assert torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert torch.equal(got.position_ids, want.position_ids)
    assert resumed.state_dict() == reference.state_dict()

    with pytest.raises(ValueError, match="seed"):
        Batcher(docs, seq_len, bs, encode=tok, seed=124).load_state_dict(state)
    with pytest.raises(ValueError, match="num_documents"):
        Batcher(docs[:-1], seq_len, bs, encode=tok, seed=123).load_state_dict(state)


def test_batcher_rows_match_pack_documents(bpe, small_corpus):
    tok, _ = bpe
    docs = small_corpus[:10]
    seq_len, bs = 32, 2
    b = Batcher(docs, seq_len, bs, encode=tok, shuffle=False)
    token_docs = [tok.encode(d, allow_special=False) for d in docs]
    rows = list(pack_documents(token_docs, seq_len, tok.eos_id, drop_last=True))[:20]
    batches = [next(b) for _ in range(10)]
    for i, batch in enumerate(batches):
        ref = collate_rows(rows[2 * i : 2 * i + 2])
        assert torch.equal(batch.input_ids, ref.input_ids)
        assert torch.equal(batch.labels, ref.labels)
        assert torch.equal(batch.cu_seqlens, ref.cu_seqlens)
