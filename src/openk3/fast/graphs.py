"""What openk3's CUDA graph sets share (the prefill forward's :class:`openk3.fast.kda.ChunkGraphs` and
:class:`openk3.infer.row_graphs.RowGraphs`, the engine's decode-step graphs): warm-up runs on one side stream and
captures into one memory pool (:class:`GraphCapture`), the process's shared streams (:func:`shared_stream`), and
warnings given once (:func:`warn_once`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

from openk3.fast._triton import cuda_index

_WARNED: set = set()
_STREAMS: dict = {}


def shared_stream(device, name: str, priority: int = 0) -> torch.cuda.Stream:
    """The process's one CUDA stream for ``name`` on ``device`` at ``priority``, made on first use.

    Engines take their side, warm-up and capture streams from here instead of making new ones. PyTorch gives every
    (cuBLAS handle, stream) pair that runs a cuBLAS call its own workspace (32 MiB on Hopper) and keeps it for the
    life of the process, and its caching allocator keeps the blocks a stream freed for that stream: with fresh
    streams, each engine built and deleted on one model left ~96 MiB behind on an H100 (bench/NOTES.md v44). Work
    queued on a shared stream is ordered as on any stream (the users wait on events or streams around it); two
    engines driven from two threads at once would queue their side work on one stream, in turn."""
    idx = cuda_index(device)
    key = (idx, name, priority)
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.Stream(torch.device("cuda", idx), priority=priority)
    return s


def warn_once(msg: str, key: Hashable | None = None) -> None:
    """``RuntimeWarning(msg)`` the first time ``key`` (default: the message itself) comes up in this process."""
    k = msg if key is None else key
    if k not in _WARNED:
        _WARNED.add(k)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


class GraphCapture:
    """CUDA graph captures that share one memory pool (the first capture's, ``pool``) and one warm-up stream.

    Sharing the pool is safe for graphs that run one after another on one stream and whose results are consumed
    (copied out, or read by the next launch) before the next replay: a later capture may reuse the memory that an
    earlier one used for its intermediates. One warm-up stream, because the allocator keeps the blocks a stream
    freed for that stream alone: a new stream per capture would keep one more warm-up's worth of memory each time.
    It is the process's shared one (:func:`shared_stream`), so later capture sets do not add a cuBLAS workspace
    either. Use it from one thread."""

    def __init__(self):
        self.pool = None
        self._stream = None

    def warm_up(self, fn: Callable, device, runs: int = 2):
        """Run ``fn()`` ``runs`` times on the warm-up stream (Triton autotuning and compiles, cuBLAS workspaces,
        layout probes: what must not happen inside a capture), ordered after and before the current stream's
        work; returns the last result."""
        dev = torch.device(device)
        s = self._stream
        if s is None or s.device != dev:
            s = self._stream = shared_stream(dev, "warm_up")
        cur = torch.cuda.current_stream(dev)
        s.wait_stream(cur)
        out = None
        with torch.cuda.stream(s):
            for _ in range(runs):
                out = fn()
        cur.wait_stream(s)
        return out

    def capture(
        self, fn: Callable, stream: torch.cuda.Stream | None = None
    ) -> tuple[torch.cuda.CUDAGraph, object]:
        """``(graph, result)``: ``fn()`` captured into the shared pool (on ``stream``; None: a fresh one of the
        default priority, as ``torch.cuda.graph`` takes)."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls from other threads (the server's) must not break the capture
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out
