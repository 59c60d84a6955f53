"""Kimi Delta Attention (KDA) reference operators in plain PyTorch.

Shapes (per call): q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``;
initial/final state ``[N, H, K, V]`` (``N = B``, or the number of packed sequences with ``cu_seqlens``).
``g`` is the log decay produced by :func:`kda_gate`; ``beta`` is already in ``(0, 1)``.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.gate import kda_gate, l2norm
from openk3.ops.kda.naive import kda_recurrent

__all__ = ["BACKENDS", "kda", "kda_chunk", "kda_gate", "kda_recurrent", "l2norm"]

BACKENDS = ("auto", "chunk", "recurrent")

# Sequences up to this length run token by token under backend="auto".
AUTO_RECURRENT_MAX_T = 16


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    backend: str = "auto",
    **kw,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA with the chosen backend; returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    ``backend``: ``"chunk"`` (:func:`kda_chunk`), ``"recurrent"`` (:func:`kda_recurrent`) or ``"auto"``
    (chunked when ``T > 16``, recurrent otherwise). Keyword arguments are forwarded; ``chunk_size`` is
    ignored by the recurrent backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kda: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "chunk" if q.dim() >= 2 and q.shape[1] > AUTO_RECURRENT_MAX_T else "recurrent"
    if backend == "chunk":
        return kda_chunk(q, k, v, g, beta, **kw)
    kw.pop("chunk_size", None)
    return kda_recurrent(q, k, v, g, beta, **kw)
