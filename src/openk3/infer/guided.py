"""Structured output (guided decoding) through llguidance: a request's JSON schema, regular expression, choice or
grammar becomes a token matcher whose mask restricts each draw to tokens that keep the output a prefix of a match.

The engine keeps one :class:`GuidedCompiler` (the tokenizer's llguidance view, built once on first use) and one
matcher per guided request. Before each draw the matcher's mask sets every other token's logit to -inf (after
``allowed_token_ids``, before the penalties and filters: the logprobs stay the model's); each drawn token is fed
back to it, and once the output is a complete match that nothing can extend, the reply ends with ``stop``. An
invalid schema or grammar is a :class:`~openk3.infer.sampling.SamplingParamError` (a 400 at the server), never an
unconstrained answer.

``SamplingParams.guided`` is one of (vLLM's ``structured_outputs`` keys): ``{"json": schema}`` (a dict or its JSON
text; ``{"type": "object"}`` is OpenAI's JSON mode), ``{"json_object": True}``, ``{"regex": pattern}``,
``{"choice": [str, ...]}``, ``{"grammar": text}`` (Lark, or GBNF / EBNF as llama.cpp writes it). JSON may hold
whitespace between its tokens, as vLLM's llguidance backend allows by default; ``compact_json``
(``EngineConfig.guided_compact_json``, vLLM's ``disable_any_whitespace``) forbids it, and a schema's
``"x-guidance"`` options (llguidance's, e.g. ``{"whitespace_flexible": false}``) override either.

llguidance is an optional dependency (``pip install openk3[serve]``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from openk3.infer.sampling import SamplingParamError

__all__ = [
    "GUIDED_KINDS",
    "GuidedCompiler",
    "check_guided",
    "guided_available",
    "mask_words_to_bool",
]

# each kind's value: (its check, what it must be)
_KIND_VALUES = {
    "json": (lambda v: isinstance(v, (dict, str)), "a JSON schema (an object or its JSON text)"),
    "json_object": (lambda v: v is True, "true"),
    "regex": (lambda v: isinstance(v, str) and v != "", "a non-empty regular expression"),
    "choice": (
        lambda v: isinstance(v, list) and len(v) > 0 and all(isinstance(c, str) and c for c in v),
        "a non-empty list of non-empty strings",
    ),
    "grammar": (lambda v: isinstance(v, str) and v.strip() != "", "a non-empty grammar text"),
}
GUIDED_KINDS = tuple(_KIND_VALUES)


def guided_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def check_guided(spec: Any) -> dict | None:
    """``spec`` (SamplingParams.guided) checked for shape: a dict with exactly one of :data:`GUIDED_KINDS` and a
    value of that kind's type; returns it, or None for None. The schema / pattern / grammar itself is checked when
    the engine compiles it."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in GUIDED_KINDS:
        raise SamplingParamError(
            "guided", f"guided must be an object with exactly one of {', '.join(GUIDED_KINDS)}; got {spec!r}"
        )
    kind, v = next(iter(spec.items()))
    ok, want = _KIND_VALUES[kind]
    if not ok(v):
        raise SamplingParamError("guided", f"guided {kind} must be {want}, got {v!r}")
    return spec


class _TokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: each id's bytes, EOS / BOS, special ids, encode."""

    def __init__(self, tok, eos: int):
        self.eos_token_id = eos
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(set((tok.special_tokens or {}).values()))
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, allow_special=False)


class GuidedCompiler:
    """The tokenizer's llguidance view (built once, on first use) and matchers from specs.
    ``eos_ids``: the ids that end a reply, which a complete match allows; ``compact_json``: no whitespace in JSON."""

    def __init__(self, tokenizer, eos_ids, *, compact_json: bool = False):
        if tokenizer is None:
            raise SamplingParamError("guided", "structured output needs a tokenizer")
        if not eos_ids:
            raise SamplingParamError(
                "guided", "structured output needs a tokenizer with an end-of-sequence token"
            )
        if not guided_available():
            raise SamplingParamError(
                "guided", "structured output needs the llguidance package (pip install 'openk3[serve]')"
            )
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.compact_json = compact_json
        self._lltok = None
        self._executor = None

    def _lltokenizer(self):
        import llguidance

        if self._lltok is None:
            tok = self.tokenizer
            hf = getattr(tok, "_hf", None)
            if hf is not None:  # the tokenizers JSON: llguidance reads it natively
                self._lltok = llguidance.LLTokenizer(
                    hf.to_str(), n_vocab=tok.vocab_size, eos_token=self.eos_ids
                )
            else:
                wrapper = llguidance.TokenizerWrapper(_TokenizerView(tok, self.eos_ids[0]))
                self._lltok = llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=self.eos_ids)
        return self._lltok

    def grammar(self, spec: dict) -> str:
        """The llguidance grammar of a :func:`check_guided` spec (SamplingParamError for an unreadable one)."""
        import llguidance

        kind, v = next(iter(spec.items()))
        ws = {"whitespace_flexible": not self.compact_json}  # (defaults: a schema's x-guidance comes after)
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=ws)
            if kind == "json":
                schema = json.loads(v) if isinstance(v, str) else v
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(v)
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(v))
            return llguidance.grammar_from("grammar", v)
        except (ValueError, TypeError) as e:
            raise SamplingParamError("guided", f"guided {kind}: {e}") from None

    def matcher(self, spec: dict):
        """A fresh matcher for ``spec``; SamplingParamError (with llguidance's message) for an invalid one."""
        import llguidance

        m = llguidance.LLMatcher(self._lltokenizer(), self.grammar(spec), log_level=0)
        if m.is_error():
            kind = next(iter(spec))
            raise SamplingParamError("guided", f"guided {kind} is invalid: {m.get_error().strip()}")
        return m

    def mask_words(self, matchers: list) -> np.ndarray:
        """The next-token bitmasks of ``matchers`` as ``[len(matchers), W]`` int32 words (llguidance's layout): one
        matcher by itself, several in one call spread over llguidance's threads (as vLLM fills a batch's masks)."""
        import llguidance

        if len(matchers) == 1:
            words = bytearray(matchers[0].compute_bitmask())  # writable: torch.from_numpy warns on a view
            return np.frombuffer(words, dtype=np.int32).reshape(1, -1)
        W = (self._lltokenizer().vocab_size + 31) // 32
        out = np.zeros((len(matchers), W), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], out.ctypes.data, W * 4, len(matchers)
        )
        return out


def mask_words_to_bool(words: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance bitmasks ``[B, W]`` int32 (bit j of word i: token 32 i + j allowed) as ``[B, width]`` bool (ids
    past 32 W: not allowed), on the words' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(words.shape[0], width - bits.shape[1])], dim=1)
