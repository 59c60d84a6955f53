"""openk3's KDA references against fla-core's own pure-PyTorch ones (``fla.ops.kda.naive`` and the gate
references in ``fla.ops.kda.gate``): fla is where KDA was published, and these run on a CPU. Forward outputs,
final states and every input gradient, fresh random inputs, per-tensor relative errors."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import kda_chunk, kda_gate, kda_recurrent

with warnings.catch_warnings():  # fla warns that Triton has no GPU here; only its PyTorch references are used
    warnings.simplefilter("ignore")
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    fla_gate = pytest.importorskip("fla.ops.kda.gate")

B, H, K, V = 2, 3, 32, 16


def _inputs(T: int, seed: int, *, kind: str = "lowerbound"):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    z = torch.randn(B, T, H, K, generator=g)
    A_log = torch.empty(H).uniform_(0, 2.7, generator=g)
    dt_bias = 0.5 * torch.randn(H * K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    s0 = 0.3 * torch.randn(B, H, K, V, generator=g)
    gate = kda_gate(z, A_log, dt_bias, kind=kind)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("lower_bound", [-5.0, -1.5])
def test_lowerbound_gate_matches_fla(rel, lower_bound):
    g = torch.Generator().manual_seed(1)
    z = 3 * torch.randn(4, 7, H, K, generator=g)
    A_log = torch.randn(H, generator=g)
    dt_bias = torch.randn(H * K, generator=g)
    want = fla_gate.naive_kda_lowerbound_gate(z, A_log, dt_bias, lower_bound=lower_bound)
    got = kda_gate(z, A_log, dt_bias, kind="lowerbound", lower_bound=lower_bound)
    assert rel(got, want) < 1e-6
    assert got.max() < 0 and got.min() > lower_bound


def test_softplus_gate_matches_fla(rel):
    g = torch.Generator().manual_seed(2)
    z = 3 * torch.randn(4, 7, H, K, generator=g)
    A_log = torch.randn(H, generator=g)
    dt_bias = torch.randn(H * K, generator=g)
    want = fla_gate.naive_kda_gate(z, A_log, dt_bias)
    assert rel(kda_gate(z, A_log, dt_bias, kind="softplus"), want) < 1e-6
    # without a bias
    assert rel(kda_gate(z, A_log, None, kind="softplus"), fla_gate.naive_kda_gate(z, A_log, None)) < 1e-6


@pytest.mark.parametrize("kind", ["lowerbound", "softplus"])
@pytest.mark.parametrize("T", [1, 37, 128])
def test_recurrence_matches_fla_forward_and_state(rel, kind, T):
    q, k, v, g, beta, s0 = _inputs(T, seed=T, kind=kind)
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    for name, fn, kw in [
        ("recurrent", kda_recurrent, {}),
        ("chunk64", kda_chunk, {"chunk_size": 64}),
        ("chunk16", kda_chunk, {"chunk_size": 16}),
    ]:
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=False, **kw)
        assert rel(o, o_ref) < 2e-5, name
        assert rel(s, s_ref) < 2e-5, name
    if T % 64 == 0:  # fla's chunked reference needs whole chunks
        o_c, s_c = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=False)
        assert rel(o, o_c) < 2e-5 and rel(s, s_c) < 2e-5


def test_l2norm_and_scale_match_fla_on_prenormalised_inputs(rel):
    # openk3 normalises q / k itself (use_qk_l2norm, eps 1e-6); fla's reference takes them normalised
    q, k, v, g, beta, s0 = _inputs(40, seed=5)
    q_raw, k_raw = 2.5 * q, 0.7 * k
    o_ref, s_ref = fla_naive.naive_recurrent_kda(
        q, k, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True
    )
    o, s = kda_chunk(q_raw, k_raw, v, g, beta, scale=0.3, initial_state=s0, output_final_state=True)
    assert rel(o, o_ref) < 2e-5 and rel(s, s_ref) < 2e-5


def test_packed_sequences_match_fla_per_sequence(rel):
    lens = [5, 64, 1, 30]
    T = sum(lens)
    q, k, v, g, beta, _ = _inputs(T, seed=9)
    q, k, v, g, beta = (x[:1] for x in (q, k, v, g, beta))
    s0 = 0.3 * torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(10))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    o, s = kda_chunk(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=False
    )
    for i in range(len(lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        o_i, s_i = fla_naive.naive_recurrent_kda(
            *(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=s0[i : i + 1], output_final_state=True
        )
        assert rel(o[:, a:b], o_i) < 2e-5, i
        assert rel(s[i : i + 1], s_i) < 2e-5, i


@pytest.mark.parametrize("fn", ["recurrent", "chunk"])
def test_gradients_match_fla(rel, fn):
    T = 45
    q, k, v, _, beta, s0 = _inputs(T, seed=11)
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.empty(H).uniform_(0, 2.7, generator=gen)
    dt_bias = 0.5 * torch.randn(H * K, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    ds = torch.randn(B, H, K, V, generator=gen)

    def run(ours: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, z, A_log, dt_bias, beta, s0)]
        q_, k_, v_, z_, a_, d_, b_, s_ = leaves
        if ours:
            g_ = kda_gate(z_, a_, d_, kind="lowerbound")
            f = kda_recurrent if fn == "recurrent" else kda_chunk
            o, s = f(q_, k_, v_, g_, b_, initial_state=s_, output_final_state=True, use_qk_l2norm=False)
        else:
            g_ = fla_gate.naive_kda_lowerbound_gate(z_, a_, d_, lower_bound=-5.0)
            o, s = fla_naive.naive_recurrent_kda(
                q_, k_, v_, g_, b_, initial_state=s_, output_final_state=True
            )
        ((o * do).sum() + (s * ds).sum()).backward()
        return [t.grad for t in leaves]

    names = ["q", "k", "v", "z", "A_log", "dt_bias", "beta", "initial_state"]
    for name, got, want in zip(names, run(True), run(False)):
        assert rel(got, want) < 1e-4, name
