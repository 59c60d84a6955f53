"""Kimi Delta Attention layer (SPEC.md §1.4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.config import K3Config
from openk3.modules.norm import gated_norm
from openk3.ops import backend as _backend
from openk3.ops.conv import causal_conv1d
from openk3.ops.kda import kda_chunk, kda_gate, kda_recurrent

# Fast-path hook: a callable with the signature of ``_kda_core_reference`` registered by openk3.fast.kda
FAST_KDA: dict[str, callable] = {}
# Fast-path hook for the "conv" op (the q/k/v short convolution): name -> fn with the signature of
# ``openk3.ops.conv.causal_conv1d``, registered by openk3.fast.conv
FAST_CONV: dict[str, callable] = {}


def _kda_core_reference(layer, q, k, v, z, beta_logits, *, initial_state, output_final_state, cu_seqlens):
    """Reference KDA core: gate activation in fp32, then chunked or token recurrence.
    q,k,v,z: [B,T,H,K] (after conv/SiLU for q,k,v; raw decay logits z); beta_logits: [B,T,H]."""
    g = kda_gate(
        z, layer.A_log[: layer.num_heads], layer.dt_bias, kind=layer.gate_kind, lower_bound=layer.lower_bound
    )
    beta = torch.sigmoid(beta_logits.float())
    T = q.shape[1]
    fn = kda_recurrent if T <= layer.recurrent_max_len else kda_chunk
    kw = {} if fn is kda_recurrent else {"chunk_size": layer.chunk_size}
    return fn(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=True,
        **kw,
    )


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        H, K = config.kda_num_heads, config.kda_head_dim
        W = config.short_conv_kernel_size
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.conv_size = H, K, W
        self.gate_kind = config.kda_gate_kind
        self.lower_bound = config.gate_lower_bound if config.gate_lower_bound is not None else -5.0
        self.eps = config.rms_norm_eps
        self.chunk_size = 64
        self.recurrent_max_len = 16  # reference backend: token recurrence at or below this length
        self.backend: str | None = None  # "kda" op backend (the core); None = auto
        self.conv_backend: str | None = None  # "conv" op backend (q/k/v short conv)
        self.norm_backend: str | None = None  # "norm" op backend (gated output norm)
        HK = H * K
        self.q_proj = nn.Linear(d, HK, bias=False)
        self.k_proj = nn.Linear(d, HK, bias=False)
        self.v_proj = nn.Linear(d, HK, bias=False)
        self.q_conv1d = nn.Conv1d(HK, HK, W, groups=HK, bias=False)
        self.k_conv1d = nn.Conv1d(HK, HK, W, groups=HK, bias=False)
        self.v_conv1d = nn.Conv1d(HK, HK, W, groups=HK, bias=False)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, HK, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(HK))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.full_rank_gate = config.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, HK, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, HK, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(HK, d, bias=False)
        self.mark_fp32_parameters()

    def mark_fp32_parameters(self) -> None:
        """Flag the parameters SPEC.md §5.3 keeps in fp32 (``K3ForCausalLM.to_dtype`` and loading honour it)."""
        for p in (
            self.dt_bias,
            self.A_log,
            self.o_norm.weight,
            self.q_conv1d.weight,
            self.k_conv1d.weight,
            self.v_conv1d.weight,
        ):
            p._keep_fp32 = True

    @torch.no_grad()
    def reset_parameters_kda(self, init: str = "fla") -> None:
        """Assumed init (SPEC.md §1.2/§10): A_log = log U(1, 16), dt_bias = 0."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        self.dt_bias.zero_()
        self.o_norm.weight.fill_(1.0)
        for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            nn.init.uniform_(c.weight, -1 / math.sqrt(self.conv_size), 1 / math.sqrt(self.conv_size))

    def forward(
        self,
        x: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cache: dict | None = None,
    ) -> torch.Tensor:
        """x: [B, T, D] (normed layer input). ``cache``: this layer's dict (``conv_q/k/v`` [B, HK, W-1], ``state``
        [B, H, K, K]) updated in place. Returns [B, T, D].

        ``cache["snap_at"]`` (positions 0 < p < T, increasing; no ``cu_seqlens``) also asks for the cache as it
        stands after the first p tokens: ``cache["snaps"]`` becomes ``[(state, {"q": conv, "k": ..., "v": ...})]``,
        one per position. The recurrence then runs in segments split there (each from the previous one's state);
        everything else runs once over all T tokens."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        use_cache = cache is not None
        snap_at = list(cache.get("snap_at") or ()) if use_cache else []
        if snap_at and (
            cu_seqlens is not None or not all(a < b for a, b in zip([0] + snap_at, snap_at + [T]))
        ):
            raise ValueError(
                f"snap_at must be increasing positions inside (0, {T}) without cu_seqlens, got {snap_at}"
            )
        hists: dict[str, list[torch.Tensor]] = {}
        convs = {}
        outs = []
        conv_be = _backend.resolve("conv", x.is_cuda, self.conv_backend)
        conv_fn = FAST_CONV.get(conv_be, causal_conv1d) if conv_be != "reference" else causal_conv1d
        for name, proj, conv in (
            ("q", self.q_proj, self.q_conv1d),
            ("k", self.k_proj, self.k_conv1d),
            ("v", self.v_proj, self.v_conv1d),
        ):
            xp = proj(x)
            init = cache.get(f"conv_{name}") if use_cache else None
            y, fin = conv_fn(
                xp,
                conv.weight,
                initial_state=init,
                cu_seqlens=cu_seqlens,
                activation="silu",
                output_final_state=use_cache,
            )
            outs.append(y.view(B, T, H, K))
            convs[name] = fin
            if snap_at:  # the conv history after p tokens: the W - 1 inputs before position p, oldest first
                w = self.conv_size - 1
                prev = (
                    init.float()
                    if init is not None
                    else xp.new_zeros(B, xp.shape[-1], w, dtype=torch.float32)
                )
                seq = torch.cat([prev, xp.float().transpose(1, 2)], dim=-1)  # [B, C, W-1 + T]
                hists[name] = [seq[..., p : p + w].clone() for p in snap_at]
        q, k, v = outs
        z = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta_logits = self.b_proj(x)
        be = _backend.resolve("kda", x.is_cuda, self.backend)
        core = _kda_core_reference if be == "reference" else FAST_KDA[be]
        state = cache.get("state") if use_cache else None
        pieces, snaps = [], []
        for a, b in zip([0] + snap_at, snap_at + [T]):  # one segment [0, T) without snapshots
            seg = (q, k, v, z, beta_logits) if b - a == T else (t[:, a:b] for t in (q, k, v, z, beta_logits))
            o, state = core(
                self, *seg, initial_state=state, output_final_state=use_cache, cu_seqlens=cu_seqlens
            )
            pieces.append(o)
            if b < T:
                snaps.append((state.float().clone(), {n: hists[n][len(snaps)] for n in ("q", "k", "v")}))
        o = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        if snap_at:
            cache["snaps"] = snaps
        if use_cache:
            for name in ("q", "k", "v"):
                cache[f"conv_{name}"] = convs[name]
            cache["state"] = state.float()
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_norm(o.to(x.dtype), self.o_norm.weight, gate.view(B, T, H, K), self.eps, self.norm_backend)
        return self.o_proj(o.reshape(B, T, H * K))
