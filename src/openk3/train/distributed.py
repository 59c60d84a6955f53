"""Distributed training, applied from outside the model: process setup, device mesh, expert parallelism (EP),
FSDP2, gradient synchronisation, Quantile Balancing across ranks and torch.distributed.checkpoint (DCP).

Layout
------
``build_mesh(world, ep)`` returns a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` with dims
``("dp", "ep")`` and shape ``(world // ep, ep)``; global rank ``= dp_index * ep + ep_index``, so the ranks of one
EP group are consecutive (one node when ``ep`` <= GPUs per node). Every rank reads its own slice of the data:
*all* ``world`` ranks are data parallel, ``ep`` only says how the routed experts are split.

* Routed experts (``SparseMoE.experts.w1/w2/w3``, stacked ``[E, ...]``): EP rank ``j`` keeps experts
  ``[j * E/ep, (j+1) * E/ep)`` as ordinary local Parameters ``[E/ep, ...]`` (``moe.expert_offset = j * E/ep``);
  the copies on the ``dp`` ranks with the same ``j`` are replicas.
* Everything else is replicated over all ranks, or sharded by FSDP2 over all ranks (``apply_fsdp``).

Gradients are those of the global loss ``mean over ranks of the per-rank loss`` (equal token counts per rank
give the mean over all tokens):

* FSDP-managed parameters: FSDP's reduce-scatter averages them.
* Replicated plain parameters: ``allreduce_grads`` averages them over all ranks.
* EP experts: the combine all-to-all already brings back, to the owner of an expert, the gradient of every EP
  rank's loss, so the local gradient is a *sum* over the EP group; ``allreduce_grads`` sums it over ``dp`` and
  divides by ``world`` (= mean over ranks of the per-rank contributions).

Typical training setup (order matters)::

    info = init_distributed()
    mesh = build_mesh(info.world_size, ep=2)
    torch.manual_seed(0); model = K3ForCausalLM(cfg)            # same init on every rank (or load weights)
    apply_expert_parallel(model, mesh)                           # 1. keep the local experts, all-to-all compute
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16)          # 2. FSDP2: attention + FFN units, then the root
    opt = build_optimizer(model, ...)                            # 3. optimizer over the sharded/local params
    extra = load_dcp(ckpt, model, opt)                           # optional resume
    for step ...:
        loss = model(inputs_of_this_rank, targets=...).loss; loss.backward()
        allreduce_grads(model, mesh)                             # replicated + expert grads (no-op for FSDP ones)
        clip_grad_norm_(model, 1.0, mesh); opt.step(); opt.zero_grad()
        allreduce_balancer(balancer); bias = balancer.compute_bias()   # identical bias on every rank
    save_dcp(ckpt, model, opt, extra={"step": step})
"""

from __future__ import annotations

import contextvars
import datetime
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "init_distributed",
    "destroy_distributed",
    "build_mesh",
    "all_to_all_single",
    "expert_parallel_experts",
    "apply_expert_parallel",
    "apply_fsdp",
    "allreduce_grads",
    "clip_grad_norm_",
    "allreduce_balancer",
    "broadcast_module",
    "reduce_mean",
    "save_dcp",
    "load_dcp",
    "launch_command",
    "launch",
    "under_torchrun",
]


# ---------------------------------------------------------------------------------------------------------------
# process group and mesh


@dataclass
class DistInfo:
    """What ``init_distributed`` set up."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True inside a process started by torchrun (its environment variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_distributed(backend: str | None = None, *, timeout_s: float = 600.0) -> DistInfo:
    """Initialise ``torch.distributed`` from the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``).

    Backend: ``nccl`` when CUDA is available, else ``gloo`` (override with ``backend``). On CUDA the device is
    ``cuda:LOCAL_RANK`` and becomes the current device. Without torchrun variables a one-process group (world
    size 1, in-memory store) is created, so FSDP/DCP code paths run unchanged on one device. An existing default
    group is reused.
    """
    cuda = torch.cuda.is_available() and backend != "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, dist.get_backend(), False)
    backend = backend or ("nccl" if cuda else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if under_torchrun():
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend, True)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _device_type() -> str:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def build_mesh(
    world_size: int | None = None, ep: int = 1, dp_shard: int | None = None, *, device_type: str | None = None
):
    """2-D device mesh ``("dp", "ep")`` of shape ``(world_size // ep, ep)`` (see the module docstring for the
    layout). ``dp_shard`` defaults to ``world_size // ep``; it is checked, not free (``dp_shard * ep`` must equal
    the world size). Needs an initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = world_size or dist.get_world_size()
    if world_size != dist.get_world_size():
        raise ValueError(
            f"build_mesh: world_size={world_size} but the process group has {dist.get_world_size()}"
        )
    if ep < 1 or world_size % ep:
        raise ValueError(f"build_mesh: ep={ep} must divide the world size {world_size}")
    dp = world_size // ep
    if dp_shard is not None and dp_shard != dp:
        raise ValueError(f"build_mesh: dp_shard={dp_shard} * ep={ep} must equal the world size {world_size}")
    return init_device_mesh(device_type or _device_type(), (dp, ep), mesh_dim_names=("dp", "ep"))


def _submesh(mesh, name: str):
    """The 1-D submesh ``name`` of a named mesh (``None`` when the mesh has no such dim)."""
    names = mesh.mesh_dim_names or ()
    if name in names:
        return mesh if mesh.ndim == 1 else mesh[name]
    return None


_WORLD_MESHES: dict[tuple[str, int], Any] = {}


def _world_mesh(device_type: str):
    """A 1-D mesh over all ranks (cached: creating one is a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, dist.get_world_size())
    if key not in _WORLD_MESHES:
        _WORLD_MESHES[key] = init_device_mesh(device_type, (key[1],), mesh_dim_names=("world",))
    return _WORLD_MESHES[key]


# ---------------------------------------------------------------------------------------------------------------
# expert parallelism


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all_single(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None
) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of ``x`` (``in_splits[j]`` rows go to rank ``j``, ``out_splits[j]``
    rows arrive from it). Works on gloo and nccl."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def expert_parallel_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    group=None,
    act: str = "situ",
    beta1: float = 4.0,
    beta2: float = 25.0,
    local_fn=None,
) -> torch.Tensor:
    """Routed-expert compute with the experts split over the ranks of ``group`` (same contract as
    ``experts_reference``, but ``w1/w2/w3`` hold only this rank's ``E_loc`` experts, global ids
    ``[rank * E_loc, (rank+1) * E_loc)``).

    x: [N, W] latent tokens; idx / weights: [N, k] global expert ids / fp32 mixture weights. Every (token, slot)
    pair is sent to the rank owning its expert (split sizes exchanged first, then the rows and their expert ids),
    the receiving rank runs its experts on what it got (``local_fn``, the expert function with ``k = 1`` and
    weight 1, grouped by expert), the outputs (x.dtype) come back through a second all-to-all and are multiplied
    by their fp32 weights and summed per token in fp32, as in the reference. Returns [N, W] in x.dtype.
    Differentiable in x, weights and the local expert weights; every rank of ``group`` must call it.
    """
    from openk3.ops.moe import experts_reference

    local_fn = local_fn or experts_reference
    ep = dist.get_world_size(group)
    e_loc = w1.shape[0]
    offset = dist.get_rank(group) * e_loc
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # grouped by expert, hence by owner rank
    e_sorted = flat[order]
    tok = order // k
    w_sorted = weights.reshape(-1)[order]
    send_counts = torch.bincount(torch.div(e_sorted, e_loc, rounding_mode="floor"), minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    if len(send) != ep:
        raise ValueError(
            f"expert id out of range: routed to {len(send) * e_loc} experts, EP holds {ep * e_loc}"
        )
    x_recv = _AllToAll.apply(x[tok], recv, send, group)
    e_recv = e_sorted.new_empty(sum(recv))
    dist.all_to_all_single(e_recv, e_sorted.contiguous(), recv, send, group=group)
    local = (e_recv - offset).unsqueeze(1)
    if (
        w1.dtype != x.dtype
    ):  # fp32 master experts under a lower-precision compute policy (FSDP mixed precision)
        w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    ones = torch.ones(local.shape, dtype=torch.float32, device=x.device)
    y_recv = local_fn(x_recv, local, ones, w1, w2, w3, act=act, beta1=beta1, beta2=beta2)
    if x_recv.shape[0] == 0 and torch.is_grad_enabled():
        # nothing arrived: keep this rank in the backward exchange (both all-to-alls) with zero gradients
        y_recv = (
            y_recv
            + x_recv * 0
            + (w1.reshape(-1)[:1] + w2.reshape(-1)[:1] + w3.reshape(-1)[:1]).to(y_recv) * 0
        )
    y = _AllToAll.apply(y_recv, send, recv, group)
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * w_sorted.unsqueeze(1))
    return out.to(x.dtype)


@dataclass
class _EPState:
    group: Any
    mesh: Any  # mesh the stacked expert tensors are described on (for DCP): [..., "ep"]
    placements: tuple
    ep: int
    num_experts: int
    offset: int
    inner: str | None  # backend of the local expert compute (None = auto)
    fqns: list[str] = field(default_factory=list)


_ACTIVE: contextvars.ContextVar[_EPState | None] = contextvars.ContextVar("openk3_ep", default=None)
_EP_BACKEND = "ep"


def _ep_backend_fn(x, idx, weights, w1, w2, w3, *, act="situ", beta1=4.0, beta2=25.0):
    from openk3.modules.moe import FAST_EXPERTS
    from openk3.ops import backend as _backend
    from openk3.ops.moe import experts_reference

    st = _ACTIVE.get()
    if st is None:
        raise RuntimeError("the 'ep' MoE backend only runs inside a layer prepared by apply_expert_parallel")
    token = _ACTIVE.set(None)  # the local compute must not resolve to "ep" again
    try:
        be = _backend.resolve("moe", x.is_cuda, st.inner)
        local_fn = experts_reference if be == "reference" else FAST_EXPERTS[be]
        return expert_parallel_experts(
            x, idx, weights, w1, w2, w3, group=st.group, act=act, beta1=beta1, beta2=beta2, local_fn=local_fn
        )
    finally:
        _ACTIVE.reset(token)


def _register_ep_backend() -> None:
    from openk3.modules.moe import FAST_EXPERTS
    from openk3.ops import backend as _backend

    if _EP_BACKEND in FAST_EXPERTS:
        return
    FAST_EXPERTS[_EP_BACKEND] = _ep_backend_fn
    _backend.register(
        "moe",
        _backend.Backend(
            _EP_BACKEND,
            lambda: (
                _ACTIVE.get() is not None,
                "expert-parallel all-to-all; only inside apply_expert_parallel layers",
            ),
            cuda_only=False,
        ),
    )


def _ep_pre_hook(module, args):
    st: _EPState = module._openk3_ep
    if module.backend != _EP_BACKEND:  # set_backend("moe", name) after EP picks the local compute backend
        st.inner = module.backend
        module.backend = _EP_BACKEND
    module._openk3_ep_token = _ACTIVE.set(st)


def _ep_post_hook(module, args, output):
    token = getattr(module, "_openk3_ep_token", None)
    if token is not None:
        _ACTIVE.reset(token)
        module._openk3_ep_token = None
    return output


def _ep_group_and_mesh(mesh_or_group):
    """(ep process group, mesh for the expert DTensor description, placements)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(mesh_or_group, DeviceMesh):
        names = mesh_or_group.mesh_dim_names or ()
        if mesh_or_group.ndim == 1:
            return mesh_or_group.get_group(), mesh_or_group, (Shard(0),)
        if "ep" not in names:
            raise ValueError(f"mesh has dims {names}; expert parallelism needs an 'ep' dim (see build_mesh)")
        placements = tuple(Shard(0) if n == "ep" else Replicate() for n in names)
        return mesh_or_group["ep"].get_group(), mesh_or_group, placements
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, _device_type())
    return group, mesh, (Shard(0),)


def apply_expert_parallel(model: nn.Module, mesh_or_group=None) -> nn.Module:
    """Split the routed experts of every ``SparseMoE`` in ``model`` over the EP ranks, in place.

    ``mesh_or_group``: a mesh from ``build_mesh`` (its ``"ep"`` dim is used), a 1-D mesh, or a process group
    (default: the world). Each MoE keeps ``experts.w1/w2/w3[offset : offset + E/ep]`` as new local Parameters
    (``moe.expert_offset``, ``moe.num_local_experts``) and computes its experts with
    :func:`expert_parallel_experts` through the ``"ep"`` MoE backend; the previous backend choice (or a later
    ``model.set_backend("moe", name)``) is used for the local expert compute. The model must hold the same
    weights on every rank (same seed or same checkpoint) when this is called. Call it before ``apply_fsdp`` and
    before building the optimizer. No-op for an EP size of 1.
    """
    from openk3.modules.moe import SparseMoE

    group, mesh, placements = _ep_group_and_mesh(mesh_or_group)
    ep = dist.get_world_size(group)
    if ep == 1:
        return model
    rank = dist.get_rank(group)
    _register_ep_backend()
    for name, moe in model.named_modules():
        if not isinstance(moe, SparseMoE):
            continue
        if hasattr(moe, "_openk3_ep"):
            raise RuntimeError(f"{name or 'model'}: experts are already expert-parallel")
        E = moe.experts.w1.shape[0]
        if E % ep:
            raise ValueError(f"{name}: {E} experts do not split over ep={ep} ranks; choose ep dividing {E}")
        e_loc = E // ep
        off = rank * e_loc
        for w in ("w1", "w2", "w3"):
            old = getattr(moe.experts, w)
            setattr(moe.experts, w, nn.Parameter(old.detach()[off : off + e_loc].clone(), old.requires_grad))
        prefix = f"{name}." if name else ""
        st = _EPState(
            group,
            mesh,
            placements,
            ep,
            E,
            off,
            moe.backend,
            [f"{prefix}experts.{w}" for w in ("w1", "w2", "w3")],
        )
        moe._openk3_ep = st
        moe.expert_offset = off
        moe.num_local_experts = e_loc
        moe.backend = _EP_BACKEND
        moe.register_forward_pre_hook(_ep_pre_hook)
        moe.register_forward_hook(_ep_post_hook, always_call=True)
    return model


def _ep_states(model: nn.Module) -> list[_EPState]:
    return [m._openk3_ep for m in model.modules() if hasattr(m, "_openk3_ep")]


def _expert_params(model: nn.Module) -> dict[int, _EPState]:
    """id(param) -> EP state, for the local expert Parameters of an expert-parallel model."""
    out = {}
    for m in model.modules():
        st = getattr(m, "_openk3_ep", None)
        if st is not None:
            for w in (m.experts.w1, m.experts.w2, m.experts.w3):
                out[id(w)] = st
    return out


# ---------------------------------------------------------------------------------------------------------------
# FSDP2


def apply_fsdp(
    model: nn.Module,
    mesh=None,
    *,
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    replicate_fp32_params: bool | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` per decoder layer, then on the root, in place.

    Each layer's attention (``self_attn``) and FFN (``block_sparse_moe`` / ``mlp``) are FSDP units; the layer's own
    small parameters (its two RMSNorms and the AttnRes pseudo-queries / norms, ``4 D`` values) belong to the root
    unit, which stays gathered for the whole forward. This is needed because the AttnRes walk hands the read-site
    parameters of *later* layers to the sealing layer (``K3Model.block_sites``), so they must be usable outside
    their own layer's forward (a whole-layer unit would see them sharded).

    The model should be in fp32 (the sharded master weights); ``param_dtype`` is the compute dtype of the
    gathered parameters (use ``torch.float32`` on CPU/gloo) and ``reduce_dtype`` the gradient reduction dtype.
    Parameters are sharded over all ranks of ``mesh`` (``mesh["dp"]`` when EP is 1; every rank otherwise);
    EP experts are left out (they are already split, replicated over ``dp`` and synchronised by
    :func:`allreduce_grads`). ``replicate_fp32_params`` (default: when ``param_dtype`` is lower than fp32) leaves
    the parameters the model pins to fp32 (``_keep_fp32``: KDA ``A_log``, ``dt_bias``, conv weights, ``o_norm``) out
    of FSDP too, so they are never cast; they stay replicated and :func:`allreduce_grads` averages their grads.

    The model then mixes DTensor (FSDP) and plain (replicated, EP expert) parameters. ``openk3.train.optim``
    steps parameter by parameter and handles both; a ``torch.optim`` optimizer with ``foreach`` kernels (the CUDA
    default) needs ``foreach=False`` or separate param groups for the two kinds.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        fsdp_mesh = _world_mesh(_device_type())
    else:
        ep_mesh = _submesh(mesh, "ep")
        if ep_mesh is not None and ep_mesh.size() > 1:
            if mesh.size() != dist.get_world_size():
                raise ValueError("apply_fsdp with EP needs a mesh over all ranks")
            fsdp_mesh = _world_mesh(mesh.device_type)
        else:
            dp_mesh = _submesh(mesh, "dp")
            fsdp_mesh = mesh if dp_mesh is None else dp_mesh
    if replicate_fp32_params is None:
        replicate_fp32_params = param_dtype is not None and param_dtype != torch.float32
    ignored: set[nn.Parameter] = set()
    for m in model.modules():
        if hasattr(m, "_openk3_ep"):
            ignored.update((m.experts.w1, m.experts.w2, m.experts.w3))
        elif hasattr(m, "experts") and hasattr(m.experts, "unpack13"):
            m.experts.unpack13()  # FSDP2 shards contiguous parameters only
    if replicate_fp32_params:
        ignored.update(p for p in model.parameters() if getattr(p, "_keep_fp32", False))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp, ignored_params=ignored or None)
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError("apply_fsdp expects a K3ForCausalLM / K3Model (with .model.layers or .layers)")
    for layer in layers:
        for unit in (getattr(layer, n, None) for n in ("self_attn", "block_sparse_moe", "mlp")):
            if unit is not None and any(True for _ in unit.parameters()):
                fully_shard(unit, reshard_after_forward=reshard_after_forward, **kw)
    # the root stays gathered until its backward: it would be re-gathered at once anyway, and FSDP cannot hook
    # the backward of a dataclass output (K3Output) in every torch version
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


# ---------------------------------------------------------------------------------------------------------------
# gradients


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dp_group(mesh):
    if mesh is None:
        return None
    dp = _submesh(mesh, "dp")
    return dp.get_group() if dp is not None else None


def _allreduce_flat(grads: list[torch.Tensor], group, scale: float) -> None:
    """In-place SUM all-reduce of ``grads`` (one buffer per dtype/device), then multiply by ``scale``."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for gs in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        off = 0
        for g in gs:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()


@torch.no_grad()
def allreduce_grads(model: nn.Module, mesh=None) -> None:
    """Synchronise the gradients FSDP does not handle (call after backward, before clipping/stepping).

    * replicated plain parameters: mean over all ranks;
    * EP experts: sum over the ``dp`` ranks holding the same experts, divided by the world size (their local
      gradient is already a sum over the EP group, see the module docstring).

    DTensor (FSDP) gradients are skipped. Missing gradients count as zeros (so every rank issues the same
    collectives). ``mesh``: the ``build_mesh`` mesh (its ``dp`` dim); ``None`` means no ``dp`` replicas of the
    experts (plain EP over the world, or no EP). No-op in a one-process world.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    experts = _expert_params(model)
    rep, exp = [], []
    for p in model.parameters():
        if not p.requires_grad or _is_dtensor(p):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (exp if id(p) in experts else rep).append(p.grad)
    if rep:
        _allreduce_flat(rep, None, 1.0 / world)
    if exp:
        dp_group = _dp_group(mesh)
        dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        ep = next(iter(experts.values())).ep
        if dp * ep != world:
            raise ValueError(
                f"allreduce_grads: experts are split over {ep} ranks and replicated over {dp}, but the world has "
                f"{world}; pass the build_mesh mesh (with its 'dp' dim)"
            )
        if dp > 1:
            _allreduce_flat(exp, dp_group, 1.0 / world)
        else:
            for g in exp:
                g.mul_(1.0 / world)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float | None, mesh=None) -> torch.Tensor:
    """Global L2 norm of all gradients (FSDP shards, replicated params and EP experts, each counted once), to be
    called after :func:`allreduce_grads`; scales the gradients in place to ``max_norm`` when it is exceeded
    (``None``: only measure). Returns the pre-clip norm (fp32 scalar, identical on every rank)."""
    from torch.distributed.tensor import Shard

    experts = _expert_params(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    local = [p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in params]
    device = local[0].device
    sums: dict[Any, torch.Tensor] = {}  # process group (None: already identical everywhere) -> sum of squares
    for p, g in zip(params, local):
        if _is_dtensor(p.grad):
            placements = p.grad.placements
            if p.grad.device_mesh.ndim != 1 or not isinstance(placements[0], Shard):
                raise RuntimeError(
                    "clip_grad_norm_ supports gradients sharded over one mesh dimension (FSDP2 over dp or all "
                    f"ranks); got placements {placements} on a {p.grad.device_mesh.ndim}-D mesh"
                )
            key = p.grad.device_mesh.get_group()
        else:
            key = experts[id(p)].group if id(p) in experts else None
        sq = g.float().pow(2).sum().to(device)
        sums[key] = sums[key] + sq if key in sums else sq
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, s in sums.items():
        if group is not None:
            dist.all_reduce(s, group=group)
        total += s
    norm = total.sqrt()
    if max_norm is not None:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef.to(g.device, g.dtype))
    return norm


@torch.no_grad()
def reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of a tensor (e.g. the loss, detached) over the ranks of ``group``; returns a new tensor."""
    t = t.detach().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return t


@torch.no_grad()
def broadcast_module(model: nn.Module, src: int = 0, group=None) -> None:
    """Copy the parameters and buffers of rank ``src`` to every rank (before EP/FSDP, for an identical start)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=src, group=group)


# ---------------------------------------------------------------------------------------------------------------
# Quantile Balancing across ranks


@torch.no_grad()
def allreduce_balancer(balancer, group=None):
    """SUM-all-reduce the histogram counts of one or several ``QuantileBalancer`` s over ``group`` (default: all
    ranks, i.e. every data-parallel rank). Token counts travel with them (every token adds one count per expert),
    so afterwards every rank's ``compute_bias()`` returns the same bias, equal to a single process observing the
    union of all ranks' tokens. Returns the argument."""
    bals = list(balancer) if isinstance(balancer, (list, tuple)) else [balancer]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return balancer
    counts = [b.histogram_counts() for b in bals]
    _allreduce_flat(counts, group, 1.0)
    return balancer


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint


def _ep_describe(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Shallow copy of ``{"model": msd, "optim": osd}`` where EP expert tensors (and their optimizer state) are
    described as DTensors ``[E, ...]`` sharded over ``ep``, aliasing the local tensors. The checkpoint then holds the
    full stacked experts under the usual keys, whatever the EP degree of the run that reads it."""
    from torch.distributed.tensor import DTensor

    fq: dict[str, _EPState] = {f: st for st in _ep_states(model) for f in st.fqns}
    if not fq:
        return state

    def wrap(t, st: _EPState):
        if not isinstance(t, torch.Tensor) or _is_dtensor(t) or t.dim() == 0:
            return t
        shape = (t.shape[0] * st.ep, *t.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(t, st.mesh, st.placements, run_check=False, shape=shape, stride=stride)

    out = dict(state)
    if "model" in state:
        msd = dict(state["model"])
        for f, st in fq.items():
            if f in msd:
                msd[f] = wrap(msd[f], st)
        out["model"] = msd
    if "optim" in state and "state" in state["optim"]:
        osd = dict(state["optim"])
        ost = dict(osd["state"])
        for f, st in fq.items():
            if f in ost:
                ost[f] = {k: wrap(v, st) for k, v in ost[f].items()}
        osd["state"] = ost
        out["optim"] = osd
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_dcp(path: str | os.PathLike, model: nn.Module, optimizer=None, extra: dict | None = None) -> str:
    """Save model (+ optimizer) with torch.distributed.checkpoint into the directory ``path``, atomically: every
    rank writes into ``path + ".tmp"``, then rank 0 renames it to ``path`` (replacing an older one) after a
    barrier. ``extra`` (step, data position, balancer state, RNG, ...) is a small picklable dict saved per rank
    with ``torch.save`` (``extra.rank{r}.pt``). All ranks must call this. Returns ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    path = os.fspath(path)
    tmp = path + ".tmp"
    if _rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier()
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(_ep_describe(state, model), checkpoint_id=tmp)
    os.makedirs(tmp, exist_ok=True)
    torch.save(dict(extra or {}), os.path.join(tmp, f"extra.rank{_rank()}.pt"))
    _barrier()
    if _rank() == 0:
        old = path + ".old"
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()
    return path


def load_dcp(path: str | os.PathLike, model: nn.Module, optimizer=None) -> dict:
    """Load a :func:`save_dcp` checkpoint into ``model`` (+ ``optimizer``), resharding as needed (other world size,
    FSDP layout or EP degree). Returns this rank's ``extra`` dict (rank 0's when the checkpoint has fewer ranks).
    All ranks must call this, after ``apply_expert_parallel`` / ``apply_fsdp`` and after building the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no DCP checkpoint at {path!r} (expected a directory written by save_dcp)")
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        # parameters that never had a gradient before the save have no optimizer state in the checkpoint (the
        # fresh state built by get_state_dict has it): load only what is there, leave those without state
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        ost, pruned = {}, False
        for fqn, entry in state["optim"].get("state", {}).items():
            kept = {k: v for k, v in entry.items() if f"optim.state.{fqn}.{k}" in saved}
            pruned |= len(kept) < len(entry)
            if kept:
                ost[fqn] = kept
        state["optim"] = {**state["optim"], "state": ost}
    dcp.load(
        _ep_describe(state, model), checkpoint_id=path
    )  # fills the (aliased) tensors of ``state`` in place
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        options = StateDictOptions(strict=not pruned)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    return read_extra(path, _rank())


def read_extra(path: str | os.PathLike, rank: int = 0) -> dict:
    """The ``extra`` dict that :func:`save_dcp` wrote for ``rank`` (rank 0's when the checkpoint has fewer ranks;
    {} when it has none)."""
    mine = os.path.join(path, f"extra.rank{rank}.pt")
    f = mine if os.path.exists(mine) else os.path.join(path, "extra.rank0.pt")
    # extra holds tensors, numbers, strings and nested dicts/lists only: no unpickling of arbitrary objects
    return torch.load(f, map_location="cpu", weights_only=True) if os.path.exists(f) else {}


# ---------------------------------------------------------------------------------------------------------------
# launcher


def _strip_nproc(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def launch_command(
    nproc: int, argv: Sequence[str], *, module: str = "openk3", extra_torchrun: Iterable[str] = ()
):
    """The torchrun command that runs ``python -m <module> <argv>`` on ``nproc`` local processes (``--nproc``
    options are removed from ``argv``)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra_torchrun,
        "-m",
        module,
        *_strip_nproc(argv),
    ]


def launch(nproc: int, argv: Sequence[str], *, module: str = "openk3") -> int:
    """Re-run ``openk3 <argv>`` under torchrun with ``nproc`` processes on this machine (for
    ``openk3 train --nproc N``); returns torchrun's exit code. Inside torchrun already, refuse (the caller should
    just run)."""
    if under_torchrun():
        raise RuntimeError("already running under torchrun; run the command directly instead of launch()")
    return subprocess.call(launch_command(nproc, argv, module=module))
