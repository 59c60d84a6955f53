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
