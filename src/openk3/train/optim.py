"""Optimizer family for K3 training (SPEC §6): Muon, Per-Head Muon, AdamW, QK-Clip and LR schedules.

Everything here is model-agnostic: parameters are sorted into Muon / AdamW groups by *name*, using the
module names of the released checkpoint (``model.layers.{i}.self_attn.q_proj.weight`` etc.).

Muon update (SPEC §6.1, Moonlight convention), per parameter with gradient ``G``::

    M <- mu * M + G
    U <- G + mu * M          (nesterov=True)      or   U <- M   (nesterov=False)
    O <- NS5(U) * scale(rows, cols)               per block (whole matrix, per head or per expert)
    W <- W * (1 - lr * wd) - lr * O               (decoupled weight decay)

``scale`` is ``0.2 * sqrt(max(rows, cols))`` (``rms_scale="moonlight"``: update RMS ~ 0.2, matching AdamW,
so one learning rate serves both families) or ``sqrt(max(1, rows / cols))`` (``rms_scale="spectral"``),
where ``rows x cols`` is the shape of the block being orthogonalised.

Per-Head Muon (SPEC §6.3): a 2-D weight ``[H * d_h, d_in]`` is viewed as ``[H, d_h, d_in]`` and each head
block is orthogonalised independently (one batched Newton–Schulz), then reshaped back. Stacked expert
weights ``[E, out, in]`` are orthogonalised per expert the same way.

Assumed choices (not published for K3):

* Nesterov momentum on (Moonlight), momentum buffers kept in fp32 for bf16/fp16 parameters.
* Per-block RMS scale uses the block's own dims (``0.2 * sqrt(max(d_h, d_in))``).
* ``kv_b_proj`` is split into whole ``k_nope + v`` head blocks (256 x 512 for K3), not k / v halves.
* AdamW parameters that are vectors (norm gains, biases, ``A_log``, ``dt_bias``, conv kernels, AttnRes
  vectors) get no weight decay; embeddings and the LM head do.
* The MoE router's weight ``[E, d]`` is a matrix, so it is on whole-matrix Muon (SPEC §6.1: only non-matrix
  parameters go to AdamW, standard Muon practice as in Moonlight); ``router="adamw"`` puts it on AdamW with
  decay instead.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "NS5_COEFFS",
    "zeropower_ns5",
    "muon_scale",
    "set_muon_blocks",
    "Muon",
    "MuonWithAuxAdam",
    "ParamClass",
    "default_param_classifier",
    "classifier_from_config",
    "build_optimizer",
    "qk_clip_",
    "warmup_cosine",
    "wsd",
]

NS5_COEFFS = (3.4445, -4.7750, 2.0315)


# ----------------------------------------------------------------------------------------------------------
# Newton–Schulz orthogonalisation
# ----------------------------------------------------------------------------------------------------------


def zeropower_ns5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, *, bf16: bool = False) -> torch.Tensor:
    """Approximate ``U V^T`` of ``G = U S V^T`` with the quintic Newton–Schulz iteration.

    ``G`` has shape ``[..., m, n]``; all leading dims are independent matrices (batched). Each matrix is
    normalised by its own Frobenius norm, ``X0 = G / (||G||_F + eps)``, transposed when ``m > n`` so that the
    Gram matrix ``X X^T`` is the small one, then iterated ``steps`` times::

        A = X X^T;  X <- a X + (b A + c A^2) X,   (a, b, c) = (3.4445, -4.7750, 2.0315)

    The quintic does not converge to exactly 1: it maps every singular value into a band around 1
    (roughly [0.7, 1.2] after 5 steps), which is all Muon needs.

    Computation runs in fp32 (fp64 inputs stay fp64); ``bf16=True`` runs the iteration in bfloat16 (for
    GPUs). The result has the dtype of ``G``.
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower_ns5 needs a matrix (or batch of matrices), got shape {tuple(G.shape)}")
    a, b, c = NS5_COEFFS
    if bf16:
        work = torch.bfloat16
    else:
        work = torch.promote_types(G.dtype, torch.float32)
    X = G.to(work)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    norm = torch.linalg.vector_norm(
        X.to(torch.promote_types(work, torch.float32)), dim=(-2, -1), keepdim=True
    )
    X = X / (norm + eps).to(work)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


def muon_scale(rows: int, cols: int, rule: str = "moonlight") -> float:
    """Scale applied to the orthogonalised update of one ``rows x cols`` block."""
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown rms_scale rule {rule!r} (expected 'moonlight', 'spectral' or 'none')")


# ----------------------------------------------------------------------------------------------------------
# Block layouts
# ----------------------------------------------------------------------------------------------------------


def set_muon_blocks(
    param: torch.Tensor, head_dim: int | None = None, expert_dim: bool = False
) -> torch.Tensor:
    """Attach a per-parameter block layout (overrides the group's ``head_dim`` / ``expert_dim``)."""
    param._muon_blocks = {"head_dim": head_dim, "expert_dim": bool(expert_dim)}
    return param


def _layout(p: torch.Tensor, group: dict[str, Any]) -> tuple[int | None, bool]:
    """Resolve ``(head_dim, expert_dim)`` for ``p``: the ``_muon_blocks`` attribute wins over the group.

    ``_muon_blocks`` may be an int (head_dim), a dict ``{"head_dim": int|None, "expert_dim": bool}`` or None.
    """
    head_dim, expert = group.get("head_dim"), bool(group.get("expert_dim", False))
    blocks = getattr(p, "_muon_blocks", None)
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        head_dim = blocks
    elif isinstance(blocks, dict):
        head_dim = blocks.get("head_dim", head_dim)
        expert = bool(blocks.get("expert_dim", expert))
    elif blocks is not None:
        raise TypeError(f"_muon_blocks must be an int, a dict or None, got {type(blocks).__name__}")
    return head_dim, expert


def _check_layout(shape: torch.Size, head_dim: int | None, expert: bool) -> None:
    if len(shape) < 2:
        raise ValueError(f"Muon needs matrix parameters, got shape {tuple(shape)}; put vectors in AdamW")
    if len(shape) > 2 and not expert:
        raise ValueError(
            f"parameter of shape {tuple(shape)} has more than 2 dims; set expert_dim=True to orthogonalise "
            "each leading index (e.g. stacked experts [E, out, in]) separately"
        )
    if head_dim is not None and (head_dim <= 0 or shape[-2] % head_dim):
        raise ValueError(
            f"output dim {shape[-2]} of shape {tuple(shape)} is not a multiple of head_dim {head_dim}"
        )


def _blocked_update(
    U: torch.Tensor, head_dim: int | None, ns_steps: int, rms_scale: str, bf16: bool
) -> torch.Tensor:
    """Orthogonalise ``U`` block-wise and apply the per-block scale; returns a tensor shaped like ``U``."""
    shape = U.shape
    if head_dim is not None:
        X = U.reshape(*shape[:-2], shape[-2] // head_dim, head_dim, shape[-1])
    else:
        X = U
    O = zeropower_ns5(X, steps=ns_steps, bf16=bf16)
    O = O * muon_scale(X.shape[-2], X.shape[-1], rms_scale)
    return O.reshape(shape)


def _is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 parameter shard)."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype


def _apply_update(p: torch.Tensor, lr: float, wd: float, update: torch.Tensor) -> None:
    """``p <- p * (1 - lr*wd) - lr * update``, computed in at least fp32 for low-precision params."""
    if p.dtype in (torch.bfloat16, torch.float16):
        w = p.float()
        if wd:
            w.mul_(1.0 - lr * wd)
        w.add_(update.float(), alpha=-lr)
        p.copy_(w)
    else:
        if wd:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)


# ----------------------------------------------------------------------------------------------------------
# Group step functions
# ----------------------------------------------------------------------------------------------------------

_MUON_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    momentum=0.95,
    nesterov=True,
    weight_decay=0.1,
    ns_steps=5,
    head_dim=None,
    expert_dim=False,
    rms_scale="moonlight",
    ns_bf16=False,
)

_ADAMW_DEFAULTS: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def _validate_muon_group(group: dict[str, Any]) -> None:
    muon_scale(2, 1, group["rms_scale"])  # validates the rule name
    for p in group["params"]:
        _check_layout(p.shape, *_layout(p, group))


def _muon_group_step(group: dict[str, Any], state: dict) -> None:
    mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
    for p in group["params"]:
        if p.grad is None:
            continue
        g = p.grad.to(_state_dtype(p))
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p, dtype=_state_dtype(p))
        buf = st["momentum_buffer"]
        buf.mul_(mu).add_(g)
        u = g.add(buf, alpha=mu) if group["nesterov"] else buf
        head_dim, _ = _layout(p, group)
        if _is_sharded(u):  # FSDP2 shard: orthogonalise the full matrix, keep this rank's shard of the update
            from torch.distributed.tensor import distribute_tensor

            full = _blocked_update(
                u.full_tensor(), head_dim, group["ns_steps"], group["rms_scale"], group["ns_bf16"]
            )
            o = distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)
        else:
            o = _blocked_update(u, head_dim, group["ns_steps"], group["rms_scale"], group["ns_bf16"])
        _apply_update(p, lr, wd, o)


def _adamw_group_step(group: dict[str, Any], state: dict) -> None:
    (b1, b2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
    for p in group["params"]:
        if p.grad is None:
            continue
        g = p.grad.to(_state_dtype(p))
        st = state[p]
        if "step" not in st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, dtype=_state_dtype(p))
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=_state_dtype(p))
        st["step"] += 1
        t = st["step"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v / (1.0 - b2**t)).sqrt_().add_(eps)
        update = (m / (1.0 - b1**t)) / denom
        _apply_update(p, lr, wd, update)


# ----------------------------------------------------------------------------------------------------------
# Optimizer classes
# ----------------------------------------------------------------------------------------------------------


class _ExactStateMixin:
    """``Optimizer.load_state_dict`` casts floating state to the parameter dtype; our fp32 buffers for
    bf16/fp16 parameters must survive a round trip bit-exactly, so restore the saved dtypes afterwards."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        for pid, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            st = self.state[p]  # type: ignore[attr-defined]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and st[k].dtype != v.dtype:
                    st[k] = v.to(device=p.device, dtype=v.dtype, copy=True)


class Muon(_ExactStateMixin, torch.optim.Optimizer):
    """Muon with optional Per-Head / per-expert orthogonalisation (see module docstring for the formula).

    Group keys: ``lr``, ``momentum`` (0.95), ``nesterov`` (True), ``weight_decay`` (0.1), ``ns_steps`` (5),
    ``head_dim`` (None = whole matrix; int = view ``[out, in]`` as ``[out // head_dim, head_dim, in]``),
    ``expert_dim`` (False; True = leading dims of an ``[E, out, in]`` tensor are independent matrices),
    ``rms_scale`` ("moonlight" | "spectral" | "none"), ``ns_bf16`` (False).
    A parameter attribute ``_muon_blocks`` (see :func:`set_muon_blocks`) overrides ``head_dim`` /
    ``expert_dim`` for that parameter. All parameters must be (stacks of) matrices.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        head_dim: int | None = None,
        expert_dim: bool = False,
        rms_scale: str = "moonlight",
        ns_bf16: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            head_dim=head_dim,
            expert_dim=expert_dim,
            rms_scale=rms_scale,
            ns_bf16=ns_bf16,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _validate_muon_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _muon_group_step(group, self.state)
        return loss


class MuonWithAuxAdam(_ExactStateMixin, torch.optim.Optimizer):
    """One optimizer object holding Muon groups and AdamW groups (one scheduler, one state_dict).

    Every param group must carry ``use_muon: bool``. Missing keys are filled from the Muon defaults
    (see :class:`Muon`) or the AdamW defaults (``lr``, ``betas`` (0.9, 0.95), ``eps`` 1e-8,
    ``weight_decay`` 0). AdamW is the decoupled form with bias correction:
    ``W <- W (1 - lr wd) - lr * m_hat / (sqrt(v_hat) + eps)``.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(list(param_groups), {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "use_muon" not in param_group:
            raise ValueError("every MuonWithAuxAdam param group needs a boolean 'use_muon' key")
        group = dict(param_group)
        defaults = _MUON_DEFAULTS if group["use_muon"] else _ADAMW_DEFAULTS
        for k, v in defaults.items():
            group.setdefault(k, v)
        super().add_param_group(group)
        if self.param_groups[-1]["use_muon"]:
            _validate_muon_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                _muon_group_step(group, self.state)
            else:
                _adamw_group_step(group, self.state)
        return loss


# ----------------------------------------------------------------------------------------------------------
# Parameter classification
# ----------------------------------------------------------------------------------------------------------


class ParamClass(NamedTuple):
    """Where a parameter goes: ``("muon", head_dim | None, is_expert)`` or ``("adamw", None, False, decay)``.

    ``weight_decay`` is only consulted for AdamW parameters (Muon parameters always use the Muon group's
    decay). A classifier may also return a plain 3-tuple; it is then read with ``weight_decay=True``, or
    ``None`` to leave the parameter out of the optimizer.
    """

    kind: str
    head_dim: int | None = None
    is_expert: bool = False
    weight_decay: bool = True


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(?:^|\.)experts\.(?:\d+\.)?w[123](?:\.weight)?$")
_ROUTER_RE = re.compile(r"(?:^|\.)gate\.weight$")
_NO_DECAY_TOKENS = ("A_log", "dt_bias", "conv1d", "_res_proj", "_res_norm", "e_score_correction_bias")


def default_param_classifier(
    name: str,
    param: torch.Tensor,
    *,
    kda_head_dim: int | None = None,
    mla_q_head_dim: int | None = None,
    mla_kv_head_dim: int | None = None,
    kda_layers: Iterable[int] = frozenset(),
    mla_layers: Iterable[int] = frozenset(),
    router: str = "muon",
) -> ParamClass:
    """Classify a parameter by its (checkpoint-style) name.

    AdamW: ``embed_tokens``, ``lm_head`` (decayed), the MoE router ``...gate.weight`` when ``router="adamw"``
    (decayed; by default it is a whole-matrix Muon parameter); norm gains
    (any dotted component containing ``norm``), biases, ``A_log``, ``dt_bias``, ``*conv1d*``, AttnRes vectors
    (``*_res_proj*``, ``*_res_norm*``), ``e_score_correction_bias``, every 1-D parameter and every 2-D
    parameter with a dimension of size 1 (not decayed).

    Muon per head: ``layers.{i}.self_attn.{q,k,v}_proj.weight`` for ``i`` in ``kda_layers`` (block
    ``kda_head_dim``); ``self_attn.q_b_proj.weight`` / ``self_attn.q_proj.weight`` (block ``mla_q_head_dim`` =
    nope + rope) and ``self_attn.kv_b_proj.weight`` (block ``mla_kv_head_dim`` = nope + v) for ``i`` in
    ``mla_layers``. A head dim left as None means whole-matrix Muon for that projection.

    Muon per expert: ``...experts.w{1,2,3}`` stacked as ``[E, out, in]``; an unstacked
    ``experts.{e}.w1.weight`` is 2-D and gets whole-matrix Muon (the same thing).

    Everything else 2-D: whole-matrix Muon. Other >2-D tensors: AdamW without decay.
    Layer indices are 0-based and parsed from ``layers.{i}.``.
    """
    parts = name.split(".")
    leaf = parts[-1]
    if param.ndim < 2:
        return ParamClass("adamw", None, False, False)
    if any(tok in name for tok in _NO_DECAY_TOKENS) or leaf == "bias":
        return ParamClass("adamw", None, False, False)
    if any("norm" in part for part in parts[:-1]):
        return ParamClass("adamw", None, False, False)
    if "embed_tokens" in name or "lm_head" in name:
        return ParamClass("adamw", None, False, True)
    if router not in ("muon", "adamw"):
        raise ValueError(f"router must be 'muon' or 'adamw', got {router!r}")
    if _ROUTER_RE.search(name):
        return (
            ParamClass("adamw", None, False, True) if router == "adamw" else ParamClass("muon", None, False)
        )
    if param.ndim == 3 and _EXPERT_RE.search(name):
        return ParamClass("muon", None, True)
    if param.ndim != 2:
        return ParamClass("adamw", None, False, False)
    if min(param.shape) == 1:
        return ParamClass("adamw", None, False, False)

    m = _LAYER_RE.search(name)
    if m is not None and ".self_attn." in name and leaf == "weight":
        layer = int(m.group(1))
        proj = parts[-2]
        if layer in set(kda_layers) and proj in ("q_proj", "k_proj", "v_proj"):
            return ParamClass("muon", kda_head_dim, False)
        if layer in set(mla_layers):
            if proj in ("q_b_proj", "q_proj"):
                return ParamClass("muon", mla_q_head_dim, False)
            if proj == "kv_b_proj":
                return ParamClass("muon", mla_kv_head_dim, False)
    return ParamClass("muon", None, False)


def _cfg_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def classifier_from_config(config: Any, *, router: str = "muon") -> Callable[[str, torch.Tensor], ParamClass]:
    """Bind :func:`default_param_classifier` to a model config (``K3Config`` or an HF-style dict) and a
    ``router`` choice ("muon" or "adamw").

    Reads ``kda_layers`` / ``full_attn_layers`` (1-based, as in the released config; also looked up inside
    ``linear_attn_config``), ``kda_head_dim`` (or ``linear_attn_config.head_dim``) and
    ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim``.
    """
    lac = _cfg_get(config, "linear_attn_config") or {}
    kda = _cfg_get(config, "kda_layers") or _cfg_get(lac, "kda_layers") or []
    full = _cfg_get(config, "full_attn_layers") or _cfg_get(lac, "full_attn_layers") or []
    kda_hd = _cfg_get(config, "kda_head_dim") or _cfg_get(lac, "head_dim")
    nope, rope, v = (_cfg_get(config, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kw = dict(
        kda_head_dim=kda_hd,
        mla_q_head_dim=(nope + rope) if nope is not None and rope is not None else None,
        mla_kv_head_dim=(nope + v) if nope is not None and v is not None else None,
        kda_layers=frozenset(int(i) - 1 for i in kda),
        mla_layers=frozenset(int(i) - 1 for i in full),
        router=router,
    )
    return lambda name, param: default_param_classifier(name, param, **kw)


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    muon_lr: float | None = None,
    adam_lr: float | None = None,
    weight_decay: float = 0.1,
    adam_weight_decay: float | None = None,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    rms_scale: str = "moonlight",
    per_head: bool = True,
    classify: Callable[[str, torch.Tensor], Any] | None = None,
    config: Any = None,
    router: str = "muon",
) -> MuonWithAuxAdam:
    """Build one :class:`MuonWithAuxAdam` for ``model``.

    ``classify(name, param)`` returns a :class:`ParamClass` (or a 3/4-tuple, or None to skip); by default
    :func:`classifier_from_config` when ``config`` is given, else :func:`default_param_classifier` without
    head dims (every matrix whole-matrix Muon); both with ``router`` ("muon": the MoE router weight on
    whole-matrix Muon, "adamw": on AdamW with decay). ``per_head=False`` drops all head blocks (plain Muon
    ablation). Frozen parameters (``requires_grad=False``) are skipped. One param group is made per
    (kind, head_dim, is_expert, decay) combination, in first-seen order, each labelled with ``group_name``;
    Muon groups use ``muon_lr or lr`` and ``weight_decay``; AdamW groups use ``adam_lr or lr`` and
    ``adam_weight_decay`` (default ``weight_decay``) or 0 for no-decay parameters.
    """
    if router not in ("muon", "adamw"):
        raise ValueError(f"router must be 'muon' or 'adamw', got {router!r}")
    if classify is None:
        if config is not None:
            classify = classifier_from_config(config, router=router)
        else:
            classify = functools.partial(default_param_classifier, router=router)
    muon_lr = lr if muon_lr is None else muon_lr
    adam_lr = lr if adam_lr is None else adam_lr
    adam_wd = weight_decay if adam_weight_decay is None else adam_weight_decay

    groups: dict[tuple, dict[str, Any]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        cls = classify(name, p)
        if cls is None:
            continue
        cls = ParamClass(*cls)
        if cls.kind == "muon":
            head_dim = cls.head_dim if per_head else None
            key = ("muon", head_dim, bool(cls.is_expert))
            if key not in groups:
                label = (
                    "muon" + (f"/head{head_dim}" if head_dim else "") + ("/expert" if cls.is_expert else "")
                )
                groups[key] = dict(
                    params=[],
                    use_muon=True,
                    group_name=label,
                    lr=muon_lr,
                    momentum=momentum,
                    nesterov=nesterov,
                    weight_decay=weight_decay,
                    ns_steps=ns_steps,
                    head_dim=head_dim,
                    expert_dim=bool(cls.is_expert),
                    rms_scale=rms_scale,
                    ns_bf16=False,
                )
        elif cls.kind == "adamw":
            key = ("adamw", bool(cls.weight_decay))
            if key not in groups:
                groups[key] = dict(
                    params=[],
                    use_muon=False,
                    group_name="adamw" if cls.weight_decay else "adamw/no_decay",
                    lr=adam_lr,
                    betas=tuple(betas),
                    eps=eps,
                    weight_decay=adam_wd if cls.weight_decay else 0.0,
                )
        else:
            raise ValueError(f"classifier returned unknown kind {cls.kind!r} for {name}")
        groups[key]["params"].append(p)
    if not groups:
        raise ValueError("model has no trainable parameters")
    return MuonWithAuxAdam(groups.values())


# ----------------------------------------------------------------------------------------------------------
# QK-Clip (MuonClip), NoPE MLA mapping
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def qk_clip_(
    q_weight: torch.Tensor,
    kv_b_weight: torch.Tensor,
    max_logits: torch.Tensor,
    *,
    tau: float = 100.0,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> torch.Tensor:
    """QK-Clip for one MLA layer (SPEC §6.2, NoPE mapping), in place. Returns ``gamma`` [H] (fp32).

    ``max_logits[h]`` is the largest pre-softmax logit of head ``h`` over the batch, already including the
    softmax scale (``q.k / sqrt(nope + rope)``). For every head with ``max_logits[h] > tau``,
    ``gamma_h = tau / max_logits[h]`` (else 1), and

    * ``q_weight`` (``q_b_proj`` or ``q_proj``, shape ``[H * (nope + rope), in]``, per head nope rows then
      rope rows): the head's nope rows are scaled by ``sqrt(gamma_h)``, its rope rows by ``gamma_h``;
    * ``kv_b_weight`` (shape ``[H * (nope + v), kv_lora_rank]``, per head k-nope rows then v rows): the
      head's k-nope rows are scaled by ``sqrt(gamma_h)``; v rows are untouched;
    * the shared 64-d key (``kv_a_proj_with_mqa``) is untouched.

    Every logit of head ``h`` is thereby multiplied by exactly ``gamma_h``: nope part ``sqrt*sqrt``,
    rope part ``gamma * 1``. (The ``kv_a_layernorm`` in front of ``kv_b_proj`` is unaffected, since the
    scaling acts on rows of ``kv_b_proj``.) Call it after the optimizer step with logits from the step's
    forward pass.
    """
    H, dn, dr, dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    if q_weight.shape[0] != H * (dn + dr):
        raise ValueError(f"q_weight has {q_weight.shape[0]} rows, expected {H}*({dn}+{dr})")
    if kv_b_weight.shape[0] != H * (dn + dv):
        raise ValueError(f"kv_b_weight has {kv_b_weight.shape[0]} rows, expected {H}*({dn}+{dv})")
    ml = torch.as_tensor(max_logits, dtype=torch.float32).to(q_weight.device).reshape(-1)
    if ml.numel() != H:
        raise ValueError(f"max_logits has {ml.numel()} entries, expected {H}")
    gamma = torch.where(ml > tau, tau / ml.clamp_min(tau), torch.ones_like(ml))
    if bool((gamma < 1).any()):
        sq = gamma.sqrt()
        qs = torch.cat([sq[:, None].expand(H, dn), gamma[:, None].expand(H, dr)], dim=1).reshape(-1, 1)
        ks = torch.cat([sq[:, None].expand(H, dn), torch.ones(H, dv, device=sq.device)], dim=1).reshape(-1, 1)
        for w, s in ((q_weight, qs), (kv_b_weight, ks)):
            work = torch.promote_types(w.dtype, torch.float32)
            s = s.to(device=w.device, dtype=work)
            if _is_sharded(w):  # FSDP2 shard: scale the full matrix (rare: only when a head clips), keep this
                # rank's shard; every rank gathers and scales the same values
                from torch.distributed.tensor import distribute_tensor

                full = (w.full_tensor().to(work) * s).to(w.dtype)
                new = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None)
                w.to_local().copy_(new.to_local())
            else:
                w.copy_((w.to(work) * s).to(w.dtype))
    return gamma


# ----------------------------------------------------------------------------------------------------------
# LR schedules
# ----------------------------------------------------------------------------------------------------------


def _warmup_steps(total_steps: int, warmup_frac: float) -> int:
    if total_steps <= 0:
        raise ValueError("total_steps must be positive")
    return max(1, round(warmup_frac * total_steps)) if warmup_frac > 0 else 0


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio`` (SPEC §6.4), as a ``LambdaLR`` multiplier.

    With ``W = max(1, round(warmup_frac * total_steps))``: factor ``(step + 1) / W`` for ``step < W`` (so the
    first update already has a non-zero LR and step ``W - 1`` reaches 1), then
    ``min + (1 - min) * (1 + cos(pi * p)) / 2`` with ``p = (step - W) / (total_steps - W)`` clamped to [0, 1].
    """
    W = _warmup_steps(total_steps, warmup_frac)

    def factor(step: int) -> float:
        if step < W:
            return (step + 1) / W
        p = min(1.0, max(0.0, (step - W) / max(1, total_steps - W)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return LambdaLR(optimizer, factor)


def wsd(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_frac: float = 0.01,
    decay_frac: float = 0.2,
    min_lr_ratio: float = 0.0,
    decay_shape: str = "linear",
) -> LambdaLR:
    """Warmup-Stable-Decay: the warmup of :func:`warmup_cosine`, constant 1, then a decay over the last
    ``D = round(decay_frac * total_steps)`` steps to ``min_lr_ratio`` at ``total_steps``.

    ``decay_shape``: "linear" (default), "cosine" or "1-sqrt" (``1 - sqrt(p)``).
    """
    W = _warmup_steps(total_steps, warmup_frac)
    D = max(0, round(decay_frac * total_steps))
    start = max(W, total_steps - D)
    shapes = {
        "linear": lambda p: 1.0 - p,
        "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
        "1-sqrt": lambda p: 1.0 - math.sqrt(p),
    }
    if decay_shape not in shapes:
        raise ValueError(f"unknown decay_shape {decay_shape!r}")
    shape = shapes[decay_shape]

    def factor(step: int) -> float:
        if step < W:
            return (step + 1) / W
        if step < start:
            return 1.0
        p = min(1.0, (step - start) / max(1, total_steps - start))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape(p)

    return LambdaLR(optimizer, factor)
