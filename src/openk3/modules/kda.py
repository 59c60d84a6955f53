"""Kimi Delta Attention layer (SPEC.md §1.4)."""

from __future__ import annotations

import math
import os

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


def _kda_core_reference(
    layer, q, k, v, z, beta_logits, *, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu=None
):
    """Reference KDA core: gate activation in fp32, then chunked or token recurrence.
    q,k,v,z: [B,T,H,K] (after conv/SiLU for q,k,v; raw decay logits z); beta_logits: [B,T,H]. ``cu_seqlens_cpu``:
    a host copy of ``cu_seqlens`` that a fast core may use to skip a device sync (unused here)."""
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


def _snap_spans(
    snap_at: list, T: int, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None = None
) -> list[tuple[int, int, list[int]]]:
    """Check ``cache["snap_at"]`` and return, per sequence, (start, end, positions) in the token axis ([] without
    snapshots)."""
    if not snap_at:
        return []
    if cu_seqlens is None:
        if not all(isinstance(p, int) for p in snap_at):
            raise ValueError(f"without cu_seqlens, snap_at must be a list of positions, got {snap_at}")
        per_seq, bounds = [snap_at], [(0, T)]
    else:
        offs = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        bounds = list(zip(offs[:-1], offs[1:]))
        per_seq = snap_at
        if len(per_seq) != len(bounds) or not all(isinstance(p, (list, tuple)) for p in per_seq):
            raise ValueError(
                f"with cu_seqlens, snap_at must hold one list of positions per sequence ({len(bounds)}), got {snap_at}"
            )
    spans = []
    for (a, b), at in zip(bounds, per_seq):
        at = list(at)
        if not all(x < y for x, y in zip([0] + at, at + [b - a])) or (at and at[0] <= 0):
            raise ValueError(f"snap_at must be increasing positions inside (0, {b - a}), got {at}")
        spans.append((a, b, at))
    return spans if any(at for _, _, at in spans) else []


# How packed sequences get their snapshot states (``cache["snap_at"]`` with ``cu_seqlens``): "prefix" (default)
# runs the recurrence over the whole sequences and, packed as extra sequences of the same call, over every
# snapshot's prefix [start, start + p) from its sequence's initial state (one call, sum(p) more tokens);
# "rounds" runs it in rounds of segments split at the positions (one call per round, no extra tokens). A KDA call
# is host-bound at these sizes (fla's chunk path launches ~15 kernels), so fewer calls win: `medium` on an H100,
# 8 x 512 tokens at interval 64: 115 ms per forward over the prefixes (then still a second call), 154 ms in
# rounds; 2 x 2,048 at interval 512: 87 ms against 202 ms (79 / 72 ms without snapshots; bench/NOTES.md v36). With
# the prefixes in the sequences' own call, 2 x 2,048 took 69.8 ms against 94.6 for two calls (v37). Rounds grow
# linearly with the snapshots per piece, prefixes quadratically: where the prefixes would hold more than
# SNAP_PREFIX_MAX_RATIO times the tokens of the sequences themselves (measured up to 3.5x, where they still won),
# "prefix" runs in rounds. The environment variable OPENK3_KDA_SNAP_MODE sets the mode at import.
SNAP_MODE: str = os.environ.get("OPENK3_KDA_SNAP_MODE") or "prefix"
SNAP_PREFIX_MAX_RATIO = 8.0
if SNAP_MODE not in ("prefix", "rounds"):
    raise ValueError(f"OPENK3_KDA_SNAP_MODE must be 'prefix' or 'rounds', got {SNAP_MODE!r}")


class _PackedSnapPlan:
    """Index tensors for the recurrence of packed sequences with snapshots inside (built once per forward and
    shared by its KDA layers, with one host-to-device copy). ``mode`` "rounds": per round, the sequences in it,
    their tokens (``idx``), their ``cu_seqlens`` (device and host) and rows (``sel``); "prefix": the same for one
    call over the N sequences themselves followed by the snapshots' prefixes packed as further sequences
    (``prefix``; its first ``num_tokens`` tokens and N rows are the sequences as they are packed). For the conv
    histories, the rows of ``[every sequence's initial history (W - 1 rows each); the packed tokens]`` that each
    snapshot's history holds (``hist_idx`` [S, W - 1], S snapshots in sequence-major order)."""

    def __init__(self, spans: list[tuple[int, int, list[int]]], w: int, device: torch.device, mode: str):
        N = len(spans)
        bounds = [[a] + [a + p for p in at] + [b] for a, b, at in spans]
        extra = sum(p for _, _, at in spans for p in at)
        if mode == "prefix" and extra > SNAP_PREFIX_MAX_RATIO * sum(b - a for a, b, _ in spans):
            mode = "rounds"
        self.mode = mode
        if self.mode not in ("rounds", "prefix"):
            raise ValueError(f"snapshot mode must be 'rounds' or 'prefix', got {self.mode!r}")
        host: list[list[int]] = []
        meta = []
        if self.mode == "rounds":
            groups = []
            for r in range(max(len(x) for x in bounds) - 1):
                seqs = [n for n, x in enumerate(bounds) if len(x) - 1 > r]
                groups.append((seqs, [(bounds[n][r], bounds[n][r + 1]) for n in seqs]))
        else:  # one group: the sequences themselves, then every snapshot's prefix from its sequence's start
            seqs = list(range(N)) + [n for n, (_, _, at) in enumerate(spans) for _ in at]
            groups = [(seqs, [(a, b) for a, b, _ in spans] + [(a, a + p) for a, _, at in spans for p in at])]
        for seqs, segs in groups:
            cu = [0]
            for a, b in segs:
                cu.append(cu[-1] + b - a)
            host += [[t for a, b in segs for t in range(a, b)], cu, seqs]
            meta.append((seqs, torch.tensor(cu, dtype=torch.long)))
        rows = []
        for n, (a, _, at) in enumerate(spans):
            for p in at:  # the W - 1 inputs before position p, oldest first
                rows += [n * w + c if c < w else N * w + a + c - w for c in range(p, p + w)]
        host.append(rows)
        # (non-blocking: a copy from pageable memory that does not wait for the work queued on the device)
        flat = torch.tensor([x for h in host for x in h], dtype=torch.long).to(device, non_blocking=True)
        parts = list(flat.split([len(h) for h in host]))
        self.hist_idx = parts.pop().view(-1, w)
        groups = [
            (seqs, parts[3 * r], parts[3 * r + 1], cu_cpu, parts[3 * r + 2])
            for r, (seqs, cu_cpu) in enumerate(meta)
        ]
        self.rounds = groups if self.mode == "rounds" else []
        self.prefix = groups[0] if self.mode == "prefix" else None
        self.num_seqs, self.num_tokens = N, sum(b - a for a, b, _ in spans)


_PLAN: list = [None]  # (cu_seqlens, key, spans, plan) of the last packed forward with snapshots


def _packed_plan(
    snap_at: list,
    T: int,
    cu_seqlens: torch.Tensor | None,
    w: int,
    cu_seqlens_cpu: torch.Tensor | None,
    device: torch.device,
):
    """(spans, plan) for packed sequences with ``snap_at`` (``cu_seqlens`` None: one sequence of T tokens): reused
    while the same ``cu_seqlens`` tensor comes with the same positions (the KDA layers of one forward)."""
    key = (tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in snap_at), T, w, SNAP_MODE, device)
    last = _PLAN[0]
    if last is not None and last[0] is cu_seqlens and last[1] == key:
        return last[2], last[3]
    spans = _snap_spans(snap_at, T, cu_seqlens, cu_seqlens_cpu)
    plan = _PackedSnapPlan(spans, w, device, SNAP_MODE) if spans else None
    _PLAN[0] = (cu_seqlens, key, spans, plan)
    return spans, plan


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
        # Inference only (set by the engine; ignored while autograd records): (buffer, sizes) holding the weights
        # of q_proj, k_proj, v_proj, f_a_proj, b_proj and g_proj (or g_a_proj) as rows of one tensor that those
        # modules' weights are views of, so that one GEMM forms all projections; and the q / k / v conv weights as
        # one [3 * HK, 1, W] tensor (their views too), so that one depthwise conv call convolves all three.
        self.fused_input: tuple[torch.Tensor, list[int]] | None = None
        self.fused_conv: torch.Tensor | None = None
        self.mark_fp32_parameters()

    def _fused_buffers(self) -> tuple[torch.Tensor, list[int], torch.Tensor | None] | None:
        """(input buffer, row sizes, conv buffer or None) where ``fused_input`` is set and the modules' weights
        still are its row blocks in order (and the conv weights ``fused_conv``'s), checked by address; None
        otherwise (e.g. a weight replaced or the model moved after the engine set them), so that a stale buffer is
        never used."""
        if self.fused_input is None:
            return None
        buf, sizes = self.fused_input

        def views(b, mods, rows):
            if b is None:
                return False
            ptr, step = b.data_ptr(), b[:1].numel() * b.element_size()
            for m, n in zip(mods, rows):
                w = m.weight
                if w.data_ptr() != ptr or w.shape[0] != n or w.dtype != b.dtype or w.device != b.device:
                    return False
                ptr += n * step
            return True

        g = self.g_proj if self.full_rank_gate else self.g_a_proj
        mods = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, g)
        if len(sizes) != len(mods) or not views(buf, mods, sizes):
            return None
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        conv = self.fused_conv if views(self.fused_conv, convs, [sizes[0]] * 3) else None
        return buf, sizes, conv

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
        cu_seqlens_cpu: torch.Tensor | None = None,
        cache: dict | None = None,
    ) -> torch.Tensor:
        """x: [B, T, D] (normed layer input). ``cache``: this layer's dict (``conv_q/k/v`` [B, HK, W-1], ``state``
        [B, H, K, K]) updated in place. Returns [B, T, D].

        ``cache["snap_at"]`` (positions 0 < p < T, increasing) also asks for the cache as it stands after the first
        p tokens: ``cache["snaps"]`` becomes ``[(state, {"q": conv, "k": ..., "v": ...})]``, one per position.
        Everything but the recurrence runs once over all T tokens; the states at the positions come from SNAP_MODE
        (default "prefix": the positions' prefixes packed beside the sequences in one recurrence call; "rounds":
        the recurrence split there, each segment from the previous one's state). A batch of several rows (B > 1,
        no ``cu_seqlens``) always runs the split recurrence. With ``cu_seqlens`` (B == 1, N packed sequences; the
        cache's entries have N rows) ``snap_at`` is one such list per sequence, positions counted from the
        sequence's start, and ``snaps`` one list per sequence (its tensors with a leading dimension of 1).
        ``cu_seqlens_cpu``: an optional host copy of ``cu_seqlens`` (the snapshot plan, the conv and the fast core
        then read the lengths without a device sync; the core also picks its token-recurrent kernel for short
        packed sequences)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        use_cache = cache is not None
        snap_at = list(cache.get("snap_at") or ()) if use_cache else []
        # per sequence: its token range [a, b) in the packed axis and its snapshot positions (from a)
        # (one sequence, B == 1, takes the packed path's prefix mode too: one call instead of one per segment)
        plan = None
        if snap_at and (cu_seqlens is not None or (B == 1 and SNAP_MODE == "prefix")):
            spans, plan = _packed_plan(snap_at, T, cu_seqlens, self.conv_size - 1, cu_seqlens_cpu, x.device)
        else:
            spans = _snap_spans(snap_at, T, cu_seqlens)
        conv_be = _backend.resolve("conv", x.is_cuda, self.conv_backend)
        conv_fn = FAST_CONV.get(conv_be, causal_conv1d) if conv_be != "reference" else causal_conv1d
        # inference with the projections reading x in one buffer (set by the engine, see `fused_input`): one GEMM
        # for them all, and q, k, v through one conv call when their conv weights share a buffer too
        fused = self._fused_buffers() if not torch.is_grad_enabled() else None
        if fused is not None:
            full = torch.nn.functional.linear(x, fused[0])
            xq, xk, xv, fa, b_logits, g_in = full.split(fused[1], dim=-1)
            if fused[2] is not None:  # [q | k | v] channels side by side: one depthwise conv
                groups = [("qkv", full[..., : 3 * H * K], fused[2])]
            else:
                groups = [("q", xq, self.q_conv1d.weight), ("k", xk, self.k_conv1d.weight)]
                groups.append(("v", xv, self.v_conv1d.weight))
        else:
            fa = b_logits = g_in = None
            groups = [
                ("q", self.q_proj(x), self.q_conv1d.weight),
                ("k", self.k_proj(x), self.k_conv1d.weight),
                ("v", self.v_proj(x), self.v_conv1d.weight),
            ]
        hists: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        convs = {}
        outs = {}
        for name, xp, weight in groups:
            names = ("q", "k", "v") if name == "qkv" else (name,)
            init = None
            if use_cache and all(cache.get(f"conv_{n}") is not None for n in names):
                init = (
                    torch.cat([cache[f"conv_{n}"] for n in names], dim=1)
                    if len(names) > 1
                    else cache[f"conv_{name}"]
                )
            y, fin = conv_fn(
                xp,
                weight,
                initial_state=init,
                cu_seqlens=cu_seqlens,
                activation="silu",
                output_final_state=use_cache,
                cu_seqlens_cpu=cu_seqlens_cpu,
            )
            HK = y.shape[-1] // len(names)  # one channel block of HK per name
            for n, part in zip(names, y.split(HK, dim=-1)):
                outs[n] = part.view(B, T, H, K)
            for n, part in zip(names, fin.split(HK, dim=1) if fin is not None else [None] * len(names)):
                convs[n] = part
            if spans:  # the conv history after p tokens: the W - 1 inputs before position p, oldest first
                w = self.conv_size - 1
                rows = B if plan is None else len(spans)
                prev = (
                    init.float()
                    if init is not None
                    else xp.new_zeros(rows, xp.shape[-1], w, dtype=torch.float32)
                )
                if plan is None:  # every row: [B, C, W-1 + T]
                    seq = torch.cat([prev, xp.float().transpose(1, 2)], dim=-1)
                    h = [seq[..., p : p + w].clone().split(HK, dim=1) for p in snap_at]
                    for j, n in enumerate(names):
                        hists[n] = [t[j] for t in h]
                else:  # all snapshots of all sequences in one gather: [S, C, W-1]
                    src = torch.cat([prev.transpose(1, 2).reshape(-1, xp.shape[-1]), xp[0].float()])
                    hists.update(zip(names, src[plan.hist_idx].transpose(1, 2).split(HK, dim=1)))
        q, k, v = outs["q"], outs["k"], outs["v"]
        z = self.f_b_proj(fa if fa is not None else self.f_a_proj(x)).view(B, T, H, K)
        beta_logits = b_logits if b_logits is not None else self.b_proj(x)
        be = _backend.resolve("kda", x.is_cuda, self.backend)
        core = _kda_core_reference if be == "reference" else FAST_KDA[be]
        state = cache.get("state") if use_cache else None
        if not spans:  # one call over everything
            o, state = core(
                self,
                q,
                k,
                v,
                z,
                beta_logits,
                initial_state=state,
                output_final_state=use_cache,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu,
            )
        elif plan is None:  # segments split at the positions, each from the previous one's state
            pieces, snaps = [], []
            for a, b in zip([0] + snap_at, snap_at + [T]):
                seg = (t[:, a:b] for t in (q, k, v, z, beta_logits))
                o, state = core(self, *seg, initial_state=state, output_final_state=True, cu_seqlens=None)
                pieces.append(o)
                if b < T:
                    snaps.append((state.float().clone(), {n: hists[n][len(snaps)] for n in ("q", "k", "v")}))
            o = torch.cat(pieces, dim=1)
            cache["snaps"] = snaps
        else:
            o, state = self._packed_snapshots(
                core, (q, k, v, z, beta_logits), state, spans, plan, hists, cache
            )
            if cu_seqlens is None:  # one sequence: its list
                cache["snaps"] = cache["snaps"][0]
        if use_cache:
            for name in ("q", "k", "v"):
                cache[f"conv_{name}"] = convs[name]
            cache["state"] = state.float()
        if g_in is not None:
            gate = g_in if self.full_rank_gate else self.g_b_proj(g_in)
        else:
            gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = gated_norm(o.to(x.dtype), self.o_norm.weight, gate.view(B, T, H, K), self.eps, self.norm_backend)
        return self.o_proj(o.reshape(B, T, H * K))

    def _packed_snapshots(self, core, tensors, state, spans, plan, hists, cache):
        """The recurrence of packed sequences with snapshots inside them (``plan.mode``, see SNAP_MODE): "rounds":
        round r runs the r-th segment of every sequence that has one as one varlen call, each from its state after
        round r - 1; "prefix": one varlen call over the whole sequences and, as further sequences, the snapshots'
        prefixes. Returns (o, states) and sets ``cache["snaps"]`` (one list per sequence)."""
        snaps = [[] for _ in spans]
        first = [0]  # each sequence's first row in hists (its snapshots in order)
        for _, _, at in spans:
            first.append(first[-1] + len(at))

        if state is None:  # no cache state given: every sequence starts from zeros
            B, H, K = len(spans), self.num_heads, self.head_dim
            state = tensors[0].new_zeros(B, H, K, K, dtype=torch.float32)

        def run(group, state, skip=0):
            """One varlen call over a plan group's segments, each from its sequence's row of ``state``; books a
            snapshot for each segment after the first ``skip`` that ends on one (in order: those rows are
            sequence-major, as hists)."""
            seqs, idx, cu, cu_cpu, sel = group
            part = (t.index_select(1, idx) for t in tensors)
            o_g, fin = core(
                self,
                *part,
                initial_state=state.index_select(0, sel),
                output_final_state=True,
                cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu,
            )
            for m, n in enumerate(seqs):
                if m < skip:
                    continue
                k = len(snaps[n])
                if k < len(spans[n][2]):  # sequence n's k-th snapshot: hists row first[n] + k
                    h = first[n] + k
                    snaps[n].append(
                        (fin[m : m + 1].float(), {x: hists[x][h : h + 1] for x in ("q", "k", "v")})
                    )
            return idx, sel, o_g, fin

        if plan.mode == "prefix":
            # one call: the sequences, then the prefixes (their final states: the snapshots)
            _, _, o, state = run(plan.prefix, state, skip=plan.num_seqs)
            o, state = o[:, : plan.num_tokens], state[: plan.num_seqs]
        else:
            o = torch.empty_like(tensors[2])
            state = state.clone()
            for group in plan.rounds:
                idx, sel, o_g, fin = run(group, state)
                o.index_copy_(1, idx, o_g.to(o.dtype))
                state.index_copy_(0, sel, fin.to(state.dtype))
        cache["snaps"] = snaps
        return o, state
