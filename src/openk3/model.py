"""K3 decoder: hybrid KDA / MLA stack with Block Attention Residuals and Stable LatentMoE (SPEC.md §5)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _ckpt

import openk3.fast  # noqa: F401,E402  (registers GPU fast paths; a no-op without CUDA/triton/fla)
from openk3.cache import K3Cache
from openk3.config import K3Config
from openk3.modules.ffn import GLUMLP
from openk3.modules.kda import KimiDeltaAttention
from openk3.modules.mla import MLAttention
from openk3.modules.moe import Experts, Router, SparseMoE
from openk3.modules.norm import RMSNorm
from openk3.ops import backend as _backend
from openk3.ops.attnres import make_reader

__all__ = ["K3Model", "K3ForCausalLM", "K3Output", "causal_lm_loss", "check_cu_seqlens"]


@dataclass
class K3Output:
    logits: torch.Tensor | None = None  # [B, T, V]
    loss: torch.Tensor | None = None
    cache: K3Cache | None = None
    hidden_states: torch.Tensor | None = None  # [B, T, D] after the final norm


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, T: int) -> torch.Tensor:
    """Validate packed-sequence boundaries; returns them as int64."""
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(
            f"packed input (cu_seqlens) needs batch size 1 (all documents in one row), got {batch}"
        )
    cu = cu_seqlens.long()
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {vals[0]}")
    if any(b <= a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {vals}")
    if vals[-1] != T:
        raise ValueError(f"cu_seqlens must end at the sequence length {T}, got {vals[-1]}")
    return cu


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy in fp32. ``targets`` are aligned with ``logits`` (target of position t at t)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=ignore_index
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.attn_type = config.layer_types[layer_idx]
        self.self_attn = (
            KimiDeltaAttention(config, layer_idx)
            if self.attn_type == "kda"
            else MLAttention(config, layer_idx)
        )
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(config, layer_idx)
        else:
            self.mlp = GLUMLP(
                d,
                config.intermediate_size,
                config.hidden_act,
                config.activation_situ_beta,
                config.activation_situ_linear_beta,
            )
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.use_attn_res = config.use_attn_res
        if self.use_attn_res:
            self.self_attention_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.seal = layer_idx % config.attn_res_block_size == 0
        self.eps = config.rms_norm_eps

    def ffn(self, x: torch.Tensor, projections: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The FFN of the layer on its normed input ``x`` [B, T, D]. ``projections``: the outputs of
        :meth:`ffn_input_projections` for ``x`` (flattened to [B*T, out]) when computed elsewhere."""
        if self.is_moe:
            return self.block_sparse_moe(x, projections)
        return self.mlp(x, projections).view(x.shape)

    def ffn_input_projections(self) -> list[nn.Linear]:
        """The Linear layers that read the FFN input (the MoE router excluded)."""
        return self.block_sparse_moe.input_projections() if self.is_moe else self.mlp.input_projections()

    def ffn_output_projections(self) -> list[nn.Linear | None]:
        """The projections whose outputs sum to the FFN output (None: identity), one per :meth:`ffn_pre_output`."""
        return self.block_sparse_moe.output_projections() if self.is_moe else [self.mlp.down_proj]

    def ffn_pre_output(
        self, x: torch.Tensor, projections: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The FFN up to its output projections: their inputs, flattened to [B*T, in]."""
        if self.is_moe:
            return self.block_sparse_moe.pre_output(x, projections)
        return [self.mlp.pre_output(x.reshape(-1, x.shape[-1]), projections)]

    def site(self, which: str) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(site id, query [1, D], norm weight [D]) of this layer's pre-attention or pre-FFN AttnRes read."""
        sid = 2 * self.layer_idx + (0 if which == "self_attention" else 1)
        return sid, getattr(self, f"{which}_res_proj").weight, getattr(self, f"{which}_res_norm").weight

    def forward(
        self,
        r,
        reader,
        *,
        cu_seqlens=None,
        cache=None,
        checkpoint=False,
        block_sites=None,
        fuse_read_norm=False,
    ):
        """One layer of the AttnRes walk (SPEC.md §3.3). r: live running sum [B,T,D]; reader: the AttnRes reader
        holding the sealed block summaries (this layer may seal, announcing ``block_sites``). Returns the new
        running sum. ``fuse_read_norm``: each read and the RMSNorm after it through ``reader.read_normed`` (the
        norm then runs outside the gradient checkpoint: the checkpoint keeps the normed input instead)."""
        attn = lambda x: self.self_attn(x, cu_seqlens=cu_seqlens, cache=cache)  # x: normed
        ck = checkpoint and cache is None
        wrap = (lambda f: lambda t: _ckpt(f, t, use_reentrant=False)) if ck else (lambda f: f)

        def normed(f, norm, r, which=None):
            """f(norm(h)) for h = r (``which`` None) or the AttnRes read at the site ``which`` of ``r``."""
            if which is not None and fuse_read_norm:
                return wrap(f)(reader.read_normed(*self.site(which), r, norm))
            h = r if which is None else reader.read(*self.site(which), r)
            return wrap(lambda t: f(norm(t)))(h)

        if not self.use_attn_res:
            r = r + normed(attn, self.input_layernorm, r)
            return r + normed(self.ffn, self.post_attention_layernorm, r)
        a = normed(attn, self.input_layernorm, r, "self_attention" if reader.num_sealed else None)
        if self.seal:
            reader.seal(r, block_sites)
            r = a
        else:
            r = r + a
        return r + normed(self.ffn, self.post_attention_layernorm, r, "mlp")


def fuse_read_norm_default() -> bool:
    """``K3Model.fuse_read_norm``'s default: on unless ``OPENK3_FUSE_READ_NORM=0``."""
    return os.environ.get("OPENK3_FUSE_READ_NORM", "1") != "0"


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.use_attn_res:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(d, 1, bias=False)
        self.gradient_checkpointing = False
        self.attnres_backend: str | None = None
        # AttnRes read + the RMSNorm after it in one kernel (forward and backward) where the reader fuses them (the
        # Triton reader); OPENK3_FUSE_READ_NORM=0 or False here: the read, then the norm module
        self.fuse_read_norm: bool = fuse_read_norm_default()

    def output_site(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (
            2 * self.config.num_hidden_layers,
            self.output_attn_res_proj.weight,
            self.output_attn_res_norm.weight,
        )

    def num_sealed_sets(self) -> int:
        """Sealed sources one forward creates (one per AttnRes block)."""
        bs = self.config.attn_res_block_size
        return -(-self.config.num_hidden_layers // bs) if bs else 0

    def block_sites(self, seal_layer: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Read sites that see the sealed set created at ``seal_layer``: its pre-FFN read, every read of the
        following layers up to and including the next sealing layer's pre-attention read (or the final read)."""
        bs = self.config.attn_res_block_size
        L = self.config.num_hidden_layers
        sites = [self.layers[seal_layer].site("mlp")]
        for j in range(seal_layer + 1, min(seal_layer + bs, L)):
            sites += [self.layers[j].site("self_attention"), self.layers[j].site("mlp")]
        sites.append(
            self.layers[seal_layer + bs].site("self_attention") if seal_layer + bs < L else self.output_site()
        )
        return sites

    def forward(self, input_ids, *, cu_seqlens=None, cache=None, inputs_embeds=None) -> torch.Tensor:
        r = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cfg = self.config
        reader = (
            make_reader(cfg.rms_norm_eps, r.is_cuda, self.attnres_backend, max_sources=self.num_sealed_sets())
            if cfg.use_attn_res
            else None
        )
        ck = self.gradient_checkpointing and self.training
        fuse = bool(self.fuse_read_norm and getattr(reader, "fuses_read_norm", False))
        for i, layer in enumerate(self.layers):
            r = layer(
                r,
                reader,
                cu_seqlens=cu_seqlens,
                cache=None if cache is None else cache.layers[i],
                checkpoint=ck,
                block_sites=self.block_sites(i) if (cfg.use_attn_res and layer.seal) else None,
                fuse_read_norm=fuse,
            )
        if cfg.use_attn_res and fuse:
            return reader.read_normed(*self.output_site(), r, self.norm)
        if cfg.use_attn_res:
            r = reader.read(*self.output_site(), r)
        return self.norm(r)


class K3ForCausalLM(nn.Module):
    """Kimi K3 / Kimi Linear causal LM.

    ``model(input_ids)`` with ``input_ids: [B, T]`` returns a :class:`K3Output` with ``.logits [B, T, V]``.
    ``cu_seqlens`` ([N+1], B == 1) packs several documents into one row; ``cache`` (:class:`K3Cache`) continues a
    previous call token by token; ``labels`` (HF style, shifted inside) or ``targets`` (aligned) give ``.loss``.
    """

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    # ---------------------------------------------------------------------------------------------------------
    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Init: N(0, initializer_range) for matrices and embeddings, ones for norm gains, AttnRes pseudo-queries
        zero (``attn_res_init="zero"``, the paper) or normal, KDA ``A_log = log U(1,16)``, ``dt_bias = 0``."""
        std = self.config.initializer_range
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                if name.endswith("_res_proj"):
                    if self.config.attn_res_init == "zero":
                        nn.init.zeros_(mod.weight)
                    else:
                        nn.init.normal_(mod.weight, 0.0, std)
                else:
                    nn.init.normal_(mod.weight, 0.0, std)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, 0.0, std)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
            elif isinstance(mod, Router):
                nn.init.normal_(mod.weight, 0.0, std)
                mod.e_score_correction_bias.zero_()
            elif isinstance(mod, Experts):
                for p in (mod.w1, mod.w2, mod.w3):
                    nn.init.normal_(p, 0.0, std)
            elif isinstance(mod, KimiDeltaAttention):
                mod.reset_parameters_kda(self.config.kda_init)

    def to_dtype(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast parameters to ``dtype`` except those SPEC.md §5.3 keeps in fp32 (A_log, dt_bias, conv weights,
        o_norm); buffers (router correction bias) stay fp32."""
        for p in self.parameters():
            if not getattr(p, "_keep_fp32", False):
                p.data = p.data.to(dtype)
        return self

    def set_backend(self, op: str, name: str | None) -> None:
        """Force a backend for one op ("kda", "mla", "moe", "attnres", "norm", "conv", "glu") on every layer; ``None``
        = auto. "norm" covers every RMSNorm and the KDA gated output norm, "conv" the KDA short convolutions, "glu" the
        activation of every dense gated FFN (layer-0 FFN, shared experts)."""
        if op not in _backend.OPS:
            raise ValueError(f"unknown op {op!r}; ops are {_backend.OPS}")
        for m in self.modules():
            if hasattr(m, "backend") and (
                (op == "kda" and isinstance(m, KimiDeltaAttention))
                or (op == "mla" and isinstance(m, MLAttention))
                or (op == "moe" and isinstance(m, SparseMoE))
                or (op == "norm" and isinstance(m, RMSNorm))
                or (op == "glu" and isinstance(m, GLUMLP))
            ):
                m.backend = name
            if isinstance(m, KimiDeltaAttention):
                if op == "norm":
                    m.norm_backend = name
                elif op == "conv":
                    m.conv_backend = name
        if op == "attnres":
            self.model.attnres_backend = name

    # ---------------------------------------------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def num_active_parameters(self) -> int:
        """Parameters touched per token: everything except the input embedding table and the routed experts a token
        does not pick (``num_experts - num_experts_per_token`` per MoE layer)."""
        c = self.config
        n = self.num_parameters()
        if not c.tie_word_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        for layer in self.model.layers:
            if layer.is_moe:
                ex = layer.block_sparse_moe.experts
                per = (ex.w1.numel() + ex.w2.numel() + ex.w3.numel()) // c.num_experts
                n -= (c.num_experts - c.num_experts_per_token) * per
        return n

    def new_cache(self) -> K3Cache:
        return K3Cache(self.config)

    # ---------------------------------------------------------------------------------------------------------
    def _validate(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.config.vocab_size}); got min {lo}, max {hi} "
                "(is the tokenizer matched to this model?)"
            )

    def _validate_targets(self, name: str, t: torch.Tensor) -> None:
        """Loss targets: integer ids in [0, vocab_size) or -100 (ignored). Checked here, since an id out of range
        is a device-side assert inside the CUDA cross-entropy kernel (one host sync, as for ``input_ids``)."""
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        V = self.config.vocab_size
        bad = ((t < 0) & (t != -100)) | (t >= V)
        if bool(bad.any()):
            v = t[bad]
            raise ValueError(
                f"{name} must lie in [0, vocab_size={V}) or be -100 (ignored); got {v.numel()} other values, "
                f"e.g. {int(v[0])}"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        return_logits: bool = True,
        logits_to_keep: int = 0,
    ) -> K3Output:
        self._validate(input_ids)
        for name, t in (("labels", labels), ("targets", targets)):  # before the forward: no sync behind it
            if t is not None:
                self._validate_targets(name, t)
        B, T = input_ids.shape
        if cu_seqlens is not None:
            cu_seqlens = check_cu_seqlens(cu_seqlens, B, T).to(input_ids.device)
            if cache is not None:
                raise ValueError(
                    "cache and cu_seqlens cannot be combined: decode packed documents separately"
                )
        if cache is not None:
            bs = cache.batch_size
            if bs is not None and bs != B:
                raise ValueError(f"cache holds {bs} sequences but input_ids has batch size {B}")
        h = self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache)
        if cache is not None:
            cache.seq_len += T
        hk = h[:, -logits_to_keep:] if logits_to_keep else h
        logits = (
            F.linear(hk, self.output_weight)
            if (return_logits or labels is not None or targets is not None)
            else None
        )
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}")
            tgt = torch.full_like(labels, -100)
            tgt[:, :-1] = labels[:, 1:]
            if cu_seqlens is not None:  # never predict across a document boundary
                tgt[0, cu_seqlens[1:-1] - 1] = -100
            loss = causal_lm_loss(logits, tgt)
        elif targets is not None:
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}")
            loss = causal_lm_loss(logits, targets)
        return K3Output(logits=logits if return_logits else None, loss=loss, cache=cache, hidden_states=h)

    # ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Simple batched generation with the hybrid cache (prompts of equal length). Returns [B, T + new]."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        cache = self.new_cache()
        out = self(input_ids, cache=cache, logits_to_keep=1)
        seq = input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            if temperature and temperature > 0:
                logits = logits / temperature
                if top_k:
                    kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            if eos_token_id is not None:
                nxt = torch.where(done[:, None], torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt[:, 0] == eos_token_id
            seq = torch.cat([seq, nxt], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
            out = self(nxt, cache=cache)
        return seq

    # ---------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> K3ForCausalLM:
        from openk3.checkpoint import load_pretrained

        return load_pretrained(path, dtype=dtype, device=device)

    def save_pretrained(
        self, path: str | os.PathLike, *, max_shard_size: int | None = None, prefix: str = ""
    ) -> None:
        from openk3.checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size, prefix=prefix)
