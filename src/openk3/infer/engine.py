"""Inference engine: continuous batching over the paged hybrid cache.

Each :meth:`Engine.step`:

1. takes new requests and aborts (thread-safe inbox), admits waiting requests while a sequence slot and pages are
   free (restoring the longest cached prefix: KDA state snapshot + shared MLA pages);
2. runs chunked prefill, at most ``max_prefill_tokens`` prompt tokens per step over all prefilling requests,
   through the model's own layers: with ``batch_prefill`` (default) one piece of each request packed in one forward,
   else one sequence at a time; the KDA state is snapshotted at multiples of the prefix-cache interval, inside the
   pieces (see ``KimiDeltaAttention.forward``'s ``snap_at``);
3. runs one batched decode step for every request whose cache holds all but its last token: the last token is fed,
   its latent written into the pages, and the next token sampled.

Prefill stops one token short of the known tokens, so the last prompt token always goes through the decode step:
sampling happens in one place, and a request that was preempted (pages ran out; its cache is dropped and recomputed
later) resumes exactly where it was. Finished or aborted requests free their pages and slot at once.

The layer walk replicates ``K3Model.forward`` (AttnRes seal/read schedule) and calls the model's own submodules;
only the attention layers read and write the engine's cache. ``Engine.start()`` runs the loop in a background
thread; :class:`~openk3.infer.server` streams from it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import math
import numbers
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from openk3.config import mistyped_field
from openk3.fast._triton import pdl_scope
from openk3.fast.graphs import GraphCapture, shared_stream
from openk3.infer import gemv as _gemv
from openk3.infer.cache import PagedHybridCache, PrefixCache, device_tensor, plan_pool
from openk3.infer.decode import (
    mla_post_reference,
    mla_prep_reference,
    resolve_kda_decode,
    resolve_mla_decode,
)
from openk3.infer.glue import add_rms_norm
from openk3.infer.row_graphs import RowGraphs
from openk3.infer.sampling import (
    SamplingParamError,
    SamplingParams,
    find_stop,
    logprob_entries,
    sample,
    sample_keys,
    stop_holdback,
    token_logprobs,
)
from openk3.modules.ffn import GLUMLP
from openk3.ops import backend as _backend
from openk3.ops.attnres import make_reader

__all__ = [
    "ContextLengthError",
    "LatencyHistogram",
    "EngineConfig",
    "PromptError",
    "Engine",
    "Request",
    "RequestOutput",
    "IncrementalDetokenizer",
    "default_tokenizer",
    "load_for_inference",
    "DEFAULT_RUN_DIR",
]

log = logging.getLogger("openk3.infer")

DEFAULT_RUN_DIR = os.path.join("runs", "default", "final")


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, token ids out of range, too long)."""


class ContextLengthError(PromptError):
    """A request that does not fit the context: its prompt alone, or its prompt with ``max_tokens``."""


class LatencyHistogram:
    """Durations in seconds counted into fixed buckets (Prometheus' histogram: a value v falls in every bucket whose
    upper bound ``le`` >= v), with their sum and count. Observed on the engine's thread, read from any thread."""

    def __init__(self, buckets: Sequence[float]):
        b = [float(x) for x in buckets]
        if not b or any(x <= 0 or x != x for x in b) or b != sorted(set(b)):
            raise ValueError(f"histogram buckets must be positive, distinct and increasing, got {buckets}")
        self.buckets = tuple(b)
        self._counts = [0] * (len(b) + 1)  # per bucket (not cumulative); the last: above every bound
        self._sum, self._count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._sum += seconds
            self._count += 1

    def snapshot(self) -> tuple[tuple[float, ...], list[int], float, int]:
        """(bucket bounds, cumulative counts per bound, sum, count): one consistent reading."""
        with self._lock:
            return self.buckets, list(itertools.accumulate(self._counts[:-1])), self._sum, self._count


# bucket bounds of the request-latency histograms (seconds): a millisecond to ten minutes
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
    2.5, 5.0,
)  # fmt: skip


@dataclass
class EngineConfig:
    """Engine settings. ``max_tokens`` is the cache pool size in tokens (``None``: from free GPU memory on CUDA,
    32768 on CPU); ``max_model_len`` caps prompt + generated tokens (default: the model's
    ``max_position_embeddings`` or the pool size, whichever is smaller)."""

    page_size: int = 16
    max_seqs: int = 64
    max_tokens: int | None = None
    max_model_len: int | None = None
    # prompt tokens prefilled per engine step, over all prefilling requests (packed into one forward with
    # batch_prefill): `medium` on an H100 prefills 8 x 511 tokens in one 93 ms forward, one 511-token piece in 66 ms
    # (bench/NOTES.md v36), so a large budget costs the running streams little per step and takes a burst of
    # prompts in few steps
    max_prefill_tokens: int = 4096
    prefix_cache: bool = True
    # prefix-cache snapshot interval in tokens. It used to end a prefill chunk at every multiple, and an eager
    # prefill forward costs about the same host time whatever its length (`medium` on an H100: ~80 ms for 64 tokens
    # or 511, bench/diag_prefill.py, bench/NOTES.md v35), so 64 made a 512-token prompt 8 forwards. Now a piece
    # takes its snapshots inside (the KDA layers run one more recurrence call over the snapshots' prefixes, the
    # rest of the forward once): packed 8 x 512 tokens 79 -> 115 ms at interval 64, 2 x 2,048 tokens 72 -> 87 ms
    # at 512 (v36)
    prefix_interval: int = 512
    prefix_cache_bytes: int | None = None  # default: max(64 MiB, 16 sequences' state)
    # also snapshot at the interval's multiples that decode reaches (generated tokens): a later prompt that repeats a
    # conversation so far (its prompt and the reply, token for token) restores from there. Off by default: each such
    # snapshot copies a sequence's whole KDA state during decode and competes with prompt snapshots for the budget;
    # not yet measured on a GPU
    prefix_cache_outputs: bool = False
    # prefill one piece of each of several requests in one forward: the pieces packed as varlen sequences, each KDA
    # layer from each sequence's own state and conv history, each MLA layer attending per sequence over its cached
    # prefix. A prefill forward is host-bound on a GPU (bench/NOTES.md v35), so this takes a burst of prompts in
    # fewer forwards: 8 prompts of 512 tokens in 0.10 s instead of 0.54 s (`medium`, H100, v36)
    batch_prefill: bool = True
    use_cuda_graphs: bool = True  # decode step captured per batch bucket on CUDA; ignored on CPU
    cuda_graph_max_batch: int = 64
    gpu_memory_utilization: float = 0.9
    cache_dtype: torch.dtype | None = None  # default: the model's dtype
    decode_backend: str | None = None  # None: auto; "reference"; or a FAST_*_DECODE name
    # the MLA layers' decode attention: None follows decode_backend (our Triton kernel on CUDA); "flashinfer":
    # FlashInfer's paged MLA decode (optional package flashinfer-python, CUDA, a bf16 / fp16 cache), planned on the
    # host once per step. On an H200 it took 1.8-2.6x less time than our kernel at 96 heads and the same at 16
    # heads, but more at one row (bench/diag_mla_peer.py, bench/NOTES.md v26); experimental: the engine path has
    # been tested on the CPU through a stand-in for FlashInfer only (tests/gpu/test_mla_peer_gpu.py not run yet)
    mla_backend: str | None = None
    record_logits: bool = False  # keep each decode step's logits on the request (tests / debugging)
    # structured output: JSON without whitespace between its tokens (vLLM's disable_any_whitespace); off, JSON may
    # hold whitespace as a model writes it (vLLM's default); a schema's "x-guidance" options override either
    guided_compact_json: bool = False
    # decode step: each attention layer's input projections (KDA q/k/v/f_a/b/g, MLA q/latent/gate) as one GEMM over
    # their weights stored side by side (fewer, larger kernels; no extra memory: the model's projection weights become
    # views into the concatenated buffer). Prefill's KDA layers read the same buffer (one GEMM instead of six) and
    # their q / k / v conv weights side by side too (one conv call instead of three): fewer launches for a
    # prefill forward that is bound by the host's launch rate (bench/NOTES.md v37)
    fuse_projections: bool = True
    # decode step: each FFN's input projections (dense gate/up; MoE latent down projection and the shared experts'
    # gate/up, the router excluded) as one GEMM the same way, and its output projections (latent up projection,
    # shared experts' down projection) as one GEMM over their inputs side by side. On an H200 (medium, batch 1-16)
    # 0.3-0.5 ms off the step (bench/bench_e2e_decode.py --compare-fusion, bench/NOTES.md)
    fuse_ffn_projections: bool = True
    # the residual adds of the decode step folded into the last GEMM of the attention and FFN outputs (addmm: one
    # rounding instead of two) where gemv_residual does not take them. Off: within 1-2 % either way on an H200
    fuse_residual: bool = False
    # decode step and prefill forward: each AttnRes read followed by its layer's RMSNorm as one launch (the fast
    # reader writes the normed rows; `TritonAttnResReader.read_normed`), one norm kernel less per read. H200, batch
    # 1: medium forward 1.66 -> 1.61 ms, 48B shape within noise (bench/NOTES.md v9)
    fuse_read_norm: bool = True
    # decode step, at most KDA_LOWRANK_MAX_ROWS rows: the KDA step kernel applies the low-rank up projections itself,
    # the decay's f_b_proj and (low-rank gates) g_b_proj (`kda_decode_triton(z_lowrank=, gate_lowrank=)`), one GEMV
    # launch fewer per projection and KDA layer. H200, batch 1: medium forward 1.66 -> 1.64 ms (both flags: 1.60),
    # 48B shape 3.36 -> 3.34 ms (bench/NOTES.md v9)
    fuse_kda_lowrank: bool = True
    # decode step, at most MLA_GLUE_MAX_ROWS rows: the glue around each MLA layer's attention kernel in two steps
    # (openk3.infer.decode: mla_prep / mla_post). Prep, one launch: the latent's RMSNorm, its cache write and the
    # absorbed query [q_nope W_UK ; q_rope]; post: W_UV, the rounding to the model dtype and the output gate,
    # folded into the attention kernel's reduce (Triton; one split: its own launch). On CUDA with the Triton MLA step
    # the Triton kernels (reading W_UK / W_UV as views of kv_b_proj's weight), otherwise the PyTorch references.
    # H200, batch 1: medium 1.46 -> 1.37 ms per step, 48B shape 2.73 -> 2.63 ms; batch 16 within noise
    # (bench/NOTES.md v13)
    fuse_mla_glue: bool = True
    # decode forward: our Triton kernels (KDA / MLA steps, AttnRes reads and seals, few-token MoE, the GEMV of
    # triton_gemv) launched with programmatic dependent launch (sm_90+), each starting while the kernel before it
    # drains (the GEMV requests its weights before it waits); steps of at most PDL_MAX_ROWS rows. H200, batch 1:
    # -0.02 to -0.07 ms per step in v9 and again in v14 (medium 1.38 -> 1.31 ms, 48B shape 2.62 -> 2.60; with
    # triton_gemv 1.28 / 2.59, bench/NOTES.md)
    pdl: bool = True
    # decode steps one ahead: step t+1's forward is launched with step t's sampled tokens still on the device, and
    # the host appends step t's tokens (detokenising, stop checks, streaming) while the GPU runs it. Same tokens as
    # without it; a row that stops at step t has step t+1 computed for nothing. On: on an H200 it took 0.06-0.34 ms
    # off a `medium` step and 0.17-0.93 ms off a 48B-shape step at batch 1-64 (bench/NOTES.md v10)
    overlap: bool = True
    # decode step, MoE layers on CUDA: independent branches on a second stream (captured into the same CUDA graph),
    # so that their fixed per-kernel latencies overlap: the router beside the FFN input GEMM and the shared experts'
    # activation beside the routed experts (latent MoE), or the whole shared-expert chain beside the router and the
    # routed experts (plain MoE). Same values as without it. H200, batch 1: medium 1.56 -> 1.50 ms per step, 48B shape
    # 3.25 -> 3.01 ms (bench/NOTES.md v13)
    parallel_ffn: bool = True
    # decode step, models without AttnRes: each residual add (attention output; the FFN output's parts) and the
    # RMSNorm that reads the result in one launch (`openk3.infer.glue.add_rms_norm`, same roundings). H200, 48B
    # shape: 3.25 -> 3.14 ms per step at batch 1, 12.30 -> 12.20 at batch 16 (bench/NOTES.md v13)
    fuse_add_norm: bool = True
    # decode step on CUDA: the step's projections (fused inputs, output projections, LM head) of one row and
    # weights of at most 32 MB (`openk3.infer.gemv.GEMV_DECODE`) as one Triton GEMV launch each (whole weight rows
    # per program, no split-K reduction launch) instead of cuBLAS. Same values up to the order of the fp32 sums.
    # H200, batch 1 with pdl: medium 1.31 -> 1.28 ms per step, 48B shape 2.60 -> 2.59 (bench/NOTES.md v14)
    triton_gemv: bool = True
    # decode step, with triton_gemv and parallel_ffn, where the GEMV takes the step (one row): a MoE layer's shared
    # experts' gated activation formed inside the GEMV that reads it (`openk3.infer.gemv.GLU`), and a latent MoE's
    # FFN output GEMM reading its two inputs in place instead of concatenated: one to two launches fewer per MoE
    # layer (the activation kernel, the concatenation). Same roundings as the separate ops. Off: on an H200 it
    # measured medium 1.29 -> 1.33 ms per step and the 48B shape 2.61 -> 2.59 at batch 1 (bench/NOTES.md v15)
    fuse_glu_gemv: bool = False
    # decode step, with triton_gemv, where the GEMV takes the step (one row): a latent MoE's RMSNorm of the routed
    # experts' mixture formed inside the FFN output GEMV that reads it (`openk3.infer.gemv.Normed`), which reads its
    # inputs in place: the norm kernel and the concatenation go. Same roundings as the separate ops. H200, `medium`
    # at batch 1: 1.24 -> 1.20-1.21 ms per step in two runs (bench/NOTES.md v15)
    fuse_norm_gemv: bool = True
    # decode step of an AttnRes model, with triton_gemv, where the GEMV takes an attention or FFN output projection
    # (one row): the residual add after it done in the GEMV's store, with the separate add's roundings (the same
    # values bit for bit): one add launch less per layer half. H200, `medium` at batch 1: 1.21 -> 1.17 ms per step
    # (bench/NOTES.md v16)
    gemv_residual: bool = True
    # decode step of a model without AttnRes, with triton_gemv and gemv_residual, at one row: the add + norm launches
    # between the layer halves folded into their neighbours. After attention: the output projection's GEMV adds the
    # residual in its store, and a plain MoE layer's router GEMV forms the RMSNorm of that sum while reading it and
    # writes the normed row for the routed experts (and forms the shared experts' gate / up projections, whose rows
    # follow the router's in one buffer: FOLD_SHARED); the routed experts' down + combine kernel then adds the shared
    # experts' output (their activation and down projection formed there) and the residual in its store. Before
    # attention: the next layer's fused input projection forms its RMSNorm in the GEMV (`openk3.infer.gemv.Normed`)
    # where the GEMV takes that weight (`GEMV_DECODE["normed_max_bytes"]`). Same roundings as the separate ops (the
    # norm's fp32 sum of squares in another order). H200, 48B shape at batch 1: 2.45 -> 2.41 ms per step
    # (bench/NOTES.md v17; the shared experts in the router's GEMV: 2.36-2.37 -> 2.33-2.34 in v19)
    fold_norms: bool = True
    # decode-step CUDA graphs with parallel_ffn: the step captured on a stream of the highest priority and the side
    # stream's branches at the lowest, so that where both have thread blocks waiting for an SM the main path's go
    # first (PyTorch instantiates graphs with per-node priorities, each kernel node keeping its capture stream's).
    # Aimed at the few-token routed experts' gate/up kernel, whose blocks queued behind the side stream's shared-
    # expert GEMV (bench/NOTES.md v18). Same values. Off: on an H200 the routed kernel then started ~3 us earlier,
    # but the shared experts' chain ran after it, on the critical path: 48B shape at batch 1 2.37 -> 2.49 ms per
    # step, `medium` 1.17 either way (bench/NOTES.md v19)
    graph_priority: bool = False
    # prefill forward on CUDA: each KDA layer's chunked recurrence (fla's chunk_kda, ~10 Triton launches and its
    # chunk-list preparation on the host) replayed from a CUDA graph per bucket of (tokens, sequences) instead of run
    # eagerly (`openk3.fast.kda.ChunkGraphs`; buckets up to max_prefill_tokens, captured on first use). Same values
    # as the eager call. A prefill forward is bound by the host (bench/NOTES.md v38); this takes its largest share
    prefill_graphs: bool = True
    # prefill forward on CUDA: each FFN layer (dense or MoE: router, row plan, grouped GEMMs, shared experts, output
    # projection, ~20 launches) replayed from a CUDA graph per (layer, multiple of 256 tokens) instead of run eagerly
    # (`openk3.infer.row_graphs.RowGraphs`; captured on first use, the tokens past the real ones zero rows that reach
    # no real output). Values as the eager layer up to the GEMMs' choice of kernels for the padded row count
    prefill_ffn_graphs: bool = True


# EngineConfig.mla_backend values (None: the MLA step that decode_backend resolves)
MLA_BACKENDS = (None, "flashinfer")
# EngineConfig.pdl applies to decode steps of at most this many rows: on an H200 it took 0.02-0.07 ms off a batch-1
# step, but a 48B-shape batch-4 step measured 4.90 -> 5.24 ms with it (bench/NOTES.md v14)
PDL_MAX_ROWS = 1
# above this many rows every KDA program would re-read its head's f_b_proj rows (from L2): the GEMV is kept
KDA_LOWRANK_MAX_ROWS = 16
# above this many rows the fused MLA post step's programs (one per row and head, or a share of a head's outputs)
# would each re-read their head's W_UV rows (from L2): the unfused glue is kept (EngineConfig.fuse_mla_glue)
MLA_GLUE_MAX_ROWS = 16
# EngineConfig.graph_priority: the capture stream's priority (lower is higher; -1 is the highest every CUDA device
# since compute capability 3.5 offers, and PyTorch clamps a number past the device's range to it)
GRAPH_PRIORITY = -1
# EngineConfig.prefill_ffn_graphs: the bucket width in tokens (a call of T tokens replays the graph of T rounded up
# to a multiple of it)
FFN_GRAPH_STEP = 256
# the prefill graph sets' counters in stats(): (key prefix, Engine attribute), and their stats' names there
_PREFILL_GRAPH_SETS = (("prefill_graph", "_chunk_graphs"), ("prefill_ffn_graph", "_ffn_graphs"))
_GRAPH_STATS = {"replays": "replays", "captures": "captures", "eager": "eager_calls"}
# EngineConfig.fold_norms applies to decode steps of at most this many rows (the router GEMV and the fused routing
# selection take one token)
FOLD_NORMS_MAX_ROWS = 1
# ... and where a folded MoE layer's shared experts run: "router" (their gate / up rows behind the router's in one
# weight buffer, so that the router's GEMV forms their projections, and their activation and down projection in the
# routed experts' down + combine kernel: no side stream, two launches fewer per MoE layer; shared experts of the
# routed experts' width only, others run on the side stream), "side" (the side stream, beside the router and the
# routed experts) or "slot" (one more slot of the routed experts' kernels). H200, 48B shape, batch 1, ms per step:
# router 2.33-2.34, side 2.36-2.37 (bench/NOTES.md v19); slot 2.50 against side 2.45 in v17. OPENK3_FOLD_SHARED
# overrides it (benchmarks)
FOLD_SHARED = os.environ.get("OPENK3_FOLD_SHARED", "router").strip() or "router"
if FOLD_SHARED not in ("side", "slot", "router"):
    raise ValueError(f"OPENK3_FOLD_SHARED must be 'side', 'slot' or 'router', got {FOLD_SHARED!r}")


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # SamplingParams.logprobs: one TokenLogprob per token of new_token_ids; prompt_logprobs: None for the first
    # prompt token, then one per prompt token (in the request's first output only)
    new_logprobs: list | None = None
    prompt_logprobs: list | None = None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything; holds back text while the
    last bytes do not form a whole character yet."""

    def __init__(self, tokenizer, skip: frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.skip = skip  # ids left out of the text (special tokens)
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if now.endswith("\ufffd") or len(now) < len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


_MUST_BE = {"bool": "True or False", "int": "an integer"}


def _check_engine_config(cfg: EngineConfig) -> None:
    """The option types, before anything is sized from them: a switch must be true / false (a string such as "no"
    is not read as on), a size an integer (a float or string would fail later inside tensor allocation)."""
    bad = mistyped_field(cfg, ("bool", "int"))
    if bad:
        name, kind, v = bad
        raise ValueError(f"engine option {name} must be {_MUST_BE[kind]}, got {v!r}")
    # the sizes not range-checked where they are used
    for name in ("cuda_graph_max_batch", "prefix_cache_bytes"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise ValueError(f"engine option {name} must be >= 1, got {v!r}")


def _swap_ids(ids: torch.Tensor, ids_from) -> None:
    """ids[b] = src[k] for each (b, k) of ``ids_from = (pairs, src)`` (device to device; None: nothing). The usual
    case, every row continuing in place ((0, 0), (1, 1), ...), is one copy; otherwise the pairs' indices go to the
    device first."""
    if not ids_from:
        return
    pairs, src = ids_from
    if all(b == i and k == i for i, (b, k) in enumerate(pairs)):
        ids[: len(pairs)].copy_(src[: len(pairs)])
        return
    dst = device_tensor([b for b, _ in pairs], torch.long, ids.device)
    idx = device_tensor([k for _, k in pairs], torch.long, src.device)
    ids.index_copy_(0, dst, src.index_select(0, idx).to(ids.dtype))


def _stack_rows(rows: list, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The requests' per-token vectors (``seen`` / ``counts``; ``None`` = zeros) as one [B, V] tensor, or ``None``
    when no request has one."""
    if all(v is None for v in rows):
        return None
    zero = torch.zeros(logits.shape[-1], dtype=dtype, device=logits.device)
    return torch.stack([zero if v is None else v for v in rows])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to (pinned) host memory without waiting: valid once an event recorded after it has passed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    return host


def _add_logit_bias(logits: torch.Tensor, biases: list) -> torch.Tensor:
    """``logits`` [B, V] with each row's ``SamplingParams.logit_bias`` added, as an fp32 copy (the step's logits
    stay as they are, for logprobs); ``logits`` itself where no row has one. No host synchronisation."""
    rows, ids, vals = [], [], []
    for b, lb in enumerate(biases):
        for t, v in (lb or {}).items():
            rows.append(b)
            ids.append(t)
            vals.append(v)
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)
    dev = logits.device
    r, i = device_tensor(rows, torch.long, dev), device_tensor(ids, torch.long, dev)
    out[r, i] += device_tensor(vals, torch.float32, dev)  # (a row's ids are distinct: the keys of a dict)
    return out


def _meta_views(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode graph's input buffer (``28 * n`` bytes, on the device or its host twin): token ids / slots / cache
    rows ``[3, n]`` int64, then the lengths ``[n]`` int32."""
    return buf[: 24 * n].view(torch.long).view(3, n), buf[24 * n :].view(torch.int32)


class _DoneEvent:
    """Stand-in for a CUDA event on CPU (work there is done when it returns)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class _Pending:
    """A decode step whose sampled tokens are still on their way to the host (EngineConfig.overlap)."""

    batch: list
    toks: torch.Tensor  # [B] on the device
    host: torch.Tensor  # [B], filled by a non-blocking copy
    ready: object  # CUDA event recorded after that copy (or _DoneEvent)
    logits: torch.Tensor | None  # the step's logits rows (record_logits only)
    # token_logprobs' tensors, copied to pinned host memory (SamplingParams.logprobs)
    logprobs: tuple | None = None


class Request:
    """One generation request and its place in the cache (engine-internal, readable for tests)."""

    _ids = itertools.count()

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, on_output, max_new: int
    ):
        self.id = request_id or f"req-{next(Request._ids)}"
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids)  # (a set: a long list is checked once per token)
        self.max_new = max_new
        self.all_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.on_output = on_output
        self.num_computed = 0  # tokens whose cache entries are written
        self.slot: int | None = None
        self.pages: list[int] = []
        self.admit_order = -1
        self.finished = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.aborted = False
        self.text = ""
        self.emitted = 0
        self.stop_hit = False  # a stop string matched: text is final
        self.detok = None
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None  # output-token counts (frequency / presence penalties)
        self.allowed: torch.Tensor | None = None  # [V] bool: the ids it may draw (params.allowed_token_ids)
        self.bad_seqs: list[tuple[int, ...]] = []  # token sequences of params.bad_words
        self.matcher = None  # params.guided: the llguidance matcher of its output so far
        self.guiding = False  # the matcher applies (from the start, or after a guided_start_token_ids token)
        self.seed: int | None = None  # sampled requests: the draw seed (params.seed, or a random one)
        self.logits_log: list[torch.Tensor] = []
        self.logprobs: list = []  # TokenLogprob per output token (params.logprobs)
        self.prompt_lps: list = []  # TokenLogprob per prompt token after the first (params.prompt_logprobs)
        self._prompt_lps_sent = False
        self.prefix_hit = 0
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.admit_time: float | None = None  # first admission (a preempted request keeps it)
        self.done_event = threading.Event()
        self._keys: list[tuple[int, bytes]] | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_logprobs(self) -> list | None:
        """``None`` for the first prompt token, then a TokenLogprob per prompt token (params.prompt_logprobs)."""
        return None if self.params.prompt_logprobs is None else [None, *self.prompt_lps]

    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_lps) < self.num_prompt - 1


class Engine:
    """Continuous-batching engine over :class:`PagedHybridCache`.

    >>> eng = Engine(model, tokenizer, page_size=16, max_seqs=8)
    >>> eng.generate(["def f(x):"], SamplingParams(max_tokens=16, temperature=0))[0].text
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, **overrides):
        cfg = config or EngineConfig()
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"unknown engine option {k!r}")
            setattr(cfg, k, v)
        _check_engine_config(cfg)
        if cfg.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {cfg.max_prefill_tokens}")
        if cfg.max_model_len is not None and cfg.max_model_len < 2:  # (else every request would be refused)
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and one to generate), got {cfg.max_model_len}"
            )
        gmu = cfg.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {gmu!r}")
        if cfg.mla_backend not in MLA_BACKENDS:
            raise ValueError(f"mla_backend must be one of {MLA_BACKENDS}, got {cfg.mla_backend!r}")
        self.cfg = cfg
        self.model = model.eval()
        self.mcfg = model.config
        self.tokenizer = tokenizer
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, model.model.embed_tokens.weight.dtype
        if self.device.type == "cuda":
            _import_fast_paths()
        # fp32 copies of the absorbed MLA weights (W_UK, W_UV), made once here rather than at every decode step
        # (before the cache pool is sized, so that a pool sized from free memory accounts for them)
        self._absorbed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                if layer.attn_type != "kda":
                    w_uk, w_uv = layer.self_attn.absorbed_weights()
                    self._absorbed[i] = (w_uk.float().contiguous(), w_uv.float().contiguous())
        cache_dtype = cfg.cache_dtype or self.dtype
        plan = plan_pool(
            self.mcfg,
            device=self.device,
            dtype=cache_dtype,
            page_size=cfg.page_size,
            max_seqs=cfg.max_seqs,
            max_tokens=cfg.max_tokens,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            reserve_bytes=self._reserve_bytes(),
        )
        self.plan = plan
        self.pool = PagedHybridCache(
            self.mcfg,
            num_pages=plan.num_pages,
            page_size=plan.page_size,
            max_seqs=plan.max_seqs,
            dtype=cache_dtype,
            device=self.device,
        )
        cap = plan.num_pages * plan.page_size if self.pool.layout.mla_layers else 1 << 62
        mml = min(self.mcfg.max_position_embeddings, cap)
        # what sets the context length, for the errors of requests that exceed it
        self._ctx_source = (
            f"the cache pool holds {cap} tokens (EngineConfig.max_tokens, --max-total-tokens)"
            if cap < self.mcfg.max_position_embeddings
            else "the model's max_position_embeddings"
        )
        if cfg.max_model_len is not None:
            if cfg.max_model_len > mml:
                raise ValueError(
                    f"max_model_len {cfg.max_model_len} exceeds what the model and the cache allow ({mml}); "
                    "raise --max-total-tokens or lower --max-model-len"
                )
            mml = cfg.max_model_len
            self._ctx_source = "max_model_len (--max-model-len)"
        self.max_model_len = mml
        snap_bytes = cfg.prefix_cache_bytes
        if snap_bytes is None:
            snap_bytes = max(64 << 20, 16 * self.pool.bytes_per_sequence)
        self.prefix = PrefixCache(self.pool, cfg.prefix_interval, snap_bytes) if cfg.prefix_cache else None
        self.eos_ids = self._eos_ids()
        self._guided = None  # openk3.infer.guided.GuidedCompiler, built for the first guided request
        # the tokenizer's special tokens (left out of generated text unless SamplingParams.skip_special_tokens is off)
        specials = getattr(tokenizer, "special_tokens", None) or {}
        self._special_ids = frozenset(int(i) for i in specials.values())
        self.tok_vocab = tokenizer.vocab_size if tokenizer is not None else self.mcfg.vocab_size
        if self.tok_vocab > self.mcfg.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tok_vocab} tokens but the model only {self.mcfg.vocab_size}"
            )
        # scheduling state
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # admitted (prefilling or decoding), admission order
        self.requests: dict[str, Request] = {}
        self._admit_counter = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._looping = threading.Event()  # set while a loop runs, in start()'s thread or in run_loop()
        self._loop_done = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self.metrics = dict.fromkeys(
            (
                "requests_total",
                "requests_finished_stop",
                "requests_finished_length",
                "requests_finished_abort",
                "requests_finished_error",
                "prompt_tokens_total",
                "prompt_tokens_computed",
                "generation_tokens_total",
                "preemptions_total",
                "steps_total",
                "decode_steps_total",
                "step_seconds_total",
                "engine_errors_total",
            ),
            0,
        )
        # request latencies (Prometheus histograms on /metrics): arrival = when the request was made (submit)
        self.latency = {
            "request_queue_time_seconds": LatencyHistogram(_LATENCY_BUCKETS),  # arrival -> first admission
            "time_to_first_token_seconds": LatencyHistogram(
                _LATENCY_BUCKETS
            ),  # arrival -> first output token
            "time_per_output_token_seconds": LatencyHistogram(
                _TOKEN_BUCKETS
            ),  # mean gap after the first token
            "e2e_request_latency_seconds": LatencyHistogram(
                _LATENCY_BUCKETS
            ),  # arrival -> finished (any reason)
        }
        # layer walk helpers
        inner = model.model
        self._seal_sites = {
            i: inner.block_sites(i)
            for i, layer in enumerate(inner.layers)
            if self.mcfg.use_attn_res and layer.seal
        }
        self._fused: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self._fused_ffn: dict[int, tuple[torch.Tensor, list[int]]] = {}
        if cfg.fuse_projections:
            self._build_fused_projections(self._input_projections, self._fused)
            self._fuse_kda_prefill()
        self._fused_ffn_out: dict[int, torch.Tensor] = {}
        if cfg.fuse_ffn_projections:
            self._build_fused_projections(lambda layer: layer.ffn_input_projections(), self._fused_ffn)
            self._build_fused_outputs()
        self._kda_step = resolve_kda_decode(self.device.type == "cuda", None, cfg.decode_backend, self.mcfg)
        # KDA layer -> (decay, gate) projections its decode step applies itself (fuse_kda_lowrank; empty: none)
        self._kda_lowrank: dict[int, tuple[bool, bool]] = {}
        if cfg.fuse_kda_lowrank:
            from openk3.infer import kernels as _kernels

            if self._kda_step is getattr(_kernels, "kda_decode_triton", None):
                self._kda_lowrank = self._plan_kda_lowrank(_kernels.kda_lowrank_ok)
            else:
                log.info("fuse_kda_lowrank: the decode step is not the Triton kernel here; the GEMV is kept")
        self._mla_step = resolve_mla_decode(self.device.type == "cuda", None, cfg.decode_backend, self.mcfg)
        # mla_backend="flashinfer": the step object, planned before each decode forward (_plan_mla)
        self._mla_fi = self._flashinfer_step() if cfg.mla_backend == "flashinfer" else None
        if self._mla_fi is not None:
            self._mla_step = self._mla_fi
        # the decode step's second stream (parallel_ffn branches); None: every op in place
        self._side_used = False  # whether this decode forward issued work on the side stream (_branch)
        self._side = (
            shared_stream(self.device, "side", priority=0)
            if self.device.type == "cuda" and cfg.parallel_ffn
            else None
        )
        # fuse_mla_glue: (prep step, post step or None when the MLA step applies it, {layer: (W_UK, W_UV)})
        self._mla_glue = self._plan_mla_glue() if cfg.fuse_mla_glue else None
        # triton_gemv: projections of few rows through openk3.infer.gemv (CUDA, or the Triton interpreter)
        self._gemv = bool(cfg.triton_gemv and (self.device.type == "cuda" or _gemv.INTERPRET))
        self._glu_gemv = bool(self._gemv and cfg.fuse_glu_gemv and cfg.parallel_ffn)
        self._norm_gemv = bool(self._gemv and cfg.fuse_norm_gemv)
        self._res_gemv = bool(self._gemv and cfg.gemv_residual)
        self._fold_norms = bool(
            self._res_gemv and cfg.fold_norms and cfg.fuse_add_norm and not self.mcfg.use_attn_res
        )
        # fold_norms with FOLD_SHARED "router": {layer: (the router's and the shared experts' gate / up rows in one
        # buffer, the shared experts as moe_small.SharedExperts)}
        self._router_shared = (
            self._plan_router_shared() if self._fold_norms and FOLD_SHARED == "router" else {}
        )
        # CUDA graphs (decode step, fixed batch buckets); a no-op off CUDA
        self.graphs_enabled = bool(cfg.use_cuda_graphs and self.device.type == "cuda")
        if self.graphs_enabled and any(layer.is_moe for layer in inner.layers):
            if _backend.resolve("moe", True, None) == "reference":
                log.warning("CUDA graphs disabled: the reference MoE path synchronises with the host")
                self.graphs_enabled = False
        self._graphs: dict[int, tuple] = {}
        self._decode_capture = GraphCapture()  # the decode graphs' memory pool and warm-up stream
        # prefill_graphs: the KDA layers' chunk calls of a prefill forward from CUDA graphs
        # (both prefill graph sets share one memory pool and warm-up stream: each consumes a graph's results
        # before the next replay)
        capturer = GraphCapture()
        self._chunk_graphs = None
        if cfg.prefill_graphs and self.device.type == "cuda" and self.pool.layout.kda_layers:
            from openk3.fast import kda as _fast_kda

            if _fast_kda.available()[0]:
                self._chunk_graphs = _fast_kda.ChunkGraphs(
                    cfg.max_prefill_tokens, max_seqs=cfg.max_seqs, capturer=capturer
                )
        # prefill_ffn_graphs: the FFN layers of a prefill forward from CUDA graphs
        self._ffn_graphs = None
        if cfg.prefill_ffn_graphs and self.device.type == "cuda" and self._ffn_graphs_ok():
            self._ffn_graphs = RowGraphs(cfg.max_prefill_tokens, step=FFN_GRAPH_STEP, capturer=capturer)
        # overlap: the decode step whose sampled tokens are still on the device
        self._pending: _Pending | None = None
        self._max_pages_per_seq = self.pool.pages_for(self.max_model_len)
        bmax = min(cfg.cuda_graph_max_batch, cfg.max_seqs)
        self._buckets = sorted(
            {b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < bmax} | {bmax}
        )

    # ------------------------------------------------------------------------------------------------ setup helpers
    @staticmethod
    def _input_projections(layer) -> list:
        """The Linear layers of one attention layer that read the layer input, in the decode step's order."""
        m = layer.self_attn
        if layer.attn_type == "kda":
            g = m.g_proj if m.full_rank_gate else m.g_a_proj
            return [m.q_proj, m.k_proj, m.v_proj, m.f_a_proj, m.b_proj, g]
        q = m.q_proj if m.q_lora_rank is None else m.q_a_proj
        return [q, m.kv_a_proj_with_mqa] + ([m.g_proj] if m.use_gate else [])

    def _plan_kda_lowrank(self, ok: Callable) -> dict[int, tuple[bool, bool]]:
        """Per KDA layer, whether the decode step can apply ``f_b_proj`` and a low-rank gate's ``g_b_proj`` itself
        (``ok``: :func:`openk3.infer.kernels.kda_lowrank_ok`), decided once from the weights."""
        plan = {}
        for i, layer in enumerate(self.model.model.layers):
            if layer.attn_type == "kda":
                m = layer.self_attn
                plan[i] = (ok(m, None)[0], not m.full_rank_gate and ok(m, None, "g_b_proj")[0])
        return plan

    def _flashinfer_step(self):
        """EngineConfig.mla_backend="flashinfer": the FlashInfer decode step for this model's MLA layers (None
        without MLA layers); a clear error where it cannot run."""
        from openk3.infer.mla_peer import FlashInferDecodeStep

        layers = [self.model.model.layers[i].self_attn for i in self.pool.layout.mla_layers]
        if not layers:
            log.info("mla_backend='flashinfer': the model has no MLA layers")
            return None
        if self.device.type != "cuda":
            raise ValueError(
                f"mla_backend='flashinfer' needs a CUDA device, the engine runs on {self.device}"
            )
        m = layers[0]
        if any((x.num_heads, x.scale, x.dc, x.dr) != (m.num_heads, m.scale, m.dc, m.dr) for x in layers):
            raise ValueError(
                "mla_backend='flashinfer': the MLA layers differ in heads, scale or latent widths"
            )
        return FlashInferDecodeStep(
            self.device, num_heads=m.num_heads, page_size=self.pool.page_size, scale=m.scale, kv_lora_rank=m.dc,
            rope_dim=m.dr, dtype=self.pool.dtype, max_pages_per_seq=self.pool.pages_for(self.max_model_len),
        )  # fmt: skip

    def _plan_mla(self, table: torch.Tensor, lengths: torch.Tensor, graph: bool) -> None:
        """The host-side plan of the coming decode forward's MLA step, where it needs one (mla_backend)."""
        if self._mla_fi is not None:
            self._mla_fi.plan(table, lengths, graph=graph)

    def _plan_mla_glue(self) -> tuple | None:
        """The MLA glue steps (EngineConfig.fuse_mla_glue): with the Triton MLA step, the Triton prep kernel and the
        post step folded into the MLA step, reading W_UK / W_UV as views of each layer's kv_b_proj weight (model
        dtype, no copy); otherwise the PyTorch references over the fp32 copies. None without MLA layers."""
        if not self._absorbed:
            return None
        from openk3.infer import kernels as _kernels

        if self._mla_step is getattr(_kernels, "mla_decode_triton", None):
            views = {i: self.model.model.layers[i].self_attn.absorbed_weights() for i in self._absorbed}
            return _kernels.mla_prep_triton, None, views
        if self._mla_fi is not None and hasattr(
            _kernels, "mla_post_triton"
        ):  # FlashInfer between our prep / post
            views = {i: self.model.model.layers[i].self_attn.absorbed_weights() for i in self._absorbed}
            return _kernels.mla_prep_triton, _kernels.mla_post_triton, views
        log.info(
            "fuse_mla_glue: the MLA step is not the Triton kernel here; the glue runs as PyTorch references"
        )
        return mla_prep_reference, mla_post_reference, self._absorbed

    @torch.no_grad()
    def _build_fused_projections(self, projections: Callable, out: dict) -> None:
        """Per layer, one buffer holding the weights of ``projections(layer)`` (Linear layers reading the same input)
        side by side, recorded in ``out[i] = (buffer, sizes)`` (see :func:`_share_buffer`). A layer with fewer than
        two such projections, or whose weights cannot share a buffer, is left unfused."""
        for i, layer in enumerate(self.model.model.layers):
            mods = projections(layer)
            buf = _share_buffer(mods, 0)
            if buf is not None:
                out[i] = (buf, [m.weight.shape[0] for m in mods])

    @torch.no_grad()
    def _fuse_kda_prefill(self) -> None:
        """Hand each KDA layer its fused input projections (``KimiDeltaAttention.fused_input``: the decode step's
        buffer, whose row blocks are q, k, v, f_a, b, g) and its q / k / v conv weights in one buffer
        (``fused_conv``, the conv modules' weights re-pointed to its views), for the model's own forward in
        prefill."""
        for i, layer in enumerate(self.model.model.layers):
            m = layer.self_attn
            if layer.attn_type != "kda" or i not in self._fused:
                continue
            buf, sizes = self._fused[i]
            HK = m.num_heads * m.head_dim
            if len(sizes) != 6 or sizes[:3] != [HK] * 3:
                continue
            m.fused_input = (buf, list(sizes))
            m.fused_conv = _share_buffer([m.q_conv1d, m.k_conv1d, m.v_conv1d], 0)

    @torch.no_grad()
    def _plan_router_shared(self) -> dict[int, tuple]:
        """Per plain MoE layer whose shared experts take the slot form (:meth:`_shared_slot`), one buffer holding the
        router's weight rows and then the shared experts' gate and up rows (the modules' weights re-pointed to its
        views, :func:`_share_buffer`; the layer's fused FFN input buffer becomes the view of the shared rows), so
        that the router's GEMV forms the shared experts' projections in the same launch (FOLD_SHARED "router"):
        ``{layer: (buffer, SharedExperts over the views)}``."""
        try:
            from openk3.fast import moe_small
        except Exception:  # (optional fast paths)
            return {}
        plan = {}
        for i, layer in enumerate(self.model.model.layers):
            moe = layer.block_sparse_moe if layer.is_moe else None
            sx = None if moe is None or moe.latent else self._shared_slot(moe_small, moe)
            if sx is None:
                continue
            sh = moe.shared_experts
            # (sx holds the modules' weight parameters, whose data become the new views)
            buf = _share_buffer([moe.gate, sh.gate_proj, sh.up_proj], 0)
            if buf is None:
                continue
            plan[i] = (buf, sx)
            if i in self._fused_ffn:  # [gate; up] of the shared experts: now rows of the new buffer
                self._fused_ffn[i] = (buf[moe.gate.weight.shape[0] :], self._fused_ffn[i][1])
        return plan

    @torch.no_grad()
    def _build_fused_outputs(self) -> None:
        """Per FFN whose output is a sum of two or more projections (latent MoE with shared experts: the latent up
        projection and the shared down projection), one ``[D, sum(in)]`` buffer with their weights side by side along
        the input dimension (column views, :func:`_share_buffer`)."""
        for i, layer in enumerate(self.model.model.layers):
            mods = layer.ffn_output_projections()
            buf = None if None in mods else _share_buffer(mods, 1)
            if buf is not None:
                self._fused_ffn_out[i] = buf

    def _reserve_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        # activations of a prefill chunk and decode batch, plus prefix snapshots: a rough, generous allowance
        from openk3.infer.cache import CacheLayout

        lay = CacheLayout.from_config(self.mcfg)
        snaps = self.cfg.prefix_cache_bytes or max(64 << 20, 16 * lay.bytes_per_sequence())
        graphs = 0
        if self.cfg.prefill_graphs and lay.kda_layers:
            # prefill_graphs: the buckets' static token inputs (~16 bytes per token and channel over all token
            # buckets), the shared graph pool's intermediates (fla's chunk forward keeps ~30 at the largest bucket)
            # and the initial states of every sequence bucket (twice max_seqs states in all)
            tokens = 1 << max(0, self.cfg.max_prefill_tokens - 1).bit_length()
            channels = self.mcfg.kda_num_heads * self.mcfg.kda_head_dim
            graphs = 48 * tokens * channels + 8 * self.cfg.max_seqs * channels * self.mcfg.kda_head_dim
        if self.cfg.prefill_ffn_graphs:
            graphs += self._ffn_graph_bytes()
        return snaps + graphs + (2 << 30)

    def _ffn_graph_bytes(self) -> int:
        """A generous allowance for ``prefill_ffn_graphs``: the static input and output rows (two buffers of
        ``max_prefill_tokens`` rows of the hidden width) and three times the estimated intermediates of the
        largest FFN call (a MoE layer's gathered rows, gate | up, activation and expert outputs per (token, slot);
        a dense layer's gate | up and activation): the graphs' shared pool, the warm-up stream's cached blocks
        and slack for fragmentation (H200, `medium` at 4,096 tokens: the reserved memory grew by 0.74-0.92 GiB
        more than without the graphs, bench/NOTES.md v40)."""
        c = self.mcfg
        tokens = -(-self.cfg.max_prefill_tokens // FFN_GRAPH_STEP) * FFN_GRAPH_STEP
        el = 4 if self.dtype == torch.float32 else 2
        per_token = 3 * c.intermediate_size + 2 * c.hidden_size
        if c.num_experts:
            width = c.routed_expert_hidden_size or c.hidden_size
            shared = 3 * c.moe_intermediate_size * max(1, c.num_shared_experts)
            moe = (
                c.num_experts_per_token * (2 * width + 3 * c.moe_intermediate_size + 4)
                + shared
                + 3 * c.hidden_size
            )
            per_token = max(per_token, moe)
        return el * tokens * (2 * c.hidden_size + 3 * per_token)

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer is not None and self.tokenizer.eos_id is not None:
            ids.add(int(self.tokenizer.eos_id))
        e = self.mcfg.eos_token_id
        if self.tokenizer is None and e is not None:
            ids.update([e] if isinstance(e, int) else list(e))
        return ids

    def memory_report(self) -> dict:
        r = self.pool.report()
        r["max_model_len"] = self.max_model_len
        r["plan"] = self.plan.source
        r["prefix_cache_bytes"] = self.prefix.max_bytes if self.prefix else 0
        r["fused_projection_layers"] = len(self._fused)
        r["fused_ffn_layers"] = len(self._fused_ffn)
        r["fused_ffn_output_layers"] = len(self._fused_ffn_out)
        r["router_shared_layers"] = len(self._router_shared)
        r["fused_mla_glue_layers"] = len(self._mla_glue[2]) if self._mla_glue else 0
        r["absorbed_weight_bytes"] = sum(a.numel() * 4 + b.numel() * 4 for a, b in self._absorbed.values())
        return r

    # ------------------------------------------------------------------------------------------------ public API
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, allow_special=True)
        if isinstance(prompt, torch.Tensor):
            if (
                prompt.ndim != 1
                or prompt.dtype.is_floating_point
                or prompt.dtype == torch.bool
                or prompt.is_complex()
            ):
                raise PromptError(
                    f"a prompt tensor must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}"
                )
            return prompt.tolist()
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
                raise PromptError(
                    f"a prompt array must be 1-D integer token ids, got {prompt.dtype} {prompt.shape}"
                )
            return prompt.tolist()
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise PromptError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if all(
            type(t) is int for t in ids
        ):  # the usual case (JSON ids, a tokenizer's output): nothing to convert
            return ids
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:  # a float would be truncated to another token, a bool read as 0 / 1
            raise PromptError(f"prompt token ids must be integers, got {bad[0]!r}")
        return [int(t) for t in ids]

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> Request:
        """Validate and build a request (``ValueError`` with a message for the client on bad input)."""
        params = (params or SamplingParams()).validate()
        ids = self.encode(prompt)
        if not ids:
            raise PromptError("the prompt is empty")
        V = self.tok_vocab  # the model's rows past the tokenizer's vocabulary are padding, never a token
        if min(ids) < 0 or max(ids) >= V:
            raise PromptError(f"prompt token ids must lie in [0, {V})")
        if params.truncate_prompt_tokens is not None:  # (vLLM's: -1 is the context length)
            k = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-k:] if params.truncation_side == "left" else ids[:k]
        n, ctx = len(ids), self.max_model_len
        if n >= ctx:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context length is {ctx}; shorten the prompt (at least one token "
                "must be left for the answer)"
            )
        if params.max_tokens is None:
            max_new = ctx - n
        else:
            max_new = params.max_tokens
            if n + max_new > ctx:
                raise ContextLengthError(
                    f"this model's maximum context length is {ctx} tokens; you requested {n + max_new} tokens "
                    f"({n} in the prompt, {max_new} for the completion); lower max_tokens or shorten the prompt "
                    f"(the limit comes from {self._ctx_source})"
                )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if params.bad_words and self.tokenizer is None:
            raise SamplingParamError("bad_words", "bad_words need a tokenizer")
        # token ids past the tokenizer's vocabulary are never drawn: a bias on one does nothing, a stop id never stops
        for name, ids_ in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            if ids_ and (top := max(ids_)) >= self.tok_vocab:
                raise SamplingParamError(
                    name, f"{name} token ids must lie in [0, {self.tok_vocab}), got {top}"
                )
        req = Request(ids, params, request_id, on_output, max_new)
        req.bad_seqs = self._bad_word_ids(params.bad_words)
        if params.guided is not None:
            if self._guided is None:
                from openk3.infer.guided import GuidedCompiler

                self._guided = GuidedCompiler(
                    self.tokenizer, self.eos_ids, compact_json=self.cfg.guided_compact_json
                )
            req.matcher = self._guided.matcher(params.guided)
            req.guiding = not params.guided_start_token_ids
        if self.tokenizer is not None:
            skip = (
                self._special_ids - set(params.keep_special_token_ids)
                if params.skip_special_tokens
                else frozenset()
            )
            req.detok = IncrementalDetokenizer(self.tokenizer, skip)
        if not params.greedy:
            req.seed = params.seed if params.seed is not None else random.getrandbits(63)
        return req

    def submit(
        self, prompt, params: SamplingParams | None = None, *, request_id=None, on_output=None
    ) -> Request:
        """Queue a request (thread-safe). Outputs are delivered through ``on_output`` from the engine's thread."""
        req = self.make_request(prompt, params, request_id=request_id, on_output=on_output)
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its pages and slot are freed at the next step."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self.active or self.waiting or self._pending is not None or not self._inbox.empty())

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[Request]:
        """Run ``prompts`` to completion (batched) and return the finished requests (``.output_ids``, ``.text``,
        ``.finish_reason``). Drives :meth:`step` itself unless the background loop is running."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.submit(p, sp, on_output=on_output) for p, sp in zip(prompts, plist)]
        if self.is_running():
            for r in reqs:
                r.done_event.wait()
        else:
            while not all(r.finished for r in reqs):
                self.step()
        return reqs

    def is_running(self) -> bool:
        """Whether the scheduling loop runs (:meth:`start`'s thread or :meth:`run_loop`)."""
        return self._looping.is_set()

    def run_loop(self, until: Callable[[], bool] | None = None) -> None:
        """Run the scheduling loop in the calling thread until :meth:`shutdown` (from another thread) or until
        ``until()`` returns true (checked between steps, at least every 50 ms).

        On CPU, run it in the thread that built the model, as ``openk3 serve`` does: a second thread doing torch work
        starts a second OpenMP thread team, and with more pool threads than cores libgomp stops spinning between
        parallel regions (the `tiny` model's decode in another thread: 3.5x slower on 2 cores, bench/NOTES.md v25)."""
        if self._thread is not None or self._looping.is_set():
            raise RuntimeError("the engine's loop is already running")
        self._stop = False
        self._loop(torch.get_num_threads(), until)

    def start(self) -> None:
        """Run the scheduling loop in a daemon thread (see :meth:`run_loop` for the CPU caveat)."""
        if self._thread is not None:
            return
        if self._looping.is_set():
            raise RuntimeError("the engine's loop is already running (run_loop)")
        self._stop = False
        n_threads = torch.get_num_threads()  # new threads do not inherit torch's intra-op setting everywhere
        self._thread = threading.Thread(
            target=self._loop, args=(n_threads,), name="openk3-engine", daemon=True
        )
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after its current step (safe from a signal handler); :meth:`shutdown` also waits."""
        self._stop = True
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (waiting up to ``timeout`` s for it) and abort whatever is still queued or running."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
            self._thread = None
        elif self._looping.is_set():  # run_loop in another thread
            if not self._loop_done.wait(timeout):
                return
        with torch.no_grad():  # nobody will step these any more: finish them so that waiters return
            self._drain_inbox()
            for r in list(self.active) + list(self.waiting):
                self._finish(r, "abort")
            self._pending = None  # (its rows are finished: their tokens would be dropped anyway)

    def _loop(self, n_threads: int, until: Callable[[], bool] | None = None) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(n_threads)
        self._loop_done.clear()
        self._looping.set()
        try:
            while not self._stop and not (until is not None and until()):
                self._wake.clear()
                if not self.has_work():
                    self._wake.wait(0.05)
                    continue
                try:
                    self.step()
                except Exception:  # step() handles its own errors; this is the last line of defence
                    log.exception("engine loop error")
                    time.sleep(0.01)
        finally:
            self._looping.clear()
            self._loop_done.set()

    # ------------------------------------------------------------------------------------------------ scheduling
    def step(self) -> None:
        """One scheduler iteration (see the module docstring). Errors fail the running requests, not the engine."""
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self._drain_inbox()
                self._admit()
                self._run_prefill()
                self._finish_scored()
                self._run_decode()
        except Exception as e:  # never let one bad step kill the server
            log.exception("engine step failed")
            self._pending = None
            self.metrics["engine_errors_total"] += 1
            for r in list(self.active) + list(self.waiting):
                try:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                except Exception:  # keep failing the others; the request is dropped either way
                    log.exception("could not release %s", r.id)
                    r.finished, r.finish_reason = True, "error"
                    r.done_event.set()
            self.active = [r for r in self.active if not r.finished]
            self.waiting = deque(r for r in self.waiting if not r.finished)
        self.metrics["steps_total"] += 1
        self.metrics["step_seconds_total"] += time.perf_counter() - t0

    def _finish_scored(self) -> None:
        """Requests of max_tokens 0 whose prompt is prefilled (its logprobs computed): finished, no token drawn."""
        for r in list(self.active):
            if r.max_new == 0 and not r.finished and r.num_computed >= len(r.all_ids) - 1:
                self._finish(r, "length")

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, x = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.requests[x.id] = x
                self.waiting.append(x)
                self.metrics["requests_total"] += 1
                self.metrics["prompt_tokens_total"] += x.num_prompt
            elif kind == "abort":
                r = self.requests.get(x)
                if r is not None and not r.finished:
                    self._finish(r, "abort")

    def _admit(self) -> None:
        ps = self.pool.page_size
        while self.waiting and len(self.active) < self.cfg.max_seqs and self.pool.num_free_slots:
            req = self.waiting[0]
            target = len(req.all_ids) - 1
            snap = (
                self.prefix.lookup(req.all_ids, target, record=False)
                if (self.prefix and target > 0 and not req.wants_prompt_logprobs())
                else None
            )
            hit = snap.length if snap else 0
            shared = hit // ps
            need = self.pool.pages_for(len(req.all_ids)) - shared
            if self.pool.num_reclaimable_pages - shared < need + 1 and self.active:
                return  # wait for running requests to free pages
            self.waiting.popleft()
            if self.prefix is not None and target > 0:
                self.prefix.record(hit)
            req.slot = self.pool.alloc_slot()
            req.admit_order = next(self._admit_counter)
            if req.admit_time is None:
                req.admit_time = time.monotonic()
                self.latency["request_queue_time_seconds"].observe(req.admit_time - req.arrival)
            req.pages = []
            self.active.append(req)
            if snap is not None:
                for p in snap.pages[:shared]:
                    self.pool.share_page(p)
                    req.pages.append(p)
                if (
                    hit % ps
                ):  # copy the partly used page; hold it while allocating (eviction may drop the snapshot)
                    src = snap.pages[shared]
                    self.pool.share_page(src)
                    dst = self._alloc_page()
                    if dst is None:
                        self.pool.release_pages([src])
                        hit = shared * ps
                    else:
                        self.pool.copy_page(src, dst)
                        self.pool.release_pages([src])
                        req.pages.append(dst)
                if hit == snap.length:
                    self.pool.load_slot(req.slot, snap.state, snap.conv)
                else:  # could not copy the partial page: start over without the prefix
                    self.pool.release_pages(req.pages)
                    req.pages, hit = [], 0
            if hit == 0:
                self.pool.reset_slot(req.slot)
            req.num_computed = hit
            req.prefix_hit = max(req.prefix_hit, hit)
            if req.params.repetition_penalty != 1.0:
                req.seen = torch.zeros(self.mcfg.vocab_size, dtype=torch.bool, device=self.device)
                req.seen.index_fill_(0, device_tensor(req.all_ids, torch.long, self.device), True)
            if req.params.frequency_penalty != 0.0 or req.params.presence_penalty != 0.0:
                req.counts = torch.zeros(self.mcfg.vocab_size, dtype=torch.float32, device=self.device)
                if req.output_ids:  # re-admitted after a preemption
                    out = device_tensor(req.output_ids, torch.long, self.device)
                    req.counts.index_add_(0, out, torch.ones_like(out, dtype=torch.float32))

    def _alloc_page(self) -> int | None:
        while True:
            p = self.pool.alloc_page()
            if p is not None:
                return p
            if self.prefix is None or not self.prefix.evict_lru():
                return None

    def _ensure_pages(self, req: Request, tokens: int) -> bool:
        """Make ``req`` hold pages for its first ``tokens`` tokens, preempting the newest requests if needed.
        Returns False when ``req`` itself had to be preempted."""
        while len(req.pages) < self.pool.pages_for(tokens):
            p = self._alloc_page()
            if p is None:
                victim = max(self.active, key=lambda r: r.admit_order)
                self._preempt(victim)
                if victim is req:
                    return False
                continue
            req.pages.append(p)
        return True

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pool.release_pages(req.pages)
            req.pages = []
        if req.slot is not None:
            self.pool.free_slot(req.slot)
            req.slot = None
        if req in self.active:
            self.active.remove(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.metrics["preemptions_total"] += 1

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.finished:
            return
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finished, req.finish_reason, req.error = True, reason, error
        self.metrics[f"requests_finished_{reason}"] += 1
        now = time.monotonic()
        self.latency["e2e_request_latency_seconds"].observe(now - req.arrival)
        if reason in ("stop", "length") and req.first_token_time is not None and len(req.output_ids) > 1:
            gap = (now - req.first_token_time) / (len(req.output_ids) - 1)
            self.latency["time_per_output_token_seconds"].observe(gap)
        tail = ""
        if reason in ("stop", "length") and req.detok is not None and not req.stop_hit:
            tail = self._extend_text(req, req.detok.flush(), final=True)
        self._emit(req, [], tail)
        self.requests.pop(req.id, None)
        req.done_event.set()

    def _emit(self, req: Request, new_ids: list[int], text: str, lps: list | None = None) -> None:
        if req.on_output is None:
            return
        prompt_lps = None
        if req.params.prompt_logprobs is not None and not req._prompt_lps_sent:
            prompt_lps, req._prompt_lps_sent = req.prompt_logprobs, True
        out = RequestOutput(
            req.id,
            new_ids,
            text,
            req.finished,
            req.finish_reason,
            req.num_prompt,
            len(req.output_ids),
            req.error,
            new_logprobs=lps if req.params.logprobs is not None else None,
            prompt_logprobs=prompt_lps,
        )
        try:
            req.on_output(out)
        except Exception:  # a consumer that went away must not stop the engine
            log.debug("output callback of %s failed", req.id, exc_info=True)

    def _extend_text(self, req: Request, delta: str, final: bool = False) -> str:
        """Append decoded text, apply stop strings; returns the text that may be sent now."""
        if req.stop_hit:
            return ""
        stops = req.params.stop
        start = len(req.text)
        req.text += delta
        # (vLLM: stop strings are looked for once min_tokens are out; one ending before then never ends the text)
        keep_stop = req.params.include_stop_str_in_output
        if stops and len(req.output_ids) >= req.params.min_tokens:
            i, hit = find_stop(req.text, stops, start, with_stop=True)
            if i >= 0:
                req.text = req.text[: i + len(hit)] if keep_stop else req.text[:i]
                final = req.stop_hit = True
        # (text that may start a stop string is held back, unless a stop would be sent anyway)
        hold = not (final or not stops or keep_stop)
        upto = len(req.text) - stop_holdback(req.text, stops) if hold else len(req.text)
        upto = max(upto, req.emitted)
        out = req.text[req.emitted : upto]
        req.emitted = upto
        return out

    # ------------------------------------------------------------------------------------------------ prefill
    def _run_prefill(self) -> None:
        budget = self.cfg.max_prefill_tokens
        # A prefill piece costs one eager forward, which costs about the same whatever its length (host-bound;
        # bench/NOTES.md v35): a piece cut short by the little budget a step has left is deferred to the next
        # step, where it gets a whole budget. A request that fits in the leftover still goes.
        min_piece = max(1, self.cfg.max_prefill_tokens // 4)
        packed: list[tuple[Request, int, int]] = []  # batch_prefill: one piece per request, one forward
        for req in list(self.active):
            if budget <= 0:
                break
            target = len(req.all_ids) - 1
            while req.num_computed < target and budget > 0 and req.slot is not None:
                start = req.num_computed
                end = min(target, start + budget)
                if end < target and end - start < min_piece:
                    break
                if not self._ensure_pages(req, end):
                    break
                budget -= end - start
                if self.cfg.batch_prefill:
                    packed.append((req, start, end))
                    break
                self._prefill_chunk(req, start, end)
                self._prefilled(req, start, end)
        # a request preempted for another's pages after its piece was planned has lost its slot and restarts at 0
        packed = [p for p in packed if p[0].slot is not None and p[0].num_computed == p[1]]
        if len(packed) == 1:
            self._prefill_chunk(*packed[0])
        elif packed:
            self._prefill_packed(packed)
        for req, start, end in packed:
            self._prefilled(req, start, end)

    def _prefilled(self, req: Request, start: int, end: int) -> None:
        """Book a prefilled piece: the request's progress, and a prefix snapshot where it ends on the interval."""
        self.metrics["prompt_tokens_computed"] += end - start
        req.num_computed = end
        if self.prefix is not None and end % self.prefix.interval == 0:
            self._snapshot(req, end)

    def _snapshot(self, req: Request, length: int, state: tuple | None = None) -> None:
        """Prefix snapshot of ``req``'s first ``length`` tokens (a multiple of the interval): the slot's KDA state,
        or ``state`` (``PrefixCache.insert``), and the pages of those tokens (their latents written already)."""
        if req._keys is None or length not in req._keys:  # (decode snapshots reach past the prompt)
            req._keys = dict(self.prefix.block_keys(req.all_ids, len(req.all_ids)))
        self.prefix.insert(req._keys[length], req.all_ids, length, req.pages, req.slot, state=state)

    def _mla_prefix(self, li: int, req: Request, start: int) -> dict:
        """MLA layer ``li``'s dict cache of ``req``'s first ``start`` tokens, gathered from the pages ({} at 0)."""
        if start == 0:
            return {}
        dc = self.pool.layout.kv_lora_rank
        lat = self.pool.gather_latent(self.pool.pool_index[li], req.pages, start)[None]
        return {"c": lat[..., :dc], "kr": lat[..., dc:]}

    def _write_latents(self, req: Request, start: int, end: int, caches: dict[int, dict]) -> None:
        """Write tokens [start, end) of ``req``'s MLA layers' dict caches (``caches[li]``, extended by the forward
        from ``_mla_prefix``) into its pages."""
        if not caches:
            return
        rows = self.pool.slot_mapping(req.pages, start, end)
        for li, d in caches.items():
            lat = torch.cat([d["c"][0, start:end], d["kr"][0, start:end].to(d["c"].dtype)], dim=-1)
            self.pool.write_latent(self.pool.pool_index[li], rows, lat)

    def _prefill_chunk(self, req: Request, start: int, end: int) -> None:
        """Prefill tokens [start, end) of one sequence in one forward (``_prefill_pieces``)."""
        self._prefill_pieces([(req, start, end)])

    def _prefill_packed(self, pieces: list[tuple[Request, int, int]]) -> None:
        """Prefill one piece of each of several sequences in one forward (``batch_prefill``; ``_prefill_pieces``)."""
        self._prefill_pieces(pieces)

    def _inner_snaps(self, start: int, end: int) -> list[int]:
        """The interval's multiples strictly inside (start, end): where a chunk takes prefix snapshots inside."""
        if self.prefix is None:
            return []
        n = self.prefix.interval
        return list(range((start // n + 1) * n, end, n))

    def _inner_snapshots(self, req: Request, inner: list[int], snaps: list) -> None:
        """Book ``req``'s snapshots at positions ``inner`` from the KDA layers' ``cache["snaps"]`` lists (``snaps``:
        one per KDA layer, each one ``(state, conv)`` per position, batch of one). Called after the chunk's latents
        are written: a snapshot holds the pages of its tokens."""
        pool, s = self.pool, req.slot
        for k, p in enumerate(inner):
            per_layer = [sn[k] for sn in snaps]
            if per_layer:
                state = torch.stack([st[0] for st, _ in per_layer])
                conv = torch.stack([torch.stack([cv["q"][0], cv["k"][0], cv["v"][0]]) for _, cv in per_layer])
            else:  # no KDA layers: the (empty) slot state
                state, conv = pool.state[:, s].clone(), pool.conv[:, s].clone()
            self._snapshot(req, p, state=(state, conv))

    def _prefill_pieces(self, pieces: list[tuple[Request, int, int]]) -> None:
        """Prefill one piece [start, end) of each of ``pieces``' sequences in one forward through the model's own
        layers (chunked KDA / MHA-form MLA paths and their fast backends), with per-layer dict caches built from
        and written back to the pool. Several pieces are packed along the token axis as varlen sequences
        (``cu_seqlens``): each KDA layer starts every sequence from its own state and conv history, each MLA layer
        projects all tokens at once and attends per sequence over its cached prefix and its new tokens (where every
        piece starts its sequence, in one varlen attention call over all of them). A single
        piece runs unpacked. Prefix snapshots at the interval's multiples inside the pieces come from the KDA
        layers (``snap_at``)."""
        pool, lay = self.pool, self.pool.layout
        one = len(pieces) == 1
        slots = device_tensor([req.slot for req, _, _ in pieces], torch.long, pool.state.device)
        offs = [0]
        for _, start, end in pieces:
            offs.append(offs[-1] + end - start)
        cu_cpu = None if one else torch.tensor(offs, dtype=torch.long)
        cu = None if one else device_tensor(cu_cpu, torch.long, self.device)
        caches: dict[int, dict] = {}
        for li in lay.kda_layers:
            j = pool.pool_index[li]
            conv = pool.conv[j].index_select(0, slots)
            state = pool.state[j].index_select(0, slots)
            caches[li] = {"conv_q": conv[:, 0], "conv_k": conv[:, 1], "conv_v": conv[:, 2], "state": state}
        inner = [self._inner_snaps(start, end) for _, start, end in pieces]
        if any(inner):  # per sequence when packed, the one list otherwise
            at = [[p - start for p in ps] for ps, (_, start, _) in zip(inner, pieces)]
            for li in lay.kda_layers:
                caches[li]["snap_at"] = at[0] if one else at
        prior = {li: [self._mla_prefix(li, req, start) for req, start, _ in pieces] for li in lay.mla_layers}
        fresh = not one and all(start == 0 for _, start, _ in pieces)

        def attn(i, layer, x):
            mod = layer.self_attn
            if i in caches:
                return mod(x, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, cache=caches[i])
            if one:
                return mod(x, cache=prior[i][0])
            T = x.shape[1]
            q = mod.project_q(x).view(1, T, mod.num_heads, mod.dn + mod.dr)
            c, kr = mod.latent(x)
            if fresh:  # every piece starts its sequence: one varlen (block-diagonal causal) attention for all
                o = mod.attend(q, c, kr, x.dtype, cu_seqlens=cu_cpu)
                for n, (a, b) in enumerate(zip(offs[:-1], offs[1:])):  # the latents to write to the pages
                    prior[i][n]["c"], prior[i][n]["kr"] = c[:, a:b], kr[:, a:b]
                return mod.output(o, x)
            o = [
                mod.attend(q[:, a:b], c[:, a:b], kr[:, a:b], x.dtype, cache=prior[i][n])
                for n, (a, b) in enumerate(zip(offs[:-1], offs[1:]))
            ]
            return mod.output(torch.cat(o, dim=1), x)

        ids = [t for req, start, end in pieces for t in req.all_ids[start:end]]
        emb = self.model.model.embed_tokens(device_tensor([ids], torch.long, self.device))
        with self._chunk_graph_scope():
            h = self._walk(
                emb, attn, ffn=self._prefill_ffn(), read_norm=self.cfg.fuse_read_norm, ffn_adds=True
            )
        for n, (req, start, end) in enumerate(pieces):
            if req.wants_prompt_logprobs():
                self._prompt_logprobs(req, h[0, offs[n] : offs[n + 1]], start, end)
        for li in lay.kda_layers:
            j, d = pool.pool_index[li], caches[li]
            conv = torch.stack([d["conv_q"], d["conv_k"], d["conv_v"]], dim=1)
            pool.conv[j].index_copy_(0, slots, conv.to(pool.conv.dtype))
            pool.state[j].index_copy_(0, slots, d["state"].to(pool.state.dtype))
        for n, (req, start, end) in enumerate(pieces):
            self._write_latents(req, start, end, {li: prior[li][n] for li in lay.mla_layers})
            if inner[n]:  # after the latents: a snapshot holds the pages of its tokens
                snaps = [caches[li]["snaps"] if one else caches[li]["snaps"][n] for li in lay.kda_layers]
                self._inner_snapshots(req, inner[n], snaps)

    def _prefill_ffn(self) -> Callable:
        """The prefill walk's FFN call, ``res + ffn(x)``: through ``prefill_ffn_graphs``' CUDA graphs where they
        take it, eagerly otherwise (a layer that records its router output stays eager: a replay would not
        record)."""
        rg = self._ffn_graphs

        def ffn(i, layer, x, res):
            m = layer.ffn
            if rg is not None and not getattr(m, "record_router", False):
                y = rg.run(i, m, x, add=res)
                if y is not None:
                    return y
            return res + m(x)

        return ffn

    def _ffn_graphs_ok(self) -> bool:
        """Whether the FFN layers can be captured: not with the reference MoE path, nor where the grouped GEMMs of
        many tokens fall back to one GEMM per expert (not bf16, or no ``torch._grouped_mm``): both read the
        per-expert row counts back to the host."""
        if any(layer.is_moe for layer in self.model.model.layers):
            if _backend.resolve("moe", True, None) == "reference":
                log.info("prefill FFN graphs off: the reference MoE path synchronises with the host")
                return False
            from openk3.fast.moe import grouped_mm_ok

            if self.dtype != torch.bfloat16 or not grouped_mm_ok(torch.bfloat16):
                log.info("prefill FFN graphs off: the MoE layers' per-expert GEMMs synchronise with the host")
                return False
        return True

    def _chunk_graph_scope(self):
        """The prefill forward's KDA chunk calls through ``prefill_graphs``' CUDA graphs (a no-op without them)."""
        if self._chunk_graphs is None:
            return contextlib.nullcontext()
        from openk3.fast.kda import chunk_graphs

        return chunk_graphs(self._chunk_graphs)

    def _prompt_logprobs(self, req: Request, h: torch.Tensor, start: int, end: int) -> None:
        """Record the prompt tokens' logprobs that positions [start, end) predict (``h``: their final hidden
        states), those not recorded yet (a preempted request recomputes from 0), in pieces of 256 positions so that
        the fp32 logits stay small."""
        k = req.params.prompt_logprobs
        p0 = max(start, len(req.prompt_lps))  # position p predicts prompt token p + 1
        p1 = min(end, req.num_prompt - 1)
        for a in range(p0, p1, 256):
            b = min(p1, a + 256)
            logits = self._lin(h[a - start : b - start], self.model.output_weight, torch.float32)  # as decode
            self._mask_vocab(logits)
            ids = req.all_ids[a + 1 : b + 1]
            tl = token_logprobs(logits, device_tensor(ids, torch.long, logits.device), k)
            req.prompt_lps.extend(logprob_entries(*tl, ids, [k] * len(ids)))

    # ------------------------------------------------------------------------------------------------ layer walk
    def _walk(
        self,
        r: torch.Tensor,
        attn: Callable,
        ffn: Callable | None = None,
        residual: bool = False,
        read_norm: bool = False,
        ffn_adds: bool = False,
    ) -> torch.Tensor:
        """``K3Model.forward`` with the attention call (and optionally the FFN call, ``ffn(i, layer, x_normed)``)
        replaced: r [B, T, D] embeddings -> final-normed hidden. ``residual``: ``attn`` and ``ffn`` take ``res=``
        and return ``res`` plus their output (so that they can fold the add into a GEMM); ``ffn_adds``: only ``ffn``
        does. ``read_norm``: each AttnRes read and the RMSNorm after it through the reader's ``read_normed`` (one
        launch on the fast path)."""
        cfg, inner = self.mcfg, self.model.model
        reader = (
            make_reader(
                cfg.rms_norm_eps, r.is_cuda, inner.attnres_backend, max_sources=inner.num_sealed_sets()
            )
            if cfg.use_attn_res
            else None
        )

        def read(site, r, norm):  # norm(AttnRes read at site)
            if read_norm:
                return reader.read_normed(*site, r, norm)
            return norm(reader.read(*site, r))

        for i, layer in enumerate(inner.layers):

            def a(x, res=None, i=i, layer=layer):  # res + attention(x), or attention(x) alone; x normed
                if res is None:
                    return attn(i, layer, x)
                return attn(i, layer, x, res=res) if residual else res + attn(i, layer, x)

            def f(x, res, i=i, layer=layer):  # res + ffn(x); x normed
                if ffn is None:
                    return res + layer.ffn(x)
                return ffn(i, layer, x, res=res) if residual or ffn_adds else res + ffn(i, layer, x)

            if not layer.use_attn_res:
                r = a(layer.input_layernorm(r), r)
                r = f(layer.post_attention_layernorm(r), r)
                continue
            if reader.num_sealed:
                x = read(layer.site("self_attention"), r, layer.input_layernorm)
            else:
                x = layer.input_layernorm(r)
            if layer.seal:
                reader.seal(r, self._seal_sites[i])
                r = a(x)
            else:
                r = a(x, r)
            r = f(read(layer.site("mlp"), r, layer.post_attention_layernorm), r)
        if cfg.use_attn_res:
            return read(inner.output_site(), r, inner.norm)
        return inner.norm(r)

    # ------------------------------------------------------------------------------------------------ decode
    def _run_decode(self) -> None:
        if self.cfg.overlap:
            self._run_decode_overlap()
            return
        ready = [r for r in self.active if r.num_computed == len(r.all_ids) - 1]
        batch = self._decode_batch(ready)
        if not batch:
            return
        logits = self._decode_logits(*self._decode_inputs(batch))
        self.metrics["decode_steps_total"] += 1
        for r in batch:
            r.num_computed += 1
        self._decode_snapshots(batch)
        toks = self._sample_rows(batch, logits)
        lps = self._logprob_rows(batch, logits, toks)
        self._append_tokens(batch, toks.tolist(), logits, lps)

    def _decode_snapshots(self, batch: list[Request]) -> None:
        """``prefix_cache_outputs``: a prefix snapshot of each row of the decode step just launched whose cache now
        ends on a multiple of the interval past its prompt (the slot holds exactly that state until the next step)."""
        if self.prefix is None or not self.cfg.prefix_cache_outputs:
            return
        n = self.prefix.interval
        for r in batch:
            L = r.num_computed
            if L % n == 0 and L >= r.num_prompt and r.slot is not None and len(r.all_ids) >= L:
                self._snapshot(r, L)

    def _logprob_rows(self, batch: list[Request], logits: torch.Tensor, toks: torch.Tensor) -> tuple | None:
        """token_logprobs of the step's rows when any asks for them (params.logprobs), on the device."""
        ks = [r.params.logprobs for r in batch if r.params.logprobs is not None]
        return token_logprobs(logits, toks, max(ks)) if ks else None

    def _append_tokens(
        self, batch: list[Request], toks: list[int], logits: torch.Tensor | None, lps: tuple | None = None
    ) -> None:
        """Append each row's sampled token (and, with record_logits, its logits row; with ``lps``, the rows'
        :meth:`_logprob_rows` tensors, its TokenLogprob); rows finished meanwhile (an abort while the tokens were
        on their way) are skipped."""
        entries = [None] * len(batch)
        if lps is not None:
            entries = logprob_entries(*lps, toks, [r.params.logprobs for r in batch])
        for b, (r, t) in enumerate(zip(batch, toks)):
            if r.finished:
                continue
            if self.cfg.record_logits:
                r.logits_log.append(logits[b].float().cpu())
            self._append_token(r, int(t), entries[b])

    def _decode_batch(self, ready: list[Request]) -> list[Request]:
        """The rows of the next decode step, in admission order, each with a page for its new token."""
        batch = []
        for req in sorted(ready, key=lambda r: r.admit_order):
            if req.slot is None or req.finished:
                continue
            if self._ensure_pages(req, req.num_computed + 1):
                batch.append(req)
        return [
            r for r in batch if r.slot is not None
        ]  # a later allocation may have preempted an earlier one

    def _mask_vocab(self, logits: torch.Tensor) -> None:
        """Logits of ids the tokenizer cannot produce (a model vocabulary padded past it) set to -inf, in place."""
        if self.tok_vocab < logits.shape[-1]:
            logits[:, self.tok_vocab :] = float("-inf")

    def _sample_rows(self, batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Next token ids [B] (on the logits' device) of ``batch``'s rows of ``logits``."""
        self._mask_vocab(logits)
        keep = self._keep_masks(batch, logits)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        logits = _add_logit_bias(logits, [self._row_bias(r) for r in batch])
        seen = _stack_rows([r.seen for r in batch], logits, torch.bool)
        counts = _stack_rows([r.counts for r in batch], logits, torch.float32)
        return sample(
            logits,
            temperature=[r.params.temperature for r in batch],
            top_k=[r.params.top_k for r in batch],
            top_p=[r.params.top_p for r in batch],
            repetition_penalty=[r.params.repetition_penalty for r in batch],
            seen=seen,
            counts=counts,
            frequency_penalty=[r.params.frequency_penalty for r in batch],
            presence_penalty=[r.params.presence_penalty for r in batch],
            min_p=[r.params.min_p for r in batch],
            keys=sample_keys([r.seed or 0 for r in batch], [len(r.output_ids) for r in batch])
            if any(r.seed is not None for r in batch)
            else None,
        )

    def _keep_masks(self, batch: list[Request], logits: torch.Tensor) -> torch.Tensor | None:
        """[B, V] bool of the ids each row may draw (``allowed_token_ids``, and a guided request's matcher mask:
        first, as vLLM's processors), or None when no row restricts its draw."""
        allowed = [r.params.allowed_token_ids is not None for r in batch]
        guided = [r.guiding for r in batch]
        if not any(allowed) and not any(guided):
            return None
        V, dev = logits.shape[-1], logits.device
        # (one mask per row, stacked: indexing the batch with a Python list of rows would copy it to the device
        # with a synchronising call)
        ones = torch.ones(V, dtype=torch.bool, device=dev)
        masks = []
        for r, a in zip(batch, allowed):
            if a and r.allowed is None:
                r.allowed = torch.zeros(V, dtype=torch.bool, device=dev).index_fill_(
                    0, device_tensor(r.params.allowed_token_ids, torch.long, dev), True
                )
            masks.append(r.allowed if a else ones)
        if any(guided):
            from openk3.infer.guided import mask_words_to_bool

            rows = [b for b, g in enumerate(guided) if g]
            words = self._guided.mask_words([batch[b].matcher for b in rows])  # (several: one parallel call)
            g = mask_words_to_bool(device_tensor(torch.from_numpy(words), torch.int32, dev), V)
            for b, gb in zip(rows, g.unbind(0)):
                masks[b] = masks[b] & gb
        return torch.stack(masks)

    def _row_bias(self, req: Request) -> dict[int, float] | None:
        """The biases added to ``req``'s next logits: its ``logit_bias``, and while fewer than ``min_tokens`` tokens
        are out, -inf on the ids that would end it (its stop ids, and end-of-sequence unless ``ignore_eos``)."""
        p = req.params
        ban = set()
        if len(req.output_ids) < p.min_tokens:
            ban |= req.stop_ids if p.ignore_eos else req.stop_ids | self.eos_ids
        out = req.output_ids
        # bad words (vLLM's rule): a word's last token, where the output ends with its other tokens
        for seq in req.bad_seqs:
            head = len(seq) - 1
            if head == 0 or (head <= len(out) and tuple(out[len(out) - head :]) == seq[:-1]):
                ban.add(seq[-1])
        if not ban:
            return p.logit_bias
        return {**(p.logit_bias or {}), **dict.fromkeys(ban, float("-inf"))}

    def _bad_word_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """The token sequences of ``bad_words``, as vLLM forms them: each word (leading spaces stripped) as it is,
        and after a space where that gives as many tokens with another first one (a word inside the text)."""
        seqs: list[tuple[int, ...]] = []
        for w in words:
            bare = tuple(self.tokenizer.encode(w.lstrip(), allow_special=False))
            spaced = tuple(self.tokenizer.encode(" " + w.lstrip(), allow_special=False))
            seqs.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                seqs.append(spaced)
        return seqs

    def _last_token_is_final(self, req: Request) -> bool:
        """Whether the pending token of ``req`` ends it by length (known before the token itself)."""
        return len(req.output_ids) + 1 >= req.max_new or len(req.all_ids) + 1 >= self.max_model_len

    def _run_decode_overlap(self) -> None:
        """EngineConfig.overlap: launch step t+1 (rows whose input token is step t's sample, still on the device,
        and rows whose input is known here), then take step t's tokens to the host and append them while the GPU
        runs step t+1, then sample step t+1 for the rows still running and leave its tokens pending."""
        pend = self._pending
        on_dev = {}  # request id -> row of pend.toks (finished or preempted rows are not active: never ready)
        if pend is not None:
            on_dev = {
                id(r): k
                for k, r in enumerate(pend.batch)
                if r.num_computed == len(r.all_ids) and not self._last_token_is_final(r)
            }
        ready = [r for r in self.active if r.num_computed == len(r.all_ids) - 1 or id(r) in on_dev]
        batch = self._decode_batch(ready)
        if batch:
            meta, lengths, table, B = self._decode_inputs(batch)
            swap = [(b, on_dev[id(r)]) for b, r in enumerate(batch) if id(r) in on_dev]
            logits = self._decode_logits(
                meta, lengths, table, B, ids_from=(swap, pend.toks) if swap else None
            )
            self.metrics["decode_steps_total"] += 1
            for r in batch:
                r.num_computed += 1
        if pend is not None:  # step t's tokens, while step t+1 runs
            self._pending = None
            pend.ready.synchronize()
            self._append_tokens(pend.batch, pend.host.tolist(), pend.logits, pend.logprobs)
        if not batch:
            return
        # (after step t's tokens: the ids that step t + 1 fed are known now; its states wait in the slots until
        # step t + 2 is launched, and the snapshot's copies queue behind step t + 1 on the stream)
        self._decode_snapshots([r for r in batch if not r.finished])
        # rows that stopped at step t: their step t+1 is discarded
        keep = [b for b, r in enumerate(batch) if not r.finished]
        if not keep:
            return
        rows = [batch[b] for b in keep]
        lg = logits if len(keep) == len(batch) else logits[device_tensor(keep, torch.long, logits.device)]
        toks = self._sample_rows(rows, lg)
        host = _to_host(toks)
        lps = self._logprob_rows(rows, lg, toks)
        if lps is not None:
            lps = tuple(_to_host(t) for t in lps)
        ready_ev = torch.cuda.Event() if toks.is_cuda else _DoneEvent()
        ready_ev.record()
        self._pending = _Pending(rows, toks, host, ready_ev, lg if self.cfg.record_logits else None, lps)

    def _append_token(self, req: Request, t: int, lp=None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.latency["time_to_first_token_seconds"].observe(req.first_token_time - req.arrival)
        if lp is not None:
            req.logprobs.append(lp)
        lps = [lp] if lp is not None else None
        req.output_ids.append(t)
        req.all_ids.append(t)
        self.metrics["generation_tokens_total"] += 1
        if req.seen is not None:
            # a fill launch: assigning a Python scalar (seen[t] = True) copies it over and synchronises
            req.seen[t : t + 1].fill_(True)
        if req.counts is not None:
            req.counts[t : t + 1].add_(1.0)
        p = req.params
        if req.matcher is not None and not req.guiding:
            req.guiding = t in p.guided_start_token_ids  # (the grammar applies from the next token)
        elif req.matcher is not None and not req.matcher.consume_token(t):
            # (only when the bans of other settings left no token of the grammar's: the draw had nothing to pick)
            self._emit(req, [t], "", lps)
            self._finish(req, "error", error=f"guided decoding: {req.matcher.get_error().strip()}")
            return
        if t in req.stop_ids or (not p.ignore_eos and t in self.eos_ids):
            # the stop token is generated output (counted in usage, with its logprob), without text
            self._emit(req, [t], "", lps)
            self._finish(req, "stop")
            return
        text = self._extend_text(req, req.detok.push(t)) if req.detok is not None else ""
        if req.guiding and req.matcher.is_stopped():  # a complete match that nothing extends
            self._emit(req, [t], text, lps)
            self._finish(req, "stop")
            return
        if req.stop_hit:
            self._emit(req, [t], text, lps)
            self._finish(req, "stop")
            return
        if len(req.output_ids) >= req.max_new or len(req.all_ids) >= self.max_model_len:
            self._emit(req, [t], text, lps)
            self._finish(req, "length")
            return
        self._emit(req, [t], text, lps)

    def _bucket(self, B: int) -> int | None:
        """The CUDA-graph batch bucket a decode batch of B rows runs in (None: eager)."""
        if not self.graphs_enabled:
            return None
        return next((b for b in self._buckets if b >= B), None)

    def _scratch_row(self) -> tuple[int, int, int]:
        """(token id, slot, cache row) of a padding row: the pool's scratch slot and the first row of its scratch
        page, so that a padded row's step reads and writes nothing of a real sequence."""
        return 0, self.pool.dummy_slot, self.pool.dummy_page * self.pool.page_size

    def _decode_inputs(self, batch: list[Request]):
        """Host tensors of one decode step, padded to its graph bucket with scratch rows (slot / page of the pool's
        scratch, length 1): ``meta`` [3, n] int64 (token ids, slots, cache rows of the new token), ``lengths`` [n]
        int32 and the block ``table`` [n, W] int32 (W: the widest row, unused entries the scratch page). Three
        tensors built from Python lists in one call each (a per-row build cost ~10 us per row)."""
        pool, B = self.pool, len(batch)
        ps, dummy = pool.page_size, pool.dummy_page
        n = self._bucket(B) or B
        pad = n - B
        pos = [r.num_computed for r in batch]
        npg = [pool.pages_for(p + 1) for p in pos]
        W = max(npg)
        s_id, s_slot, s_row = self._scratch_row()
        meta = torch.tensor(
            [
                [r.all_ids[-1] for r in batch] + [s_id] * pad,
                [r.slot for r in batch] + [s_slot] * pad,
                [r.pages[p // ps] * ps + p % ps for r, p in zip(batch, pos)] + [s_row] * pad,
            ],
            dtype=torch.long,
        )
        lengths = torch.tensor([p + 1 for p in pos] + [1] * pad, dtype=torch.int32)
        fill = [dummy] * W
        # through numpy: ~3x faster than torch.tensor on nested lists (64 rows x 64 pages: 0.1 vs 0.3 ms)
        table = torch.from_numpy(
            np.array([r.pages[:k] + fill[k:] for r, k in zip(batch, npg)] + [fill] * pad, dtype=np.int32)
        )
        return meta, lengths, table, B

    def _decode_logits(self, meta, lengths, table, B: int, ids_from=None) -> torch.Tensor:
        """Logits [B, V] of one decode step from :meth:`_decode_inputs`' tensors (graph replay or eager).
        ``ids_from = (pairs, src)``: row ``b`` takes its token id from ``src[k]`` (a device tensor) for each
        ``(b, k)`` in ``pairs`` instead of from ``meta`` (overlap: tokens not yet on the host)."""
        bucket = self._bucket(B)
        if bucket is not None and bucket == meta.shape[1]:
            try:
                return self._graph_decode(bucket, meta, lengths, table, B, ids_from)
            except Exception as e:  # capture failed (host sync in some op): run eagerly from now on
                self._disable_graphs(e)
        dev = self.device
        self._plan_mla(table[:B], lengths[:B], graph=False)
        meta, lengths, table = (device_tensor(t, t.dtype, dev) for t in (meta[:, :B], lengths[:B], table[:B]))
        _swap_ids(meta[0], ids_from)
        return self._decode_forward(meta[0], meta[1], table, lengths, meta[2])

    def _decode_forward(self, ids, slots, table, lengths, rows) -> torch.Tensor:
        """One token per row: ids/slots/lengths/rows [B], table [B, W]. Pure device work (graph-capturable)."""
        self._side_used = False
        with pdl_scope(self.cfg.pdl and ids.shape[0] <= PDL_MAX_ROWS):
            out = self._decode_forward_body(ids, slots, table, lengths, rows)
        self._join()  # every side-stream branch rejoins before the step ends (a captured graph needs it)
        return out

    @contextlib.contextmanager
    def _branch(self):
        """Work issued inside runs on the side stream, after everything issued so far on the current stream (in
        place when there is no side stream). Tensors it reads must stay referenced until :meth:`_join`."""
        side = self._side
        if side is None:
            yield
            return
        self._side_used = True
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield

    def _join(self) -> None:
        """The current stream waits for the side stream's work so far."""
        # (only after a branch: a graph capture must not wait on a stream that never joined it)
        if self._side is not None and self._side_used:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _lin(self, x, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``F.linear(x, w)`` (as ``out_dtype`` when given) for ``x [B, K]`` (or what ``openk3.infer.gemv.gemv``
        takes: a GLU, a pair of row segments): the Triton GEMV where ``openk3.infer.gemv.decode_gemv_ok``
        (``triton_gemv``; few rows, weights not too large), cuBLAS otherwise."""
        if self._gemv and _gemv.decode_gemv_ok(x, w):
            return _gemv.gemv(x, w, out_dtype)
        y = F.linear(x if isinstance(x, torch.Tensor) else _gemv._dense(x), w)
        return y if out_dtype is None else y.to(out_dtype)

    def _lin_mod(self, mod, x: torch.Tensor) -> torch.Tensor:
        """``mod(x)`` for a bias-free ``nn.Linear`` through :meth:`_lin`; any other module as it is."""
        if isinstance(mod, torch.nn.Linear) and mod.bias is None:
            return self._lin(x, mod.weight)
        return mod(x)

    def _shared_glu(self, shared, proj, xf: torch.Tensor, w):
        """The shared experts' activation as an ``openk3.infer.gemv.GLU`` for the GEMV that reads it
        (fuse_glu_gemv), or None where it does not apply: their gate and up projections computed (``proj``), a
        plain GLU FFN, and the GEMV taking a row count like ``xf``'s and the weight ``w``."""
        ok = (
            self._glu_gemv
            and proj is not None
            and w is not None
            and isinstance(shared, GLUMLP)
            and shared.act in ("situ", "silu", "swiglu")
            and _gemv.decode_gemv_ok(xf, w)
        )
        return _gemv.GLU(proj[0], proj[1], shared.act, shared.beta1, shared.beta2) if ok else None

    def _res_gemv_ok(self, x, w: torch.Tensor, res: torch.Tensor | None) -> bool:
        """Whether ``res + x @ w.T`` goes through the GEMV with the add in its store (gemv_residual)."""
        return res is not None and self._res_gemv and _gemv.decode_gemv_ok(x, w)

    def _ffn_parts(
        self, i: int, layer, x: torch.Tensor, res: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The FFN output of the normed input ``x [B, 1, D]`` as a list of ``[B, 1, D]`` parts whose left-to-right
        sum (rounded after each add, as the model sums them) is the output; MoE branches on two streams with
        ``parallel_ffn``. With a residual ``res [B, 1, D]``: one part, ``res`` plus that sum (added in the output
        GEMV's store where one GEMV reads every part, gemv_residual)."""
        parts, folded = self._ffn_parts_of(i, layer, x, res)
        if res is None or folded:
            return parts
        y = parts[0]
        for p in parts[1:]:
            y = y + p
        return [res + y]

    def _ffn_parts_of(self, i: int, layer, x: torch.Tensor, res) -> tuple[list[torch.Tensor], bool]:
        """:meth:`_ffn_parts`'s parts, and whether ``res`` is already added (inside the output GEMV)."""
        xf = x[:, 0]
        fused = self._fused_ffn.get(i)
        out = self._fused_ffn_out.get(i)

        def in_proj():  # the input projections as one GEMM (None: the modules run their own)
            return None if fused is None else list(self._lin(xf, fused[0]).split(fused[1], dim=-1))

        def out_parts(pre):  # the output projections: one GEMM over their inputs side by side, or one each
            if out is not None:
                if isinstance(pre[0], _gemv.Normed) or isinstance(pre[-1], _gemv.GLU):  # read in place
                    xin = tuple(pre)
                else:
                    xin = torch.cat([_gemv._dense(p) for p in pre], dim=-1)
                if self._res_gemv_ok(xin, out, res):
                    return [_gemv.gemv(xin, out, residual=res[:, 0])[:, None]], True
                return [self._lin(xin, out)[:, None]], False
            parts = [
                (p if m is None else self._lin_mod(m, p))[:, None]
                for m, p in zip(layer.ffn_output_projections(), pre)
            ]
            return parts, False

        if not layer.is_moe or not self.cfg.parallel_ffn:
            return out_parts(layer.ffn_pre_output(x, in_proj()))
        moe = layer.block_sparse_moe
        shared = moe.shared_experts
        if moe.latent:  # router beside the input GEMM; the shared activation beside the routed experts
            with self._branch():
                routing = moe.route(xf)
            proj = in_proj()
            h = proj.pop(0) if proj is not None else moe.routed_expert_down_proj(xf)
            self._join()
            s = (
                None if shared is None else self._shared_glu(shared, proj, xf, out)
            )  # formed inside the out GEMV
            if shared is not None and s is None:
                with self._branch():
                    s = shared.pre_output(xf, proj)
            # fuse_norm_gemv: the mixture's RMSNorm left to the output GEMV that reads it
            norm = moe.routed_expert_norm
            fold = self._norm_gemv and norm is not None and out is not None and _gemv.decode_gemv_ok(xf, out)
            u = moe.routed(h, routing, norm=not fold)
            if fold:
                u = _gemv.Normed(u, norm.weight, norm.eps)
            self._join()
            return out_parts([u] if s is None else [u, s])
        # plain MoE (no output projection to fuse): the shared experts' whole chain beside the router and the
        # routed experts
        sd = None
        if shared is not None:
            with self._branch():
                sd = self._shared_out(i, shared, xf)
        u = moe.routed(xf, moe.route(xf))
        self._join()
        return ([u[:, None]] if sd is None else [u[:, None], sd[:, None]]), False

    def _shared_out(self, i: int, shared, xf: torch.Tensor) -> torch.Tensor:
        """A plain MoE layer's shared experts' output ``[B, D]`` for the normed tokens ``xf [B, D]``: their
        gate/up projections (the layer's fused FFN input GEMM where there is one), the activation (inside the down
        GEMV with fuse_glu_gemv) and the down projection."""
        fused = self._fused_ffn.get(i)
        proj = None if fused is None else list(self._lin(xf, fused[0]).split(fused[1], dim=-1))
        glu = self._shared_glu(shared, proj, xf, shared.down_proj.weight)  # formed inside the down GEMV
        if glu is not None:
            return self._lin(glu, shared.down_proj.weight)
        return self._lin_mod(shared.down_proj, shared.pre_output(xf, proj))

    def _decode_forward_body(self, ids, slots, table, lengths, rows) -> torch.Tensor:
        pool, lay = self.pool, self.pool.layout
        dc = lay.kv_lora_rank

        def out_proj(w, y, res):  # y @ w^T [B, D] -> [B, 1, D], plus res [B, 1, D] when given
            if res is None:
                return self._lin(y, w)[:, None]
            if self._res_gemv_ok(y, w, res):  # the add in the GEMV's store, the separate add's roundings
                return _gemv.gemv(y, w, residual=res[:, 0])[:, None]
            if self.cfg.fuse_residual:  # one addmm: one rounding instead of two
                return torch.addmm(res[:, 0], y, w.t())[:, None]
            return res + self._lin(y, w)[:, None]

        def attn(i, layer, x, res=None):
            # x [B, 1, D], or a Normed [B, D] whose norm the fused input projection forms (fold_norms)
            xx = x if isinstance(x, _gemv.Normed) else x[:, 0]
            B = xx.shape[0]
            m = layer.self_attn
            j = pool.pool_index[i]
            fused = self._fused.get(i)
            if fused is not None:  # one GEMM for every projection of the layer input
                parts = self._lin(xx, fused[0]).split(fused[1], dim=-1)
            if layer.attn_type == "kda":
                if fused is not None:
                    q, k, v, fa, bl, ga = parts
                else:
                    q, k, v, fa, bl = m.q_proj(xx), m.k_proj(xx), m.v_proj(xx), m.f_a_proj(xx), m.b_proj(xx)
                    ga = m.g_proj(xx) if m.full_rank_gate else m.g_a_proj(xx)
                # the projections the kernel applies itself (fuse_kda_lowrank) get their activations instead
                own_z, own_g = self._kda_lowrank.get(i, (False, False))
                if B > KDA_LOWRANK_MAX_ROWS:
                    own_z = own_g = False
                kw = {}
                z = None if own_z else m.f_b_proj(fa)
                if own_z:
                    kw["z_lowrank"] = fa
                gate = ga if m.full_rank_gate else None if own_g else m.g_b_proj(ga)
                if own_g:
                    kw["gate_lowrank"] = ga
                o = self._kda_step(m, q, k, v, z, bl, gate, pool.conv[j], pool.state[j], slots, **kw)
                return out_proj(m.o_proj.weight, o, res)
            H = m.num_heads
            if fused is not None:
                qx = (
                    parts[0]
                    if m.q_lora_rank is None
                    else self._lin_mod(m.q_b_proj, m.q_a_layernorm(parts[0]))
                )
                q = qx.reshape(B, H, m.dn + m.dr)
                c, kr = parts[1].split([m.dc, m.dr], dim=-1)
            else:
                q = m.project_q(xx).view(B, H, m.dn + m.dr)
                c, kr = m.kv_a_proj_with_mqa(xx).split([m.dc, m.dr], dim=-1)
            glue = self._mla_glue if B <= MLA_GLUE_MAX_ROWS else None
            if glue is not None:  # norm + cache write + absorbed query in one step; W_UV (+ gate) in another
                prep, post, weights = glue
                w_uk, w_uv = weights[i]
                norm = m.kv_a_layernorm
                ql = prep(q, c, kr, norm.weight, norm.eps, w_uk, pool.kv[j], rows)
                gate = (parts[2] if fused is not None else m.g_proj(xx)) if m.use_gate else None
                if post is None:  # the MLA step applies it
                    o = self._mla_step(
                        ql, pool.kv[j], table, lengths, scale=m.scale, kv_lora_rank=dc, w_uv=w_uv, gate=gate,
                        out_dtype=xx.dtype,
                    )  # fmt: skip
                else:
                    cbar = self._mla_step(ql, pool.kv[j], table, lengths, scale=m.scale, kv_lora_rank=dc)
                    o = post(cbar, w_uv, gate, xx.dtype)
                return out_proj(m.o_proj.weight, o, res)
            c = m.kv_a_layernorm(c)
            pool.write_latent(j, rows, torch.cat([c, kr.to(c.dtype)], dim=-1))
            w_uk, w_uv = self._absorbed[i]  # fp32 [H, dn, dc], [H, dv, dc]
            qa = torch.bmm(q[..., : m.dn].float().transpose(0, 1), w_uk)  # [H, B, dc]
            ql = torch.cat([qa.transpose(0, 1), q[..., m.dn :].float()], dim=-1)
            cbar = self._mla_step(ql, pool.kv[j], table, lengths, scale=m.scale, kv_lora_rank=dc)
            o = torch.bmm(cbar.transpose(0, 1), w_uv.transpose(1, 2))  # [H, B, dv]
            o = o.transpose(0, 1).to(xx.dtype).reshape(B, H * m.dv)
            if m.use_gate:
                o = torch.sigmoid(parts[2] if fused is not None else m.g_proj(xx)) * o
            return out_proj(m.o_proj.weight, o, res)

        def ffn(i, layer, x, res=None):
            if self.cfg.parallel_ffn and layer.is_moe:
                parts = self._ffn_parts(i, layer, x, res)
                y = parts[0]
                for p in parts[1:]:
                    y = y + p
                return y
            fused = self._fused_ffn.get(i)
            proj = None if fused is None else list(self._lin(x[:, 0], fused[0]).split(fused[1], dim=-1))
            out = self._fused_ffn_out.get(i)
            if out is not None:  # the output projections' inputs side by side: one GEMM
                return out_proj(out, torch.cat(layer.ffn_pre_output(x, proj), dim=-1), res)
            mods = layer.ffn_output_projections()
            if res is not None and len(mods) == 1 and mods[0] is not None:  # fold the residual add into it
                return out_proj(mods[0].weight, layer.ffn_pre_output(x, proj)[0], res)
            y = layer.ffn(x, proj)
            return y if res is None else res + y

        r = self.model.model.embed_tokens(ids)[:, None]
        if self.cfg.fuse_add_norm and not self.mcfg.use_attn_res:
            h = self._walk_add_norm(r, attn)
        else:
            h = self._walk(
                r,
                attn,
                ffn,
                residual=self.cfg.fuse_residual or self._res_gemv,
                read_norm=self.cfg.fuse_read_norm,
            )
        return self._lin(h[:, 0], self.model.output_weight, torch.float32)

    def _walk_add_norm(self, r: torch.Tensor, attn: Callable) -> torch.Tensor:
        """The decode walk of a model without AttnRes with each residual add and the RMSNorm after it in one launch
        (fuse_add_norm): r [B, 1, D] embeddings -> final-normed hidden. ``attn(i, layer, x)``: the attention output
        of the normed ``x``; the FFN through :meth:`_ffn_parts`."""
        inner = self.model.model

        def add_norm(r, parts, norm):
            x, r = add_rms_norm(r[:, 0], [p[:, 0] for p in parts], norm.weight, norm.eps)
            return x[:, None], r[:, None]

        fold = self._fold_norms and r.shape[0] <= FOLD_NORMS_MAX_ROWS
        pending: list[torch.Tensor] = []
        for i, layer in enumerate(inner.layers):
            # the attention input: the pending adds and the norm in one launch, or (fold_norms, nothing pending) the
            # norm left to the fused input projection's GEMV
            x = self._normed_input(i, layer, r) if fold and not pending else None
            if x is None:
                x, r = add_norm(r, pending, layer.input_layernorm)
            small = self._fold_moe(i, layer, r) if fold else None
            if small is not None:
                r = attn(i, layer, x, res=r)  # the residual added in the output projection's store
                r = self._moe_folded(i, small, layer, r)
                pending = []
            else:
                pending = [attn(i, layer, x)]
                x, r = add_norm(r, pending, layer.post_attention_layernorm)
                pending = self._ffn_parts(i, layer, x)
        return add_norm(r, pending, inner.norm)[0]

    def _normed_input(self, i: int, layer, r: torch.Tensor):
        """fold_norms: ``Normed(r, input_layernorm)`` for layer ``i``'s fused input projection where the GEMV
        takes it (and forms the norm while reading ``r [B, 1, D]``); None otherwise."""
        fused = self._fused.get(i)
        if fused is None:
            return None
        norm = layer.input_layernorm
        nx = _gemv.Normed(r[:, 0], norm.weight, norm.eps)
        return nx if _gemv.decode_gemv_ok(nx, fused[0]) else None

    def _fold_moe(self, i: int, layer, r: torch.Tensor):
        """fold_norms: ``openk3.fast.moe_small`` where layer ``i`` is a plain MoE layer whose router, experts and
        attention output projection take the one-row kernels that fold the add + norm between the layer halves
        (:meth:`_moe_folded`); None otherwise."""
        if not layer.is_moe or not _gemv.decode_gemv_ok(r[:, 0], layer.self_attn.o_proj.weight):
            return None
        moe = layer.block_sparse_moe
        small = moe.fused_small_path(r[:, 0])
        if small is None or not _gemv.triton_gemv_ok(r[:, 0], moe.gate.weight):
            return None
        return small

    def _moe_folded(self, i: int, small, layer, r: torch.Tensor) -> torch.Tensor:
        """``r + MoE(post_attention_layernorm(r))`` for ``r [B, 1, D]`` (fold_norms, see :meth:`_fold_moe`): the
        router GEMV forms the norm and writes the normed row. The shared experts: with ``FOLD_SHARED`` "router" (where
        :meth:`_plan_router_shared` put their gate / up rows behind the router's) that GEMV forms their projections
        too and the down + combine kernel the rest; otherwise on the side stream beside it (their fused input GEMV
        forming the norm too; without one, after the router, reading its normed row), or with "slot" as one more
        slot of the routed experts' kernels (:meth:`_shared_slot`). The routed experts' down + combine kernel adds
        their output and ``r`` in its store (the model's order and roundings: ``r + (routed + shared)``)."""
        moe = layer.block_sparse_moe
        norm = layer.post_attention_layernorm
        r0 = r[:, 0]
        xn = torch.empty_like(r0)
        shared = moe.shared_experts
        # their gate / up rows behind the router's (FOLD_SHARED "router", planned at start-up)
        rs, slot = self._router_shared.get(i, (None, None)) if FOLD_SHARED == "router" else (None, None)
        if rs is not None and not _gemv.decode_gemv_ok(r0, rs):
            rs = slot = None
        if FOLD_SHARED == "slot":
            slot = self._shared_slot(small, moe)
        sd = None
        fused = self._fused_ffn.get(i)
        nx = _gemv.Normed(r0, norm.weight, norm.eps)
        early = (
            shared is not None and slot is None and fused is not None and _gemv.decode_gemv_ok(nx, fused[0])
        )
        if early:  # beside the router, their input GEMV forming the norm itself
            with self._branch():
                sd = self._shared_out(i, shared, nx)
        gate = moe.gate
        routing = small.route_logits_small(
            dataclasses.replace(nx, out=xn),
            gate.weight if rs is None else rs,
            gate.e_score_correction_bias,
            extra=0 if rs is None else rs.shape[0] - gate.weight.shape[0],
            **gate.options(),
        )
        if rs is not None:  # their activation and down projection in the down + combine kernel
            slot = dataclasses.replace(slot, gu=routing.extra)
        e = moe.experts
        if shared is not None and slot is None and not early:
            with self._branch():  # after the router: reads its normed row
                sd = self._shared_out(i, shared, xn)
        y = small.experts_small(
            xn, routing, None, e.w1, e.w2, e.w3, act=moe.act, beta1=moe.beta1, beta2=moe.beta2,
            add=sd, residual=r0, before_down=None if sd is None else self._join, shared=slot,
        )  # fmt: skip
        return y[:, None]

    @staticmethod
    def _shared_slot(small, moe):
        """A plain MoE layer's shared experts as ``small.SharedExperts`` (one more slot of the routed experts' gate/up
        and down + combine kernels, fold_norms) where they are one GLU FFN of the routed experts' width and a
        supported activation; None otherwise (they then run on the side stream)."""
        sh = moe.shared_experts
        if not isinstance(sh, GLUMLP) or sh.act not in ("situ", "silu", "swiglu"):
            return None
        _, I, W = moe.experts.w1.shape
        ws = (sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
        if ws[0].shape != (I, W) or ws[1].shape != (I, W) or ws[2].shape != (W, I):
            return None
        if any(w.dtype != moe.experts.w1.dtype for w in ws):
            return None
        return small.SharedExperts(*ws, act=sh.act, beta1=sh.beta1, beta2=sh.beta2)

    def _graph_decode(self, bucket, meta, lengths, table, B: int, ids_from=None) -> torch.Tensor:
        if bucket not in self._graphs:
            self._capture(bucket)
        # after a capture, which plans the MLA step for its scratch rows
        self._plan_mla(table, lengths, graph=True)
        g, (b_meta, b_len, b_table), out, (buf, host) = self._graphs[bucket]
        # two copies, padding rows included: meta and lengths through one host buffer laid out as the device one
        # (pageable: the copy has taken the bytes when it returns), then the table; table columns past W keep
        # earlier page ids (valid pool pages) and are never read: each row reads the pages of its own length only
        h_meta, h_len = _meta_views(host, meta.shape[1])
        h_meta.copy_(meta)
        h_len.copy_(lengths)
        buf.copy_(host, non_blocking=True)
        b_table[:, : table.shape[1]].copy_(table, non_blocking=True)
        _swap_ids(b_meta[0], ids_from)
        g.replay()
        # the rows of the graph's output buffer: read by this step's sampling, queued before the next replay; kept
        # logits (record_logits) outlive it, so they get a copy
        return out[:B].clone() if self.cfg.record_logits else out[:B]

    def capture_graphs(self) -> int:
        """Capture the decode graph of every batch bucket now (a server calls this at start-up, so that no request
        waits for a capture). Returns the number of captured buckets; 0 off CUDA, with graphs off, or when a
        capture fails (graphs are then disabled, as on the lazy path)."""
        if not self.graphs_enabled:
            return 0
        try:
            with torch.no_grad():
                for b in self._buckets:
                    if b not in self._graphs:
                        self._capture(b)
        except Exception as e:  # same fallback as the lazy capture in _decode_logits
            self._disable_graphs(e)
            return 0
        return len(self._graphs)

    def _disable_graphs(self, err: Exception) -> None:
        log.warning("CUDA graph decode disabled: %s", err)
        self.graphs_enabled = False
        self._graphs.clear()

    def _capture(self, bucket: int) -> None:
        dev, pool = self.device, self.pool
        # token ids, slots, cache rows [3, bucket] int64, then the lengths [bucket] int32, in one buffer (one copy
        # per step); scratch rows until a step fills them
        buf = torch.empty(28 * bucket, dtype=torch.uint8, device=dev)
        meta, lengths = _meta_views(buf, bucket)
        meta.copy_(torch.tensor([[v] * bucket for v in self._scratch_row()], dtype=torch.long))
        lengths.fill_(1)
        table = torch.full((bucket, self._max_pages_per_seq), pool.dummy_page, dtype=torch.int32, device=dev)
        bufs = (meta[0], meta[1], table, lengths, meta[2])
        # the MLA step's plan for the scratch rows (the warm-up and the capture run them)
        self._plan_mla(
            torch.full((bucket, 1), pool.dummy_page, dtype=torch.int32),
            torch.ones(bucket, dtype=torch.int32),
            graph=True,
        )
        self._decode_capture.warm_up(lambda: self._decode_forward(*bufs), dev)  # on scratch rows only
        # graph_priority: captured on a high-priority stream (its kernel nodes keep that priority; the side stream's
        # keep the lowest, 0); otherwise on a stream of the default priority (both shared by every engine)
        cap = shared_stream(dev, "capture", priority=GRAPH_PRIORITY if self.cfg.graph_priority else 0)
        g, out = self._decode_capture.capture(lambda: self._decode_forward(*bufs), stream=cap)
        self._graphs[bucket] = (g, (meta, lengths, table), out, (buf, torch.empty_like(buf, device="cpu")))

    # ------------------------------------------------------------------------------------------------ stats
    def counter_names(self) -> set[str]:
        """The keys of :meth:`stats` that only ever grow (Prometheus counters); the rest are gauges."""
        prefix_cache = {"prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_tokens"}
        graphs = {f"{prefix}_{name}" for prefix, _ in _PREFILL_GRAPH_SETS for name in _GRAPH_STATS.values()}
        return set(self.metrics) | prefix_cache | graphs

    def stats(self) -> dict:
        m = dict(self.metrics)
        active = list(self.active)
        m.update(
            {
                "requests_running": sum(1 for r in active if r.num_computed >= len(r.all_ids) - 1),
                "requests_prefilling": sum(1 for r in active if r.num_computed < len(r.all_ids) - 1),
                "requests_waiting": len(self.waiting),
                "pages_total": self.pool.num_pages,
                "pages_free": self.pool.num_free_pages,
                "pages_used_by_sequences": self.pool.num_seq_pages,
                "pages_held_by_prefix_cache_only": self.pool.num_reclaimable_pages - self.pool.num_free_pages,
                "slots_free": self.pool.num_free_slots,
                "page_size": self.pool.page_size,
                "bytes_per_token": self.pool.bytes_per_token,
                "bytes_per_sequence": self.pool.bytes_per_sequence,
                "cache_pool_bytes": self.pool.nbytes(),
                "max_model_len": self.max_model_len,
                "cuda_graphs": int(self.graphs_enabled),
            }
        )
        for prefix, attr in _PREFILL_GRAPH_SETS:
            graphs = getattr(self, attr)
            if graphs is not None:
                m.update({f"{prefix}_{name}": graphs.stats[k] for k, name in _GRAPH_STATS.items()})
        if self.prefix is not None:
            m.update(
                {
                    "prefix_cache_queries": self.prefix.queries,
                    "prefix_cache_hits": self.prefix.hits,
                    "prefix_cache_hit_tokens": self.prefix.hit_tokens,
                    "prefix_cache_snapshots": len(self.prefix.entries),
                    "prefix_cache_bytes": self.prefix.nbytes,
                }
            )
        return m


def _share_buffer(mods: list, dim: int) -> torch.Tensor | None:
    """Concatenate the weights of the Linear layers ``mods`` along ``dim`` (0: rows, 1: columns) into one buffer
    and re-point each module's weight to its view of it (same values, no second copy), so the model's own forward
    (prefill) and a fused decode GEMM read the same memory. None (nothing changed) for fewer than two layers or
    weights that are not plain tensors (e.g. sharded) of one dtype and device."""
    ws = [m.weight for m in mods]
    if len(ws) < 2 or not all(
        type(w.data) is torch.Tensor and w.dtype == ws[0].dtype and w.device == ws[0].device for w in ws
    ):
        return None
    data = [w.data for w in ws]
    buf = _shared_already(data, dim)
    if buf is not None:  # an earlier engine on this model made it: the same buffer again, no second copy
        return buf
    buf = torch.cat(data, dim)
    for m, part in zip(mods, buf.split([w.shape[dim] for w in ws], dim)):
        m.weight.data = part
    return buf


def _shared_already(ws: list, dim: int) -> torch.Tensor | None:
    """The buffer of which ``ws`` already are the consecutive views along ``dim`` (the layout :func:`_share_buffer`
    makes), when they are and it spans their whole storage; else None."""
    st = ws[0].untyped_storage()
    if any(w.untyped_storage().data_ptr() != st.data_ptr() or w.dim() != ws[0].dim() for w in ws):
        return None
    shape = list(ws[0].shape)
    shape[dim] = sum(w.shape[dim] for w in ws)
    strides = list(torch.empty(shape, device="meta").stride())  # contiguous
    if math.prod(shape) * ws[0].element_size() != st.nbytes():
        return None
    rest = shape[:dim] + shape[dim + 1 :]  # the sizes off `dim`, which every view must share
    at = 0
    for w in ws:
        if list(w.shape[:dim] + w.shape[dim + 1 :]) != rest:
            return None
        if list(w.stride()) != strides or w.storage_offset() != at * strides[dim]:
            return None
        at += w.shape[dim]
    # on the storage itself (a view of ws[0] would keep that tensor alive as its base)
    return torch.empty(0, dtype=ws[0].dtype, device=ws[0].device).set_(st, 0, shape, strides)


def _import_fast_paths() -> None:
    """Register the GPU fast paths (``openk3.fast``) when they can be imported."""
    try:
        import openk3.fast  # noqa: F401
        import openk3.infer.kernels  # noqa: F401  (registers the Triton decode steps when triton + CUDA exist)
    except Exception as e:  # optional: the reference paths still work
        log.info("GPU fast paths not loaded (%s); using the reference ops", e)


# =================================================================================================== model loading
def default_tokenizer(vocab_size: int = 4096):
    """Byte-level BPE trained on a small slice of the embedded corpus (cached under ~/.cache/openk3)."""
    from openk3.train.data import default_corpus
    from openk3.train.tokenizer import Tokenizer

    docs = default_corpus(max_bytes=1_000_000)
    cache = Path(os.environ.get("OPENK3_CACHE", Path.home() / ".cache" / "openk3")) / "tokenizers"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        import tempfile

        cache = Path(tempfile.gettempdir()) / "openk3-tokenizers"
        cache.mkdir(parents=True, exist_ok=True)
    return Tokenizer.train_bpe(docs, vocab_size=vocab_size, cache_dir=cache)


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tiktoken.model").is_file()


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and floating-point buffers as :func:`random_model` stores them (SPEC.md §5.3's
    fp32 parameters and the buffers in fp32, the rest in their dtype)."""
    n = 0
    for p in model.parameters():
        n += p.numel() * (4 if getattr(p, "_keep_fp32", False) else p.element_size())
    for b in model.buffers():
        n += b.numel() * (4 if b.is_floating_point() else b.element_size())
    return n


def free_memory(device: torch.device) -> int | None:
    """Free bytes on ``device``: the CUDA allocator's free memory, or the host's available memory (Linux's
    ``MemAvailable``) for the CPU; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def random_model(
    preset: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **over,
):
    """A freshly initialised (random-weight) model of ``preset`` (config fields ``over`` replaced), in eval mode
    without gradients, built directly on ``device`` in ``dtype`` so that large presets (the 48B shape: ~98 GB in
    bf16) need no host copy and no fp32 copy. The parameters and buffers SPEC.md §5.3 keeps in fp32 are fp32."""
    from openk3.config import get_preset
    from openk3.model import K3ForCausalLM

    cfg = get_preset(preset, **over)
    dev = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"random_model: dtype must be a floating-point dtype, got {dtype}")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # the size first, without allocating
            need = _weight_bytes(K3ForCausalLM(cfg))
        free = free_memory(dev)
        if free is not None and need > free:
            raise RuntimeError(
                f"preset {cfg.name!r} needs {need / 1e9:.1f} GB of weights in {str(dtype).removeprefix('torch.')}, "
                f"more than the {free / 1e9:.1f} GB free on {dev}; pick a smaller preset or another device / dtype"
            )
        torch.manual_seed(seed)
        with dev:
            model = K3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for p in model.parameters():
            if getattr(p, "_keep_fp32", False):
                p.data = p.data.float()
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.float()
    model.requires_grad_(False)
    return model.eval()


def load_for_inference(
    ckpt: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: str | os.PathLike | None = None,
    seed: int = 0,
    preset: str | None = None,
):
    """(model, tokenizer, name, source) for the CLI and the server.

    ``ckpt`` given: load that released-format checkpoint (tokenizer from ``tokenizer`` or the same directory).
    ``preset`` given: a freshly initialised model of that preset (random weights: for timing the engine or the
    server on a model of that shape), with ``tokenizer`` or a small byte-level BPE tokenizer. Neither:
    ``runs/default/final`` (``openk3 train``'s default output) if it exists, else a freshly initialised ``tiny``
    model with a small byte-level BPE tokenizer, so the commands always run."""
    from openk3.model import K3ForCausalLM
    from openk3.train.tokenizer import Tokenizer

    if ckpt is not None and preset is not None:
        raise ValueError("pass a checkpoint (--ckpt) or a preset to initialise (--preset), not both")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(dev)!r}: the engine runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {str(dev)!r}: this machine's torch sees no CUDA device; pass --device cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {str(dev)!r}: there are only {torch.cuda.device_count()} CUDA devices")
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = Path(ckpt) if ckpt is not None else None
    if path is None and preset is None and (Path(DEFAULT_RUN_DIR) / "config.json").is_file():
        path = Path(DEFAULT_RUN_DIR)
    if path is not None:
        if not path.exists():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} does not exist; pass a directory with config.json"
            )
        model = K3ForCausalLM.from_pretrained(path, dtype=dt, device=dev)
        tdir = Path(tokenizer) if tokenizer is not None else (path if path.is_dir() else path.parent)
        if tokenizer is None and not _has_tokenizer(tdir):
            raise FileNotFoundError(
                f"no tokenizer.json or tiktoken.model in {str(tdir)!r}; pass --tokenizer PATH"
            )
        tok = Tokenizer.from_file(tdir)
        name = path.resolve().name if path.name != "final" else path.resolve().parent.name
        source = f"checkpoint {path}"
    else:
        which = preset if preset is not None else "tiny"
        model = random_model(which, device=dev, dtype=dt, seed=seed)
        # the tokenizer need not cover a large preset's vocabulary: the rows past it are never sampled
        tok = (
            Tokenizer.from_file(tokenizer)
            if tokenizer is not None
            else default_tokenizer(min(model.config.vocab_size, 4096))
        )
        name = f"openk3-{model.config.name}-random"
        source = (
            f"a freshly initialised {model.config.name} model (random weights)"
            if preset is not None
            else "a freshly initialised tiny model (no checkpoint; run `openk3 train` for a trained one)"
        )
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} tokens but the model only {model.config.vocab_size}; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    model.eval()
    return model, tok, name, source
