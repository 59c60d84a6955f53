"""The "norm" and "conv" ops (RMSNorm + KDA gated output norm, KDA short conv): backend resolution, the module
hooks, model.set_backend, CPU always on the reference, and fla's conv-state layout conversion (pure torch)."""

import pytest
import torch

import openk3.fast  # noqa: F401  (registers the fast backends; they report unavailable here)
from openk3 import K3ForCausalLM
from openk3.config import get_preset
from openk3.fast.conv import conv_state_from_fla, conv_state_to_fla
from openk3.modules import kda as kda_mod
from openk3.modules import norm as norm_mod
from openk3.ops import backend
from openk3.ops.conv import causal_conv1d
from openk3.ops.norm import gated_rms_norm, rms_norm


def _tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("tiny")).eval()


def test_ops_registered_with_fla_backend():
    assert "norm" in backend.OPS and "conv" in backend.OPS
    for op in ("norm", "conv"):
        assert backend.names(op)[0] == "fla" and "reference" in backend.names(op)
    d = backend.describe(is_cuda=False)
    assert d["norm"]["chosen"] == "reference" and d["conv"]["chosen"] == "reference"
    assert set(d["norm"]["backends"]) == {"fla", "reference"}


@pytest.mark.parametrize("op", ["norm", "conv"])
def test_resolution_env_override_and_notice(op, capsys, monkeypatch):
    monkeypatch.delenv(f"OPENK3_BACKEND_{op.upper()}", raising=False)
    assert backend.resolve(op, is_cuda=False) == "reference"
    # fla unusable here (not installed, or no CUDA device): CUDA inputs fall back with one line, once
    monkeypatch.setattr(backend, "_NOTICED", set())
    ok, why = backend._REGISTRY[op][0].available()
    assert not ok and why
    assert backend.resolve(op, is_cuda=True) == "reference"
    assert backend.resolve(op, is_cuda=True) == "reference"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"openk3: {op} uses the reference path on CUDA" in err[0] and why in err[0]
    # forcing the unavailable fast path is an error that says why; the environment forces as well
    with pytest.raises(RuntimeError, match="not available"):
        backend.resolve(op, is_cuda=True, requested="fla")
    monkeypatch.setenv(f"OPENK3_BACKEND_{op.upper()}", "fla")
    with pytest.raises(RuntimeError, match="not available"):
        backend.resolve(op, is_cuda=False)
    monkeypatch.setenv(f"OPENK3_BACKEND_{op.upper()}", "reference")
    assert backend.resolve(op, is_cuda=True) == "reference"
    monkeypatch.setenv(f"OPENK3_BACKEND_{op.upper()}", "nope")
    with pytest.raises(ValueError, match="unknown backend"):
        backend.resolve(op, is_cuda=False)


def test_cpu_model_never_calls_fast_hooks(monkeypatch):
    """auto on CPU tensors = reference, even with fast hooks present (they would raise here)."""
    m = _tiny()
    ids = torch.randint(0, m.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = m(ids).logits

    def boom(*a, **k):
        raise AssertionError("fast path called on CPU")

    monkeypatch.setitem(norm_mod.FAST_RMS_NORM, "fla", boom)
    monkeypatch.setitem(norm_mod.FAST_GATED_NORM, "fla", boom)
    monkeypatch.setitem(kda_mod.FAST_CONV, "fla", boom)
    monkeypatch.delenv("OPENK3_BACKEND_NORM", raising=False)
    monkeypatch.delenv("OPENK3_BACKEND_CONV", raising=False)
    with torch.no_grad():
        got = m(ids).logits
    assert torch.equal(got, want)


def test_set_backend_norm_and_conv():
    m = _tiny()
    norms = [x for x in m.modules() if isinstance(x, norm_mod.RMSNorm)]
    kdas = [x for x in m.modules() if isinstance(x, kda_mod.KimiDeltaAttention)]
    assert norms and kdas
    m.set_backend("norm", "reference")
    assert all(x.backend == "reference" for x in norms) and all(x.norm_backend == "reference" for x in kdas)
    assert all(x.conv_backend is None and x.backend is None for x in kdas)  # other ops untouched
    m.set_backend("conv", "reference")
    assert all(x.conv_backend == "reference" for x in kdas)
    m.set_backend("norm", None)
    m.set_backend("conv", None)
    assert all(x.backend is None for x in norms)
    assert all(x.norm_backend is None and x.conv_backend is None for x in kdas)
    with pytest.raises(ValueError, match="unknown op"):
        m.set_backend("conv2d", "reference")


def test_hooks_route_prefill_and_cached_decode(monkeypatch, rel):
    """A fast backend registered for CPU tensors receives every norm / gated norm / conv call -- including the cached
    single-token steps with the conv state -- and gives the reference's logits when it computes the same thing."""
    calls = {"rms": 0, "gated": 0, "conv": 0, "conv_with_state": 0}

    def rms(x, w, eps):
        calls["rms"] += 1
        return rms_norm(x, w, eps)

    def gated(x, w, g, eps):
        calls["gated"] += 1
        return gated_rms_norm(x, w, g, eps)

    def conv(x, w, *, initial_state=None, **kw):
        calls["conv"] += 1
        calls["conv_with_state"] += initial_state is not None
        return causal_conv1d(x, w, initial_state=initial_state, **kw)

    monkeypatch.setitem(norm_mod.FAST_RMS_NORM, "test_cpu", rms)
    monkeypatch.setitem(norm_mod.FAST_GATED_NORM, "test_cpu", gated)
    monkeypatch.setitem(kda_mod.FAST_CONV, "test_cpu", conv)
    for op in ("norm", "conv"):
        backend.register(op, backend.Backend("test_cpu", lambda: (True, "test"), cuda_only=False))
    try:
        m = _tiny()
        ids = torch.randint(0, m.config.vocab_size, (2, 20))
        with torch.no_grad():
            ref_full = m(ids).logits
            assert sum(calls.values()) == 0
            m.set_backend("norm", "test_cpu")
            m.set_backend("conv", "test_cpu")
            full = m(ids).logits
            cache = m.new_cache()
            parts = [m(ids[:, :17], cache=cache).logits]
            for t in range(17, 20):
                parts.append(m(ids[:, t : t + 1], cache=cache).logits)
        assert torch.equal(full, ref_full)
        assert rel(torch.cat(parts, 1), full) < 2e-5
        n_kda = sum(isinstance(x, kda_mod.KimiDeltaAttention) for x in m.modules())
        assert calls["gated"] == 5 * n_kda and calls["conv"] == 15 * n_kda
        assert calls["conv_with_state"] == 9 * n_kda  # the 3 decode steps carry q/k/v conv state
        assert calls["rms"] > 0
    finally:
        for op in ("norm", "conv"):
            backend._REGISTRY[op] = [b for b in backend._REGISTRY[op] if b.name != "test_cpu"]


# --------------------------------------------------------------------------------------------------------------
# conv-state layout: ours [N, C, W-1] (previous inputs, oldest first) <-> fla's [N, C, W] (slot 0 never read)


def test_conv_state_layout_roundtrip_and_meaning():
    N, C, W, T = 3, 5, 4, 9
    ours = torch.randn(N, C, W - 1)
    fla = conv_state_to_fla(ours)
    assert fla.shape == (N, C, W) and fla.is_contiguous() and fla.dtype == ours.dtype
    assert torch.equal(fla[..., 0], torch.zeros(N, C))  # the slot fla's convolution never reads
    assert torch.equal(fla[..., 1:], ours)
    assert torch.equal(conv_state_from_fla(fla), ours)
    # fla's final state is the last W inputs of each sequence (slot w = token T-W+w): dropping slot 0 gives ours
    x = torch.randn(N, T, C)
    w = torch.randn(C, W)
    _, final = causal_conv1d(x, w, output_final_state=True)
    fla_final = x[:, T - W :].transpose(1, 2)
    assert torch.equal(conv_state_from_fla(fla_final), final)


def test_conv_state_to_fla_is_differentiable():
    s = torch.randn(2, 3, 3, requires_grad=True)
    g = torch.randn(2, 3, 4)
    (conv_state_to_fla(s) * g).sum().backward()
    assert torch.equal(s.grad, g[..., 1:])


def test_fla_tap_order_matches_reference():
    """fla convolves y[t] = sum_w weight[:, w] * x[t - (W-1) + w] (state slot w = input W-w steps back, weight
    [C, W]); written out here in torch with the fla layout, it must equal our reference with converted states."""
    N, C, W, T = 2, 4, 4, 6
    x = torch.randn(N, T, C)
    w = torch.randn(C, W)
    h0 = torch.randn(N, C, W - 1)
    h_fla = conv_state_to_fla(h0)
    hist = torch.cat([h_fla, x.transpose(1, 2)], dim=-1)  # [N, C, W + T]: position p = token p - W
    y = torch.stack([(hist[..., t + 1 : t + 1 + W] * w).sum(-1) for t in range(T)], dim=1)
    fla_final = hist[..., T : T + W]
    want, final = causal_conv1d(x, w, initial_state=h0, activation=None, output_final_state=True)
    assert torch.allclose(y, want, atol=1e-6)
    assert torch.equal(conv_state_from_fla(fla_final), final)


def test_glu_op_hook_and_set_backend(monkeypatch):
    """The "glu" op: every dense gated FFN (layer-0 FFN, shared experts) calls the registered fast activation when
    its backend is chosen, with the reference's arguments; set_backend reaches every GLUMLP; CPU auto = reference."""
    from openk3.modules import ffn as ffn_mod
    from openk3.ops.activations import glu_act

    assert "glu" in backend.OPS and backend.names("glu")[0] == "triton"
    assert backend.describe(is_cuda=False)["glu"]["chosen"] == "reference"
    seen = []

    def fake(g, u, kind, b1, b2):
        seen.append((tuple(g.shape), kind, b1, b2))
        return glu_act(g, u, kind, b1, b2)

    monkeypatch.setitem(ffn_mod.FAST_GLU, "test_cpu", fake)
    backend.register("glu", backend.Backend("test_cpu", lambda: (True, "test"), cuda_only=False))
    try:
        m = _tiny()
        ids = torch.randint(0, m.config.vocab_size, (2, 9))
        with torch.no_grad():
            ref = m(ids).logits
            assert not seen
            m.set_backend("glu", "test_cpu")
            mlps = [x for x in m.modules() if isinstance(x, ffn_mod.GLUMLP)]
            assert mlps and all(x.backend == "test_cpu" for x in mlps)
            out = m(ids).logits
        assert torch.equal(out, ref)
        assert len(seen) == len(mlps)
        cfg = m.config
        assert all(k == cfg.hidden_act and b1 == cfg.activation_situ_beta for _, k, b1, _ in seen)
        m.set_backend("glu", None)
        assert all(x.backend is None for x in mlps)
    finally:
        backend._REGISTRY["glu"] = [b for b in backend._REGISTRY["glu"] if b.name != "test_cpu"]
