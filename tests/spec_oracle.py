"""Independent fp64 forward pass of the K3 / Kimi Linear text model, written from SPEC.md only.

It reads a checkpoint directory by the released names: ``config.json`` (flat text config or the multimodal
wrapper with ``text_config``) and ``*.safetensors`` keyed ``[language_model.]model.*`` / ``lm_head.weight``
(SPEC §5.5). Everything is plain PyTorch in float64; the KDA recurrence is evaluated token by token in the
recurrent form of SPEC §1.1, MLA in the prefill MHA form of SPEC §2.2.

Section references (§) are to SPEC.md.
"""

from __future__ import annotations

import json
import math
import os
from glob import glob

import torch
from safetensors.torch import load_file

__all__ = ["SpecOracle"]

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# loading


def _load_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        d = json.load(f)
    if isinstance(d.get("text_config"), dict):
        d = d["text_config"]
    return d


def _load_weights(directory: str) -> dict[str, torch.Tensor]:
    """All tensors as float64, with the multimodal ``language_model.`` prefix removed."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob(os.path.join(directory, "*.safetensors"))):
        for k, v in load_file(path).items():
            if k.startswith("language_model."):
                k = k[len("language_model.") :]
            if k in out:
                raise KeyError(f"duplicate tensor {k}")
            out[k] = v.to(F64)
    if not out:
        raise FileNotFoundError(f"no safetensors in {directory}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# elementary ops


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """§1.1: x / sqrt(sum x^2 + eps)."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.transpose(-1, -2)


def causal_conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """§1.4 step 2: depthwise causal conv over time, zero left padding, last tap on the current token; SiLU.

    x: [B, T, C]; w: [C, 1, K]. y[t, c] = sum_j w[c, j] * x[t - (K-1) + j, c].
    """
    B, T, C = x.shape
    K = w.shape[-1]
    xp = torch.cat([x.new_zeros(B, K - 1, C), x], 1)
    y = sum(w[:, 0, j] * xp[:, j : j + T] for j in range(K))
    return torch.nn.functional.silu(y)


def glu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Gated MLP: SiTU-GLU (§4.3) or SwiGLU (Kimi Linear, §7.2), then the down-projection."""
    g, u = linear(x, wg), linear(x, wu)
    act = cfg.get("hidden_act", "situ")
    if act == "situ":
        b1 = float(cfg.get("activation_situ_beta", 4.0))
        b2 = float(cfg.get("activation_situ_linear_beta", 25.0))
        h = (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))
    elif act in ("silu", "swiglu"):
        h = torch.nn.functional.silu(g) * u
    else:
        raise NotImplementedError(f"hidden_act {act!r}")
    return linear(h, wd)


# ---------------------------------------------------------------------------------------------------------------
# the model


class SpecOracle:
    """fp64 reference forward pass over a saved checkpoint directory."""

    def __init__(self, directory: str | os.PathLike):
        directory = os.fspath(directory)
        self.cfg = c = _load_config(directory)
        self.w = _load_weights(directory)
        self.used: set[str] = set()
        lac = c.get("linear_attn_config") or {}
        self.n_layers = int(c["num_hidden_layers"])
        full = set(int(i) for i in lac.get("full_attn_layers", []))  # 1-based (§5.1)
        kda = set(int(i) for i in lac.get("kda_layers", []))
        assert full | kda == set(range(1, self.n_layers + 1)) and not (full & kda)
        self.layer_types = ["mla" if i + 1 in full else "kda" for i in range(self.n_layers)]
        self.kda_heads = int(lac.get("num_heads", 96))
        self.kda_dim = int(lac.get("head_dim", 128))
        self.gate_lb = lac.get("gate_lower_bound", None)  # absent -> negative-softplus gate (§1.2)
        self.full_rank_gate = bool(lac.get("use_full_rank_gate", False))
        self.eps = float(c.get("rms_norm_eps", 1e-5))
        self.lat_eps = float(c.get("mla_latent_norm_eps", 1e-6))
        self.block = c.get("attn_res_block_size", None)
        if c.get("mla_use_nope", True) is not True:
            raise NotImplementedError("only NoPE MLA is specified")
        if c.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise NotImplementedError("only the sigmoid router is specified (§4.1)")
        if int(c.get("num_expert_group", 1)) != 1 or int(c.get("topk_group", 1)) != 1:
            raise NotImplementedError("group-limited routing is not specified (§4.1)")

    # -------------------------------------------------------------------------------------------------------
    def _p(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.w[name]

    def _opt(self, name: str) -> torch.Tensor | None:
        return self._p(name) if name in self.w else None

    def unused_keys(self) -> list[str]:
        """Checkpoint tensors that no forward pass so far has read."""
        return sorted(set(self.w) - self.used)

    def _is_moe(self, i: int) -> bool:
        c = self.cfg
        return i >= int(c.get("first_k_dense_replace", 1)) and i % int(c.get("moe_layer_freq", 1)) == 0

    # -------------------------------------------------------------------------------------------------------
    def kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """KDA layer (§1.1, §1.2, §1.4) on the normed input x [B, T, D], recurrent form token by token."""
        pre = f"model.layers.{i}.self_attn."
        P = lambda n: self._p(pre + n)
        B, T, _ = x.shape
        H, d = self.kda_heads, self.kda_dim
        q = causal_conv_silu(linear(x, P("q_proj.weight")), P("q_conv1d.weight")).view(B, T, H, d)
        k = causal_conv_silu(linear(x, P("k_proj.weight")), P("k_conv1d.weight")).view(B, T, H, d)
        v = causal_conv_silu(linear(x, P("v_proj.weight")), P("v_conv1d.weight")).view(B, T, H, d)
        q = l2_norm(q) * d**-0.5
        k = l2_norm(k)
        # decay gate: z = W_fb W_fa x + b_dt; A_h one scalar per head (first num_heads stored values)
        z = linear(linear(x, P("f_a_proj.weight")), P("f_b_proj.weight")) + P("dt_bias")
        z = z.view(B, T, H, d)
        a = torch.exp(P("A_log").reshape(-1)[:H]).view(H, 1)
        if self.gate_lb is not None:
            g = float(self.gate_lb) * torch.sigmoid(a * z)
        else:
            g = -a * torch.nn.functional.softplus(z)
        beta = torch.sigmoid(linear(x, P("b_proj.weight")))  # [B, T, H]
        S = x.new_zeros(B, H, d, d)  # [key channel, value channel]
        outs = []
        for t in range(T):
            S = torch.exp(g[:, t]).unsqueeze(-1) * S  # decay rows (key channels)
            pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)
            S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # read after the write
        o = torch.stack(outs, 1)  # [B, T, H, d]
        if self.full_rank_gate:
            gate = linear(x, P("g_proj.weight"))
        else:
            gate = linear(linear(x, P("g_a_proj.weight")), P("g_b_proj.weight"))
            if (b := self._opt(pre + "g_b_proj.bias")) is not None:
                gate = gate + b
        o = rms_norm(o, P("o_norm.weight"), self.eps) * torch.sigmoid(gate.view(B, T, H, d))
        return linear(o.reshape(B, T, H * d), P("o_proj.weight"))

    # -------------------------------------------------------------------------------------------------------
    def mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Gated MLA with NoPE (§2.1-2.3), MHA prefill form with a causal mask."""
        c = self.cfg
        pre = f"model.layers.{i}.self_attn."
        P = lambda n: self._p(pre + n)
        B, T, _ = x.shape
        H = int(c["num_attention_heads"])
        dn, dr, dv = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
        dc = int(c["kv_lora_rank"])
        if c.get("q_lora_rank") is not None:
            ql = rms_norm(linear(x, P("q_a_proj.weight")), P("q_a_layernorm.weight"), self.lat_eps)
            q = linear(ql, P("q_b_proj.weight"))
        else:
            q = linear(x, P("q_proj.weight"))
        q = q.view(B, T, H, dn + dr)
        ckr = linear(x, P("kv_a_proj_with_mqa.weight"))
        cl, kr = ckr[..., :dc], ckr[..., dc:]
        cl = rms_norm(cl, P("kv_a_layernorm.weight"), self.lat_eps)
        kv = linear(cl, P("kv_b_proj.weight")).view(B, T, H, dn + dv)
        kn, v = kv[..., :dn], kv[..., dn:]
        k = torch.cat([kn, kr.unsqueeze(2).expand(B, T, H, dr)], -1)  # shared unrotated k^r on every head
        s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dn + dr)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v).reshape(B, T, H * dv)
        if c.get("mla_use_output_gate", False):
            o = o * torch.sigmoid(linear(x, P("g_proj.weight")))
        return linear(o, P("o_proj.weight"))

    # -------------------------------------------------------------------------------------------------------
    def dense_ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"model.layers.{i}.mlp."
        P = lambda n: self._p(pre + n)
        return glu(x, P("gate_proj.weight"), P("up_proj.weight"), P("down_proj.weight"), self.cfg)

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """(Stable Latent)MoE (§4.1-4.3): sigmoid router, biased selection, unbiased weights."""
        c = self.cfg
        pre = f"model.layers.{i}.block_sparse_moe."
        P = lambda n: self._p(pre + n)
        E, K = int(c["num_experts"]), int(c["num_experts_per_token"])
        s = torch.sigmoid(linear(x, P("gate.weight")))  # [B, T, E]
        bias = self._opt(pre + "gate.e_score_correction_bias")
        sel = torch.topk(s if bias is None else s + bias, K, dim=-1).indices
        p = s.gather(-1, sel)
        if c.get("moe_renormalize", True):
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
        p = p * float(c.get("routed_scaling_factor", 1.0))
        weights = torch.zeros_like(s).scatter(-1, sel, p)  # [B, T, E], zero off the top-k
        width = c.get("routed_expert_hidden_size")
        latent = width is not None and int(width) != int(c["hidden_size"])  # §4.2 latent path
        xe = linear(x, P("routed_expert_down_proj.weight")) if latent else x
        u = 0
        for e in range(E):
            ex = f"experts.{e}."
            fe = glu(xe, P(ex + "w1.weight"), P(ex + "w3.weight"), P(ex + "w2.weight"), c)
            u = u + weights[..., e : e + 1] * fe
        if latent:
            if c.get("latent_moe_use_norm", True):
                u = rms_norm(u, P("routed_expert_norm.weight"), self.eps)
            u = linear(u, P("routed_expert_up_proj.weight"))
        if int(c.get("num_shared_experts", 0)) > 0:
            u = u + glu(
                x,
                P("shared_experts.gate_proj.weight"),
                P("shared_experts.up_proj.weight"),
                P("shared_experts.down_proj.weight"),
                c,
            )
        return u

    # -------------------------------------------------------------------------------------------------------
    def attn_res_read(self, site: str, cands: list[torch.Tensor]) -> torch.Tensor:
        """§3.3 read: softmax over <gamma * w, v / rms(v)> across candidates; raw values mixed."""
        qv = self._p(site + "_res_norm.weight") * self._p(site + "_res_proj.weight").reshape(-1)
        V = torch.stack(cands, 0)  # [S, B, T, D]
        keys = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + self.eps)
        p = torch.softmax((keys * qv).sum(-1), 0)
        return (p.unsqueeze(-1) * V).sum(0)

    def _attn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self._p(f"model.layers.{i}.input_layernorm.weight"), self.eps)
        return self.kda(i, x) if self.layer_types[i] == "kda" else self.mla(i, x)

    def _ffn(self, i: int, m: torch.Tensor) -> torch.Tensor:
        x = rms_norm(m, self._p(f"model.layers.{i}.post_attention_layernorm.weight"), self.eps)
        return self.moe(i, x) if self._is_moe(i) else self.dense_ffn(i, x)

    # -------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (float64) for token ids [B, T] (§5.2)."""
        r = self._p("model.embed_tokens.weight")[ids]
        if self.block is None:  # plain pre-norm residual stream
            for i in range(self.n_layers):
                r = r + self._attn(i, r)
                r = r + self._ffn(i, r)
            h = r
        else:  # Block AttnRes bookkeeping, §3.3
            bs = int(self.block)
            sealed: list[torch.Tensor] = []
            for i in range(self.n_layers):
                pre = f"model.layers.{i}."
                h = self.attn_res_read(pre + "self_attention", [*sealed, r]) if sealed else r
                if i % bs == 0:
                    sealed.append(r)
                    r = None
                a = self._attn(i, h)
                r = a if r is None else r + a
                m = self.attn_res_read(pre + "mlp", [*sealed, r])
                r = r + self._ffn(i, m)
            h = self.attn_res_read("model.output_attn", [*sealed, r])
        h = rms_norm(h, self._p("model.norm.weight"), self.eps)
        head = self._opt("lm_head.weight")
        if head is None:
            if not self.cfg.get("tie_word_embeddings", False):
                raise KeyError("lm_head.weight missing and tie_word_embeddings is false")
            head = self._p("model.embed_tokens.weight")
        return linear(h, head)

    __call__ = forward
