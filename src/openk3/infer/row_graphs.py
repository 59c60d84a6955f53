"""Row-wise layers of a prefill forward replayed from CUDA graphs, one per (layer, bucket of rows).

A prefill forward is bound by its host work (bench/NOTES.md v38-v39): a K3 MoE layer of many tokens is ~20 launches
(the router and its selection, the row plan, gathers, two grouped GEMMs, the activation, the combine, the shared
experts, the output projection), each a few microseconds of Python and launcher time while the GPU waits.
:class:`RowGraphs` captures such a layer once per bucket of token counts and replays it as one launch.

It takes functions that are **row-wise**: output row ``t`` depends on input row ``t`` alone (an FFN, dense or MoE
with top-k routing: no capacity limit couples the tokens at inference). Only then is a padded call equal to the
unpadded one on the real rows. A call of ``T`` rows runs in the graph of the bucket ``Tb`` (``T`` rounded up to a
multiple of ``step``): the rows are copied into a static input buffer, the rows past ``T`` are zeroed (a zero row
routes like any other token and reaches no real output), the graph replays, and the first ``T`` rows of its static
output buffer are returned as a new tensor (or added to ``add``: the residual add in the same launch as the copy
out). Every bucket of one width and dtype shares one input and one output buffer (views of its first ``Tb`` rows),
and every graph shares one memory pool for its intermediates: calls run one after another on one stream and each
graph's result is copied out before the next call, so nothing that a graph keeps past its replay is overwritten
while it is still needed.

The first call of a (key, bucket) runs the function twice eagerly (Triton autotuning and compiles, cuBLAS
workspaces, layout probes outside the graph), captures it and replays it. A capture that fails (a host
synchronisation inside the function, say) leaves that (key, bucket) eager for good (``failed`` says why, warned
once) and :meth:`run` returns None for it, as it does past ``max_rows``. The graphs hold the function's parameters
by address: a model whose parameters are re-allocated (``.to()``, a re-load that replaces tensors) needs a new
:class:`RowGraphs`. ``capture=False`` runs the same padded call eagerly instead (any device: tests, debugging).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from openk3.fast.graphs import GraphCapture, warn_once


class _Graph:
    __slots__ = ("graph", "width", "dtype")

    def __init__(self, graph, width: int, dtype: torch.dtype):
        self.graph, self.width, self.dtype = graph, width, dtype


class RowGraphs:
    """CUDA graphs of row-wise functions ``fn: [Tb, D] -> [Tb, D']`` per ``(key, Tb)`` (see the module docstring).

    ``max_rows``: the largest call taken (rounded up to a multiple of ``step``); ``step``: the bucket width in rows;
    ``capturer``: the :class:`~openk3.fast.graphs.GraphCapture` (memory pool, warm-up stream) to share with other
    graph sets whose results are likewise consumed before the next replay (None: one of its own)."""

    def __init__(
        self, max_rows: int, step: int = 256, capture: bool = True, capturer: GraphCapture | None = None
    ):
        if int(step) < 1 or int(max_rows) < 1:
            raise ValueError(f"RowGraphs: max_rows {max_rows} and step {step} must be >= 1")
        self.step = int(step)
        self.max_rows = -(-int(max_rows) // self.step) * self.step
        self.capture = bool(capture)
        self.capturer = capturer if capturer is not None else GraphCapture()
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: dict[tuple, str] = {}
        self._bufs: dict[tuple, torch.Tensor] = {}  # (role, width, dtype, device) -> [max_rows, width]
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    def bucket(self, T: int) -> int | None:
        """The bucket (rows) of a call of ``T`` rows, or None past ``max_rows``."""
        if T < 1 or T > self.max_rows:
            return None
        return -(-T // self.step) * self.step

    def _buf(self, role: str, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (role, width, dtype, device)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.zeros(self.max_rows, width, dtype=dtype, device=device)
        return b

    def buffer_bytes(self) -> int:
        """Bytes held by the static input and output buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def run(
        self,
        key: Hashable,
        fn: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``fn(x)`` (``x [..., D]``, its rows the flattened leading dims) through the graph of ``key`` and ``x``'s
        bucket, in ``x``'s leading shape; ``add + fn(x)`` when ``add`` is given (same shape as the result, added in
        the result's dtype as ``add + y`` would). None where the call runs eagerly: off CUDA with ``capture`` on,
        past ``max_rows``, a failed capture, or with autograd recording (counted in ``stats["eager"]``, as are the
        calls of ``capture=False``). ``key`` names the function: one key, one function, for the object's life."""
        res = self._run(key, fn, x, add)
        if res is None or not self.capture:
            self.stats["eager"] += 1
        return res

    def _run(self, key, fn, x, add):
        if x.dim() < 1 or (self.capture and not x.is_cuda) or torch.is_grad_enabled():
            return None
        D = x.shape[-1]
        T = x.numel() // D if D else 0
        Tb = self.bucket(T)
        if Tb is None:
            return None
        gkey = (key, Tb, D, x.dtype, x.device)
        if gkey in self.failed:
            return None
        xin = self._buf("in", D, x.dtype, x.device)
        xin[:T].copy_(x.reshape(T, D))
        if Tb > T:
            xin[T:Tb].zero_()
        if not self.capture:
            y = fn(xin[:Tb])
            out, width = y, y.shape[-1]
        else:
            g = self.graphs.get(gkey)
            if g is None:
                try:
                    g = self._capture(fn, xin[:Tb])
                except Exception as err:
                    why = self.failed[gkey] = f"{type(err).__name__}: {err}"
                    # once per reason, not per (key, bucket): every layer of a kind fails alike
                    warn_once(
                        f"row graphs not captured ({why}); such calls run eagerly (first: {key!r}, {Tb} rows)",
                        key=("row graphs", why),
                    )
                    return None
                self.graphs[gkey] = g
                self.stats["captures"] += 1
            g.graph.replay()
            self.stats["replays"] += 1
            width = g.width
            out = self._buf("out", width, g.dtype, x.device)
        shape = (*x.shape[:-1], width)
        y = out[:T].view(shape)
        if add is not None:
            if add.shape != y.shape:
                raise ValueError(
                    f"RowGraphs.run: add has shape {tuple(add.shape)}, the result {tuple(y.shape)}"
                )
            return add + y
        return y.clone()

    def _capture(self, fn, xb: torch.Tensor) -> _Graph:
        y = self.capturer.warm_up(lambda: fn(xb), xb.device)
        if y.dim() != 2 or y.shape[0] != xb.shape[0]:
            raise ValueError(f"not row-wise: {tuple(xb.shape)} -> {tuple(y.shape)}")
        width, dtype = y.shape[1], y.dtype
        out = self._buf("out", width, dtype, xb.device)
        del y
        graph, _ = self.capturer.capture(lambda: out[: xb.shape[0]].copy_(fn(xb)))
        return _Graph(graph, width, dtype)
