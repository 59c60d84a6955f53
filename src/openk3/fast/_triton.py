"""Triton import guard and small device helpers shared by the fast kernels."""

from __future__ import annotations

import contextlib
import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing
    triton = tl = None
    HAS_TRITON = False
    tanh_f32 = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Programmatic dependent launch (sm_90+) for the decode-step kernels: a kernel launched with it may start while the
# kernel before it in the stream is still running; before ``pdl_wait`` it reads only data that no kernel of the same
# step writes (weights, a KDA slot's state) and writes nothing, and every such kernel signals early
# (``pdl_trigger``) that the next one may launch. "on" is the process default (OPENK3_PDL=1); EngineConfig.pdl sets
# it for an engine's decode forward.
PDL = {"on": os.environ.get("OPENK3_PDL", "0") == "1"}
_PDL_DEVICES: dict = {}


def pdl_on(t) -> bool:
    """Whether kernels on ``t``'s device launch with programmatic dependent launch now (PDL["on"], compiled
    kernels, a CUDA device of compute capability 9.0 or newer)."""
    if not (PDL["on"] and HAS_TRITON) or INTERPRET or not t.is_cuda:
        return False
    idx = t.device.index
    if idx not in _PDL_DEVICES:
        import torch

        _PDL_DEVICES[idx] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _PDL_DEVICES[idx]


@contextlib.contextmanager
def pdl_scope(on: bool):
    """PDL["on"] set to ``on`` inside the block (an engine's decode step: eager, or while a CUDA graph is captured)."""
    old = PDL["on"]
    PDL["on"] = bool(on)
    try:
        yield
    finally:
        PDL["on"] = old


def pdl_launch(on: bool) -> dict:
    """The launch keyword for a kernel compiled with ``PDL=on``."""
    return {"launch_pdl": True} if on else {}


def triton_ok(t=None) -> tuple[bool, str]:
    """Whether our Triton kernels can run on tensors like ``t`` (CUDA, or anything under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        return False, "triton not installed"
    if INTERPRET:
        return True, "triton (interpreter)"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if t is not None and not t.is_cuda:
        return False, "tensor not on CUDA"
    return True, "triton"


if HAS_TRITON:

    @triton.jit
    def tanh_f32(x):
        """tanh in fp32 without cancellation near 0 (odd Taylor series below |x| = 1/16)."""
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        return tl.where(ax < 0.0625, small, tl.where(x < 0, -big, big))

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """``x`` (fp32) rounded to ``dtype`` (to nearest even) and back to fp32; the bf16 case by bit arithmetic, so
        the CPU interpreter (whose bf16 cast truncates) rounds like the GPU and like PyTorch."""
        if dtype == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) << 16
            y = u.to(tl.float32, bitcast=True)
        else:
            y = x.to(dtype).to(tl.float32)
        return y

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """With ``PDL``: block until the kernel before this one has finished and its writes are visible. Call it
        before the first load of anything but constant data and before the first store."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_trigger(PDL: tl.constexpr):
        """With ``PDL``: let the next kernel in the stream launch now (it waits for this one in its pdl_wait)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs):
        """Request the 128-byte lines holding ``ptrs`` into L2 (nothing waits for them and no registers hold them).
        Compiled kernels only: the interpreter has no inline assembly (callers gate this on a constexpr)."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def prefetch(ptrs, LEVEL: tl.constexpr):
        """Request the lines holding ``ptrs`` into L1 (``LEVEL`` 1) or L2 (2); compiled kernels only."""
        if LEVEL == 1:
            tl.inline_asm_elementwise(
                "prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;",
                "=r,l",
                [ptrs],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            prefetch_l2(ptrs)


_SM_COUNT: dict[int, int] = {}


def cuda_index(device) -> int:
    """The ordinal of a CUDA ``device`` (``cuda`` without one: the current device)."""
    import torch

    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 for a CPU tensor (the interpreter: a few programs,
    so that code splitting work over the SMs still runs more than one)."""
    import torch

    if device.type != "cuda":
        return 4
    idx = cuda_index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def occupancy(n_regs: int, shared: int, num_warps: int, max_shared: int) -> int:
    """Programs of ``num_warps`` warps, ``n_regs`` registers per thread and ``shared`` bytes of shared memory that one
    sm_90 SM holds at once: the least of what its shared memory (``max_shared``, the per-block limit, plus the 1 KB
    each block reserves), its 64 K registers (allocated per warp in units of 256, i.e. per thread rounded up to 8)
    and its 2,048 threads allow, at most 32."""
    by_smem = (max_shared + 1024) // (shared + 1024)
    regs = -(-max(1, n_regs) // 8) * 8
    by_regs = 65536 // (regs * 32 * num_warps)
    by_threads = 2048 // (32 * num_warps)
    return max(0, min(by_smem, by_regs, by_threads, 32))


def resident_per_sm(ck, num_warps: int, device) -> int:
    """:func:`occupancy` of the compiled kernel ``ck`` (a ``warmup`` result) on the CUDA ``device``."""
    ck._init_handles()
    props = triton.runtime.driver.active.utils.get_device_properties(cuda_index(device))
    return occupancy(ck.n_regs, ck.metadata.shared, num_warps, props["max_shared_mem"])


def env_int(name: str, default: int, what: str) -> int:
    """A non-negative integer setting from the environment variable ``name`` (``default`` when unset or blank); a
    clear ``ValueError`` naming ``what`` it counts otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be a non-negative integer ({what}), got {raw!r}")
    return int(raw)


def env_flag(name: str, default: bool) -> bool:
    """An on/off setting from the environment variable ``name``: "1" on, "0" off, ``default`` when unset or blank; a
    clear ``ValueError`` for anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def head_tail(K: int) -> tuple[int, int]:
    """A row of ``K >= 1`` columns as a power-of-two head tile and a power-of-two tail tile (0: none), the tiles of
    the kernels that hold whole rows (K = 2304: 2048 + 256, no masked lanes)."""
    k1 = 1 << (K.bit_length() - 1)
    return k1, (1 << (K - k1 - 1).bit_length() if K > k1 else 0)
