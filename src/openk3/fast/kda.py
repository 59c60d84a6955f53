"""KDA core on fla-core's Triton kernels (``chunk_kda`` for training / prefill, ``fused_recurrent_kda`` for short
inference calls), with the decay gate, the beta sigmoid and the q/k L2 normalisation done inside the kernels.

Plugs into :data:`openk3.modules.kda.FAST_KDA` under the name ``"fla"`` with the signature of
``openk3.modules.kda._kda_core_reference``. fla-core is optional: :func:`available` says why it cannot be used.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from openk3.fast.graphs import GraphCapture
from openk3.fast.graphs import warn_once as _warn_once


def limit_autotune(n: int) -> None:
    """Make every Triton autotuner (fla's included) try at most ``n`` configs -- the ones closest to
    ``num_warps=4, num_stages=2`` (least shared memory). Compile time over kernel speed, for short-lived GPU
    sessions; set ``OPENK3_AUTOTUNE_MAX=n`` before importing openk3.fast."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner, "_openk3_limit", None) is not None:
        Autotuner._openk3_limit = n
        return
    orig = Autotuner.prune_configs

    def prune_configs(self, kwargs):
        cfgs = orig(self, kwargs)
        lim = Autotuner._openk3_limit
        if lim and len(cfgs) > lim:
            cfgs = sorted(cfgs, key=lambda c: (abs(c.num_warps - 4), abs(c.num_stages - 2)))[:lim]
        return cfgs

    Autotuner.prune_configs = prune_configs
    Autotuner._openk3_limit = n


if os.environ.get("OPENK3_AUTOTUNE_MAX"):
    try:
        limit_autotune(int(os.environ["OPENK3_AUTOTUNE_MAX"]))
    except ImportError:
        pass

_fla = None
_why = ""
try:  # fla-core is an optional dependency
    from fla.ops.kda import chunk_kda as _chunk_kda
    from fla.ops.kda import fused_recurrent_kda as _fused_recurrent_kda

    _fla = True
except Exception as e:  # ImportError, or a Triton/driver problem at import time
    _chunk_kda = _fused_recurrent_kda = None
    _why = (
        f"fla-core not installed ({type(e).__name__}: {e})"
        if not isinstance(e, ImportError)
        else ("fla-core not installed")
    )

# Inference calls (no autograd) up to this many tokens per sequence use the token-recurrent kernel.
RECURRENT_MAX_LEN = 64
# fp32 chunk_kda is used up to this head dim (larger ones run out of shared memory on an H200).
CHUNK_FP32_MAX_K = 64
# fla's M=16 tensor-core path ("safe gate") is valid for lower bounds in [-5, 0).
SAFE_GATE_MIN = -5.0


def available() -> tuple[bool, str]:
    if not _fla:
        return False, _why or "fla-core not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "fla-core chunk_kda / fused_recurrent_kda"


def gate_kwargs(layer) -> dict:
    """In-kernel gate arguments for ``layer`` (``gate_kind`` "lowerbound" = K3, "softplus" = Kimi Linear)."""
    H = layer.num_heads
    kw = {
        "use_gate_in_kernel": True,
        "A_log": layer.A_log.reshape(-1)[:H],
        "dt_bias": layer.dt_bias.reshape(-1),
    }
    if layer.gate_kind == "lowerbound":
        lb = float(layer.lower_bound)
        kw["lower_bound"] = lb
        kw["safe_gate"] = SAFE_GATE_MIN <= lb < 0.0
    elif layer.gate_kind != "softplus":
        raise ValueError(f"fla KDA backend: unknown gate kind {layer.gate_kind!r}")
    return kw


def _reference(layer, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens):
    from openk3.modules.kda import _kda_core_reference

    return _kda_core_reference(
        layer,
        q,
        k,
        v,
        z,
        beta_logits,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


def kda_core_fla(
    layer, q, k, v, z, beta_logits, *, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu=None
):
    """q, k, v: [B, T, H, K] (post conv/SiLU, model dtype); z: [B, T, H, K] raw decay logits (no dt_bias);
    beta_logits: [B, T, H]; initial_state: [N, H, K, V] or None; ``cu_seqlens_cpu``: a host copy of ``cu_seqlens``
    (fla's chunk path then builds its chunk indices without a device sync). Returns (o [B, T, H, V], final_state
    fp32 or None).
    """
    if q.dtype == torch.float64:  # fla's kernels have no fp64 path: keep exactness checks exact
        return _reference(layer, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens)
    kw = gate_kwargs(layer)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    T = q.shape[1]
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, z, beta_logits, kw["A_log"], kw["dt_bias"])
    )
    # the longest sequence: packed sequences with a host copy of cu_seqlens are measured one by one (no sync)
    longest = T if cu_seqlens_cpu is None or cu_seqlens is None else int(cu_seqlens_cpu.diff().max())
    recurrent = not needs_grad and longest <= RECURRENT_MAX_LEN
    if q.dtype == torch.float32 and q.shape[-1] > CHUNK_FP32_MAX_K and not recurrent:
        # fla-core 0.6.0's chunk kernels do not fit an H200's shared memory in fp32 at K = 128, and a failed launch
        # part-way through the chunk pipeline left wrong results behind: never try, take the exact reference core
        _warn_once(f"fla chunk_kda has no fp32 path for K={q.shape[-1]}; using the reference KDA core")
        return _reference(layer, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens)
    kw.update(
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )
    if recurrent:
        # token recurrence: exact fp32 state update, no chunk padding; forward only (fla has no backward for it)
        kw.pop("safe_gate", None)
        return _fused_recurrent_kda(q, k, v, z, beta_logits, **kw)
    graphs = getattr(_ACTIVE, "graphs", None)
    if graphs is not None and not needs_grad:
        res = graphs.run(q, k, v, z, beta_logits, kw, cu_seqlens_cpu)
        if res is not None:
            return res
    if cu_seqlens is not None and cu_seqlens_cpu is not None:
        kw["cu_seqlens_cpu"] = cu_seqlens_cpu
    try:
        o, state = _chunk_kda(q, k, v, z, beta_logits, **kw)
    except Exception as e:
        # fla-core 0.6.0's chunk kernels need more shared memory than an H200 has for fp32 inputs with K = V = 128
        # (seen with autotuning capped, see limit_autotune); keep such models working on the exact reference.
        if type(e).__name__ != "OutOfResources":
            raise
        _warn_once(f"fla chunk_kda failed ({e}); using the reference KDA core for {q.dtype} K={q.shape[-1]}")
        return _reference(layer, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens)
    return o, state


# ------------------------------------------------------------------------------------------ graph-captured chunks
_ACTIVE = threading.local()


@contextlib.contextmanager
def chunk_graphs(graphs: ChunkGraphs | None):
    """Inside the block, this thread's inference calls of :func:`kda_core_fla` that take fla's chunk path replay
    ``graphs``' CUDA graphs (:class:`ChunkGraphs`) where they can; ``None`` leaves them eager."""
    old = getattr(_ACTIVE, "graphs", None)
    _ACTIVE.graphs = graphs
    try:
        yield
    finally:
        _ACTIVE.graphs = old


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _Entry:
    """One bucket's static inputs, its graph and the graph's outputs."""

    __slots__ = ("bufs", "graph", "out")

    def __init__(self, bufs: dict):
        self.bufs, self.graph, self.out = bufs, None, None


class ChunkGraphs:
    """fla's ``chunk_kda`` forward captured in CUDA graphs, one per bucket of (tokens, sequences), for inference
    calls (the engine's prefill). An eager ``chunk_kda`` call is ~10 autotuned Triton launches plus fla's host-side
    preparation of the chunk list, and a prefill forward pays that host time in every KDA layer while the GPU waits
    (bench/NOTES.md v38); a replay is one launch.

    A call of ``T`` tokens in ``N`` packed sequences runs in the graph of the bucket ``(Tb, Nb)``: ``T`` rounded up
    to a power of two (at least ``min_tokens``) and ``N`` to a power of two. Its inputs are copied into the
    bucket's static buffers (tokens past ``T`` keep whatever they held), ``cu_seqlens`` is padded with empty
    sequences to ``Nb + 1`` entries, and the graph runs fla's fixed-shape form (``use_graph=True``: the chunk list
    built on the device, chunks past the real ones skipped), so the padding tokens belong to no sequence and
    reach no output. The outputs are copied out of the graph's memory before the call returns. The first call of a
    bucket runs it twice eagerly (fla's autotuning and compiles), captures it and replays it.

    Calls it does not take return None from :meth:`run` and run eagerly: more than ``max_tokens`` tokens or
    ``max_seqs`` sequences, packed sequences without a host copy of ``cu_seqlens``, a bucket whose capture failed
    (``failed`` holds why). Every layer with the same shapes and gate constants shares a bucket's graph: its
    per-layer parameters (``A_log``, ``dt_bias``) are inputs too. ``capture=False`` runs the same padded
    fixed-shape call eagerly instead of replaying a graph (any device: tests, debugging). ``capturer``: the
    :class:`~openk3.fast.graphs.GraphCapture` (memory pool, warm-up stream) to share with other graph sets whose
    results are consumed before the next replay (None: one of its own)."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int = 256,
        min_tokens: int = 256,
        capture: bool = True,
        capturer: GraphCapture | None = None,
    ):
        if max_tokens < 1 or max_seqs < 1 or min_tokens < 1:
            raise ValueError(
                f"ChunkGraphs: max_tokens {max_tokens}, max_seqs {max_seqs}, min_tokens {min_tokens} must be >= 1"
            )
        self.min_tokens = _pow2(min_tokens)
        self.max_tokens = max(_pow2(max_tokens), self.min_tokens)
        self.max_seqs = _pow2(max_seqs)
        self.entries: dict[tuple, _Entry] = {}
        self._static: dict[tuple, torch.Tensor] = {}  # the buckets' static inputs, one per shape (_buffers)
        self.failed: dict[tuple, str] = {}
        self.capture = bool(capture)
        self.capturer = capturer if capturer is not None else GraphCapture()
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    def bucket(self, T: int, N: int) -> tuple[int, int] | None:
        """``(Tb, Nb)`` for ``T`` tokens in ``N`` sequences, or None past the limits."""
        Tb, Nb = max(self.min_tokens, _pow2(T)), _pow2(N)
        if T < 1 or N < 1 or Tb > self.max_tokens or Nb > self.max_seqs:
            return None
        return Tb, Nb

    def run(self, q, k, v, g, beta, kw: dict, cu_seqlens_cpu=None) -> tuple | None:
        """``chunk_kda(q, k, v, g, beta, **kw)`` (``kw`` as :func:`kda_core_fla` forms it: in-kernel gate, L2 norm
        and beta sigmoid) through a graph: ``(o, final_state or None)``, or None where the call runs eagerly
        (counted in ``stats["eager"]``, as are the calls of ``capture=False``)."""
        if _chunk_kda is None or (self.capture and not q.is_cuda):
            return None
        res = self._run(q, k, v, g, beta, kw, cu_seqlens_cpu)
        if res is None or not self.capture:
            self.stats["eager"] += 1
        return res

    def _run(self, q, k, v, g, beta, kw, cu_seqlens_cpu):
        B, T, H, K = q.shape
        V = v.shape[-1]
        cu = kw.get("cu_seqlens")
        if cu is not None:
            if cu_seqlens_cpu is None or B != 1:
                return None
            offs = [int(x) for x in cu_seqlens_cpu.tolist()]
        else:
            offs = [b * T for b in range(B + 1)]
        N = len(offs) - 1
        h0 = kw.get("initial_state")
        if h0 is not None and h0.shape != (N, H, K, V):
            return None
        bk = self.bucket(B * T, N)
        if bk is None:
            return None
        Tb, Nb = bk
        final = bool(kw.get("output_final_state"))
        key = (Tb, Nb, H, K, V, q.dtype, q.device, h0 is not None, final, kw.get("lower_bound"),
               bool(kw.get("safe_gate")), kw["A_log"].dtype, tuple(kw["A_log"].shape), kw["dt_bias"].dtype,
               tuple(kw["dt_bias"].shape))  # fmt: skip
        if key in self.failed:
            return None
        e = self.entries.get(key)
        if e is None:
            e = _Entry(self._buffers(Tb, Nb, q, v, kw, h0 is not None))
        self._fill(e.bufs, (q, k, v, g, beta), kw, offs)
        n = B * T
        if not self.capture:  # the padded call itself
            self.entries[key] = e
            out = self._call(e, kw, final)
        else:
            if e.graph is None:
                try:
                    self._capture(e, kw, final)
                except Exception as err:
                    # the bucket stays eager (the caller runs this call eagerly)
                    why = self.failed[key] = f"{type(err).__name__}: {err}"
                    _warn_once(f"KDA chunk graph for {Tb} tokens / {Nb} sequences not captured ({why})")
                    return None
                self.entries[key] = e
                self.stats["captures"] += 1
            e.graph.replay()
            self.stats["replays"] += 1
            out = e.out
        # copied out of the bucket's buffers, which the next call overwrites
        return out[0][0, :n].reshape(B, T, H, V).clone(), (out[1][:N].clone() if final else None)

    @staticmethod
    def _fill(b: dict, xs, kw: dict, offs: list[int]) -> None:
        """Copy one call's inputs into a bucket's buffers ``b``: ``xs = (q, k, v, g, beta)`` to the first tokens,
        the layer's ``A_log`` / ``dt_bias``, the initial states (``kw``), and the packed offsets ``offs`` padded
        with empty sequences to the bucket's count."""
        n = xs[0].shape[0] * xs[0].shape[1]
        for name, x in zip(("q", "k", "v", "g", "beta"), xs):
            b[name][0, :n].view(x.shape).copy_(x)
        b["A_log"].copy_(kw["A_log"])
        b["dt_bias"].copy_(kw["dt_bias"])
        if kw.get("initial_state") is not None:
            b["h0"][: len(offs) - 1].copy_(kw["initial_state"])
        pad = offs + [offs[-1]] * (b["cu"].shape[0] - len(offs))
        b["cu"].copy_(torch.tensor(pad, dtype=torch.long), non_blocking=True)

    def _buffers(self, Tb, Nb, q, v, kw, has_h0: bool) -> dict:
        """A bucket's static inputs. Buckets share them where their shapes agree (the token buffers between buckets
        of the same token count, the initial states and ``cu_seqlens`` between those of the same sequence count):
        calls run one after another and every call fills what it reads, so one set per shape is enough."""
        H, K, V, dev = q.shape[2], q.shape[3], v.shape[-1], q.device

        def shared(name, shape, dtype):
            key = (name, tuple(shape), dtype, dev)
            if key not in self._static:
                self._static[key] = torch.zeros(shape, dtype=dtype, device=dev)
            return self._static[key]

        b = {
            name: shared(name, (1, Tb, H, d), q.dtype) for name, d in (("q", K), ("k", K), ("v", V), ("g", K))
        }
        b["beta"] = shared("beta", (1, Tb, H), q.dtype)
        b["A_log"] = shared("A_log", kw["A_log"].shape, kw["A_log"].dtype)
        b["dt_bias"] = shared("dt_bias", kw["dt_bias"].shape, kw["dt_bias"].dtype)
        b["h0"] = shared("h0", (Nb, H, K, V), torch.float32) if has_h0 else None
        b["cu"] = shared("cu", (Nb + 1,), torch.long)
        return b

    def _call(self, e: _Entry, kw: dict, final: bool):
        b = e.bufs
        args = {
            key: kw[key]
            for key in ("use_gate_in_kernel", "lower_bound", "safe_gate", "use_qk_l2norm_in_kernel",
                        "use_beta_sigmoid_in_kernel")
            if key in kw
        }  # fmt: skip
        return _chunk_kda(
            b["q"], b["k"], b["v"], b["g"], b["beta"], A_log=b["A_log"], dt_bias=b["dt_bias"],
            initial_state=b["h0"], output_final_state=final, cu_seqlens=b["cu"], use_graph=True,
            max_num_seqs=b["cu"].shape[0] - 1, **args,
        )  # fmt: skip

    def _capture(self, e: _Entry, kw: dict, final: bool) -> None:
        self.capturer.warm_up(lambda: self._call(e, kw, final), e.bufs["q"].device)
        e.graph, e.out = self.capturer.capture(lambda: self._call(e, kw, final))
