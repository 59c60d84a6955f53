"""Tokenizers for training and inference.

One small :class:`Tokenizer` class fronts two backends:

* HF ``tokenizers`` (a ``tokenizer.json``), including byte-level BPE models trained here with
  :meth:`Tokenizer.train_bpe`;
* tiktoken-style BPE ranks files such as Kimi's ``tiktoken.model`` (one ``base64(token_bytes) rank``
  pair per line), read with the optional ``tiktoken`` package.

Special token ids (bos / eos / pad) and an optional Jinja chat template are read from a
``tokenizer_config.json`` next to the tokenizer file when there is one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "IM_START_TOKEN",
    "IM_END_TOKEN",
    "TOOL_MARKERS",
    "DEFAULT_SPLIT_PATTERN",
    "Tokenizer",
]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Kimi's tool-call markers (special tokens of Kimi's tokenizer): the section of an assistant reply holding its calls,
# each call ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>``
TOOL_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
TOOL_MARKERS = (TOOL_SECTION_BEGIN, TOOL_SECTION_END, TOOL_CALL_BEGIN, TOOL_ARGUMENT_BEGIN, TOOL_CALL_END)

# Special tokens of tokenizers trained by ``train_bpe``; they get ids 0..4 in this order.
_TRAINED_SPECIALS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# Names used to find bos/eos/pad when no tokenizer_config.json says which tokens they are.
_BOS_NAMES = (BOS_TOKEN, "[BOS]", "<s>", "<|begin_of_text|>", "<|startoftext|>")
_EOS_NAMES = (EOS_TOKEN, "[EOS]", "</s>", "<|end_of_text|>", "<|endoftext|>")
_PAD_NAMES = (PAD_TOKEN, "[PAD]", "<pad>", "<|padding|>")

# Generic pre-split regex for tiktoken-style ranks files, in the spirit of cl100k: English
# contractions, letter runs with at most one leading non-letter/non-digit, digit groups of up to
# three, punctuation runs (with one optional leading space and trailing newlines), newline runs, and
# whitespace (a whitespace run leaves its last space to the following word). Kimi's exact pattern is
# part of its tokenizer code/config; pass it via ``Tokenizer.from_file(..., pattern=...)``.
DEFAULT_SPLIT_PATTERN = "|".join(
    [
        r"(?i:'(?:s|t|re|ve|m|ll|d))",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (the GPT-2 convention that HF's ByteLevel pre-tokenizer
    uses): the printable Latin-1 bytes stand for themselves, the other 68 bytes for code points 256, 257, ... in
    byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    kept_set = set(kept)
    out = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in kept_set:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()
_TOKENIZER_JSON = "tokenizer.json"
_TIKTOKEN_FILE = "tiktoken.model"
_CONFIG_JSON = "tokenizer_config.json"
_BPE_CACHE_VERSION = "openk3-bpe-v1"


def _token_content(value: Any) -> str | None:
    """A special token named in tokenizer_config.json: either a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / _CONFIG_JSON
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}; fix or remove the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object; fix or remove the file")
    return config


def _config_added_tokens(config: Mapping[str, Any], path: Path) -> dict[str, int]:
    """``added_tokens_decoder`` ({"id": {"content": ...}}) as a {content: id} mapping."""
    out: dict[str, int] = {}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise ValueError(f"{path / _CONFIG_JSON}: added_tokens_decoder must be an object of id -> token")
    for key, value in decoder.items():
        content = _token_content(value)
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(
                f"{path / _CONFIG_JSON}: added_tokens_decoder key {key!r} is not a token id"
            ) from None
        if content is None:
            raise ValueError(f"{path / _CONFIG_JSON}: added_tokens_decoder[{key!r}] has no 'content'")
        out[content] = token_id
    return out


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read tokenizer file {path}: {e}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path}:{lineno}: not a tiktoken ranks line ('base64(token_bytes) rank'); "
                f"pass a tokenizer.json or a tiktoken.model file"
            ) from None
        if token in ranks:
            raise ValueError(f"{path}:{lineno}: token {token!r} listed twice; the ranks file is corrupt")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path} holds no tokens; pass a tokenizer.json or a tiktoken.model file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} of the 256 single bytes have no rank (first: {missing[0]}); "
            f"a byte-level ranks file must contain every byte"
        )
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: two tokens share a rank; the ranks file is corrupt")
    return ranks


def _corpus_key(texts: Sequence[str], vocab_size: int, min_frequency: int) -> str:
    h = hashlib.sha256()
    h.update(f"{_BPE_CACHE_VERSION}|tokenizers={tokenizers.__version__}|".encode())
    h.update(f"vocab={vocab_size}|min_freq={min_frequency}|docs={len(texts)}|".encode())
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class Tokenizer:
    """Encode/decode text with either an HF ``tokenizers`` model or a tiktoken encoding.

    Build one with :meth:`train_bpe` or :meth:`from_file`; the constructor is internal.
    """

    def __init__(
        self,
        *,
        hf: tokenizers.Tokenizer | None = None,
        tiktoken_encoding: Any = None,
        tiktoken_ranks: dict[bytes, int] | None = None,
        special_tokens: Mapping[str, int] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        chat_template: str | None = None,
        pattern: str | None = None,
    ):
        if (hf is None) == (tiktoken_encoding is None):
            raise ValueError("Tokenizer needs exactly one backend; use Tokenizer.train_bpe or from_file")
        self._hf = hf
        self._tt = tiktoken_encoding
        # an HF byte-level BPE spells each byte as one printable character (token_bytes undoes it)
        self._byte_level = hf is not None and type(hf.decoder).__name__ == "ByteLevel"
        self._tt_ranks = tiktoken_ranks
        self._pattern = pattern
        self.special_tokens: dict[str, int] = dict(special_tokens or {})
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.chat_template = chat_template

    # ------------------------------------------------------------------ basic use
    @property
    def backend(self) -> str:
        """``"hf"`` or ``"tiktoken"``."""
        return "hf" if self._hf is not None else "tiktoken"

    @property
    def vocab_size(self) -> int:
        """Number of token ids (one past the largest id), special tokens included."""
        if self._hf is not None:
            return self._hf.get_vocab_size(with_added_tokens=True)
        return self._tt.n_vocab

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of ``text`` (no bos/eos added).

        With ``allow_special`` (the default) the text of a special token, e.g. ``<|im_end|>``, becomes
        that token, as chat prompts need; pass ``allow_special=False`` for raw data, where such text
        is encoded like any other text.
        """
        if self._hf is not None:
            self._hf.encode_special_tokens = not allow_special
            return self._hf.encode(text, add_special_tokens=False).ids
        if allow_special:
            return self._tt.encode(text, allowed_special="all")
        return self._tt.encode(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once (multithreaded in both backends)."""
        texts = list(texts)
        if self._hf is not None:
            self._hf.encode_special_tokens = not allow_special
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        if allow_special:
            return self._tt.encode_batch(texts, allowed_special="all")
        return self._tt.encode_batch(texts, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._tt.decode(ids, errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (a part of a UTF-8 character for some byte-level tokens, whose
        :meth:`decode` alone is U+FFFD); a special token's are those of its text."""
        i = int(i)
        if self._tt is not None:
            try:
                return self._tt.decode_single_token_bytes(i)
            except KeyError:
                return self.decode([i]).encode("utf-8")
        piece = self._hf.id_to_token(i)
        if piece is not None and i not in self.special_tokens.values() and self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        return self.decode([i]).encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token or (HF backend) any vocabulary entry; None if unknown."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        if self._hf is not None:
            return self._hf.token_to_id(token)
        try:
            return self._tt.encode_single_token(token)
        except KeyError:
            return None

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(backend={self.backend}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render chat ``messages`` (dicts with ``role`` and ``content``) as one prompt string.

        Uses the ``chat_template`` of the tokenizer's ``tokenizer_config.json`` when there is one and
        ``jinja2`` is installed (given ``messages`` as they are and ``tools``, as transformers does); otherwise a
        built-in template::

            <|im_start|>{role}\\n{content}<|im_end|>\\n   (per message)
            <|im_start|>assistant\\n                      (if add_generation_prompt)

        ``content`` is a string, None, or a list of text parts (``{"type": "text", "text": ...}``, joined). Tools
        follow Kimi's layout: ``tools`` (OpenAI's list of ``{"type": "function", "function": {...}}``) as a first
        ``tool_declare`` message holding their JSON; an assistant message's ``tool_calls`` (OpenAI's, ``content``
        may be None or absent) after its content as
        ``<|tool_calls_section_begin|>`` + ``<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>``
        per call + ``<|tool_calls_section_end|>``; a ``tool`` message as ``## Return of {tool_call_id}\\n{content}``.
        The markers are Kimi's special tokens; a tokenizer without them encodes the same text as plain text.

        ``template_kwargs`` are extra variables of a jinja template (vLLM's ``chat_template_kwargs``, e.g. Kimi's
        ``thinking``); the built-in template takes ``thinking`` only (it writes the same prompt either way: the
        switch is for the reader of the reply) and refuses any other name.

        Encode the result with ``encode(prompt, allow_special=True)``.
        """
        messages = list(messages)
        template_kwargs = self.check_template_kwargs(template_kwargs)
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content' keys")
            if "content" not in m and not m.get("tool_calls"):
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content' keys")
        tools = list(tools) if tools else None
        if self._uses_jinja():
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson  # (transformers' JSON, not jinja's HTML-escaped one)
            id_to_special = {v: k for k, v in self.special_tokens.items()}
            return env.from_string(self.chat_template).render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=id_to_special.get(self.bos_id, ""),
                eos_token=id_to_special.get(self.eos_id, ""),
            )
        parts = []
        if tools:
            parts.append(
                f"{IM_START_TOKEN}tool_declare\n{json.dumps(tools, ensure_ascii=False)}{IM_END_TOKEN}\n"
            )
        for i, m in enumerate(messages):
            body = _content_text(m.get("content"), i)
            if m["role"] == "tool" and m.get("tool_call_id") is not None:
                body = f"## Return of {m['tool_call_id']}\n{body}"
            if m.get("tool_calls"):
                body += render_tool_calls(m["tool_calls"], i)
            parts.append(f"{IM_START_TOKEN}{m['role']}\n{body}{IM_END_TOKEN}\n")
        if add_generation_prompt:
            parts.append(f"{IM_START_TOKEN}assistant\n")
        return "".join(parts)

    def _uses_jinja(self) -> bool:
        """Whether :meth:`apply_chat_template` renders the tokenizer's own jinja template (else the built-in one)."""
        if not self.chat_template:
            return False
        try:
            import jinja2.sandbox  # noqa: F401
        except ImportError:
            return False
        return True

    def check_template_kwargs(self, template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``template_kwargs`` checked for :meth:`apply_chat_template` (a ``ValueError`` says what is wrong)."""
        kw = dict(template_kwargs or {})
        reserved = sorted(set(kw) & _TEMPLATE_NAMES)
        if reserved:
            raise ValueError(
                f"template variables {reserved} are set by the chat request itself, not by its kwargs"
            )
        other = sorted(set(kw) - {"thinking"})
        if other and not self._uses_jinja():
            raise ValueError(
                f"the built-in chat template takes only the 'thinking' option, not {other} (a tokenizer_config.json "
                "with a chat_template takes its own variables)"
            )
        return kw

    # ------------------------------------------------------------------ save / load
    def _config(self) -> dict[str, Any]:
        id_to_special = {v: k for k, v in self.special_tokens.items()}
        config: dict[str, Any] = {
            "added_tokens_decoder": {
                str(i): {"content": tok, "special": True}
                for tok, i in sorted(self.special_tokens.items(), key=lambda x: x[1])
            }
        }
        for name, token_id in (
            ("bos_token", self.bos_id),
            ("eos_token", self.eos_id),
            ("pad_token", self.pad_id),
        ):
            if token_id is not None and token_id in id_to_special:
                config[name] = id_to_special[token_id]
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if self._tt is not None and self._pattern != DEFAULT_SPLIT_PATTERN:
            config["pattern"] = self._pattern
        return config

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer (``tokenizer.json`` or ``tiktoken.model``) and ``tokenizer_config.json``
        into ``directory``; :meth:`from_file` on that directory loads it back. Returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self._hf is not None:
            _atomic_write(directory / _TOKENIZER_JSON, self._hf.to_str().encode("utf-8"))
        else:
            lines = [
                base64.b64encode(tok) + b" " + str(rank).encode()
                for tok, rank in sorted(self._tt_ranks.items(), key=lambda x: x[1])
            ]
            _atomic_write(directory / _TIKTOKEN_FILE, b"\n".join(lines) + b"\n")
        _atomic_write(directory / _CONFIG_JSON, json.dumps(self._config(), indent=2).encode("utf-8"))
        return directory

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        special_tokens: Mapping[str, int] | None = None,
        pattern: str | None = None,
    ) -> Tokenizer:
        """Load a tokenizer.

        ``path`` is an HF ``tokenizer.json``, a tiktoken ranks file (e.g. Kimi's ``tiktoken.model``),
        or a directory holding one of them. A ``tokenizer_config.json`` in the same directory supplies
        special tokens (``added_tokens_decoder``), bos/eos/pad and ``chat_template``.

        For tiktoken files, ``special_tokens`` ({token: id}) adds to / overrides the config's, and
        ``pattern`` replaces :data:`DEFAULT_SPLIT_PATTERN` (or a ``pattern`` key in the config) as the
        pre-split regex; the ``tiktoken`` package must be installed.
        """
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"tokenizer path {str(p)!r} does not exist; pass a tokenizer.json, a tiktoken.model "
                f"ranks file, or a directory holding one"
            )
        if p.is_dir():
            for name in (_TOKENIZER_JSON, _TIKTOKEN_FILE):
                if (p / name).is_file():
                    p = p / name
                    break
            else:
                raise FileNotFoundError(
                    f"no {_TOKENIZER_JSON} or {_TIKTOKEN_FILE} in directory {str(p)!r}; pass the tokenizer file itself"
                )
        try:
            with open(p, "rb") as f:
                head = f.read(64).lstrip()
        except OSError as e:
            raise ValueError(f"cannot read tokenizer file {str(p)!r}: {e}") from None
        config = _read_config(p.parent)
        if head.startswith(b"{"):
            return cls._from_hf_json(p, config)
        return cls._from_tiktoken(p, config, special_tokens, pattern)

    @classmethod
    def _from_hf_json(cls, path: Path, config: Mapping[str, Any]) -> Tokenizer:
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(
                f"cannot load {str(path)!r} as an HF tokenizer.json ({e}); regenerate the file"
            ) from None
        specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        specials.update(_config_added_tokens(config, path.parent))

        def find(key: str, names: Sequence[str]) -> int | None:
            content = _token_content(config.get(key))
            candidates = [content] if content else list(names)
            for name in candidates:
                token_id = specials.get(name, hf.token_to_id(name))
                if token_id is not None:
                    return token_id
            return None

        return cls(
            hf=hf,
            special_tokens=specials,
            bos_id=find("bos_token", _BOS_NAMES),
            eos_id=find("eos_token", _EOS_NAMES),
            pad_id=find("pad_token", _PAD_NAMES),
            chat_template=config.get("chat_template")
            if isinstance(config.get("chat_template"), str)
            else None,
        )

    @classmethod
    def _from_tiktoken(
        cls,
        path: Path,
        config: Mapping[str, Any],
        special_tokens: Mapping[str, int] | None,
        pattern: str | None,
    ) -> Tokenizer:
        try:
            import tiktoken
        except ImportError:
            raise ImportError(
                f"{str(path)!r} is a tiktoken ranks file; reading it needs the tiktoken package: pip install tiktoken"
            ) from None
        ranks = _read_tiktoken_ranks(path)
        specials = _config_added_tokens(config, path.parent)
        specials.update(special_tokens or {})
        rank_ids = set(ranks.values())
        clash = sorted(t for t, i in specials.items() if i in rank_ids)
        if clash:
            raise ValueError(
                f"special token {clash[0]!r} reuses id {specials[clash[0]]} of a regular token in {str(path)!r}; "
                f"give special tokens ids past the ranks"
            )
        if pattern is None:
            pattern = (
                config.get("pattern") if isinstance(config.get("pattern"), str) else DEFAULT_SPLIT_PATTERN
            )
        try:
            enc = tiktoken.Encoding(
                name=f"openk3:{path.name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except Exception as e:
            raise ValueError(f"cannot build a tiktoken encoding from {str(path)!r}: {e}") from None

        def find(key: str, names: Sequence[str]) -> int | None:
            content = _token_content(config.get(key))
            for name in [content] if content else names:
                if name in specials:
                    return specials[name]
            return None

        chat_template = config.get("chat_template")
        return cls(
            tiktoken_encoding=enc,
            tiktoken_ranks=ranks,
            special_tokens=specials,
            bos_id=find("bos_token", _BOS_NAMES),
            eos_id=find("eos_token", _EOS_NAMES),
            pad_id=find("pad_token", _PAD_NAMES),
            chat_template=chat_template if isinstance(chat_template, str) else None,
            pattern=pattern,
        )

    # ------------------------------------------------------------------ training
    @classmethod
    def train_bpe(
        cls,
        texts: Iterable[str],
        vocab_size: int = 4096,
        cache_dir: str | os.PathLike | None = None,
        min_frequency: int = 2,
    ) -> Tokenizer:
        """Train a byte-level BPE tokenizer (HF ``tokenizers``) on ``texts``.

        The pre-tokenizer and decoder are ByteLevel (every byte is in the base alphabet, so any text
        round-trips through encode/decode); special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>``,
        ``<|im_start|>``, ``<|im_end|>`` get ids 0..4. The result is deterministic for a given
        corpus. With ``cache_dir``, the tokenizer is stored under a key hashed from the corpus,
        ``vocab_size`` and ``min_frequency`` (``cache_dir/bpe-<key>/tokenizer.json``) and reused by
        later calls with the same inputs instead of retraining.
        """
        if vocab_size < 256 + len(_TRAINED_SPECIALS):
            raise ValueError(f"vocab_size={vocab_size} is too small; byte-level BPE needs at least 261")
        texts = [t for t in texts if t]
        if not texts:
            raise ValueError("train_bpe got an empty corpus; pass at least one non-empty text")
        cache_path = None
        if cache_dir is not None:
            key = _corpus_key(texts, vocab_size, min_frequency)
            cache_path = Path(cache_dir) / f"bpe-{key[:24]}"
            if (cache_path / _TOKENIZER_JSON).is_file():
                try:
                    return cls.from_file(cache_path)
                except (ValueError, OSError):
                    pass  # a damaged cache entry: retrain and overwrite it

        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(_TRAINED_SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
        specials = {t: hf.token_to_id(t) for t in _TRAINED_SPECIALS}
        tok = cls(
            hf=hf,
            special_tokens=specials,
            bos_id=specials[BOS_TOKEN],
            eos_id=specials[EOS_TOKEN],
            pad_id=specials[PAD_TOKEN],
        )
        if cache_path is not None:
            tok.save(cache_path)
        return tok


# the variables apply_chat_template itself gives a jinja template
_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _content_text(content: Any, i: int) -> str:
    """A message's content as text: a string, None (empty), or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ValueError(f"chat message {i}: only text content parts can be rendered, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"chat message {i}: content must be a string, None or a list of text parts")


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]], i: int = 0) -> str:
    """An assistant message's OpenAI ``tool_calls`` in Kimi's layout (see :meth:`Tokenizer.apply_chat_template`):
    each call's ``id`` (``functions.NAME:K`` where missing, K its position) and its ``function.arguments`` (a JSON
    string as it is, another value as its JSON)."""
    calls = []
    for k, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"chat message {i}: tool_calls[{k}] must have a function with a name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_id = call.get("id") or f"functions.{fn['name']}:{k}"
        calls.append(f"{TOOL_CALL_BEGIN}{call_id}{TOOL_ARGUMENT_BEGIN}{args}{TOOL_CALL_END}")
    return f"{TOOL_SECTION_BEGIN}{''.join(calls)}{TOOL_SECTION_END}"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
