"""FlashInfer's paged MLA decode (optional) over openk3's paged latent cache.

openk3's cache keeps one ``[pages, page_size, dc + dr]`` tensor (the normed latent ``c`` followed by the shared key
part); FlashInfer reads the two parts as strided views of it, so nothing is copied. FlashInfer plans each decode
step on the host from the rows' lengths (its work split), then runs; :class:`FlashInferDecodeStep` turns openk3's
block table and lengths into its page lists and is the engine's MLA step with ``EngineConfig.mla_backend=
"flashinfer"`` (``--mla-backend flashinfer``).

FlashInfer is not a dependency: ``pip install flashinfer-python`` (it compiles its kernels on first use with the CUDA
toolkit's ``nvcc``). :func:`flashinfer_available` says whether it can be used here and why not.
"""

from __future__ import annotations

import torch

WORKSPACE_BYTES = 128 << 20


def flashinfer_available() -> tuple[bool, str]:
    """(usable, reason if not): FlashInfer importable and a CUDA device of compute capability 8.0 or newer."""
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # ImportError, or a broken install failing at import
        return False, f"flashinfer not importable: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return False, "FlashInfer's MLA decode needs compute capability 8.0 or newer"
    return True, ""


class FlashInferDecodeStep:
    """The engine's MLA decode step through FlashInfer (``EngineConfig.mla_backend="flashinfer"``), with the
    signature of ``openk3.infer.decode.FAST_MLA_DECODE`` entries.

    FlashInfer splits the work on the host from the rows' lengths, so the engine calls :meth:`plan` once per decode
    step with the step's host-side block table and lengths (every MLA layer of the step reads the same rows), and
    the layers then call the step itself (graph-capturable). One FlashInfer wrapper per row count, with fixed device
    buffers, so that a captured decode graph stays valid across re-plans (FlashInfer's plan keeps its buffer
    offsets for a given row count). A wrapper's host staging buffer is reused by its next plan only after the copy
    out of it has run on the device (an event per wrapper)."""

    def __init__(
        self, device: torch.device, *, num_heads: int, page_size: int, scale: float, kv_lora_rank: int,
        rope_dim: int, dtype: torch.dtype, max_pages_per_seq: int, backend: str = "auto",
    ):  # fmt: skip
        ok, why = flashinfer_available()
        if not ok:
            raise RuntimeError(f"mla_backend='flashinfer': {why}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"mla_backend='flashinfer' needs a bf16 or fp16 latent cache, got {dtype}")
        self.device = torch.device(device)
        self.heads, self.page_size, self.scale = num_heads, page_size, float(scale)
        self.dc, self.dr, self.dtype = kv_lora_rank, rope_dim, dtype
        self.max_pages = max_pages_per_seq
        self.backend = backend
        self._ws = torch.empty(
            WORKSPACE_BYTES, dtype=torch.uint8, device=self.device
        )  # shared by the wrappers
        self._wrappers: dict[int, tuple] = {}  # rows -> (wrapper, event of its last plan)
        self._planned: tuple | None = None  # (rows, wrapper) of the current plan

    def _wrapper(self, key: int | None):
        """The wrapper of ``key`` rows with fixed buffers (graphs), or (None) the one for eager steps of any size."""
        if key not in self._wrappers:
            import flashinfer.mla

            dev = self.device
            bufs = {}
            if key is not None:
                bufs = dict(
                    use_cuda_graph=True,
                    qo_indptr=torch.arange(key + 1, dtype=torch.int32, device=dev),
                    kv_indptr=torch.zeros(key + 1, dtype=torch.int32, device=dev),
                    kv_indices=torch.zeros(key * self.max_pages, dtype=torch.int32, device=dev),
                    kv_len_arr=torch.ones(key, dtype=torch.int32, device=dev),
                )
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._ws, backend=self.backend, **bufs)
            self._wrappers[key] = (w, None)
        return self._wrappers[key]

    def plan(self, block_table: torch.Tensor, lengths: torch.Tensor, graph: bool = False) -> None:
        """Plan the next decode forward of ``n`` rows from host tensors ``block_table [n, W]`` int32 and
        ``lengths [n]`` int32 (>= 1); ``graph``: through the wrapper of ``n`` rows whose buffers a captured graph
        reads."""
        import numpy as np

        n = block_table.shape[0]
        lens = lengths.numpy().astype(np.int32, copy=False)
        if lens.shape != (n,) or (n and int(lens.min()) < 1):
            raise ValueError(f"FlashInferDecodeStep.plan: lengths must be [{n}] of values >= 1")
        npg = (lens + self.page_size - 1) // self.page_size
        if n and int(npg.max()) > min(block_table.shape[1], self.max_pages):
            raise ValueError(
                "FlashInferDecodeStep.plan: a row's length needs more pages than its table holds"
            )
        key = n if graph else None
        w, ev = self._wrapper(key)
        if ev is not None:
            ev.synchronize()  # the previous plan's copy out of the host staging buffer has run
        tab = block_table.numpy()
        keep = np.arange(tab.shape[1])[None, :] < npg[:, None]
        kv_indices = torch.from_numpy(np.ascontiguousarray(tab[keep], dtype=np.int32))
        kv_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(npg)]).astype(np.int32))
        w.plan(
            torch.arange(n + 1, dtype=torch.int32), kv_indptr, kv_indices, torch.from_numpy(lens.copy()),
            self.heads, self.dc, self.dr, self.page_size, False, self.scale, self.dtype, self.dtype,
        )  # fmt: skip
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
        self._wrappers[key] = (w, ev)
        self._planned = (n, w)

    def __call__(self, q, kv_cache, block_table, lengths, *, scale, kv_lora_rank, **kw) -> torch.Tensor:
        if kw:
            raise ValueError(
                f"FlashInferDecodeStep: unsupported arguments {sorted(kw)} (the MLA glue's fused post)"
            )
        B = q.shape[0]
        if self._planned is None or self._planned[0] != B:
            planned = None if self._planned is None else self._planned[0]
            raise RuntimeError(f"FlashInferDecodeStep: planned for {planned} rows, called with {B}")
        if float(scale) != self.scale or kv_lora_rank != self.dc or q.shape[1] != self.heads:
            raise ValueError(
                "FlashInferDecodeStep: called with another scale, latent width or head count than planned"
            )
        w = self._planned[1]
        qc = q.to(self.dtype)
        out = w.run(
            qc[..., : self.dc], qc[..., self.dc :], kv_cache[..., : self.dc], kv_cache[..., self.dc :]
        )
        return out.float()
