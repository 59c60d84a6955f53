"""MLA prefill attention (MHA form, q/k head dim 192, v head dim 128) without materialising the score matrix.

Backends for :data:`openk3.modules.mla.FAST_MHA` (signature ``fn(q [B,T,H,Dqk], k [B,S,H,Dqk], v [B,S,H,Dv], *,
scale, cu_seqlens) -> o [B,T,H,Dv]``; causal, queries are the last T of the S keys; block-diagonal causal when
``cu_seqlens`` packs documents into one row):

* ``"sdpa"``: ``F.scaled_dot_product_attention``. How V's narrower head dim is handled is chosen by
  ``SDPA_MODE`` (env ``OPENK3_MLA_SDPA``): ``"pad"`` zero-pads V to Dqk and runs the flash kernel (the flash
  kernel wants equal head dims), ``"cudnn"`` / ``"efficient"`` run those kernels on the native shapes, ``"auto"``
  lets PyTorch pick. Packed documents go through ``torch.nn.attention.varlen.varlen_attn`` (flash, V padded) when
  this PyTorch has it, else one SDPA call per document.
* ``"flex"``: FlexAttention (compiled) with a causal / document block mask; native head dims.

Which is fastest was measured on an H200 (bench/NOTES.md); ``auto`` picks the first registered available one.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import torch.nn.functional as F

SDPA_MODE = os.environ.get("OPENK3_MLA_SDPA", "cudnn")
VARLEN_MODE = os.environ.get("OPENK3_MLA_VARLEN", "varlen")  # "varlen" | "loop" | "flex"

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
except Exception:  # pragma: no cover - very old torch
    SDPBackend = sdpa_kernel = causal_lower_right = None

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except Exception:
    _varlen_attn, _VARLEN_PARAMS = None, set()

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except Exception:
    create_block_mask = flex_attention = None


def sdpa_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if sdpa_kernel is None:
        return False, "torch.nn.attention.sdpa_kernel missing (old PyTorch)"
    return True, f"scaled_dot_product_attention ({SDPA_MODE}); varlen: {varlen_kind()}"


def flex_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if flex_attention is None:
        return False, "torch.nn.attention.flex_attention missing"
    return True, "FlexAttention (torch.compile) with causal/document block masks"


def varlen_kind() -> str:
    if VARLEN_MODE == "varlen" and _varlen_attn is None:
        return "loop"
    return VARLEN_MODE


_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "pad": "FLASH_ATTENTION",
}


def _sdpa(qt, kt, vt, *, scale, T, S, mode):
    """qt, kt, vt: [B, H, L, D] views. Causal with the queries at the end of the keys."""
    Dv = vt.shape[-1]
    if mode == "pad" and Dv < qt.shape[-1]:
        vt = F.pad(vt, (0, qt.shape[-1] - Dv))
    if T == S:
        kw = {"is_causal": True}
    else:
        kw = {"attn_mask": causal_lower_right(T, S)}
    if mode == "auto":
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kw)
    else:
        with sdpa_kernel([getattr(SDPBackend, _BACKENDS[mode])]):
            o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **kw)
    return o[..., :Dv] if o.shape[-1] != Dv else o


def mha_sdpa(q, k, v, *, scale, cu_seqlens=None, mode: str | None = None):
    """q: [B, T, H, Dqk]; k: [B, S, H, Dqk]; v: [B, S, H, Dv] -> o [B, T, H, Dv] (q.dtype)."""
    mode = mode or SDPA_MODE
    if q.dtype not in (torch.bfloat16, torch.float16):
        mode = "auto"  # the flash and cuDNN kernels are half-precision only
    B, T, H, _ = q.shape
    S = k.shape[1]
    if cu_seqlens is not None:
        return _mha_varlen(q, k, v, scale=scale, cu_seqlens=cu_seqlens, mode=mode)
    o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, T=T, S=S, mode=mode)
    return o.transpose(1, 2)


def _mha_varlen(q, k, v, *, scale, cu_seqlens, mode):
    if q.shape[1] != k.shape[1]:
        raise ValueError("packed (cu_seqlens) attention needs as many keys as queries")
    kind = varlen_kind()
    if kind == "flex":
        return mha_flex(q, k, v, scale=scale, cu_seqlens=cu_seqlens)
    if cu_seqlens.device.type == "cpu":  # a host copy: the bounds without reading the device back
        bounds = cu_seqlens.tolist()
        cu = cu_seqlens.to(dtype=torch.long).to(q.device, non_blocking=True)
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.long)
        bounds = cu.tolist()
    if kind == "varlen" and q.dtype in (torch.bfloat16, torch.float16):  # (flash: half precision only)
        Dqk, Dv = q.shape[-1], v.shape[-1]
        vp = F.pad(v[0], (0, Dqk - Dv)) if Dv < Dqk else v[0]
        cu32 = cu.to(torch.int32)
        maxlen = max(b - a for a, b in zip(bounds, bounds[1:]))
        kw = {}
        qq = q[0]
        if "scale" in _VARLEN_PARAMS:
            kw["scale"] = scale
        else:
            qq = qq * (scale * Dqk**0.5)
        if "is_causal" in _VARLEN_PARAMS:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
        o = _varlen_attn(qq, k[0], vp, cu32, cu32, maxlen, maxlen, **kw)
        return o[..., :Dv].unsqueeze(0)
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        sl = slice(a, b)
        qt, kt, vt = (x[:, sl].transpose(1, 2) for x in (q, k, v))
        try:
            o = _sdpa(qt, kt, vt, scale=scale, T=b - a, S=b - a, mode=mode)
        except RuntimeError:  # e.g. cuDNN has no kernel for a 1-token document
            o = _sdpa(qt, kt, vt, scale=scale, T=b - a, S=b - a, mode="auto")
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------------------------------------------------------
# FlexAttention


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


_MASK_CACHE: dict = {}


def _block_mask(T: int, S: int, cu: tuple[int, ...] | None, device):
    key = (T, S, cu, str(device))
    bm = _MASK_CACHE.get(key)
    if bm is not None:
        return bm
    off = S - T
    if cu is None:

        def mask_mod(b, h, qi, ki):
            return qi + off >= ki

    else:
        seg = torch.zeros(S, dtype=torch.int32, device=device)
        seg[torch.tensor(cu[1:-1], device=device, dtype=torch.long)] = 1
        seg = seg.cumsum(0).to(torch.int32)

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (seg[qi] == seg[ki])

    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=S, device=device)
    if len(_MASK_CACHE) > 16:
        _MASK_CACHE.clear()
    _MASK_CACHE[key] = bm
    return bm


def mha_flex(q, k, v, *, scale, cu_seqlens=None):
    """FlexAttention form of :func:`mha_sdpa` (native head dims; documents via a block mask)."""
    T, S = q.shape[1], k.shape[1]
    cu = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens.tolist())
    bm = _block_mask(T, S, cu, q.device)
    o = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale)
    return o.transpose(1, 2)
