"""Stable LatentMoE (SPEC.md §4) and plain MoE (Kimi Linear)."""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3Config
from openk3.modules.ffn import GLUMLP
from openk3.modules.norm import RMSNorm
from openk3.ops import backend as _backend
from openk3.ops.moe import experts_reference, route

# Fast-path hook for the expert compute: name -> fn(x, idx, weights, w1, w2, w3, act=, beta1=, beta2=) -> y
FAST_EXPERTS: dict[str, callable] = {}
# Few-token (decode) variant of a backend: name -> object with ``enabled(x, top_k, num_experts) -> bool``,
# ``route_small(x, weight, bias, top_k=, activation=, renormalize=, scaling=)`` (``route`` for n_group == 1) and
# ``experts_small`` (as FAST_EXPERTS)
FAST_SMALL: dict[str, object] = {}


class Router(nn.Module):
    """``weight`` [E, D] (fp32 logits) and the selection-only ``e_score_correction_bias`` [E] (a buffer, moved only by
    the balancer, never by gradients)."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_token
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.n_group, self.topk_group = config.num_expert_group, config.topk_group

    def options(self) -> dict:
        """The routing options other than group-limited selection (the keyword arguments of ``route_small``)."""
        return dict(
            top_k=self.top_k, activation=self.activation, renormalize=self.renormalize, scaling=self.scaling
        )

    def forward(self, x: torch.Tensor):
        return route(
            x,
            self.weight,
            self.e_score_correction_bias,
            **self.options(),
            n_group=self.n_group,
            topk_group=self.topk_group,
        )


def gate_up_view(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """A zero-copy [E, 2I, W] view when w1 and w3 already are the two halves of one buffer, else None."""
    E, I, W = w1.shape
    st = (2 * I * W, W, 1)
    if w3.shape != w1.shape or w3.dtype != w1.dtype or w3.device != w1.device:
        return None
    if w1.stride() != st or w3.stride() != st or E < 2:
        return None
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return None
    if w3.storage_offset() != w1.storage_offset() + I * W:
        return None
    return w1.as_strided((E, 2 * I, W), st)


class Experts(nn.Module):
    """Routed experts stacked: ``w1`` (gate) and ``w3`` (up) [E, I, W], ``w2`` (down) [E, W, I]. The checkpoint holds
    them per expert as ``experts.{e}.w{1,2,3}.weight`` (see openk3.checkpoint).

    ``w1`` and ``w3`` are separate parameters (Muon orthogonalises each expert's gate and up matrix on its own) that
    live as the two halves of one ``[E, 2I, W]`` buffer, so the grouped-GEMM path reads them as one stacked gate|up
    operand without a per-call copy (``openk3.fast.moe.stack13``). Device / dtype moves re-pack them (:meth:`_apply`);
    where the halves cannot be adjacent (e.g. sharded parameters) the fast path falls back to one copy per call."""

    def __init__(self, num: int, width: int, inter: int):
        super().__init__()
        w13 = torch.empty(num, 2 * inter, width)
        self.w1 = nn.Parameter(w13[:, :inter])
        self.w2 = nn.Parameter(torch.empty(num, width, inter))
        self.w3 = nn.Parameter(w13[:, inter:])
        self.keep_packed = True

    def unpack13(self) -> None:
        """Give ``w1`` and ``w3`` their own contiguous storage and stop re-packing them (FSDP2 shards only
        contiguous parameters)."""
        self.keep_packed = False
        with torch.no_grad():
            for p in (self.w1, self.w3):
                if type(p.data) is torch.Tensor and not p.is_contiguous():
                    p.data = p.data.contiguous()

    def pack13(self) -> bool:
        """Make ``w1`` and ``w3`` the two halves of one buffer again (values unchanged); True when they are."""
        if not self.keep_packed:
            return False
        w1, w3 = self.w1, self.w3
        plain = type(w1.data) is torch.Tensor and type(w3.data) is torch.Tensor
        if not plain or w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device:
            return False
        if w1.device.type == "meta":
            return False
        if gate_up_view(w1, w3) is not None:
            return True
        I = w1.shape[1]
        with torch.no_grad():
            buf = torch.cat([w1.data, w3.data], 1)
        w1.data, w3.data = buf[:, :I], buf[:, I:]
        return True

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack13()
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.latent = config.use_latent_moe
        W = config.moe_width
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, W, config.moe_intermediate_size)
        self.act = config.hidden_act
        self.beta1, self.beta2 = config.activation_situ_beta, config.activation_situ_linear_beta
        if config.num_shared_experts > 0:
            self.shared_experts = GLUMLP(
                d, config.moe_intermediate_size * config.num_shared_experts, self.act, self.beta1, self.beta2
            )
        else:
            self.shared_experts = None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(d, W, bias=False)
            self.routed_expert_up_proj = nn.Linear(W, d, bias=False)
            self.routed_expert_norm = RMSNorm(W, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.backend: str | None = None
        self.record_router = (
            False  # when True, ``last_router`` keeps (scores [N,E], topk_idx [N,k]) for balancing
        )
        self.last_router: tuple[torch.Tensor, torch.Tensor] | None = None

    def input_projections(self) -> list[nn.Linear]:
        """The Linear layers that read the layer input besides the router, in the order :meth:`forward`'s
        ``projections`` lists their outputs: the latent down projection (latent MoE), the shared experts' gate and up
        projections (when there are shared experts)."""
        mods = [self.routed_expert_down_proj] if self.latent else []
        if self.shared_experts is not None:
            mods += self.shared_experts.input_projections()
        return mods

    def output_projections(self) -> list[nn.Linear | None]:
        """The projections whose outputs sum to the layer output, one per entry of :meth:`pre_output` (None: the
        entry is added as it is): the latent up projection (identity for a plain MoE), then the shared experts'
        down projection (when there are shared experts)."""
        mods = [self.routed_expert_up_proj if self.latent else None]
        if self.shared_experts is not None:
            mods.append(self.shared_experts.down_proj)
        return mods

    def forward(self, x: torch.Tensor, projections: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, D] (post-attention-normed). Returns [B, T, D]. ``projections``: the outputs of
        :meth:`input_projections` for ``x`` ([B*T, out] each) when they were computed elsewhere (the inference engine
        runs them as one GEMM)."""
        parts = self.pre_output(x, projections)
        u = None
        for m, part in zip(self.output_projections(), parts):
            y = (part if m is None else m(part)).view(x.shape)
            u = y if u is None else u + y  # (summed in the output shape: the result is not a view when a
            # second term exists, which FSDP2 warns about for a wrapped module's output)
        return u

    def pre_output(
        self, x: torch.Tensor, projections: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The inputs of :meth:`output_projections` ([B*T, in] each): the routed experts' mixture (normed, for a
        latent MoE) and the shared experts' activation."""
        xf = x.reshape(-1, x.shape[-1])
        pre = list(projections) if projections is not None else None
        routing = self.route(xf)
        if self.latent:
            h = pre.pop(0) if pre is not None else self.routed_expert_down_proj(xf)
        else:
            h = xf
        parts = [self.routed(h, routing)]
        if self.shared_experts is not None:
            parts.append(self.shared_experts.pre_output(xf, pre))
        return parts

    def route(self, xf: torch.Tensor) -> tuple:
        """Routing of the tokens ``xf [N, D]``: ``(topk_idx, weights, experts_fn)`` for :meth:`routed` (the few-token
        path's router and experts where it applies; with its selection fused into the experts' first kernel,
        ``(PendingRoute, None, experts_fn)``). Records the router output when ``record_router`` is set."""
        be = _backend.resolve("moe", xf.is_cuda, self.backend)
        fn = experts_reference if be == "reference" else FAST_EXPERTS[be]
        small = self._small(xf, be)
        if small is not None:
            gate = self.gate
            fn = small.experts_small
            if self._fuse_select(small, xf.shape[0]):
                # the selection is formed inside the experts' first kernel
                pending = small.route_logits_small(
                    xf, gate.weight, gate.e_score_correction_bias, **gate.options()
                )
                return pending, None, fn
            idx, w, scores = small.route_small(
                xf, gate.weight, gate.e_score_correction_bias, **gate.options()
            )
        else:
            idx, w, scores = self.gate(xf)
        if self.record_router:
            self.last_router = (scores.detach(), idx.detach())
        return idx, w, fn

    def _small(self, xf: torch.Tensor, be: str):
        """The few-token kernels' module (``openk3.fast.moe_small``) where they take the tokens ``xf [N, D]`` under
        the resolved backend ``be``; None otherwise."""
        small = FAST_SMALL.get(be)
        if (
            small is not None
            and self.gate.n_group == 1
            and small.enabled(xf, self.gate.top_k, self.gate.weight.shape[0])
        ):
            return small
        return None

    def _fuse_select(self, small, n: int) -> bool:
        return (
            getattr(small, "FUSE_SELECT", False)
            and n <= small.FUSE_SELECT_MAX_TOKENS
            and not self.record_router
        )

    def fused_small_path(self, xf: torch.Tensor):
        """``openk3.fast.moe_small`` where :meth:`route` would take its fused-selection path for tokens like ``xf [N,
        D]`` (router logits now, the selection inside the experts' first kernel); None otherwise. The inference
        engine then calls those kernels itself (with the router input's norm formed in the router launch)."""
        if self.latent:
            return None
        small = self._small(xf, _backend.resolve("moe", xf.is_cuda, self.backend))
        return small if small is not None and self._fuse_select(small, xf.shape[0]) else None

    def routed(self, h: torch.Tensor, routing: tuple, norm: bool = True) -> torch.Tensor:
        """The routed experts' mixture of ``h`` (the tokens, or their latent for a latent MoE) under ``routing``
        (:meth:`route`), normed for a latent MoE with the norm (unless ``norm=False``: the caller applies it)."""
        idx, w, fn = routing
        u = fn(
            h,
            idx,
            w,
            self.experts.w1,
            self.experts.w2,
            self.experts.w3,
            act=self.act,
            beta1=self.beta1,
            beta2=self.beta2,
        )
        if norm and self.latent and self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        return u
