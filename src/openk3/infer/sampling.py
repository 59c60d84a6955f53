"""Token sampling and stop-string handling as pure functions.

Order of the logit transforms (vLLM's): repetition penalty, frequency and presence penalties, temperature, min-p,
top-k, top-p, then a draw from the softmax. ``temperature == 0`` means greedy (argmax of the penalised logits).
Min-p and top-k keep a top set bounded by the row's own values, so they commute; transformers' ``generate`` applies
min-p after top-p instead, which differs only where both are on (there top-p's mass is taken before min-p's cut).
All functions work on a batch ``logits: [B, V]`` with per-row parameters, and never modify their inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from openk3.infer.cache import device_tensor

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParamError",
    "SamplingParams",
    "TokenLogprob",
    "token_logprobs",
    "apply_count_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "min_p_filter",
    "top_k_filter",
    "top_p_filter",
    "sample",
    "sample_keys",
    "gumbel_argmax",
    "gumbel_scores",
    "find_stop",
    "stop_holdback",
]


MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (logprobs / prompt_logprobs)
MIN_TEMPERATURE = 1e-5  # SamplingParams.validate takes a lower temperature as 0 (greedy)
MAX_REPETITION_PENALTY = 100.0  # SamplingParams.repetition_penalty lies in [1 / this, this]
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the seeds SamplingParams takes: those of a signed 64-bit integer


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's distribution and the ``k`` most likely tokens there,
    ``top = [(token id, logprob), ...]`` most likely first."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


class SamplingParamError(ValueError):
    """An invalid :class:`SamplingParams` value; ``param`` names the field (as the OpenAI API's errors do)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request generation settings.

    ``max_tokens``: new tokens to generate at most (``None``: up to the context length; 0: none, the prompt is only
    scored: prefilled, with its ``prompt_logprobs`` if asked, finishing with "length"). ``temperature`` 0 is
    greedy (:meth:`validate` sets one below ``MIN_TEMPERATURE`` to 0: dividing the fp32 logits by it would overflow
    them, or it would round to 0 there). ``top_k`` 0 or -1, ``top_p`` == 1 and ``min_p`` == 0 disable those
    filters; ``min_p`` in [0, 1] keeps the tokens at least ``min_p`` times as likely as the most likely one (after
    the temperature, as vLLM). ``min_tokens`` (vLLM semantics, at most ``max_tokens``): the end-of-sequence and
    ``stop_token_ids`` ids are banned until that many tokens are out, and stop strings are not looked for before.
    ``include_stop_str_in_output``: the stop string that ended the text stays in it. ``allowed_token_ids``: only
    these ids can be drawn (the others' logits become -inf first). ``bad_words``: strings never generated (each
    tokenized as it is and after a space; a word's last token is banned where the output ends with its other
    tokens). ``truncate_prompt_tokens`` k: only the last k prompt tokens are kept (the first k with
    ``truncation_side="right"``; -1: the context length). These five are vLLM's extras, with its meanings.
    ``guided``: structured output, one of ``{"json": schema}``, ``{"json_object": True}``, ``{"regex": pattern}``,
    ``{"choice": [...]}``, ``{"grammar": text}`` (:mod:`openk3.infer.guided`; needs llguidance).
    ``guided_start_token_ids``: the grammar applies only after the first of these ids in the output (a thinking
    model's end of reasoning, ``</think>``, as vLLM starts structured output after the reasoning); empty: from the
    first token.
    ``repetition_penalty`` > 1 discourages tokens already present in the prompt or the output, < 1 favours them (HF
    semantics; in [0.01, 100]).
    ``frequency_penalty`` / ``presence_penalty`` (OpenAI semantics, in [-2, 2]) subtract ``frequency * count +
    presence * (count > 0)`` from each token's logit, ``count`` being how often it occurs in the output so far.
    ``seed`` (a signed 64-bit integer) makes sampling reproducible, whatever else runs in the same batch. ``stop``:
    strings that end generation (not included in the text); ``stop_token_ids``: extra ids that end generation; the
    end-of-sequence id does too unless ``ignore_eos``. ``logprobs`` k (0..20; ``None`` = off): each generated token's
    log-probability under the model's distribution (``log_softmax`` of the logits, before penalty, temperature and
    filters) and the k most likely tokens with theirs. ``skip_special_tokens`` (vLLM's default, on): special
    tokens the model generates (``<|im_end|>``, BOS, ...) are left out of the text; their ids and logprobs stay.
    ``keep_special_token_ids``: special tokens whose text stays in it all the same (the server's tool-call markers,
    which its parser reads from the text).
    ``prompt_logprobs`` k: the same for each prompt token after the first (a request asking for them does not reuse
    a cached prefix). ``logit_bias`` (OpenAI semantics):
    ``{token id: bias}``, each bias in [-100, 100] added to that token's logit before the penalties, temperature and
    filters (a large negative bias bans the token, a large positive one forces it); logprobs stay those of the
    model's distribution, without it.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    guided: dict | None = None
    keep_special_token_ids: list[int] = field(default_factory=list)
    guided_start_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> SamplingParams:
        """Raise :class:`SamplingParamError` (a ``ValueError`` naming the field) for an invalid value; returns self."""

        def num(name, v, lo=None, hi=None, lo_open=False, param=None) -> float:
            """``v`` as a float, checked: a finite number (an int too large for a float is not) in range."""
            param = param or name
            f = math.nan
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    f = float(v)
                except OverflowError:
                    f = math.inf
            if not math.isfinite(f):
                raise SamplingParamError(param, f"{name} must be a finite number, got {v!r}")
            if lo is not None and (f <= lo if lo_open else f < lo):
                raise SamplingParamError(param, f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and f > hi:
                raise SamplingParamError(param, f"{name} must be <= {hi}, got {v}")
            return f

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise SamplingParamError(
                    "max_tokens", f"max_tokens must be an integer, got {self.max_tokens!r}"
                )
            if self.max_tokens < 0:
                raise SamplingParamError("max_tokens", f"max_tokens must be >= 0, got {self.max_tokens}")
        self.temperature = num("temperature", self.temperature, 0.0, 100.0)
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SamplingParamError("top_k", f"top_k must be an integer (0 or -1 = off), got {self.top_k!r}")
        # as vLLM: -1 and 0 turn the filter off; another negative is a mistake, not "off"
        if self.top_k < -1:
            raise SamplingParamError("top_k", f"top_k must be >= 1, or 0 or -1 for off; got {self.top_k}")
        self.top_p = num("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.min_p = num("min_p", self.min_p, 0.0, 1.0)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingParamError(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        # (the penalty divides or multiplies fp32 logits: one of 1e-300 rounds to 0 there, 1e300 to inf)
        self.repetition_penalty = num(
            "repetition_penalty", self.repetition_penalty, 1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        )
        self.frequency_penalty = num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingParamError("seed", f"seed must be an integer, got {self.seed!r}")
        # a draw uses the seed's 64 bits, so seeds beyond them would alias seeds within (2**64 + 5 draws as 5)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingParamError(
                "seed", f"seed must lie in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS
            ):
                raise SamplingParamError(
                    name, f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}"
                )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamError(
                    "logit_bias",
                    f"logit_bias must be a mapping of token ids to biases, got {self.logit_bias!r}",
                )
            biases = {}
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise SamplingParamError(
                        "logit_bias", f"logit_bias keys must be non-negative token ids, got {t!r}"
                    )
                biases[int(t)] = num(f"logit_bias[{t}]", v, -100.0, 100.0, param="logit_bias")
            self.logit_bias = biases or None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamError("stop", "stop must be a string or a list of strings")
        self.stop = [s for s in self.stop if s]
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("stop_token_ids", "keep_special_token_ids", "guided_start_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in getattr(self, name)
            ):
                raise SamplingParamError(name, f"{name} must be a list of non-negative integers")
        a = self.allowed_token_ids
        if a is not None:
            if (
                not isinstance(a, (list, tuple))
                or not a
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in a)
            ):
                raise SamplingParamError(
                    "allowed_token_ids", "allowed_token_ids must be a non-empty list of non-negative integers"
                )
            self.allowed_token_ids = list(a)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        words = self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise SamplingParamError("bad_words", "bad_words must be a list of strings")
        self.bad_words = [w for w in self.bad_words if w.strip()]
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise SamplingParamError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be an integer >= 1, or -1 for the context length; got {k!r}",
            )
        if self.truncation_side not in ("left", "right"):
            raise SamplingParamError(
                "truncation_side", f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}"
            )
        from openk3.infer.guided import check_guided

        self.guided = check_guided(self.guided)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _col(x: float | Sequence[float] | torch.Tensor, B: int, logits: torch.Tensor) -> torch.Tensor:
    """Per-row parameter as a [B, 1] fp32 tensor on the logits' device."""
    t = device_tensor(x, torch.float32, logits.device)
    return t.reshape(-1, 1).expand(B, 1) if t.numel() == 1 else t.reshape(B, 1)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float | Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """HF repetition penalty: for each token already present (``seen [B, V]`` bool), a positive logit is divided by
    ``penalty`` and a negative one multiplied by it. ``penalty`` is a float or one per row; 1 = no change."""
    B = logits.shape[0]
    p = _col(penalty, B, logits)
    x = logits.float()
    pen = torch.where(x > 0, x / p, x * p)
    return torch.where(seen, pen, x)


def apply_count_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency: float | Sequence[float] | torch.Tensor,
    presence: float | Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """OpenAI frequency / presence penalties: ``logits - frequency * counts - presence * (counts > 0)`` (fp32), with
    ``counts [B, V]`` each token's occurrences in the row's output so far; per-row floats or one for all."""
    B = logits.shape[0]
    c = counts.float()
    return logits.float() - _col(frequency, B, logits) * c - _col(presence, B, logits) * (c > 0).float()


def apply_temperature(
    logits: torch.Tensor, temperature: float | Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Divide by the temperature (rows with temperature 0 are left as they are: they are taken greedily)."""
    B = logits.shape[0]
    t = _col(temperature, B, logits)
    return logits.float() / torch.where(t > 0, t, torch.ones_like(t))


def min_p_filter(logits: torch.Tensor, p: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Min-p filter (vLLM's and transformers' ``min_p``): keep the tokens whose probability is at least ``p`` times
    the most likely token's, i.e. ``x_i >= max_j x_j + log(p)`` on the (temperature-scaled) logits; the rest become
    -inf. The most likely token (and any tied with it) is always kept; ``p == 0`` leaves the row unchanged."""
    B = logits.shape[0]
    pp = _col(p, B, logits)
    x = logits.float()
    bound = x.amax(-1, keepdim=True) + torch.log(pp)  # (log 0 = -inf: nothing dropped)
    return logits.masked_fill(x < bound, float("-inf"))


def top_k_filter(logits: torch.Tensor, k: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (ties with the k-th are kept), set the rest to -inf. ``k <= 0`` or
    ``k >= V`` leaves the row unchanged."""
    B, V = logits.shape
    kk = device_tensor(k, torch.long, logits.device).reshape(-1)
    kk = kk.expand(B) if kk.numel() == 1 else kk.reshape(B)
    kk = torch.where((kk <= 0) | (kk > V), torch.full_like(kk, V), kk)
    sorted_vals = logits.sort(dim=-1, descending=True).values
    kth = sorted_vals.gather(1, (kk - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass reaches ``p`` (the most
    likely token is always kept); the rest become -inf. ``p >= 1`` leaves the row unchanged.

    A token is dropped when the mass of the tokens strictly more likely than it reaches ``p``, so tokens of exactly
    equal logits are kept or dropped together, whatever order the sort puts them in (the draw kernels of
    :mod:`openk3.infer.sample_kernels` apply the same rule)."""
    B = logits.shape[0]
    pp = _col(p, B, logits)
    vals, idx = logits.float().sort(dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens sorted ahead
    # ... taken at the first token of each run of equal values: the mass of the strictly more likely tokens
    # (``before`` never decreases along the sorted row, so a running max carries each run's first value)
    start = torch.ones_like(vals, dtype=torch.bool)
    start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    before = torch.where(start, before, torch.zeros_like(before)).cummax(-1).values
    drop_sorted = (before >= pp) & (pp < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# ---------------------------------------------------------------------------------- counter-based draws
# A draw for (seed, counter) from a stateless hash instead of a torch.Generator: every row of a batch is sampled in
# one pass (Gumbel-max: argmax of logits + Gumbel noise), and a request's token depends on its own seed and position
# only, whatever else is in the batch. Noise of token i in a row with key k: a 32-bit integer hash (two
# xor-shift-multiply rounds, _h32) of hash(i) xor k, turned into a 24-bit uniform u and -log(-log(u)) (a token more
# than ~20 nats below the best one is never drawn: probability ratio < 2e-9).
_M32 = 0xFFFFFFFF
_HMUL = 0x45D9F3B


def _h32(x):
    """32-bit integer hash of a Python int or an int64 tensor of values in [0, 2**32) (products stay below 2**59:
    exact in int64)."""
    x = (((x >> 16) ^ x) * _HMUL) & _M32
    x = (((x >> 16) ^ x) * _HMUL) & _M32
    return (x >> 16) ^ x


def sample_keys(seeds: Sequence[int], counters: Sequence[int]) -> list[int]:
    """The 32-bit draw key of each (seed, counter) pair (seed: any integer, counter: the request's token position)."""
    out = []
    for s, c in zip(seeds, counters):
        s = int(s) & ((1 << 64) - 1)
        out.append(_h32(_h32(_h32((s >> 32) & _M32) ^ (s & _M32)) ^ (int(c) & _M32)))
    return out


_VOCAB_HASH: dict = {}
# The uniform of a 24-bit hash h is (h + 0.5) / 2**24, but h = 2**24 - 1 rounds to 1.0 in fp32, where the Gumbel
# noise -log(-log(u)) is +inf: that token would win whatever its probability (1 draw in ~100 at a 163,840-token
# vocabulary), and a banned (-inf) token would score NaN. The largest fp32 below 1 keeps the noise finite.
U_MAX = 1.0 - 2.0**-24


def gumbel_scores(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``logits + Gumbel(key, index)`` in fp32 ([R, V]); keys: [R] int64 from :func:`sample_keys`."""
    V = logits.shape[-1]
    hv = _VOCAB_HASH.get((V, logits.device))
    if hv is None:  # the per-index half of the hash, once per vocabulary size and device
        hv = _VOCAB_HASH[(V, logits.device)] = _h32(torch.arange(V, dtype=torch.long, device=logits.device))
    h = _h32(hv[None, :] ^ keys.to(device=logits.device, dtype=torch.long)[:, None])
    u = (((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)).clamp_(max=U_MAX)
    return logits.float() - torch.log(-torch.log(u))


def gumbel_argmax_reference(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax over each row of :func:`gumbel_scores` (first index on ties): a draw from ``softmax(logits)`` per row.
    logits: [R, V] (-inf excluded); keys: [R] int64 from :func:`sample_keys`."""
    return gumbel_scores(logits, keys).argmax(-1)


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel_argmax_reference`, in one Triton kernel on CUDA (``openk3.infer.sample_kernels``)."""
    from openk3.fast._triton import triton_ok

    if logits.is_cuda and triton_ok()[0]:
        from openk3.infer.sample_kernels import gumbel_argmax_triton

        return gumbel_argmax_triton(logits, keys)
    return gumbel_argmax_reference(logits, keys)


# fast=None in sample(): the Triton draw on CUDA when this is on (off: the PyTorch path, for A/B measurements)
FAST_DRAW = {"on": True}


def _triton_draws() -> bool:
    from openk3.fast._triton import triton_ok

    return FAST_DRAW["on"] and triton_ok()[0]


def _per_row(v, B: int, cast) -> list:
    return [cast(v)] * B if isinstance(v, (int, float)) else [cast(e) for e in v]


def sample(
    logits: torch.Tensor,
    *,
    temperature: Sequence[float] | float = 1.0,
    top_k: Sequence[int] | int = 0,
    top_p: Sequence[float] | float = 1.0,
    repetition_penalty: Sequence[float] | float = 1.0,
    seen: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    keys: Sequence[int] | None = None,
    fast: bool | None = None,
    counts: torch.Tensor | None = None,
    frequency_penalty: Sequence[float] | float = 0.0,
    presence_penalty: Sequence[float] | float = 0.0,
    min_p: Sequence[float] | float = 0.0,
) -> torch.Tensor:
    """Next token per row. logits: [B, V]; per-row settings (scalars broadcast); ``seen [B, V]`` marks tokens for the
    repetition penalty, ``counts [B, V]`` each token's occurrences in the row's output for the frequency / presence
    penalties. Draws: with ``keys`` (one per row, :func:`sample_keys` of the request's seed and position),
    one counter-based Gumbel-max draw for every sampled row (what the engine uses); else ``generators``, one per row
    (``None`` = torch's default generator), one ``multinomial`` per seeded row. Returns ids [B] int64.

    Either way a sampled row's token depends only on its own seed (and position), so a seeded request gets the
    same tokens whatever else is in the batch.

    ``fast``: the keyed draw (or an all-greedy batch) through the Triton kernels of
    :mod:`openk3.infer.sample_kernels` (no sort, no per-row pass over the vocabulary): ``None`` = on CUDA when
    Triton is there, ``True`` = always (CPU tensors need ``TRITON_INTERPRET=1``), ``False`` = the PyTorch
    transforms below. The two give the same tokens up to fp32 rounding of the probability mass next to ``top_p``
    (both keep tokens of equal logits at the top-p boundary together)."""
    B, V = logits.shape
    temps = _per_row(temperature, B, float)
    pens = _per_row(repetition_penalty, B, float)
    ks = _per_row(top_k, B, int)
    ps = _per_row(top_p, B, float)
    freqs = _per_row(frequency_penalty, B, float)
    pres = _per_row(presence_penalty, B, float)
    mps = _per_row(min_p, B, float)
    if not (len(temps) == len(pens) == len(ks) == len(ps) == len(freqs) == len(pres) == len(mps) == B):
        raise ValueError(f"sample: per-row settings must have one value per row ({B})")
    if keys is not None and len(keys) != B:
        raise ValueError(f"keys: expected one per row ({B}), got {len(keys)}")
    if seen is not None and tuple(seen.shape) != (B, V):
        raise ValueError(f"seen must be [B, V] = {(B, V)}, got {tuple(seen.shape)}")
    if counts is not None and tuple(counts.shape) != (B, V):
        raise ValueError(f"counts must be [B, V] = {(B, V)}, got {tuple(counts.shape)}")
    if counts is not None and any(f != 0.0 or q != 0.0 for f, q in zip(freqs, pres)):
        # the count penalties in PyTorch after the repetition penalty (their order), then the rest on the result
        if seen is not None and any(r != 1.0 for r in pens):
            logits = apply_repetition_penalty(logits, seen, pens)
        logits, seen = apply_count_penalties(logits, counts, freqs, pres), None
    sampled_rows = [i for i, t in enumerate(temps) if t > 0]
    if fast is None:
        fast = logits.is_cuda and _triton_draws()
    elif fast:
        from openk3.fast._triton import triton_ok

        ok, why = triton_ok(logits)
        if not ok:
            raise RuntimeError(f"sample(fast=True) needs the Triton kernels on these logits: {why}")
    if fast and (keys is not None or not sampled_rows):
        return _sample_triton(logits, temps, ks, ps, pens, seen, keys, sampled_rows, mps)
    penalised = seen is not None and any(r != 1.0 for r in pens)
    # greedy rows alone, no penalty: the argmax of the logits as they are (the fp32 copy has the same order)
    x = logits.float() if penalised or sampled_rows else logits
    if penalised:
        x = apply_repetition_penalty(x, seen, pens)
    greedy_ids = x.argmax(-1)
    if not sampled_rows:
        return greedy_ids
    rows = device_tensor(sampled_rows, torch.long, x.device)
    xs = apply_temperature(x[rows], [temps[i] for i in sampled_rows])
    m_rows = [mps[i] for i in sampled_rows]
    if any(m > 0 for m in m_rows):
        xs = min_p_filter(xs, m_rows)
    k_rows = [ks[i] for i in sampled_rows]
    p_rows = [ps[i] for i in sampled_rows]
    if any(0 < k < V for k in k_rows):
        xs = top_k_filter(xs, device_tensor(k_rows, torch.long, x.device))
    if any(p < 1.0 for p in p_rows):
        xs = top_p_filter(xs, p_rows)
    out = greedy_ids.clone()
    if keys is not None:
        kt = device_tensor([keys[i] for i in sampled_rows], torch.long, x.device)
        out[rows] = gumbel_argmax(xs, kt)
        return out
    probs = torch.softmax(xs, dim=-1)
    gens = [generators[i] if generators is not None else None for i in sampled_rows]
    # rows without their own generator: one draw for all of them from torch's default generator (a launch per row
    # cost ~10-20 us each at large batches); seeded rows: one draw each from their own generator
    free = [j for j, g in enumerate(gens) if g is None]
    if free:
        sel = device_tensor(free, torch.long, x.device)
        out[rows[sel]] = torch.multinomial(probs[sel], 1)[:, 0]
    for j, g in enumerate(gens):
        if g is not None:
            out[sampled_rows[j]] = torch.multinomial(probs[j], 1, generator=g)[0]
    return out


def _sample_triton(logits, temps, ks, ps, pens, seen, keys, sampled_rows, mps) -> torch.Tensor:
    """:func:`sample`'s keyed draw through :func:`openk3.infer.sample_kernels.sample_triton`: one host-to-device
    copy of the per-row settings and one of the keys; top-k rows add a ``torch.topk`` for their bound, min-p rows a
    row max (``max + T log(min_p)`` on the penalised logits is the kernel's bound of ``x >= max + log(min_p)`` on
    the scaled ones)."""
    from openk3.infer.sample_kernels import sample_triton

    B, V = logits.shape
    dev = logits.device
    penalised = seen is not None and any(r != 1.0 for r in pens)
    params = device_tensor([[t, p, 0.0, r] for t, p, r in zip(temps, ps, pens)], torch.float32, dev)
    kt = device_tensor(list(keys) if keys is not None else [0] * B, torch.long, dev)
    k_rows = [i for i in sampled_rows if 0 < ks[i] < V]
    m_rows = [i for i in sampled_rows if mps[i] > 0]
    lower = None
    x = logits
    if k_rows or m_rows:
        if penalised:  # the bounds are statistics of the penalised logits: apply the penalty here, once
            x = apply_repetition_penalty(logits, seen, pens)
            seen = None
        lower = torch.full((B,), float("-inf"), dtype=torch.float32, device=dev)
    if k_rows:
        rk = device_tensor(k_rows, torch.long, dev)
        top = torch.topk(x[rk], max(ks[i] for i in k_rows), dim=-1).values
        kth = top.gather(1, device_tensor([[ks[i] - 1] for i in k_rows], torch.long, dev))[:, 0]
        lower[rk] = kth.float()
    if m_rows:
        rm = device_tensor(m_rows, torch.long, dev)
        shift = device_tensor([temps[i] * math.log(mps[i]) for i in m_rows], torch.float32, dev)
        lower[rm] = torch.maximum(lower[rm], x[rm].float().amax(-1) + shift)
    return sample_triton(
        x,
        params,
        kt,
        lower=lower,
        seen=seen if penalised else None,
        top_p=any(ps[i] < 1.0 for i in sampled_rows),
    )


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """``log_softmax`` (fp32) of ``logits [N, V]`` at ``ids [N]``, and its ``k`` largest values with their ids:
    (chosen [N], top values [N, k], top ids [N, k]); all on the logits' device. On CUDA (``FAST_DRAW``) two Triton
    launches (:func:`openk3.infer.sample_kernels.logprobs_triton`); else a ``logsumexp`` and a ``topk``."""
    if logits.is_cuda and _triton_draws() and 0 <= k <= 32:
        from openk3.infer.sample_kernels import logprobs_triton

        return logprobs_triton(logits, ids, k)
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(1, ids.reshape(-1, 1).to(device=x.device, dtype=torch.long)) - lse)[:, 0]
    vals, idx = x.topk(min(max(k, 0), x.shape[-1]), dim=-1)
    return chosen, vals - lse, idx


def logprob_entries(chosen, top_v, top_i, ids, ks) -> list[TokenLogprob | None]:
    """Host-side :class:`TokenLogprob` per row from :func:`token_logprobs`' tensors (one transfer each); ``ks``: each
    row's k (``None``: that row gets ``None``)."""
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    out = []
    for b, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        out.append(TokenLogprob(int(ids[b]), chosen[b], list(zip(top_i[b][:k], top_v[b][:k]))))
    return out


# --------------------------------------------------------------------------------------------- stop strings
def find_stop(text: str, stops: Sequence[str], start: int = 0, *, with_stop: bool = False):
    """Index of the earliest occurrence of any stop string in ``text`` that ends after ``start`` (search from
    ``start - len(stop) + 1``), or -1; with ``with_stop`` the pair (index, that stop string; the first listed of
    those found there), ``(-1, "")`` when none is."""
    best, hit = -1, ""
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best < 0 or i < best):
            best, hit = i, s
    return (best, hit) if with_stop else best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Number of trailing characters of ``text`` that could be the start of a stop string (so a stream must not
    emit them yet)."""
    hold, n = 0, len(text)
    for s in stops:
        # a candidate start is an occurrence of the stop's first character in the text's tail, the earliest first
        # (the longest hold): per token this runs on the engine's thread, so a long stop string must cost a scan,
        # not a copy of each of its prefixes
        p = text.find(s[0], n - min(len(s) - 1, n)) if s else -1
        while p != -1 and n - p > hold:
            if s.startswith(text[p:]):
                hold = n - p
                break
            p = text.find(s[0], p + 1)
    return hold
