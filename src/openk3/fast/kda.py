"""KDA core on fla-core's Triton kernels (``chunk_kda`` for training / prefill, ``fused_recurrent_kda`` for short
inference calls), with the decay gate, the beta sigmoid and the q/k L2 normalisation done inside the kernels.

Plugs into :data:`openk3.modules.kda.FAST_KDA` under the name ``"fla"`` with the signature of
``openk3.modules.kda._kda_core_reference``. fla-core is optional: :func:`available` says why it cannot be used.
"""

from __future__ import annotations

import os

import torch


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


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)
