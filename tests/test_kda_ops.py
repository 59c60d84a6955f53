"""Tests for the plain-PyTorch KDA operators (gate, recurrence, chunked form)."""

from __future__ import annotations

import time

import pytest
import torch

from openk3.ops.kda import kda, kda_chunk, kda_gate, kda_recurrent, l2norm

H, K, V = 2, 24, 20
F64, F32 = torch.float64, torch.float32
GATES = ("lowerbound", "softplus")


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = time.time_ns() % (2**31)
    torch.manual_seed(seed)
    print(f"torch seed {seed}")  # shown by pytest on failure, to reproduce a run
    yield


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (the absolute error when b is exactly zero, e.g. d g with T=1 and no state)."""
    err, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return err / ref if ref > 0 else err


def make_g(B, T, kind, dtype=F64, z_scale=2.0, z_shift=0.0):
    z = torch.randn(B, T, H, K, dtype=dtype) * z_scale + z_shift
    A_log = torch.log(torch.empty(H, dtype=torch.float32).uniform_(1.0, 16.0))
    dt_bias = 0.5 * torch.randn(H * K, dtype=torch.float32)
    return kda_gate(z, A_log, dt_bias, kind=kind).to(dtype)


def make_inputs(B, T, kind, *, dtype=F64, n_state=None, with_init=True, **gate_kw):
    """Leaf tensors (requires_grad) for one KDA call; n_state = number of sequences (default B)."""
    n_state = B if n_state is None else n_state
    x = {
        "q": torch.randn(B, T, H, K, dtype=dtype),
        "k": torch.randn(B, T, H, K, dtype=dtype),
        "v": torch.randn(B, T, H, V, dtype=dtype),
        "g": make_g(B, T, kind, dtype, **gate_kw),
        "beta": torch.rand(B, T, H, dtype=dtype) * 0.98 + 0.01,
    }
    if with_init:
        x["initial_state"] = torch.randn(n_state, H, K, V, dtype=dtype)
    return {name: t.requires_grad_() for name, t in x.items()}


def run(fn, x, do, ds, **kw):
    """Forward with a final state, backward with cotangents (do, ds); returns (o, state, grads)."""
    kw = dict(kw)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, s = fn(*args, initial_state=x.get("initial_state"), output_final_state=True, **kw)
    loss = (o.double() * do).sum() + (s.double() * ds).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return o, s, dict(zip(x.keys(), grads))


def cast(x, dtype):
    return {n: t.detach().to(dtype).requires_grad_() for n, t in x.items()}


def cotangents(B, T, N):
    return torch.randn(B, T, H, V, dtype=F64), torch.randn(N, H, K, V, dtype=F64)


def assert_close(ref, got, tol, what=""):
    o_r, s_r, g_r = ref
    o_g, s_g, g_g = got
    errs = {"o": rel(o_g, o_r), "state": rel(s_g, s_r)}
    errs.update({f"d{n}": rel(g_g[n], g_r[n]) for n in g_r})
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors above {tol}: {bad}"
    return max(errs.values())


# ----------------------------------------------------------------------------------------------------
# recurrence vs an independent matrix-form implementation


def matrix_form_kda(q, k, v, g, beta, scale, S0):
    """S_t = (I - b k k^T) Diag(alpha) S_{t-1} + b k v^T, o_t = S_t^T q_t; one sequence/head at a time."""
    B, T, Hh, Kk = q.shape
    o = torch.zeros(B, T, Hh, v.shape[-1], dtype=F64)
    S_final = torch.zeros_like(S0)
    eye = torch.eye(Kk, dtype=F64)
    for b in range(B):
        for h in range(Hh):
            S = S0[b, h].clone()
            for t in range(T):
                qt = q[b, t, h] / torch.sqrt((q[b, t, h] ** 2).sum() + 1e-6) * scale
                kt = k[b, t, h] / torch.sqrt((k[b, t, h] ** 2).sum() + 1e-6)
                bt = beta[b, t, h]
                S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(torch.exp(g[b, t, h])) @ S
                S = S + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ qt
            S_final[b, h] = S
    return o, S_final


@pytest.mark.parametrize("kind", GATES)
def test_recurrent_matches_matrix_form(kind):
    B, T = 2, 23
    x = {n: t.detach() for n, t in make_inputs(B, T, kind).items()}
    scale = 0.37
    o, s = kda_recurrent(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        scale=scale,
        initial_state=x["initial_state"],
        output_final_state=True,
    )
    o_ref, s_ref = matrix_form_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"])
    assert rel(o, o_ref) < 1e-12
    assert rel(s, s_ref) < 1e-12


# ----------------------------------------------------------------------------------------------------
# chunked form vs recurrence


@pytest.mark.parametrize("with_init", [False, True], ids=["zero_state", "init_state"])
@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 200])
def test_chunk_matches_recurrent_fp64(T, kind, with_init):
    B = 2
    x = make_inputs(B, T, kind, with_init=with_init)
    do, ds = cotangents(B, T, B)
    ref = run(kda_recurrent, x, do, ds)
    assert ref[0].dtype == F64 and ref[1].dtype == F64
    for C in (16, 32, 64):
        got = run(kda_chunk, x, do, ds, chunk_size=C)
        assert got[0].dtype == F64 and got[1].dtype == F64
        assert_close(ref, got, 1e-10, f"T={T} C={C}")


@pytest.mark.parametrize(
    "kind,T,C,gate_kw",
    [
        ("lowerbound", 200, 64, {"z_scale": 3.0, "z_shift": 2.0}),  # mostly near the -5 floor: strong decay
        ("lowerbound", 130, 16, {}),
        ("softplus", 200, 64, {"z_scale": 3.0}),  # per-step decay down to about -100
    ],
)
def test_fp32_matches_fp64(kind, T, C, gate_kw):
    B = 2
    x32 = make_inputs(B, T, kind, dtype=F32, **gate_kw)
    do, ds = cotangents(B, T, B)
    ref = run(kda_recurrent, cast(x32, F64), do, ds)
    chunk32 = run(kda_chunk, x32, do, ds, chunk_size=C)
    rec32 = run(kda_recurrent, x32, do, ds)
    assert chunk32[0].dtype == F32 and chunk32[1].dtype == F32
    # observed: ~1.5e-7 for both (outputs, states and all gradients)
    assert_close(ref, chunk32, 2e-6, f"chunk fp32 {kind}")
    assert_close(ref, rec32, 2e-6, f"recurrent fp32 {kind}")


def test_odd_chunk_sizes():
    B, T = 1, 50
    x = make_inputs(B, T, "softplus")
    do, ds = cotangents(B, T, B)
    ref = run(kda_recurrent, x, do, ds)
    for C in (1, 5, 7, 24, 49, 50, 1000):
        assert_close(ref, run(kda_chunk, x, do, ds, chunk_size=C), 1e-10, f"C={C}")


def test_extreme_decay_is_finite_and_exact():
    """Cumulative decay far beyond exp() range inside a chunk (fp32 and fp64)."""
    B, T = 1, 96
    x = make_inputs(B, T, "softplus")
    with torch.no_grad():
        x["g"].copy_(-torch.rand(B, T, H, K, dtype=F64) * 0.05)
        x["g"][..., : K // 2] = -200.0 - 50.0 * torch.rand(B, T, H, K // 2, dtype=F64)
    do, ds = cotangents(B, T, B)
    ref = run(kda_recurrent, x, do, ds)
    assert_close(ref, run(kda_chunk, x, do, ds, chunk_size=64), 1e-10, "fp64")
    got32 = run(kda_chunk, cast(x, F32), do, ds, chunk_size=64)
    assert all(torch.isfinite(t).all() for t in (got32[0], got32[1], *got32[2].values()))
    assert_close(ref, got32, 1e-5, "fp32")


def test_low_precision_inputs():
    B, T = 1, 40
    x = {n: t.detach().to(torch.bfloat16) for n, t in make_inputs(B, T, "lowerbound").items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ref = kda_recurrent(
        *[a.float() for a in args], initial_state=x["initial_state"].float(), output_final_state=True
    )
    for fn in (kda_chunk, kda_recurrent):
        o, s = fn(*args, initial_state=x["initial_state"], output_final_state=True)
        assert o.dtype == torch.bfloat16 and s.dtype == F32
        assert rel(o, ref[0]) < 1e-2 and rel(s, ref[1]) < 1e-5


# ----------------------------------------------------------------------------------------------------
# packed sequences


@pytest.mark.parametrize("with_init", [False, True], ids=["zero_state", "init_state"])
def test_varlen_matches_separate(with_init):
    lens = [37, 1, 64, 20, 90]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N, T = len(lens), sum(lens)
    kinds = {0: "lowerbound", 1: "softplus"}
    x = make_inputs(1, T, kinds[int(torch.randint(2, ()))], n_state=N, with_init=with_init)
    do, ds = cotangents(1, T, N)
    for fn, kw in ((kda_recurrent, {}), (kda_chunk, {"chunk_size": 16}), (kda_chunk, {"chunk_size": 64})):
        packed = run(fn, x, do, ds, cu_seqlens=cu, **kw)
        assert packed[0].shape == (1, T, H, V) and packed[1].shape == (N, H, K, V)
        for n in range(N):
            a, b = int(cu[n]), int(cu[n + 1])
            xs = {
                m: t.detach()[:, a:b].clone().requires_grad_() for m, t in x.items() if m != "initial_state"
            }
            if with_init:
                xs["initial_state"] = x["initial_state"].detach()[n : n + 1].clone().requires_grad_()
            single = run(fn, xs, do[:, a:b], ds[n : n + 1], **kw)
            assert rel(packed[0][:, a:b], single[0]) < 1e-12
            assert rel(packed[1][n : n + 1], single[1]) < 1e-12
            for m in xs:
                g_packed = packed[2][m][n : n + 1] if m == "initial_state" else packed[2][m][:, a:b]
                assert rel(g_packed, single[2][m]) < 1e-12, (fn.__name__, n, m)


def test_varlen_chunk_matches_varlen_recurrent():
    lens = [5, 1, 130, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long)
    N, T = len(lens), sum(lens)
    x = make_inputs(1, T, "lowerbound", n_state=N)
    do, ds = cotangents(1, T, N)
    ref = run(kda_recurrent, x, do, ds, cu_seqlens=cu)
    assert_close(ref, run(kda_chunk, x, do, ds, cu_seqlens=cu, chunk_size=32), 1e-10, "varlen")


# ----------------------------------------------------------------------------------------------------
# normalisation, scale, dispatch


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunk])
def test_l2norm_invariance_and_default_scale(fn):
    B, T = 2, 33
    x = {n: t.detach() for n, t in make_inputs(B, T, "lowerbound").items()}
    q, k, v, g, beta, s0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    c = float(torch.empty(()).uniform_(1.5, 40.0))
    # eps=1e-6 inside the norm makes the invariance approximate (|x|^2 ~ K here: ~1e-8 relative)
    for qq, kk in ((q * c, k), (q, k * c), (q * c, k * c)):
        o2, s2 = fn(qq, kk, v, g, beta, initial_state=s0, output_final_state=True)
        assert rel(o2, o) < 1e-6 and rel(s2, s) < 1e-6
    o3 = fn(q, k, v, g, beta, initial_state=s0, scale=K**-0.5)[0]
    assert torch.equal(o3, o)
    o4 = fn(q, k, v, g, beta, initial_state=s0, scale=0.5 * K**-0.5)[0]
    assert rel(o4, o) > 1e-3
    assert fn(q, k, v, g, beta)[1] is None


def test_without_l2norm_and_l2norm_helper():
    B, T = 1, 50
    x = make_inputs(B, T, "softplus")
    with torch.no_grad():
        x["q"].copy_(l2norm(x["q"]))
        x["k"].copy_(l2norm(x["k"]))
    do, ds = cotangents(B, T, B)
    ref = run(kda_recurrent, x, do, ds, use_qk_l2norm=False)
    assert_close(ref, run(kda_chunk, x, do, ds, use_qk_l2norm=False, chunk_size=16), 1e-10, "no l2norm")
    # inputs that are already unit-norm barely change under the in-kernel norm
    o_norm = kda_recurrent(
        *[x[n].detach() for n in ("q", "k", "v", "g", "beta")], initial_state=x["initial_state"]
    )[0]
    assert rel(o_norm, ref[0]) < 1e-5

    y = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    n = l2norm(y)
    assert n.dtype == F32
    yf = y.float()
    assert torch.allclose(n, yf / torch.sqrt((yf * yf).sum(-1, keepdim=True) + 1e-6))
    assert l2norm(torch.randn(4, 6, dtype=F64)).dtype == F64


def test_dispatch():
    for T in (9, 40):
        x = {n: t.detach() for n, t in make_inputs(1, T, "lowerbound").items()}
        args = [x[n] for n in ("q", "k", "v", "g", "beta")]
        kw = {"initial_state": x["initial_state"], "output_final_state": True}
        ref = kda_recurrent(*args, **kw)
        for backend in ("auto", "chunk", "recurrent"):
            o, s = kda(*args, backend=backend, chunk_size=8, **kw)
            assert rel(o, ref[0]) < 1e-12 and rel(s, ref[1]) < 1e-12
    with pytest.raises(ValueError, match="backend"):
        kda(*args, backend="fast")


# ----------------------------------------------------------------------------------------------------
# gate


def test_gate_values_and_a_log_layouts():
    Hh, Kk = 3, 8
    z = torch.randn(2, 5, Hh, Kk) * 2
    A = torch.log(torch.empty(Hh).uniform_(1.0, 16.0))
    dt = torch.randn(Hh * Kk)
    for lb in (-5.0, -10.0, -0.5):
        g = kda_gate(z, A, dt, kind="lowerbound", lower_bound=lb)
        assert g.dtype == F32 and g.shape == z.shape
        assert (g >= lb).all() and (g <= 0).all()  # fp32 sigmoid may saturate for large logits
        moderate = (z * 0.5).clamp(-1, 1).double()  # |exp(A) (z + dt)| <= 16 * 2: strict bounds hold
        g64 = kda_gate(moderate, A, dt.clamp(-1, 1), kind="lowerbound", lower_bound=lb)
        assert (g64 > lb).all() and (g64 < 0).all()
        ref = lb * torch.sigmoid(A.exp()[:, None] * (z + dt.view(Hh, Kk)))
        assert torch.allclose(g, ref, rtol=1e-6, atol=0)
    gs = kda_gate(z, A, dt, kind="softplus")
    assert (gs <= 0).all()
    assert torch.allclose(gs, -A.exp()[:, None] * torch.log1p(torch.exp(z + dt.view(Hh, Kk))), rtol=1e-5)
    # large logits: linear branch of softplus, no overflow
    big = kda_gate(torch.full((1, Hh, Kk), 500.0), A, None, kind="softplus")
    assert torch.isfinite(big).all() and torch.allclose(big, -A.exp()[:, None] * 500.0 * torch.ones(Kk))

    padded = torch.cat([A, torch.zeros(Kk - Hh)])  # stored zero-padded to head_dim entries
    for kind in GATES:
        ref = kda_gate(z, A, dt, kind=kind)
        for a in (padded, A.view(1, 1, Hh, 1)):
            assert torch.equal(kda_gate(z, a, dt, kind=kind), ref)
        assert torch.equal(kda_gate(z, A, dt.view(Hh, Kk), kind=kind), ref)
        assert kda_gate(z.to(torch.bfloat16), A, dt, kind=kind).dtype == F32
        assert kda_gate(z.double(), A, dt, kind=kind).dtype == F64


def test_gate_rejects_bad_arguments():
    z, A, dt = torch.randn(4, 2, 8), torch.zeros(2), torch.zeros(16)
    with pytest.raises(ValueError, match="kind"):
        kda_gate(z, A, dt, kind="sigmoid")
    for lb in (0.0, 1.0, -10.5):
        with pytest.raises(ValueError, match="lower_bound"):
            kda_gate(z, A, dt, lower_bound=lb)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(z, torch.zeros(1), dt)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(z, A, torch.zeros(15))


# ----------------------------------------------------------------------------------------------------
# input validation


def _args(B=1, T=10):
    x = {n: t.detach() for n, t in make_inputs(B, T, "lowerbound", with_init=False).items()}
    return [x[n] for n in ("q", "k", "v", "g", "beta")]


@pytest.mark.parametrize("fn", [kda_recurrent, kda_chunk])
def test_bad_inputs_raise(fn):
    q, k, v, g, beta = _args()
    cases = [
        ("q must have shape", (q[0], k, v, g, beta), {}),
        ("k must have", (q, k[..., :-1], v, g, beta), {}),
        ("g must have", (q, k, v, g[:, :-1], beta), {}),
        ("v must have", (q, k, v[:, :, :1], g, beta), {}),
        ("beta must have", (q, k, v, g, beta[..., None]), {}),
        ("floating-point", (q, k, v, g, (beta > 0.5).long()), {}),
        ("initial_state", (q, k, v, g, beta), {"initial_state": torch.zeros(1, H, V, K, dtype=F64)}),
        ("initial_state", (q, k, v, g, beta), {"initial_state": torch.zeros(2, H, K, V, dtype=F64)}),
        ("scale", (q, k, v, g, beta), {"scale": float("nan")}),
        ("1-D", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([[0, 10]])}),
        ("integer", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0.0, 10.0])}),
        ("start at 0", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([1, 10])}),
        ("strictly increasing", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0, 4, 4, 10])}),
        ("strictly increasing", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0, 6, 4, 10])}),
        ("end at", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0, 4, 9])}),
        ("at least 2", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0])}),
        ("initial_state", (q, k, v, g, beta), {"cu_seqlens": torch.tensor([0, 4, 10]),
                                                "initial_state": torch.zeros(1, H, K, V)}),
    ]  # fmt: skip
    for msg, args, kw in cases:
        with pytest.raises(ValueError, match=msg):
            fn(*args, **kw)
    q2, k2, v2, g2, b2 = _args(B=2)
    with pytest.raises(ValueError, match="batch size must be 1"):
        fn(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 4, 10]))
    if fn is kda_chunk:
        for bad in (0, -16, 16.0, True):
            with pytest.raises(ValueError, match="chunk_size"):
                fn(q, k, v, g, beta, chunk_size=bad)


# ---------------------------------------------------------------------------------------------------------------------
# openk3.fast.kda.ChunkGraphs: the padded fixed-shape call behind the prefill's graph-captured chunk calls. fla's chunk
# kernels do not run on the CPU (not even interpreted), so a small sequence-aware recurrence with fla's argument
# contract stands in for them here; tests/gpu/test_fast_ops.py runs fla itself, captured and replayed.


def _stand_in_chunk(q, k, v, g, beta, *, A_log, dt_bias, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_graph=False, max_num_seqs=None, **_):  # fmt: skip
    """``s <- s * sigmoid(g_t + dt_bias) + sigmoid(beta_t) k_t v_t^T``, ``o_t = exp(A_log) q_t s`` per sequence
    (``cu_seqlens`` or each batch row); tokens in no sequence get NaN outputs. In fla's graph form the sequence
    count must be the padded ``max_num_seqs``."""
    B, T, Hq, Kq = q.shape
    Vq = v.shape[-1]
    if use_graph:
        assert cu_seqlens is not None and cu_seqlens.shape[0] - 1 == max_num_seqs
    if cu_seqlens is None:
        seqs = [(b, b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        assert B == 1 and cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= T
        seqs = [(n, 0, a, b) for n, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
    o = torch.full((B, T, Hq, Vq), float("nan"), dtype=q.dtype)
    finals = []
    for n, b, t0, t1 in seqs:
        s = torch.zeros(Hq, Kq, Vq) if initial_state is None else initial_state[n].clone()
        for t in range(t0, t1):
            decay = torch.sigmoid(g[b, t].float() + dt_bias.view(Hq, Kq))
            kv = (
                torch.sigmoid(beta[b, t].float())[:, None, None]
                * k[b, t].float()[:, :, None]
                * v[b, t].float()[:, None]
            )
            s = s * decay[..., None] + kv
            o[b, t] = (torch.einsum("hk,hkv->hv", q[b, t].float(), s) * A_log.exp()[:, None]).to(q.dtype)
        finals.append(s)
    return o, (torch.stack(finals) if output_final_state else None)


def _graph_inputs(T, Hq=2, Kq=8, Vq=4, B=1, N=None, dtype=F32):
    q, k, g = (torch.randn(B, T, Hq, Kq, dtype=dtype) for _ in range(3))
    v = torch.randn(B, T, Hq, Vq, dtype=dtype)
    beta = torch.randn(B, T, Hq, dtype=dtype)
    kw = {
        "use_gate_in_kernel": True,
        "A_log": torch.randn(Hq),
        "dt_bias": torch.randn(Hq * Kq),
        "lower_bound": -5.0,
        "safe_gate": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "initial_state": torch.randn(N or B, Hq, Kq, Vq),
        "output_final_state": True,
    }
    return (q, k, v, g, beta), kw


def _padded_vs_direct(graphs, xs, kw, lens=None):
    """The runner's result and the stand-in's direct one for packed sequences of lengths ``lens`` (or per row)."""
    kw = dict(kw)
    cu_cpu = None
    if lens is not None:
        cu_cpu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
        kw["cu_seqlens"] = cu_cpu.clone()
    got = graphs.run(*xs, kw, cu_cpu)
    assert got is not None
    want = _stand_in_chunk(*xs, **kw)
    return got, want


def test_chunk_graphs_padded_call_matches_direct(monkeypatch):
    """The bucket's padded call (tokens to a power of two, empty sequences to a power of two, per-layer parameters
    copied in) gives the direct call's outputs and final states, bit for bit, for packed sequences of several
    layouts in one bucket, for batch rows without cu_seqlens, and with the padding tokens of the buffers poisoned
    with NaN between calls."""
    import openk3.fast.kda as FK

    monkeypatch.setattr(FK, "_chunk_kda", _stand_in_chunk)
    graphs = FK.ChunkGraphs(max_tokens=512, max_seqs=8, min_tokens=64, capture=False)
    for lens in ([5, 40, 17], [60, 2], [1, 1, 1, 1, 1], [130]):
        xs, kw = _graph_inputs(sum(lens), N=len(lens))
        (o, s), (o2, s2) = _padded_vs_direct(graphs, xs, kw, lens)
        assert torch.equal(o, o2) and torch.equal(s, s2), lens
        # whatever the buffers hold past the tokens must not reach an output
        for e in graphs.entries.values():
            for name in ("q", "k", "v", "g", "beta"):
                e.bufs[name][0, sum(lens) :] = float("nan")
            e.bufs["h0"][len(lens) :] = float("nan")
    assert sorted(k[:2] for k in graphs.entries) == [(64, 2), (64, 4), (64, 8), (256, 1)]
    # one set of static inputs per shape: the 64-token buckets share their token buffers, not their states
    by_tb = {}
    for key, e in graphs.entries.items():
        by_tb.setdefault(key[0], set()).add((e.bufs["q"].data_ptr(), e.bufs["h0"].data_ptr()))
    assert len({q for q, _ in by_tb[64]}) == 1 and len({h for _, h in by_tb[64]}) == 3
    # batch rows, no cu_seqlens (each row a sequence)
    xs, kw = _graph_inputs(30, B=3)
    (o, s), (o2, s2) = _padded_vs_direct(graphs, xs, kw)
    assert o.shape == (3, 30, 2, 4) and torch.equal(o, o2) and torch.equal(s, s2)
    # no final state asked for, no initial state
    xs, kw = _graph_inputs(70, N=2)
    kw.update(initial_state=None, output_final_state=False)
    (o, s), (o2, s2) = _padded_vs_direct(graphs, xs, kw, [35, 35])
    assert s is None and s2 is None and torch.equal(o, o2)
    assert graphs.stats == {"replays": 0, "captures": 0, "eager": 4 + 1 + 1}


def test_chunk_graphs_declines_what_it_cannot_take(monkeypatch):
    """Calls past the buckets, packed calls without a host copy of cu_seqlens and initial states of another
    sequence count go back to the caller (None) untouched; bad limits are refused."""
    import openk3.fast.kda as FK

    monkeypatch.setattr(FK, "_chunk_kda", _stand_in_chunk)
    graphs = FK.ChunkGraphs(max_tokens=100, max_seqs=4, min_tokens=16, capture=False)
    assert graphs.max_tokens == 128 and graphs.bucket(128, 4) == (128, 4) and graphs.bucket(129, 1) is None
    assert graphs.bucket(10, 5) is None and graphs.bucket(0, 1) is None
    xs, kw = _graph_inputs(200, N=1)
    assert graphs.run(*xs, {**kw, "cu_seqlens": torch.tensor([0, 200])}, torch.tensor([0, 200])) is None
    xs, kw = _graph_inputs(20, N=5)
    cu = torch.tensor([0, 4, 8, 12, 16, 20])
    assert graphs.run(*xs, {**kw, "cu_seqlens": cu}, cu) is None  # 5 sequences > 4
    xs, kw = _graph_inputs(20, N=2)
    cu = torch.tensor([0, 4, 20])
    assert graphs.run(*xs, {**kw, "cu_seqlens": cu}, None) is None  # no host copy: no sync to read it
    assert graphs.run(*xs, {**kw, "cu_seqlens": cu, "initial_state": kw["initial_state"][:1]}, cu) is None
    assert not graphs.entries and graphs.stats == {"replays": 0, "captures": 0, "eager": 4}
    gpu = FK.ChunkGraphs(
        max_tokens=100
    )  # capturing needs CUDA tensors (a CPU call is not a prefill chunk call)
    assert gpu.run(*xs, {**kw, "cu_seqlens": cu}, cu) is None and gpu.stats["eager"] == 0
    for bad in (dict(max_tokens=0), dict(max_tokens=8, max_seqs=0), dict(max_tokens=8, min_tokens=0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            FK.ChunkGraphs(**bad)


def test_kda_core_takes_chunk_graphs_only_inside_the_scope(monkeypatch):
    """kda_core_fla hands an inference chunk call to the runner of this thread's ``chunk_graphs`` scope: not outside
    it, not from another thread, not with autograd, not for the short calls of the token-recurrent kernel."""
    import threading

    import openk3.fast.kda as FK
    from openk3.config import get_preset
    from openk3.modules.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(get_preset("tiny"), 0)
    H, Kd = layer.num_heads, layer.head_dim
    seen = []
    monkeypatch.setattr(
        FK, "_chunk_kda", lambda q, *a, **k: seen.append(("eager chunk", q.shape[1])) or (q, None)
    )
    monkeypatch.setattr(
        FK, "_fused_recurrent_kda", lambda q, *a, **k: seen.append(("recurrent", q.shape[1])) or (q, None)
    )

    class Runner:
        def run(self, q, k, v, g, beta, kw, cu_cpu=None):
            seen.append(("graph", q.shape[1], kw["output_final_state"], cu_cpu))
            return "graph"

    def call(T, grad=False):
        xs = [torch.randn(1, T, H, Kd, requires_grad=grad) for _ in range(4)]
        beta = torch.randn(1, T, H)
        with torch.set_grad_enabled(grad):
            return FK.kda_core_fla(
                layer, *xs, beta, initial_state=None, output_final_state=True, cu_seqlens=None
            )

    T = FK.RECURRENT_MAX_LEN + 1
    runner = Runner()
    with FK.chunk_graphs(runner):
        assert call(T) == "graph"
        call(T, grad=True)
        call(FK.RECURRENT_MAX_LEN)
        box = []
        t = threading.Thread(target=lambda: box.append(getattr(FK._ACTIVE, "graphs", None)))
        t.start()
        t.join()
        assert box == [None]
        with FK.chunk_graphs(None):
            assert getattr(FK._ACTIVE, "graphs", None) is None
            call(T)
        assert FK._ACTIVE.graphs is runner
    assert getattr(FK._ACTIVE, "graphs", None) is None
    call(T)
    assert seen == [
        ("graph", T, True, None),
        ("eager chunk", T),
        ("recurrent", T - 1),
        ("eager chunk", T),
        ("eager chunk", T),
    ]
