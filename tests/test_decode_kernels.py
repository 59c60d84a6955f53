"""Triton decode kernels (openk3.infer.kernels) against the PyTorch references of openk3.infer.decode.

Without CUDA the kernels run under the Triton interpreter on CPU at small sizes. The interpreter must be chosen
before ``triton`` is first imported, so on such a machine :func:`test_interpreted` re-runs this file in a
subprocess with ``TRITON_INTERPRET=1`` (and the kernel tests here skip); run
``TRITON_INTERPRET=1 python -m pytest tests/test_decode_kernels.py`` to see them individually. With CUDA they run
compiled, and the ``gpu``-marked tests add model-sized shapes and CUDA-graph capture.

Every check draws fresh random inputs (never zeros), compares per tensor by ``||got - want|| / ||want||`` in fp64
(NaN never passes), and checks that rows the step must not touch (other slots, other pages) are bit-identical
afterwards. Padded rows (scratch slot / scratch page, duplicated) are excluded from comparisons.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import types
import zlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.6.0)")

import openk3.infer.kernels as KN  # noqa: E402
from openk3.infer.decode import (  # noqa: E402
    kda_decode_reference,
    mla_decode_reference,
    mla_post_reference,
    mla_prep_reference,
)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = CUDA or KN.INTERPRET
here = pytest.mark.skipif(not RUN_HERE, reason="no CUDA: runs under TRITON_INTERPRET=1 in test_interpreted")


# test_interpreted's shards (-k expressions; together every test of this file): each a few minutes under the
# interpreter on a 2-core machine, so that pytest-xdist's workers share them (the whole file in one subprocess took
# ~9-14 min, the suite's longest test)
_SAMPLING = "kda or sample or gumbel or logprobs"
INTERPRETED_SHARDS = {
    "kda-sampling": _SAMPLING,
    "mla-persist-engine": "mla_persist or engine_mla_glue",
    "mla-rest": f"not ({_SAMPLING} or mla_persist or engine_mla_glue)",
}


@pytest.mark.parametrize("shard", list(INTERPRETED_SHARDS))
def test_interpreted(shard):
    """CPU only: this file's kernel tests (one shard of them) in a subprocess under the Triton interpreter."""
    if RUN_HERE:
        pytest.skip("kernel tests run directly in this process")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(root, "src"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    cmd += ["-k", INTERPRETED_SHARDS[shard]]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    print(tail)
    assert r.returncode == 0, f"interpreted kernel tests failed:\n{tail}"
    assert " passed" in r.stdout and "failed" not in r.stdout


@contextlib.contextmanager
def poisoned_empty():
    """Floating-point ``torch.empty`` returns NaN-filled memory while the kernels run, so an output element the
    kernels fail to write shows up as NaN (the checks reject non-finite values)."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    err = float((a - b).norm() / b.norm().clamp_min(1e-300))
    print(f"relerr {name} = {err:.3e} (tol {tol:.1e})")
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.1e}"
    return err


# ---------------------------------------------------------------------------------------------------------- KDA
def make_kda_layer(H: int, K: int, W: int, gate_kind: str, gen: torch.Generator):
    """Stand-in for KimiDeltaAttention carrying exactly what the decode step reads (random parameters)."""
    HK = H * K

    def rnd(*shape, s=1.0, base=0.0):
        return (base + s * torch.randn(*shape, generator=gen)).to(DEV)

    def conv():
        return types.SimpleNamespace(weight=rnd(HK, 1, W, s=0.5))

    return types.SimpleNamespace(
        q_conv1d=conv(),
        k_conv1d=conv(),
        v_conv1d=conv(),
        A_log=rnd(K, s=0.5),  # zero-padded-to-head_dim style: only the first H entries are used
        dt_bias=rnd(HK, s=0.5),
        o_norm=types.SimpleNamespace(weight=rnd(K, s=0.2, base=1.0)),
        gate_kind=gate_kind,
        lower_bound=-5.0,
        eps=1e-5,
        num_heads=H,
        head_dim=K,
    )


def run_kda_case(
    B, H, K, W, S, dtype, gate_kind, bv, seed, tol_o, tol_s, num_warps=None, stages=None, lowrank=0, gate_rank=0,
    **extra,
):  # fmt: skip
    """``lowrank`` R > 0: the decay projection is given to the kernel as its low-rank activation [B, R] (the kernel
    applies ``f_b_proj``); the reference gets ``z = f_b_proj(activation)`` in the model dtype. ``gate_rank``: the
    same for the output gate (``g_b_proj``)."""
    gen = torch.Generator().manual_seed(seed)
    HK = H * K
    layer = make_kda_layer(H, K, W, gate_kind, gen)

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen)).to(DEV)

    q, k, v, z, gate = (rnd(B, HK).to(dtype) for _ in range(5))
    z = (z.float() * 2).to(dtype)  # exercise both tails of the gates
    lr = {}
    if lowrank:
        layer.f_b_proj = types.SimpleNamespace(weight=rnd(HK, lowrank, s=2 * lowrank**-0.5).to(dtype))
        fa = rnd(B, lowrank).to(dtype)
        z = torch.nn.functional.linear(fa, layer.f_b_proj.weight)
        lr = {"z_lowrank": fa}
    if gate_rank:
        layer.g_b_proj = types.SimpleNamespace(weight=rnd(HK, gate_rank, s=2 * gate_rank**-0.5).to(dtype))
        ga = rnd(B, gate_rank).to(dtype)
        gate = torch.nn.functional.linear(ga, layer.g_b_proj.weight)
        lr = {**lr, "gate_lowrank": ga}
    beta_logits = rnd(B, H, s=2.0).to(dtype)
    conv_state = rnd(S + 1, 3, HK, W - 1)
    state = rnd(S + 1, H, K, K, s=0.3)
    # real rows on distinct slots (scratch slot = S), padded rows duplicated on the scratch slot
    n_real = max(1, B - 2)
    real = torch.randperm(S, generator=gen)[:n_real]
    slots = torch.cat([real, torch.full((B - n_real,), S)]).to(DEV)
    perm = torch.randperm(B, generator=gen).to(DEV)  # padded rows anywhere in the batch
    slots = slots[perm]
    is_real = slots != S

    c1, s1 = conv_state.clone(), state.clone()
    c2, s2 = conv_state.clone(), state.clone()
    with poisoned_empty():
        o1 = KN.kda_decode_triton(
            layer, q, k, v, None if lowrank else z, beta_logits, None if gate_rank else gate, c1, s1, slots, BV=bv,
            num_warps=num_warps, stages=stages, **extra, **lr,
        )  # fmt: skip
    assert torch.isfinite(o1).all(), "kda: output not fully written"
    o2 = kda_decode_reference(layer, q, k, v, z, beta_logits, gate, c2, s2, slots)
    assert o1.dtype == dtype and o1.shape == (B, HK)
    tag = (
        f"kda B={B} H={H} K={K} W={W} {dtype} {gate_kind} BV={bv} stages={stages} {extra} lowrank={lowrank}/"
        f"{gate_rank}"
    )
    errs = {"o": check(f"{tag} o", o1[is_real], o2[is_real], tol_o)}
    rs = slots[is_real]
    errs["state"] = check(f"{tag} state", s1[rs], s2[rs], tol_s)
    assert torch.equal(c1[rs], c2[rs]), f"{tag}: conv history differs"
    untouched = torch.ones(S + 1, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(s1[untouched], state[untouched]), f"{tag}: other slots' state changed"
    assert torch.equal(c1[untouched], conv_state[untouched]), f"{tag}: other slots' conv history changed"
    return errs


KDA_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 2e-3)}


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_kind", ["lowerbound", "softplus"])
@pytest.mark.parametrize("bv", [0, 16, 8], ids=["head", "tiles", "tiles8"])
def test_kda_decode(dtype, gate_kind, bv):
    """One program per (row, head) walking the state in tiles of BV columns (0: the whole head)."""
    seed = seed_of(str(dtype), gate_kind, bv)
    run_kda_case(6, 2, 32, 4, 9, dtype, gate_kind, bv, seed, *KDA_TOL[dtype])


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bv,stages", [(16, 3), (8, 2), (8, 4)])
def test_kda_decode_pipelined(dtype, bv, stages):
    """The plain-loop form (tile loads streamed by Triton's pipeliner, ``stages`` >= 2)."""
    seed = seed_of(str(dtype), "pipelined", bv, stages)
    run_kda_case(6, 2, 32, 4, 9, dtype, "lowerbound", bv, seed, *KDA_TOL[dtype], stages=stages)


@here
def test_kda_decode_few_rows_config(monkeypatch):
    """KDA_CONFIG["few"]: batches of at most few_max_batch rows launch with those parameters (and stay exact)."""
    monkeypatch.setitem(KN.KDA_CONFIG, "few", {"BV": 8, "stages": 2, "num_warps": 2})
    monkeypatch.setitem(KN.KDA_CONFIG, "few_max_batch", 4)
    run_kda_case(3, 2, 32, 4, 5, torch.float32, "lowerbound", None, 31, *KDA_TOL[torch.float32])
    flags = {
        "l2_prefetch": KN.KDA_CONFIG["l2_prefetch"] and not KN.INTERPRET,
        "heads_fast": KN.KDA_CONFIG["heads_fast"],
        "lowrank": 0,
        "gate_lowrank": 0,
        "pdl": KN.pdl_on(torch.empty(0, device=DEV)),
    }
    assert KN.KDA_LAST_LAUNCH == {"BV": 8, "num_warps": 2, "stages": 2, "split_v": 0, **flags}
    run_kda_case(6, 2, 32, 4, 9, torch.float32, "lowerbound", None, 32, *KDA_TOL[torch.float32])
    default = KN.KDA_CONFIG
    assert KN.KDA_LAST_LAUNCH == {
        "BV": min(default["BV"] or 32, 32),
        "num_warps": default["num_warps"],
        "stages": default["stages"],
        "split_v": 0,
        **flags,
    }


@here
@pytest.mark.parametrize("l2_prefetch", [False, True], ids=["nopf", "pf"])
@pytest.mark.parametrize("heads_fast", [False, True], ids=["rows", "heads"])
def test_kda_decode_launch_flags(l2_prefetch, heads_fast):
    """The grid order and the L2 prefetch of the state (a no-op under the interpreter, which has no inline
    assembly: the launch record says so) leave the results exact."""
    seed = seed_of("flags", l2_prefetch, heads_fast)
    for bv in (0, 8):
        run_kda_case(
            5, 3, 32, 4, 7, torch.float32, "lowerbound", bv, seed + bv, *KDA_TOL[torch.float32],
            l2_prefetch=l2_prefetch, heads_fast=heads_fast,
        )  # fmt: skip
        assert KN.KDA_LAST_LAUNCH["heads_fast"] is heads_fast
        assert KN.KDA_LAST_LAUNCH["l2_prefetch"] is (l2_prefetch and not KN.INTERPRET)


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank,gate_rank", [(16, 0), (64, 0), (0, 32), (32, 16)])
def test_kda_decode_lowrank(dtype, rank, gate_rank):
    """z_lowrank / gate_lowrank: the kernel forms the decay projection f_b_proj(activation) and / or the output
    gate g_b_proj(activation) itself (whole-head and tiled walks, both decay gates)."""
    for bv, gate_kind in ((0, "lowerbound"), (8, "softplus")):
        seed = seed_of(str(dtype), "lowrank", rank, gate_rank, bv)
        run_kda_case(
            5, 2, 32, 4, 7, dtype, gate_kind, bv, seed, *KDA_TOL[dtype], lowrank=rank, gate_rank=gate_rank
        )
        assert (KN.KDA_LAST_LAUNCH["lowrank"], KN.KDA_LAST_LAUNCH["gate_lowrank"]) == (rank, gate_rank)


def test_kda_decode_lowrank_refusals():
    gen = torch.Generator().manual_seed(3)
    layer = make_kda_layer(2, 16, 4, "lowerbound", gen)
    z = torch.zeros(1, 32, device=DEV)
    args = (z, z, z)
    tail = (torch.zeros(1, 2, device=DEV), z, torch.zeros(2, 3, 32, 3, device=DEV),
            torch.zeros(2, 2, 16, 16, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV))  # fmt: skip
    with pytest.raises(ValueError, match="no 2-D f_b_proj"):
        KN.kda_decode_triton(layer, *args, None, *tail, z_lowrank=torch.zeros(1, 16, device=DEV))
    layer.f_b_proj = types.SimpleNamespace(weight=torch.zeros(32, 24, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        KN.kda_decode_triton(layer, *args, None, *tail, z_lowrank=torch.zeros(1, 24, device=DEV))
    with pytest.raises(ValueError, match="does not match"):
        KN.kda_decode_triton(layer, *args, None, *tail, z_lowrank=torch.zeros(1, 16, device=DEV))
    with pytest.raises(ValueError, match="exactly one"):
        KN.kda_decode_triton(layer, *args, z, *tail, z_lowrank=torch.zeros(1, 24, device=DEV))
    with pytest.raises(ValueError, match="exactly one"):
        KN.kda_decode_triton(layer, *args, None, *tail)
    bl, gate, *rest = tail
    with pytest.raises(ValueError, match="exactly one of gate and gate_lowrank"):
        KN.kda_decode_triton(layer, *args, z, bl, None, *rest)
    with pytest.raises(ValueError, match="no 2-D g_b_proj"):
        KN.kda_decode_triton(layer, *args, z, bl, None, *rest, gate_lowrank=torch.zeros(1, 16, device=DEV))


def test_kda_decode_bad_stages():
    layer = make_kda_layer(2, 16, 4, "lowerbound", torch.Generator().manual_seed(0))
    z = torch.zeros(1, 32, device=DEV)
    with pytest.raises(ValueError, match="stages"):
        KN.kda_decode_triton(
            layer, z, z, z, z, torch.zeros(1, 2, device=DEV), z, torch.zeros(2, 3, 32, 3, device=DEV),
            torch.zeros(2, 2, 16, 16, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV), BV=8, stages=1,
        )  # fmt: skip


@here
def test_kda_decode_short_conv_and_single_row():
    """Conv width 3 (history 2, padded tap tile) and a batch of one real row."""
    run_kda_case(1, 2, 16, 3, 3, torch.bfloat16, "lowerbound", 0, 11, *KDA_TOL[torch.bfloat16])
    run_kda_case(3, 2, 16, 2, 4, torch.float32, "softplus", 4, 12, *KDA_TOL[torch.float32])
    run_kda_case(1, 2, 16, 3, 3, torch.bfloat16, "lowerbound", 8, 13, *KDA_TOL[torch.bfloat16])


@here
def test_kda_decode_two_steps():
    """Two consecutive steps: the second reads the history and state the first wrote."""
    gen = torch.Generator().manual_seed(5)
    B, H, K, W, S = 4, 2, 16, 4, 5
    layer = make_kda_layer(H, K, W, "lowerbound", gen)
    conv_state = torch.randn(S + 1, 3, H * K, W - 1, generator=gen).to(DEV)
    state = (0.3 * torch.randn(S + 1, H, K, K, generator=gen)).to(DEV)
    slots = torch.tensor([2, 0, 4, 1], device=DEV)
    c1, s1, c2, s2 = conv_state.clone(), state.clone(), conv_state.clone(), state.clone()
    for step in range(2):
        ins = [torch.randn(B, H * K, generator=gen).to(DEV) for _ in range(5)]
        bl = torch.randn(B, H, generator=gen).to(DEV)
        o1 = KN.kda_decode_triton(layer, *ins[:4], bl, ins[4], c1, s1, slots, BV=8)
        o2 = kda_decode_reference(layer, *ins[:4], bl, ins[4], c2, s2, slots)
        check(f"step {step} o", o1, o2, 1e-5)
    check("state", s1, s2, 1e-6)
    assert torch.equal(c1, c2)


def split_counters_zero() -> bool:
    """Every arrival counter of the split KDA form is back at zero."""
    return all(int(c.abs().sum()) == 0 for c in KN._KDA_COUNTERS.values())


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nv", [2, 4])
def test_kda_decode_split(dtype, nv):
    """The split form (split_v programs per (row, head), the last to arrive normalises the head): one row; three
    real rows plus two padded rows duplicated on the scratch slot; full-rank and low-rank decay and gate, both decay
    gates. The arrival counters are back at zero after every call."""
    cases = [
        (1, "lowerbound", 0, 0),
        (5, "softplus", 16, 64),
        (5, "lowerbound", 64, 16),
        (1, "softplus", 0, 16),
    ]
    for B, gate_kind, rank, gate_rank in cases:
        seed = seed_of(str(dtype), "split", nv, B, gate_kind, rank, gate_rank)
        run_kda_case(
            B, 2, 32, 4, 7, dtype, gate_kind, None, seed, *KDA_TOL[dtype], lowrank=rank, gate_rank=gate_rank,
            split_v=nv,
        )  # fmt: skip
        launch = KN.KDA_LAST_LAUNCH
        assert (launch["split_v"], launch["BV"], launch["lowrank"], launch["gate_lowrank"]) == (
            nv,
            32 // nv,
            rank,
            gate_rank,
        )
        assert split_counters_zero()


@here
@pytest.mark.parametrize("nv", [2, 4])
def test_kda_decode_split_two_steps(nv):
    """The split form twice in a row on the same caches: the second step reads the conv history the first step's
    last arrivers shifted (q, k) and every program shifted (its v channels), and starts from counters at zero.
    Rows on distinct slots plus two padded rows sharing the scratch slot."""
    gen = torch.Generator().manual_seed(seed_of("split two steps", nv))
    B, H, K, W, S = 5, 2, 16, 4, 5
    layer = make_kda_layer(H, K, W, "lowerbound", gen)
    layer.f_b_proj = types.SimpleNamespace(weight=(0.5 * torch.randn(H * K, 16, generator=gen)).to(DEV))
    conv_state = torch.randn(S + 1, 3, H * K, W - 1, generator=gen).to(DEV)
    state = (0.3 * torch.randn(S + 1, H, K, K, generator=gen)).to(DEV)
    slots = torch.tensor([2, S, 0, S, 4], device=DEV)
    real = slots != S
    c1, s1, c2, s2 = conv_state.clone(), state.clone(), conv_state.clone(), state.clone()
    for step in range(2):
        q, k, v, gate = (torch.randn(B, H * K, generator=gen).to(DEV) for _ in range(4))
        fa = torch.randn(B, 16, generator=gen).to(DEV)
        bl = torch.randn(B, H, generator=gen).to(DEV)
        o1 = KN.kda_decode_triton(layer, q, k, v, None, bl, gate, c1, s1, slots, split_v=nv, z_lowrank=fa)
        assert KN.KDA_LAST_LAUNCH["split_v"] == nv and split_counters_zero()
        z = torch.nn.functional.linear(fa, layer.f_b_proj.weight)
        o2 = kda_decode_reference(layer, q, k, v, z, bl, gate, c2, s2, slots)
        check(f"split step {step} o", o1[real], o2[real], 1e-5)
        assert torch.isfinite(o1).all()
        rs = slots[real]
        assert torch.equal(c1[rs], c2[rs]), f"step {step}: conv history differs"
        check(f"split step {step} state", s1[rs], s2[rs], 1e-6)
    assert torch.equal(c1[1], conv_state[1]) and torch.equal(s1[3], state[3])  # slots no row uses


@here
def test_kda_decode_split_config(monkeypatch):
    """KDA_CONFIG["few"]["split_v"]: the split at one row, halved while B * H * NV exceeds split_programs_per_sm
    programs per SM; the per-head form once it would reach one program per head. The keyword is taken as given."""
    monkeypatch.setattr(KN, "_sm_count", lambda device: 4)
    monkeypatch.setitem(KN.KDA_CONFIG, "few", {**KN.KDA_CONFIG["few"], "split_v": 8})
    monkeypatch.setitem(KN.KDA_CONFIG, "split_programs_per_sm", 4)  # 16 programs
    monkeypatch.setitem(KN.KDA_CONFIG, "split_num_warps", 2)
    tol = KDA_TOL[torch.float32]
    for B, nv in ((1, 8), (2, 4), (3, 2), (5, 0)):
        run_kda_case(B, 2, 32, 4, 7, torch.float32, "lowerbound", None, seed_of("split cfg", B), *tol)
        assert KN.KDA_LAST_LAUNCH["split_v"] == nv, (B, KN.KDA_LAST_LAUNCH)
        if nv:
            assert KN.KDA_LAST_LAUNCH["num_warps"] == 2 and KN.KDA_LAST_LAUNCH["BV"] == 32 // nv
    run_kda_case(5, 2, 32, 4, 7, torch.float32, "lowerbound", None, 3, *tol, split_v=8)
    assert KN.KDA_LAST_LAUNCH["split_v"] == 8
    assert split_counters_zero()


def test_kda_decode_split_refusals():
    layer = make_kda_layer(2, 16, 4, "lowerbound", torch.Generator().manual_seed(0))
    z = torch.zeros(1, 32, device=DEV)
    args = (layer, z, z, z, z, torch.zeros(1, 2, device=DEV), z, torch.zeros(2, 3, 32, 3, device=DEV),
            torch.zeros(2, 2, 16, 16, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV))  # fmt: skip
    for bad in (3, -2, 32):
        with pytest.raises(ValueError, match="split_v"):
            KN.kda_decode_triton(*args, split_v=bad)
    with pytest.raises(ValueError, match="split_prefetch"):
        KN.kda_decode_triton(*args, split_v=2, split_prefetch=3)


# ------------------------------------------------------------------------------------------------- sampling
@here
@pytest.mark.parametrize("R,V", [(1, 10), (5, 4096), (3, 3000), (2, 1), (4, 1025)])
def test_gumbel_argmax_kernel(R, V):
    """The one-pass counter-based draw (Triton) against sampling.gumbel_argmax_reference: the same tokens (on a GPU
    up to fp32 near-ties of the two log implementations), never an excluded (-inf) token."""
    from openk3.infer.sampling import gumbel_argmax_reference, sample_keys

    gen = torch.Generator().manual_seed(seed_of("gumbel", R, V))
    x = (3 * torch.randn(R, V, generator=gen)).to(DEV)
    if V > 5:
        x[:, ::3] = float("-inf")
    keys = torch.tensor(sample_keys(range(100, 100 + R), [7] * R), device=DEV)
    got = KN.gumbel_argmax_triton(x, keys)
    want = gumbel_argmax_reference(x, keys)
    assert got.dtype == torch.long and got.shape == (R,)
    if V > 5:
        assert bool((got % 3 != 0).all()), got
    diff = got != want
    if bool(diff.any()):  # only where the two scores tie within fp32 rounding
        from openk3.infer.sampling import gumbel_scores

        sc = gumbel_scores(x, keys)
        gap = (sc.gather(1, want[:, None]) - sc.gather(1, got[:, None])).abs()
        assert bool((gap[diff] < 1e-4).all()), (got, want)
    assert not CUDA or diff.float().mean() <= 0.2
    if not CUDA:
        assert torch.equal(got, want)


@here
def test_gumbel_kernels_at_the_top_hash():
    """Tokens whose hash is the largest (the uniform that rounded to 1.0: +inf noise, so the token always won): the
    one-pass draw and the draw kernels of sample() pick the likely token, as the reference does."""
    from openk3.infer.sampling import sample
    from test_sampling import top_hash_hits

    V = 4096
    hits = top_hash_hits(V, 4)
    keys = [k for k, _ in hits]
    x = torch.full((len(hits), V), -30.0)
    likely = [(i + 1) % V for _, i in hits]
    for r, j in enumerate(likely):
        x[r, j] = 0.0
    x = x.to(DEV)
    want = torch.tensor(likely, device=DEV)
    assert torch.equal(KN.gumbel_argmax_triton(x, torch.tensor(keys, device=DEV)), want)
    got = sample(x, temperature=1.0, keys=keys, fast=True)
    assert torch.equal(got, want)
    assert torch.equal(sample(x, temperature=1.0, top_p=0.9, keys=keys, fast=True), want)


def _nucleus_mass_above(xs: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """Per row: the probability mass (of softmax(xs), xs already filtered) of the tokens strictly more likely than
    ``tok``, in fp64: a token is in the top-p set iff this is below p."""
    pr = torch.softmax(xs.double(), -1)
    xt = xs.gather(1, tok[:, None])
    return (pr * (xs > xt)).sum(-1)


def run_draw_case(
    B, V, dtype, temps, ks, ps, pens, seed, scale=3.0, seen_frac=0.0, ninf=False, step=0.0, min_p=0.0
):
    """:func:`openk3.infer.sampling.sample` with draw keys through the Triton kernels against the PyTorch path
    (sort-based top-p, the same Gumbel noise): the same token per row, except where the reference's own token lies
    within fp32 rounding of the top-p boundary. Returns (the tokens, the rows' filtered scaled logits)."""
    from openk3.infer.sampling import (
        apply_repetition_penalty,
        apply_temperature,
        min_p_filter,
        sample,
        sample_keys,
        top_k_filter,
    )

    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(B, V, generator=gen)).to(dtype)
    if step:  # logits on a coarse grid: runs of exactly equal values everywhere, the top-p boundary included
        x = (x / step).round() * step
    if ninf:
        x[:, 1::4] = float("-inf")
    seen = (torch.rand(B, V, generator=gen) < seen_frac).to(DEV) if seen_frac else None
    x = x.to(DEV)
    keys = sample_keys(range(seed, seed + B), [3] * B)
    kw = dict(
        temperature=temps, top_k=ks, top_p=ps, repetition_penalty=pens, seen=seen, keys=keys, min_p=min_p
    )
    with poisoned_empty():
        got = sample(x, fast=True, **kw)
    want = sample(x, fast=False, **kw)
    assert got.dtype == torch.long and got.shape == (B,)
    # the filtered, scaled logits of each row (greedy rows: penalised only), for the checks below
    per = (lambda v: [v] * B) if not isinstance(temps, list) else (lambda v: v)
    xp = x.float() if seen is None else apply_repetition_penalty(x, seen, pens)
    xs = apply_temperature(xp, temps)
    each = lambda v: v if isinstance(v, list) else [v] * B  # noqa: E731
    xs = min_p_filter(xs, [m if t > 0 else 0.0 for m, t in zip(each(min_p), each(temps))])
    kk = [k if 0 < k < V else V for k in (ks if isinstance(ks, list) else [ks] * B)]
    xs = top_k_filter(xs, torch.tensor(kk, device=DEV))
    diff = (got != want).cpu()
    if bool(diff.any()):
        pp = torch.tensor(ps if isinstance(ps, list) else [ps] * B, dtype=torch.float64)
        near = (_nucleus_mass_above(xs, want).cpu() - pp).abs() < 1e-5
        tmp = torch.tensor(per(temps)) if isinstance(temps, list) else torch.full((B,), float(temps))
        assert bool((near | (tmp <= 0))[diff].all()), (got, want)
        assert not CUDA or diff.float().mean() <= 0.05
    if not CUDA:
        assert torch.equal(got, want)
    return got, xs


@here
@pytest.mark.parametrize(
    "B,V,dtype,settings",
    [
        (4, 3000, torch.float32, "mixed"),
        (4, 3000, torch.bfloat16, "mixed-penalty"),
        (24, 2500, torch.float32, "small-p"),
        (2, 10, torch.float32, "tiny"),
        (3, 2049, torch.bfloat16, "greedy"),
        (5, 1025, torch.float32, "minus-inf"),
        (6, 3000, torch.float32, "ties"),
        (6, 3000, torch.float32, "min-p"),
        (5, 2500, torch.bfloat16, "min-p-penalty"),
    ],
)
def test_sample_kernels(B, V, dtype, settings):
    """The sorting-free keyed draw (three Triton kernels) against the sort-based PyTorch path: temperatures, top-k,
    top-p, repetition penalty, greedy rows mixed in, -inf logits; on small p most rows need the rejection rounds
    (checked here: the unfiltered pick is outside the nucleus), some the per-row rounds of the last kernel."""
    seed = seed_of("draw", B, V, settings)
    temps, ks, ps, pens, kw = [0.8, 0.0, 1.0, 2.0], [0, 0, 50, 0], [0.95, 1.0, 0.9, 0.3], 1.0, {}
    if settings == "mixed-penalty":
        pens, kw = [1.3, 1.2, 1.5, 1.1], {"seen_frac": 0.1}
    elif settings == "small-p":
        temps, ks, ps, kw = (
            [1.0] * B,
            [0] * (B - 4) + [7, 40, 0, 300],
            [0.02 + 0.04 * i for i in range(B)],
            {},
        )
        kw = {"scale": 0.5}
    elif settings == "tiny":
        temps, ks, ps = [1.0, 0.0], [3, 0], [0.5, 1.0]
    elif settings == "greedy":
        temps, ks, ps = [0.0] * B, 0, 1.0
    elif settings == "minus-inf":
        temps, ks, ps, kw = [1.0] * B, [0, 5, 0, 0, 2], [0.5, 0.7, 1.0, 1e-9, 0.99], {"ninf": True}
    elif settings == "ties":  # groups of equal logits straddle the boundary: kept together by both paths
        temps, ks, ps, kw = [1.0] * B, [0, 0, 30, 0, 0, 0], [0.1, 0.3, 0.5, 0.7, 0.9, 0.97], {"step": 0.5}
    elif settings == "min-p":  # alone, with top-k (the tighter bound wins either way), with top-p, greedy
        temps, ks, ps = [1.0, 0.7, 1.5, 1.0, 0.0, 2.0], [0, 0, 3, 400, 0, 0], [1.0, 1.0, 1.0, 0.6, 1.0, 0.9]
        kw = {"min_p": [0.3, 0.05, 0.01, 0.01, 0.5, 1.0]}
    elif settings == "min-p-penalty":  # the bound is taken on the penalised logits
        temps, ks, ps, pens = (
            [0.9] * B,
            [0, 20, 0, 0, 0],
            [1.0, 1.0, 0.8, 1.0, 1.0],
            [1.5, 1.2, 2.0, 1.0, 3.0],
        )
        kw = {"min_p": [0.2, 0.1, 0.05, 0.0, 0.4], "seen_frac": 0.2}
    got, xs = run_draw_case(B, V, dtype, temps, ks, ps, pens, seed, **kw)
    assert bool(torch.isfinite(xs.gather(1, got[:, None])).all()), "drew a token the filters exclude"
    if settings == "small-p":
        from openk3.infer.sampling import gumbel_scores, sample_keys

        keys = torch.tensor(sample_keys(range(seed, seed + B), [3] * B), device=DEV)
        sc = gumbel_scores(xs, keys)
        first = sc.argmax(-1)  # the first round's pick: not kept in most rows at these p
        pp = torch.tensor(ps, dtype=torch.float64)
        out1 = _nucleus_mass_above(xs, first).cpu() >= pp
        second = sc.masked_fill(xs <= xs.gather(1, first[:, None]), float("-inf")).argmax(-1)
        out2 = out1 & (_nucleus_mass_above(xs, second).cpu() >= pp)
        assert int(out1.sum()) >= B // 3 and int(out2.sum()) >= 1, (out1, out2)


@here
@pytest.mark.parametrize("N,V,k", [(3, 3000, 5), (2, 4096, 20), (4, 700, 0), (1, 10, 3), (2, 2049, 1)])
def test_logprobs_kernel(N, V, k):
    """The two-launch logprobs (chunk parts and top k, then the merge) against logsumexp + topk in PyTorch: the
    chosen tokens' values, the top values, and their ids (the same values where ids differ: ties)."""
    from openk3.infer.sample_kernels import logprobs_triton

    gen = torch.Generator().manual_seed(seed_of("logprobs", N, V, k))
    x = (3 * torch.randn(N, V, generator=gen)).to(torch.bfloat16).to(DEV)  # bf16: many exact ties
    x[:, ::7] = float("-inf")
    ids = (1 + 7 * torch.randint(0, (V - 2) // 7 + 1, (N,), generator=gen)).to(DEV)  # finite logits
    chosen, tv, ti = logprobs_triton(x, ids, k)
    lp = torch.log_softmax(x.float(), -1)
    check("chosen", chosen, lp.gather(1, ids[:, None])[:, 0], 1e-5)
    ref = lp.topk(k, dim=-1)
    assert tv.shape == (N, k) and ti.shape == (N, k) and ti.dtype == torch.long
    if k:
        check("top values", tv, ref.values, 1e-5)
        assert torch.allclose(lp.gather(1, ti), ref.values, rtol=0, atol=1e-5)
        assert bool((ti % 7 != 0).all()), "an excluded (-inf) token among the top"
        assert all(len(set(r)) == k for r in ti.tolist())  # k distinct tokens per row


@here
def test_sample_kernels_refusals():
    from openk3.infer.sample_kernels import sample_triton

    x = torch.randn(2, 8, device=DEV)
    par = torch.zeros(2, 4, device=DEV)
    keys = torch.zeros(2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="params"):
        sample_triton(x, par[:, :3].contiguous(), keys)
    with pytest.raises(ValueError, match="keys"):
        sample_triton(x, par, keys[:1])
    with pytest.raises(ValueError, match="lower"):
        sample_triton(x, par, keys, lower=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="seen"):
        sample_triton(x, par, keys, seen=torch.zeros(2, 7, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="logits"):
        sample_triton(x[0], par, keys)


@pytest.mark.gpu
@here
@pytest.mark.parametrize("B", [1, 7, 64])
def test_sample_kernels_gpu(B):
    """Model-sized vocabulary (163,840), the CLI's defaults and top-k / penalty rows."""
    V = 163840
    temps = [0.8] * B
    ps = [0.95 if i % 3 else 0.3 for i in range(B)]
    ks = [0 if i % 4 else 50 for i in range(B)]
    run_draw_case(B, V, torch.float32, temps, ks, ps, 1.0, seed_of("draw-gpu", B))
    run_draw_case(B, V, torch.bfloat16, [0.0] * B, 0, 1.0, 1.2, seed_of("draw-gpu-greedy", B), seen_frac=0.01)


# ---------------------------------------------------------------------------------------------------------- MLA
def run_mla_case(lengths, H, DC, DR, page_size, dtype, seed, tol, n_pad=1, poison=False, post=None, **kw):
    """Rows with ``lengths`` (row 1 shares its first pages with row 0, as after a prefix hit) plus ``n_pad`` padded
    rows (scratch page, length 1). ``poison``: every cache row that no token of the batch owns is NaN (the kernel
    must not let the unused rows of a row's last page reach its output). ``post = (dv, out_dtype, gate)``: the
    post step folded in (``w_uv`` a strided view, as the engine's), against the reference step then the reference
    post step."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths) + n_pad
    max_len = max(lengths)
    max_pages = -(-max_len // page_size) + 1  # one spare column of padding
    P = B * max_pages + 4
    kv = torch.randn(P + 1, page_size, DC + DR, generator=gen).to(dtype).to(DEV)
    ids = torch.randperm(P, generator=gen)
    table = torch.full((B, max_pages), P, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lengths):
        npg = -(-n // page_size)
        table[r, :npg] = ids[used : used + npg]
        used += npg
    if len(lengths) > 1:
        shared = min(-(-lengths[0] // page_size), -(-lengths[1] // page_size)) // 2
        table[1, :shared] = table[0, :shared]
    lens = torch.tensor(list(lengths) + [1] * n_pad, dtype=torch.int32)
    perm = torch.randperm(B, generator=gen)
    table, lens = table[perm].to(DEV), lens[perm].to(DEV)
    real = (perm < len(lengths)).to(DEV)
    if poison:
        owned = torch.zeros(P + 1, page_size, dtype=torch.bool)
        for r in range(B):
            n = int(lens[r])
            for t in range(n):
                owned[int(table[r, t // page_size]), t % page_size] = True
        kv[~owned.to(DEV)] = float("nan")
    q = torch.randn(B, H, DC + DR, generator=gen).to(DEV)
    scale = (DC // 4 + DR) ** -0.5
    kv0 = kv.clone()
    pkw = {}
    if post is not None:
        dv, out_dtype, gated = post
        w_uv = mla_weights(H, 8, dv, DC, out_dtype, gen)[1]
        gate = (
            (2 * torch.randn(B, H * dv + 3, generator=gen))[:, : H * dv].to(out_dtype).to(DEV)
            if gated
            else None
        )
        pkw = dict(w_uv=w_uv, gate=gate, out_dtype=out_dtype)
    with poisoned_empty():
        o1 = KN.mla_decode_triton(q, kv, table, lens, scale=scale, kv_lora_rank=DC, **kw, **pkw)
    assert torch.isfinite(o1).all(), "mla: output not fully written (padded rows included)"
    o2 = mla_decode_reference(q, kv, table, lens, scale=scale, kv_lora_rank=DC)
    assert torch.allclose(kv, kv0, rtol=0, atol=0, equal_nan=True)  # the cache is read only
    tag = f"mla lens={lengths} H={H} ps={page_size} {dtype} {kw}"
    if post is not None:
        o2 = mla_post_reference(o2, w_uv, gate, out_dtype)
        assert o1.dtype == out_dtype and o1.shape == (B, H * dv)
        assert KN.MLA_LAST_LAUNCH["post"] == ("reduce" if KN.MLA_LAST_LAUNCH["splits"] > 1 else "kernel")
        return check(f"{tag} post dv={dv} {out_dtype} gate={gated}", o1[real], o2[real], tol)
    assert o1.dtype == torch.float32 and o1.shape == (B, H, DC)
    assert KN.MLA_LAST_LAUNCH["post"] is None
    return check(tag, o1[real], o2[real], tol)


def mla_weights(H, DN, DV, DC, dtype, gen):
    """(w_uk [H, DN, DC], w_uv [H, DV, DC]): views of one kv_b_proj-like weight, as the engine passes them."""
    w = (torch.randn(H, DN + DV, DC, generator=gen) * DC**-0.5).to(dtype).to(DEV)
    return w[:, :DN], w[:, DN:]


def run_mla_prep_case(B, H, DN, DR, DC, page_size, dtype, seed, tol, n_pad=0, cache_dtype=None, chunks=None):
    """The prep step against the reference composition (norm, cache write, absorbed query). Inputs laid out as the
    engine's: ``q``, ``c`` and ``kr`` views of one projection output, ``w_uk`` a view of a kv_b_proj-like weight, a
    norm weight in fp32; ``B`` real rows write distinct cache rows in random pages, ``n_pad`` padded rows all write
    the scratch page's first row. Every other cache row must stay bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    N = B + n_pad
    P = 3 * N + 2
    kv = torch.randn(P + 1, page_size, DC + DR, generator=gen).to(cache_dtype).to(DEV)
    real_rows = torch.randperm(P * page_size, generator=gen)[:B]
    rows = torch.cat([real_rows, torch.full((n_pad,), P * page_size)])
    perm = torch.randperm(N, generator=gen)
    rows, real = rows[perm].to(DEV), (perm < B).to(DEV)
    wq = H * (DN + DR)
    proj = (2 * torch.randn(N, wq + DC + DR + 5, generator=gen)).to(dtype).to(DEV)
    q = proj[:, :wq].view(N, H, DN + DR)
    c, kr = proj[:, wq : wq + DC], proj[:, wq + DC : wq + DC + DR]
    norm_w = (1.0 + 0.2 * torch.randn(DC, generator=gen)).to(DEV)
    w_uk = mla_weights(H, DN, 16, DC, dtype, gen)[0]
    eps = 1e-6
    kv1, kv2 = kv.clone(), kv.clone()
    with poisoned_empty():
        ql1 = KN.mla_prep_triton(q, c, kr, norm_w, eps, w_uk, kv1, rows, chunks=chunks)
    ql2 = mla_prep_reference(q, c, kr, norm_w, eps, w_uk, kv2, rows)
    assert ql1.dtype == torch.float32 and ql1.shape == (N, H, DC + DR)
    tag = f"mla prep B={B}+{n_pad} H={H} dn={DN} dr={DR} dc={DC} ps={page_size} {dtype} cache {cache_dtype}"
    check(f"{tag} ql", ql1[real], ql2[real], 2e-6)
    flat1, flat2 = kv1.view(-1, DC + DR), kv2.view(-1, DC + DR)
    written = rows[real]
    check(f"{tag} latent", flat1[written, :DC], flat2[written, :DC], tol)
    assert torch.equal(flat1[written, DC:], flat2[written, DC:]), f"{tag}: rope key part differs"
    untouched = torch.ones(flat1.shape[0], dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(flat1[untouched], kv.view(-1, DC + DR)[untouched]), f"{tag}: other cache rows changed"


# latent rows: fp32 statistics in another summation order, so a bf16 value may round the other way
PREP_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [2, 5])
@pytest.mark.parametrize("B", [1, 3])
def test_mla_prep(dtype, H, B):
    """The prep step (latent RMSNorm + cache write + absorbed query, one launch): dn not a power of two, several
    column chunks per head (and one), page sizes 1, 16 and 7, a padded row on the scratch row."""
    seed = seed_of("prep", str(dtype), H, B)
    for k, (ps, chunks, n_pad) in enumerate(((16, 2, 0), (1, None, 1), (7, 4, 2))):
        run_mla_prep_case(B, H, 24, 16, 32, ps, dtype, seed + k, PREP_TOL[dtype], n_pad=n_pad, chunks=chunks)


@here
def test_mla_prep_cache_dtype():
    """A cache dtype other than the model's: bf16 model, fp32 cache and fp32 model, bf16 cache (rounded to nearest
    even, also under the interpreter); a latent of 64 and a rope part of 32."""
    run_mla_prep_case(
        3, 2, 16, 32, 64, 8, torch.bfloat16, 41, PREP_TOL[torch.bfloat16], cache_dtype=torch.float32
    )
    run_mla_prep_case(
        2, 3, 16, 16, 64, 8, torch.float32, 42, PREP_TOL[torch.bfloat16], cache_dtype=torch.bfloat16
    )


@here
def test_mla_prep_dn_steps(monkeypatch):
    """The prep kernel's other form: W_UK's tile larger than MLA_GLUE_CONFIG["prep_elems"], so dn is walked in steps
    for each row instead of held once."""
    monkeypatch.setitem(KN.MLA_GLUE_CONFIG, "prep_elems", 128)
    for k, (dtype, B, chunks) in enumerate(((torch.float32, 3, 2), (torch.bfloat16, 1, None))):
        run_mla_prep_case(B, 5, 24, 16, 32, 8, dtype, 61 + k, PREP_TOL[dtype], n_pad=1, chunks=chunks)
        assert KN.MLA_GLUE_LAST_LAUNCH["prep"]["NB"] < 32


def run_mla_post_case(B, H, DC, DV, dtype, gated, seed, tol, v_splits=None):
    gen = torch.Generator().manual_seed(seed)
    cbar = torch.randn(B, H, DC, generator=gen).to(DEV)
    w_uv = mla_weights(H, 8, DV, DC, dtype, gen)[1]
    gate = (2 * torch.randn(B, H * DV + 3, generator=gen))[:, : H * DV].to(dtype).to(DEV) if gated else None
    with poisoned_empty():
        o1 = KN.mla_post_triton(cbar, w_uv, gate, dtype, v_splits=v_splits)
    o2 = mla_post_reference(cbar, w_uv, gate, dtype)
    assert o1.dtype == dtype and o1.shape == (B, H * DV)
    return check(f"mla post B={B} H={H} dc={DC} dv={DV} {dtype} gate={gated} vs={v_splits}", o1, o2, tol)


# the output rounded to bf16 after fp32 sums in another order: a value may round the other way
POST_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [2, 5])
@pytest.mark.parametrize("B", [1, 3])
def test_mla_post(dtype, H, B):
    """The post step on its own (W_UV, rounding, output gate): dv not a power of two, one and several programs per
    (row, head)."""
    seed = seed_of("post", str(dtype), H, B)
    for k, (gated, vs) in enumerate(((True, None), (False, 2), (True, 4))):
        run_mla_post_case(B, H, 32, 24, dtype, gated, seed + k, POST_TOL[dtype], v_splits=vs)


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [2, 5])
@pytest.mark.parametrize("rows", [[1], [45, 3, 70]], ids=["rows1", "rows3"])
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_mla_decode_post(dtype, H, rows, whole, monkeypatch):
    """The post step folded into the reduce (several splits), and as its own launch after a one-split walk, with
    and without the gate, padded rows, page sizes 16 and 7; the reduce's W_UV slice held from before its wait
    (whole, where a program's slice spans more than one step of rows: here v_splits 2 and the default), or always
    streamed after the combine."""
    monkeypatch.setitem(KN.MLA_GLUE_CONFIG, "post_whole_elems", 1 << 20 if whole else 0)
    seed = seed_of("decode post", str(dtype), H, len(rows))
    tol = max(MLA_TOL[dtype], POST_TOL[dtype])
    for k, (ps, ns, gated, vs) in enumerate(((16, 3, True, None), (7, 1, True, 2), (16, 2, False, 4))):
        run_mla_case(
            rows, H, 32, 16, ps, dtype, seed + k, tol, post=(24, dtype, gated), num_splits=ns, block_n=16,
            v_splits=vs,
        )  # fmt: skip


MLA_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "page_size,block_n", [(16, 16), (16, 32), (64, 32)], ids=["p16n16", "p16n32", "p64n32"]
)
@pytest.mark.parametrize("prefetch", [False, True, 2], ids=["plain", "rows", "table"])
def test_mla_decode_poisoned_cache(dtype, page_size, block_n, prefetch):
    """Every cache row that no token owns (the rest of a row's last page, unused pages) is NaN: lengths that end
    inside a page, each loop form, auto and explicit splits; the output stays exact."""
    seed = seed_of(str(dtype), page_size, block_n, str(prefetch))
    kw = dict(block_n=block_n, prefetch=prefetch, block_h=16)
    for splits in (None, 3):
        run_mla_case(
            [1, 45, 64, 71],
            5,
            64,
            16,
            page_size,
            dtype,
            seed,
            MLA_TOL[dtype],
            poison=True,
            num_splits=splits,
            **kw,
        )


def test_mla_reference_ignores_rows_past_length():
    """The reference MLA decode step: cache rows past a row's length (the rest of its last page, a recycled page)
    do not reach its output even when they hold NaN or huge values."""
    g = torch.Generator().manual_seed(11)
    kv = torch.randn(6, 8, 80, generator=g)
    q = torch.randn(2, 3, 80, generator=g)
    table = torch.tensor([[4, 1], [2, 5]], dtype=torch.int32)
    lens = torch.tensor([11, 3], dtype=torch.int32)
    want = mla_decode_reference(q, kv, table, lens, scale=0.1, kv_lora_rank=64)
    bad = kv.clone()
    bad[1, 3:] = float("nan")  # row 0: tokens 8..10 live in page 1, slots 0..2
    bad[2, 3:] = float("inf")  # row 1: tokens 0..2 in page 2
    bad[5] = float("nan")
    got = mla_decode_reference(q, bad, table, lens, scale=0.1, kv_lora_rank=64)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "s1", "s3"])
def test_mla_decode(dtype, page_size, num_splits):
    """Page sizes: several pages per block (1, 16), one page per block (64), neither (7)."""
    seed = seed_of(str(dtype), page_size, num_splits)
    lengths = [1, 45, 64, 71]  # length 1; lengths that are and are not multiples of the page size
    run_mla_case(lengths, 5, 64, 16, page_size, dtype, seed, MLA_TOL[dtype], num_splits=num_splits)


@here
@pytest.mark.parametrize("trans", [True, False], ids=["trans", "direct"])
@pytest.mark.parametrize("prefetch", [True, False, 2], ids=["prefetch", "plain", "tables"])
def test_mla_decode_variants(trans, prefetch):
    """Both product orientations and both loop forms; more heads than one head block (masked tail block), more
    splits than a short row has tokens, several block sizes."""
    kw = dict(trans=trans, prefetch=prefetch)
    # (32-token blocks: register prefetch with 64-token blocks and <= 32 heads per program is refused when compiled)
    run_mla_case(
        [3, 70, 129], 20, 32, 16, 4, torch.bfloat16, 3, 1e-2, block_h=16, block_n=32, num_splits=5, **kw
    )
    run_mla_case([40, 9, 1], 16, 32, 16, 8, torch.float32, 4, 1e-5, n_pad=2, block_n=16, **kw)
    run_mla_case([33, 200], 3, 32, 16, 32, torch.float32, 5, 1e-5, block_n=16, num_splits=2, **kw)


def balanced_splits(lengths, ns, block_n, spread):
    """The balanced form's split arithmetic, written out plainly: (blocks per split, each row's split count)."""
    blocks = [-(-n // block_n) for n in lengths]
    c = max(1, -(-sum(blocks) // (ns * len(lengths))), -(-max(blocks) // (spread * ns)))
    return c, [-(-n // c) for n in blocks]


@here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
def test_mla_decode_balanced(dtype, page_size):
    """Balanced splits (the programs share the batch's tokens evenly): ragged rows, one long row among short ones
    (its splits capped at balance_spread x the even share), more head blocks than one (masked tail), both product
    orientations, auto and explicit split counts, padded rows; against the reference, partials poisoned."""
    seed = seed_of("balanced", str(dtype), page_size)
    tol = MLA_TOL[dtype]
    cases = (
        ([300, 5, 7, 2, 9], 2, dict(block_n=16)),
        ([1, 45, 64, 71], 3, dict(block_n=16, block_h=16, trans=False, prefetch=False)),
        ([129, 70, 3], 5, dict(block_n=32, block_h=16, prefetch=2)),
        ([200, 33], None, dict(block_n=16)),
    )
    for k, (lengths, ns, kw) in enumerate(cases):
        H = 20 if "block_h" in kw else 5
        run_mla_case(lengths, H, 32, 16, page_size, dtype, seed + k, tol, num_splits=ns, balance=True, **kw)
        assert KN.MLA_LAST_LAUNCH["balance"] == (KN.MLA_LAST_LAUNCH["splits"] > 1)
    # the cap binds for the long row: [300, 5, 7, 2, 9] + a padded row at 16-token blocks and two splits
    c, per_row = balanced_splits([300, 5, 7, 2, 9, 1], 2, 16, KN.MLA_CONFIG["balance_spread"])
    assert max(per_row) == 2 * KN.MLA_CONFIG["balance_spread"] and sum(per_row) <= 2 * 6 + 6
    run_mla_case(
        [300, 5, 7, 2, 9], 5, 32, 16, page_size, dtype, seed + 9, max(tol, POST_TOL[dtype]),
        post=(24, dtype, True), num_splits=3, block_n=16, balance=True,
    )  # fmt: skip
    assert KN.MLA_LAST_LAUNCH["balance"] and KN.MLA_LAST_LAUNCH["post"] == "reduce"


def test_balanced_split_arithmetic():
    """The balanced form's split counts: every row's tokens covered, no row over the cap, all splits within the
    launch's ns * B + B programs, and at uniform lengths the same chunks as the per-row form."""
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        B = int(torch.randint(1, 40, (1,), generator=g))
        ns = int(torch.randint(1, 9, (1,), generator=g))
        bn = (16, 32, 64)[trial % 3]
        lengths = torch.randint(1, 5000, (B,), generator=g).tolist()
        c, per_row = balanced_splits(lengths, ns, bn, 2)
        assert all(s * c * bn >= n for s, n in zip(per_row, lengths))
        assert max(per_row) <= 2 * ns and sum(per_row) <= ns * B + B
        n = lengths[0]
        c_u, per_u = balanced_splits([n] * B, ns, bn, 2)
        per_split = -(-n // ns)
        chunk = -(-per_split // bn) * bn  # the per-row form's tokens per split
        assert c_u * bn == chunk and per_u == [-(-n // chunk)] * B


@here
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_mla_prep_weight_before_the_wait(early, monkeypatch):
    """The prep kernel's held W_UK tile loaded before the wait for the kernel before it (MLA_GLUE_CONFIG
    ["prep_early"], the default) or after it: exact either way."""
    monkeypatch.setitem(KN.MLA_GLUE_CONFIG, "prep_early", early)
    dt = torch.bfloat16
    run_mla_prep_case(2, 4, 32, 16, 64, 16, dt, seed_of("early prep", early), PREP_TOL[dt], n_pad=1)
    assert KN.MLA_GLUE_LAST_LAUNCH["prep"]["early"] == early


@here
def test_mla_decode_min_chunk(monkeypatch):
    """MLA_CONFIG["few_min_chunk"] (at most few_min_chunk_rows rows) and the min_chunk override: a smaller least
    chunk gives a short context more splits; the output stays exact."""
    dev = torch.empty(0, device=DEV).device
    want = {}
    for mc in (None, 16):
        monkeypatch.setitem(KN.MLA_CONFIG, "few_min_chunk", mc or KN.MLA_CONFIG["min_chunk"])
        run_mla_case([300], 5, 32, 16, 16, torch.float32, 51, MLA_TOL[torch.float32], n_pad=0, block_n=16)
        want[mc] = KN.mla_num_splits(1, 5, 20 * 16, 16, dev, block_n=16)
        assert KN.MLA_LAST_LAUNCH["splits"] == want[mc]
    assert want[16] > want[None]
    run_mla_case(
        [300], 5, 32, 16, 16, torch.float32, 52, MLA_TOL[torch.float32], n_pad=0, block_n=16, min_chunk=16
    )
    assert KN.MLA_LAST_LAUNCH["splits"] == want[16] and KN.MLA_LAST_LAUNCH["min_chunk"] == 16


def test_mla_glue_refusals():
    z = torch.zeros
    with pytest.raises(ValueError, match="w_uk must be"):
        KN.mla_prep_triton(
            z(1, 2, 40), z(1, 32), z(1, 16), z(32), 1e-6, z(3, 24, 32), z(2, 4, 48), z(1, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="power-of-two"):
        KN.mla_prep_triton(
            z(1, 2, 36), z(1, 32), z(1, 12), z(32), 1e-6, z(2, 24, 32), z(2, 4, 44), z(1, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="gate must be"):
        KN.mla_post_triton(z(2, 2, 32), z(2, 24, 32), z(2, 24), torch.float32)
    with pytest.raises(ValueError, match="v_splits"):
        KN.mla_post_triton(z(2, 2, 32), z(2, 24, 32), None, torch.float32, v_splits=3)
    with pytest.raises(ValueError, match="come with w_uv"):
        KN.mla_decode_triton(
            z(1, 2, 48), z(2, 4, 48), z(1, 1, dtype=torch.int32), z(1, dtype=torch.int32), scale=1.0,
            kv_lora_rank=32, gate=z(1, 48),
        )  # fmt: skip


@here
@pytest.mark.parametrize(
    "q_lora,balance",
    [(True, False), (False, False), (True, True)],
    ids=["qlora-gate", "plain-q-nogate", "balanced"],
)
def test_engine_mla_glue_triton_path(q_lora, balance, monkeypatch):
    """The engine's fuse_mla_glue branch with the Triton steps (taken on CUDA), here on a tiny fp32 model whose shared
    key fits the MLA kernel: the prep kernel gets the engine's strided projection slices and views of kv_b_proj, the
    post step is folded into the MLA step (the gate a slice of the fused projection); the decode logits equal those
    of the engine without the flag (same Triton MLA step) and of a full re-forward. ``balance``: the engine's MLA
    steps in the balanced split form (MLA_CONFIG["balance"]; 16-token splits, so the two ragged rows take splits).
    The projections go through the Triton GEMV, as on CUDA."""
    if balance:
        monkeypatch.setitem(KN.MLA_CONFIG, "balance", True)
        monkeypatch.setitem(KN.MLA_CONFIG, "min_chunk", 16)
        monkeypatch.setitem(KN.MLA_CONFIG, "few_min_chunk", 16)
    seen = []
    real_step = KN.mla_decode_triton

    def step(*a, **k):
        out = real_step(*a, **k)
        seen.append(KN.MLA_LAST_LAUNCH["balance"])
        return out

    monkeypatch.setattr(KN, "mla_decode_triton", step)
    from openk3.infer import gemv as G

    # fewer, wider GEMV programs: the interpreter runs them one by one
    monkeypatch.setitem(G.GEMV_CONFIG, "programs_per_sm", 1)

    from openk3.config import get_preset
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams
    from openk3.model import K3ForCausalLM

    torch.manual_seed(4)
    over = {} if q_lora else dict(q_lora_rank=None, mla_use_output_gate=False)
    cfg = get_preset("tiny").replace(attn_res_init="normal", qk_rope_head_dim=16, **over)
    model = K3ForCausalLM(cfg).to(DEV).eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 21)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 2)]
    logs = []
    for glue in (False, True):
        eng = Engine(
            model, None, max_seqs=4, max_tokens=256, page_size=8, record_logits=True, fuse_mla_glue=glue
        )
        assert eng._gemv  # (the projections through the Triton GEMV, as on CUDA)
        eng._mla_step = KN.mla_decode_triton  # (what CUDA resolves to; here the spy around it)
        if glue:
            eng._mla_glue = eng._plan_mla_glue()
            assert eng._mla_glue[:2] == (KN.mla_prep_triton, None)
        KN.MLA_GLUE_LAST_LAUNCH.clear()
        reqs = eng.generate(prompts, params)
        assert ("prep" in KN.MLA_GLUE_LAST_LAUNCH) == glue and (
            KN.MLA_LAST_LAUNCH["post"] is not None
        ) == glue
        if glue:
            assert KN.MLA_GLUE_LAST_LAUNCH["post"]["gate"] == q_lora
        for r in reqs:
            got = torch.stack(r.logits_log)
            with torch.no_grad():
                ref = model(torch.tensor([r.all_ids[:-1]], device=DEV)).logits[0, r.num_prompt - 1 :].float()
            check(f"engine glue={glue} vs full forward", got, ref, 1e-4)
        logs.append([torch.stack(r.logits_log) for r in reqs])
    for a, b in zip(*logs):
        check("engine glue vs none", b, a, 1e-5)
    assert any(seen) == balance


def test_register_only_with_cuda():
    import openk3.infer.kernels as shared
    from openk3.infer.decode import FAST_KDA_DECODE, FAST_MLA_DECODE

    assert shared.register() == CUDA
    assert ("triton" in FAST_KDA_DECODE) == CUDA and ("triton" in FAST_MLA_DECODE) == CUDA


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate_kind", ["lowerbound", "softplus"])
@pytest.mark.parametrize(
    "bv,num_warps,stages",
    [(0, 16, 0), (16, 4, 0), (32, 4, 0), (64, 8, 0), (16, 2, 0), (32, 2, 0), (64, 4, 0), (32, 8, 0)]
    + [(32, 4, 3), (16, 4, 3), (16, 2, 3), (32, 8, 3), (64, 8, 3), (16, 4, 4)],
)
def test_kda_decode_gpu(dtype, gate_kind, bv, num_warps, stages):
    seed = seed_of(str(dtype), gate_kind, bv, num_warps, stages)
    run_kda_case(
        37, 32, 128, 4, 48, dtype, gate_kind, bv, seed, *KDA_TOL[dtype], num_warps=num_warps, stages=stages
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "bv,num_warps,extra",
    [
        (32, 4, dict(l2_prefetch=True)),
        (32, 4, dict(heads_fast=True)),
        (32, 4, dict(l2_prefetch=True, heads_fast=True)),
        (64, 4, dict(l2_prefetch=True)),
        (16, 2, dict(l2_prefetch=True)),
        (8, 1, dict(l2_prefetch=True)),
        (0, 16, dict(l2_prefetch=True)),
        (0, 8, dict(l2_prefetch=True, heads_fast=True)),
    ],
)
def test_kda_decode_gpu_launch_flags(dtype, bv, num_warps, extra):
    """The L2 prefetch of the state and the heads-fastest grid, compiled, at model shapes."""
    seed = seed_of(str(dtype), "flags", bv, num_warps, sorted(extra))
    for gate_kind in ("lowerbound", "softplus"):
        run_kda_case(
            37, 32, 128, 4, 48, dtype, gate_kind, bv, seed, *KDA_TOL[dtype], num_warps=num_warps, **extra
        )
        assert KN.KDA_LAST_LAUNCH["l2_prefetch"] is bool(
            extra.get("l2_prefetch", KN.KDA_CONFIG["l2_prefetch"])
        )


# (H, decay rank, gate rank, decay gate) of the model shapes: Kimi-Linear-48B (low-rank decay and gate, softplus)
# and the medium preset (low-rank decay, full-rank gate, lower-bounded decay)
KDA_MODEL_SHAPES = {"48b": (32, 128, 128, "softplus"), "medium": (16, 128, 0, "lowerbound")}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", sorted(KDA_MODEL_SHAPES))
@pytest.mark.parametrize(
    "nv,num_warps,prefetch,maxnreg",
    [(2, 8, 2, 0), (4, 8, 2, 0), (8, 8, 2, 0), (2, 4, 2, 0), (4, 4, 2, 0), (8, 4, 2, 0), (16, 4, 2, 0)]
    + [(4, 8, 1, 0), (8, 8, 1, 0), (4, 8, 0, 0), (4, 8, 2, 128), (8, 4, 2, 128)],
)
def test_kda_decode_split_gpu(dtype, shape, nv, num_warps, prefetch, maxnreg, K=128, S=12):
    """The split form compiled, at model shapes: one row, four rows, five rows plus two padded rows on the
    scratch slot; the arrival counters are back at zero after each call."""
    H, rank, gate_rank, gate_kind = KDA_MODEL_SHAPES[shape]
    for B in (1, 4, 7):
        seed = seed_of(str(dtype), "split gpu", shape, nv, num_warps, prefetch, maxnreg, B)
        run_kda_case(
            B, H, K, 4, S, dtype, gate_kind, None, seed, *KDA_TOL[dtype], num_warps=num_warps, lowrank=rank,
            gate_rank=gate_rank, split_v=nv, split_prefetch=prefetch, split_maxnreg=maxnreg,
        )  # fmt: skip
        assert KN.KDA_LAST_LAUNCH["split_v"] == nv and KN.KDA_LAST_LAUNCH["num_warps"] == num_warps
        assert split_counters_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("nv", [2, 4, 8])
@pytest.mark.parametrize("counters", ["kept", "in_capture"])
def test_kda_decode_split_cuda_graph(nv, counters, H=32, K=128, rank=128):
    """The split form in a CUDA graph, replayed several times on new inputs against the reference: with the
    long-lived counters (allocated by an eager call before the capture), and with counters first asked for during
    the capture (a fresh zeroed buffer that the graph clears before each replay's launch, not kept)."""
    gen = torch.Generator().manual_seed(seed_of("split graph", nv, counters))
    B, W, S = 5, 4, 8
    layer = make_kda_layer(H, K, W, "softplus", gen)
    HK = H * K
    for proj in ("f_b_proj", "g_b_proj"):
        w = 2 * rank**-0.5 * torch.randn(HK, rank, generator=gen)
        setattr(layer, proj, types.SimpleNamespace(weight=w.bfloat16().to(DEV)))
    conv = torch.randn(S + 1, 3, HK, W - 1, generator=gen).to(DEV)
    state = (0.3 * torch.randn(S + 1, H, K, K, generator=gen)).to(DEV)
    slots = torch.tensor([3, S, 0, S, 6], device=DEV)  # two padded rows on the scratch slot
    real = slots != S
    q, k, v = (torch.randn(B, HK, generator=gen).bfloat16().to(DEV) for _ in range(3))
    fa, ga = (torch.randn(B, rank, generator=gen).bfloat16().to(DEV) for _ in range(2))
    bl = torch.randn(B, H, generator=gen).bfloat16().to(DEV)

    def step():
        return KN.kda_decode_triton(
            layer, q, k, v, None, bl, None, conv, state, slots, split_v=nv, z_lowrank=fa, gate_lowrank=ga
        )

    # compile outside the capture (and, for "in_capture", at another batch size, whose counters are dropped)
    warm = 2 if counters == "in_capture" else B
    c0, s0 = conv.clone(), state.clone()
    KN.kda_decode_triton(
        layer, q[:warm], k[:warm], v[:warm], None, bl[:warm], None, c0, s0, slots[:warm], split_v=nv,
        z_lowrank=fa[:warm], gate_lowrank=ga[:warm],
    )  # fmt: skip
    torch.cuda.synchronize()
    key = (q.device.type, q.device.index, B * H)
    if counters == "in_capture":  # (no graph of an earlier test that used this buffer is replayed again)
        KN._KDA_COUNTERS.pop(key, None)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g = step()
    torch.cuda.synchronize()
    assert (key in KN._KDA_COUNTERS) == (counters == "kept")
    for rep in range(4):
        for t in (q, k, v, fa, ga, bl):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        c2, s2 = conv.clone(), state.clone()
        g.replay()
        torch.cuda.synchronize()
        z = torch.nn.functional.linear(fa, layer.f_b_proj.weight)
        gate = torch.nn.functional.linear(ga, layer.g_b_proj.weight)
        o_r = kda_decode_reference(layer, q, k, v, z, bl, gate, c2, s2, slots)
        assert torch.isfinite(o_g).all()
        tol_o, tol_s = KDA_TOL[torch.bfloat16]
        check(f"split graph nv={nv} {counters} replay {rep} o", o_g[real], o_r[real], tol_o)
        rs = slots[real]
        check(f"split graph replay {rep} state", state[rs], s2[rs], tol_s)
        assert torch.equal(conv[rs], c2[rs]), f"replay {rep}: conv history differs"
        assert split_counters_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [16, 96])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_decode_gpu(dtype, H, page_size):
    seed = seed_of(str(dtype), H, page_size)
    lengths = [1, 2047, 3000, 64, 777, 16]
    tol = MLA_TOL[dtype]
    run_mla_case(lengths, H, 512, 64, page_size, dtype, seed, tol, n_pad=2)
    run_mla_case(lengths, H, 512, 64, page_size, dtype, seed + 1, tol, n_pad=2, num_splits=1)
    run_mla_case(lengths, H, 512, 64, page_size, dtype, seed + 4, tol, n_pad=2, balance=True)
    run_mla_case(lengths, H, 512, 64, page_size, dtype, seed + 5, tol, n_pad=2, num_splits=3, balance=True)
    if H == 96 and dtype == torch.bfloat16:
        run_mla_case(lengths, H, 512, 64, page_size, dtype, seed + 2, tol, n_pad=2, block_h=64, block_n=64)
        run_mla_case(
            lengths, H, 512, 64, page_size, dtype, seed + 3, tol, n_pad=2, trans=False, prefetch=False
        )


# the ping-pong form with 32-token blocks in a ring of four (its sm_90 compile spills 3 values against ~80 with
# 64-token blocks)
VARIANT_PP32 = {"pingpong": True, "block_n": 32, "stages": 4, "pv_regs": 240}


# the persistent Gluon walk at any row count
ALL_ROWS = {"persist_min_rows": 1}


def _gluon_here() -> bool:
    from openk3.infer.mla_gluon import HAS_GLUON

    return CUDA and HAS_GLUON and torch.cuda.get_device_capability()[0] == 9


@here
def test_mla_gluon_refusals():
    """The Gluon split kernel is asked for where it cannot run: a clear error, never a fallback that hides it."""
    from openk3.infer.mla_gluon import gluon_supported

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 64, 576, generator=gen).to(DEV)
    kv = torch.randn(9, 16, 576, generator=gen).to(DEV)
    table = torch.arange(8, dtype=torch.int32).view(2, 4).to(DEV)
    lens = torch.tensor([40, 64], dtype=torch.int32).to(DEV)
    if not _gluon_here():
        ok, why = gluon_supported(q, kv.bfloat16(), 512)
        assert not ok and why
        with pytest.raises(ValueError, match="gluon"):
            KN.mla_decode_triton(q, kv.bfloat16(), table, lens, scale=0.1, kv_lora_rank=512, gluon=True)
        # the default leaves it off here (and off below the head threshold everywhere)
        KN.mla_decode_triton(q, kv, table, lens, scale=0.1, kv_lora_rank=512)
        assert KN.MLA_LAST_LAUNCH["kernel"] == "triton"
        return
    for bad, msg in (
        (kv, "bf16 or fp16"),  # fp32 cache
        (torch.randn(9, 12, 576, generator=gen).bfloat16().to(DEV), "power-of-two page"),
        (torch.randn(9, 16, 640, generator=gen).bfloat16().to(DEV)[..., :576], "contiguous"),
    ):
        with pytest.raises(ValueError, match=msg):
            KN.mla_decode_triton(q, bad, table, lens, scale=0.1, kv_lora_rank=512, gluon=True)


@here
@pytest.mark.parametrize("H", [32, 96, 128])
@pytest.mark.parametrize(
    "lens,groups,min_blocks,align",
    [
        ("ragged", 7, 1, 10),
        ("ragged", 66, 4, 10),
        ("ragged", 3, 2, 10),
        ("uniform", 11, 1, 10),
        ("uniform", 11, 1, 0),
    ],
)
def test_mla_persist_plan_and_reduce(H, lens, groups, min_blocks, align):
    """The persistent Gluon walk's parts that run without a Hopper GPU: the prep kernel's query rows and plan, the
    walk the plan describes (:func:`persist_segments`: every block of every (row, head block) exactly once, each
    group within its share, the head blocks of a segment in one group, distinct slots, a row that one group walks
    whole written to the output), and the reduce (and the reduce with the post step) over outputs and slots written
    as the walk writes them, against the fp32 reference (a row without tokens gives zeros)."""
    from openk3.infer.mla_gluon import MLA_GLUON_CONFIG, persist_segments

    if KN.INTERPRET and H == 128 and not (groups == 66 or (groups == 11 and not align)):
        pytest.skip(
            "under the interpreter 128 heads (two whole head blocks) run two of the cases; 96 and 32 all"
        )
    gen = torch.Generator().manual_seed(seed_of("persist", H, lens, groups, min_blocks, align))
    lengths = [700, 1, 0, 64, 65, 3000, 128, 63, 2048] if lens == "ragged" else [4096] * 5 + [0]
    B, ps, bn, ph = len(lengths), 16, 64, 64
    maxp = -(-max(lengths) // ps)
    kv = torch.randn(B * maxp + 1, ps, 576, generator=gen).bfloat16().to(DEV)
    table = torch.randperm(B * maxp, generator=gen).view(B, maxp).int().to(DEV)
    lens_t = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H, 576, generator=gen).to(DEV)
    scale = 192**-0.5
    cfg = {**MLA_GLUON_CONFIG, "min_blocks": min_blocks, "align": align}
    qb, plan = KN.mla_persist_prep(q, lens_t, torch.bfloat16, groups, cfg)
    nhb = -(-H // ph)
    # the query rows: per (row, head block), rounded to bf16, zeros past H
    want_q = torch.zeros(B, nhb * ph, 576)
    want_q[:, :H] = q.cpu().bfloat16().float()
    assert torch.equal(qb.cpu().float(), want_q.view(-1, 576))
    # the plan, derived independently
    blocks = [-(-n // bn) for n in lengths]
    total, most = sum(blocks), max(blocks)
    w = max(-(-total // groups), min_blocks)
    wa = -(-most // max(most // w, 1))
    w = wa if wa >= w and wa * 100 <= w * (100 + align) else w
    if lens == "uniform":  # (64 blocks a row, 30 a share: two shares of 32 per row where 10 % is allowed)
        assert w == (32 if align else 30)
    starts = [sum(blocks[:r]) for r in range(B)]
    got = plan.cpu().tolist()
    assert got[:2] == [w, total] and got[2 : 3 + B] == starts + [total]
    segs = persist_segments(plan.cpu(), lens_t.cpu(), H, ph, bn)
    cover, per_prog = {}, {}
    for c, slot, r, hb, start, end in segs:
        assert start % bn == 0 and 0 <= start < end <= lengths[r] and c % nhb == hb
        assert (slot == -1) == (start == 0 and end == lengths[r])
        cover.setdefault((r, hb), []).append((start, end, c // nhb))
        per_prog[c] = per_prog.get(c, 0) + -(-(end - start) // bn)
    assert max(per_prog.values()) <= w and max(per_prog) < groups * nhb
    slots_used = [s[1] for s in segs if s[1] >= 0]
    assert len(set(slots_used)) == len(slots_used) and max(slots_used, default=0) < (B + groups) * nhb
    for r, n in enumerate(lengths):
        for hb in range(nhb):
            spans = sorted(cover.get((r, hb), []))
            if n == 0:
                assert spans == []
                continue
            assert [a for a, _, _ in spans] == [0] + [e for _, e, _ in spans[:-1]] and spans[-1][1] == n
            assert spans == sorted(cover[(r, 0)])  # every head block of a row in the same groups
    # outputs and slots as the walk writes them (normalised, with the log2 sum-exp), then the reduce
    slots = (B + groups) * nhb
    part = torch.full((slots, ph, 512), float("nan"))
    lse = torch.full((slots, ph), float("nan"))
    direct = torch.full((B, H, 512), float("nan"))
    rows = kv.cpu().float()[table.cpu().long()].view(B, -1, 576)
    for _c, slot, r, hb, start, end in segs:
        heads = slice(hb * ph, min(H, hb * ph + ph))
        nh = heads.stop - heads.start
        s_ = q.cpu()[r, heads].bfloat16().float() @ rows[r, start:end].T * scale
        o_ = torch.softmax(s_, -1) @ rows[r, start:end, :512]
        if slot < 0:
            direct[r, heads] = o_
        else:
            part[slot, :nh] = o_
            lse[slot, :nh] = torch.logsumexp(s_, -1) / math.log(2.0)
    with pytest.raises(ValueError, match="min_blocks"):
        KN.mla_persist_prep(q, lens_t, torch.bfloat16, groups, {**cfg, "min_blocks": 0})
    part, lse, bkw = part.to(DEV), lse.to(DEV), dict(BAL=2, BP=1, PH=ph)
    out = direct.to(DEV)
    KN._mla_finish(part, lse, plan, out, None, None, 1, 1, bn, False, bkw)
    # (the walk rounds the query to the cache dtype: so does the reference here, leaving the combine's arithmetic)
    ref = mla_decode_reference(q.bfloat16().float(), kv, table, lens_t, scale=scale, kv_lora_rank=512)
    live = lens_t > 0
    check(f"persistent reduce H={H} {lens} G={groups} min={min_blocks}", out[live], ref[live], 1e-5)
    assert torch.equal(out[~live].cpu(), torch.zeros_like(out[~live].cpu()))
    # (the interpreter is slow with the post step: one ragged case there, a uniform one too when compiled)
    if H != 32 or groups not in ((7,) if KN.INTERPRET else (7, 11)) or not align:
        return
    # the reduce with the post step folded in reads the rows walked whole from the walk's output
    w_uv = mla_weights(H, 8, 128, 512, torch.bfloat16, gen)[1]
    post = KN._post_setup(B, H, 512, w_uv, None, torch.bfloat16, None, DEV, "test")
    o = KN._mla_finish(part, lse, plan, direct.to(DEV), w_uv, post, 1, 1, bn, False, bkw)
    want = mla_post_reference(ref, w_uv, None, torch.bfloat16)
    check(f"persistent reduce + post H={H} {lens}", o.view(B, H, -1)[live], want.view(B, H, -1)[live], 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "H,page_size",
    [(h, p) for h in (64, 96) for p in (8, 16, 64, 128)] + [(16, 16), (16, 64), (32, 8), (32, 128)],
)
def test_mla_gluon_gpu(dtype, H, page_size):
    """The warp-specialised Gluon kernel against the fp32 reference, its persistent walk (the default; shares of
    1, 4 and 64 blocks, so that segments start and end mid-row and one program walks many rows) and its split walk:
    ragged rows (one token, block and page boundaries, a shared prefix, padded rows), several splits, one split,
    every cache row no token owns NaN, and the post step folded into the reduce."""
    if not _gluon_here():
        pytest.skip("needs Triton's Gluon and a Hopper GPU")
    from openk3.infer.mla_gluon import MLA_GLUON_CONFIG

    seed = seed_of("gluon", str(dtype), H, page_size)
    lengths = [1, 2047, 3000, 64, 777, 16, 128, 63]
    tol = MLA_TOL[torch.bfloat16]
    for k, kw in enumerate(
        (
            dict(gluon_config=ALL_ROWS),
            dict(poison=True, gluon_config={**ALL_ROWS, "min_blocks": 1}),
            dict(gluon_config={**ALL_ROWS, "min_blocks": 64}),
            dict(post=(128, torch.bfloat16, True), gluon_config={**ALL_ROWS, "min_blocks": 2}),
            dict(gluon_config={**ALL_ROWS, "block_n": 32, "stages": 4}),
            {},  # (10 rows: the split walk by default)
            dict(gluon_config={"persistent": False}),
            dict(num_splits=1),
            dict(num_splits=3),
            dict(num_splits=5, poison=True),
            dict(post=(128, torch.bfloat16, True), gluon_config={"persistent": False}),
            # 32-token blocks in a ring of four
            dict(gluon_config={"block_n": 32, "stages": 4}),
            dict(num_splits=3, poison=True, gluon_config={"block_n": 32, "stages": 4}),
        )
    ):
        run_mla_case(lengths, H, 512, 64, page_size, dtype, seed + k, tol, n_pad=2, gluon=True, **kw)
        assert KN.MLA_LAST_LAUNCH["kernel"] == "gluon"
        assert KN.MLA_LAST_LAUNCH["block_n"] == kw.get("gluon_config", {}).get("block_n", 64)
        gc = {**MLA_GLUON_CONFIG, **kw.get("gluon_config", {})}
        persist = "num_splits" not in kw and gc["persistent"] and len(lengths) + 2 >= gc["persist_min_rows"]
        assert KN.MLA_LAST_LAUNCH["schedule"] == ("persistent" if persist else "per-row")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["n64", "n32"])
@pytest.mark.parametrize("H", [64, 96])
@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_gluon_gpu_pingpong(H, page_size, tile):
    """The Gluon kernel's ping-pong form (the two warp groups score alternate blocks, the softmax state passed
    between them through shared memory) against the fp32 reference: odd and even block counts per split, one block,
    NaN in unowned cache rows, the folded post step."""
    if not _gluon_here():
        pytest.skip("needs Triton's Gluon and a Hopper GPU")
    seed = seed_of("gluon-pp", H, page_size, tile)
    lengths = [1, 2047, 3000, 64, 777, 16, 128, 63, 65, 192]
    pp = {"pingpong": True} if tile == "n64" else dict(VARIANT_PP32)
    for k, kw in enumerate(
        (
            {},
            dict(num_splits=1),
            dict(num_splits=3, poison=True),
            dict(num_splits=2, post=(128, torch.bfloat16, True)),
        )
    ):
        run_mla_case(
            lengths, H, 512, 64, page_size, torch.bfloat16, seed + k, MLA_TOL[torch.bfloat16], n_pad=2,
            gluon=True, gluon_config=pp, **kw,
        )  # fmt: skip
        assert KN.MLA_LAST_LAUNCH["kernel"] == "gluon"


@pytest.mark.gpu
@pytest.mark.parametrize("walk", ["split", "persistent"])
def test_mla_gluon_gpu_graph(walk):
    """The Gluon walk (split or persistent) captured in a CUDA graph (with the reduce; the persistent walk's plan
    too), replayed on new queries, lengths and cache rows, agrees with the Triton kernel and the reference."""
    if not _gluon_here():
        pytest.skip("needs Triton's Gluon and a Hopper GPU")
    gen = torch.Generator().manual_seed(23)
    B, H, ps, maxp = 6, 96, 16, 200
    kv = torch.randn(B * maxp + 1, ps, 576, generator=gen).bfloat16().to(DEV)
    table = torch.randperm(B * maxp, generator=gen).view(B, maxp).int().to(DEV)
    lens = torch.randint(1, maxp * ps, (B,), generator=gen).int().to(DEV)
    q = torch.randn(B, H, 576, generator=gen).to(DEV)

    def step():
        gc = {"persistent": walk == "persistent", **ALL_ROWS}
        return KN.mla_decode_triton(
            q, kv, table, lens, scale=192**-0.5, kv_lora_rank=512, gluon=True, gluon_config=gc
        )

    step()
    assert KN.MLA_LAST_LAUNCH["schedule"] == ("persistent" if walk == "persistent" else "per-row")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g = step()
    for rep in range(3):
        q.copy_(torch.randn(q.shape, generator=gen))
        kv.copy_(torch.randn(kv.shape, generator=gen).bfloat16())
        lens.copy_(torch.randint(1, maxp * ps, (B,), generator=gen))
        g.replay()
        torch.cuda.synchronize()
        ref = mla_decode_reference(q, kv, table, lens, scale=192**-0.5, kv_lora_rank=512)
        check(f"gluon graph replay {rep}", o_g, ref, MLA_TOL[torch.bfloat16])
        tri = KN.mla_decode_triton(q, kv, table, lens, scale=192**-0.5, kv_lora_rank=512, gluon=False)
        check(f"gluon graph replay {rep} vs triton", o_g, tri, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(
    "dtype,block_h,block_n,num_warps,num_stages,num_splits",
    [
        (torch.bfloat16, 16, 32, 4, 3, None),
        (torch.bfloat16, 16, 32, 4, 4, 2),
        (torch.bfloat16, 16, 32, 8, 4, None),
        (torch.bfloat16, 16, 16, 4, 6, 3),
        (torch.bfloat16, 32, 32, 4, 4, None),
        (torch.float32, 16, 16, 4, 2, None),
    ],
)
def test_mla_decode_gpu_table_prefetch(dtype, page_size, block_h, block_n, num_warps, num_stages, num_splits):
    """The launch configurations of the table-prefetch loop form (prefetch=2) that the benchmark sweeps, compiled."""
    seed = seed_of(str(dtype), page_size, block_h, block_n, num_warps, num_stages, num_splits)
    kw = dict(prefetch=2, block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    lengths = [1, 2047, 3000, 64, 777, 16]
    for H in (16, 96):
        run_mla_case(
            lengths,
            H,
            512,
            64,
            page_size,
            dtype,
            seed + H,
            MLA_TOL[dtype],
            n_pad=2,
            num_splits=num_splits,
            **kw,
        )


@pytest.mark.gpu
def test_decode_kernels_cuda_graph():
    """Both steps captured in one CUDA graph; replays on new inputs match the references."""
    gen = torch.Generator().manual_seed(7)
    B, H, K, W, S = 8, 4, 128, 4, 10
    layer = make_kda_layer(H, K, W, "lowerbound", gen)
    conv = torch.randn(S + 1, 3, H * K, W - 1, generator=gen).to(DEV)
    state = (0.3 * torch.randn(S + 1, H, K, K, generator=gen)).to(DEV)
    slots = torch.randperm(S, generator=gen)[:B].to(DEV)
    ins = [torch.randn(B, H * K, generator=gen).bfloat16().to(DEV) for _ in range(5)]
    bl = torch.randn(B, H, generator=gen).bfloat16().to(DEV)
    Hm, ps, maxp = 16, 16, 40
    kv = torch.randn(B * maxp + 1, ps, 576, generator=gen).bfloat16().to(DEV)
    table = torch.randperm(B * maxp, generator=gen).view(B, maxp).int().to(DEV)
    lens = torch.randint(1, maxp * ps, (B,), generator=gen).int().to(DEV)
    qm = torch.randn(B, Hm, 576, generator=gen).to(DEV)

    def step():
        o = KN.kda_decode_triton(layer, *ins[:4], bl, ins[4], conv, state, slots)
        c = KN.mla_decode_triton(qm, kv, table, lens, scale=192**-0.5, kv_lora_rank=512)
        return o, c

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g, c_g = step()
    for _ in range(2):
        for t in ins + [bl, qm]:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        lens.copy_(torch.randint(1, maxp * ps, (B,), generator=gen))
        c2, s2 = conv.clone(), state.clone()
        g.replay()
        o_r = kda_decode_reference(layer, *ins[:4], bl, ins[4], c2, s2, slots)
        check("graph kda o", o_g, o_r, 1e-2)
        check("graph kda state", state[slots], s2[slots], 2e-3)
        check(
            "graph mla",
            c_g,
            mla_decode_reference(qm, kv, table, lens, scale=192**-0.5, kv_lora_rank=512),
            1e-2,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [16, 32])
@pytest.mark.parametrize("B", [1, 3, 16])
def test_mla_glue_gpu(dtype, H, B):
    """The prep and post steps at model shapes (dn 128, dr 64, dc 512, dv 128), compiled: default and explicit
    chunking, page sizes 16 and 64, the post step on its own with and without the gate."""
    seed = seed_of("glue gpu", str(dtype), H, B)
    for k, (ps, chunks) in enumerate(((16, None), (64, 4), (1, 32))):
        run_mla_prep_case(B, H, 128, 64, 512, ps, dtype, seed + k, PREP_TOL[dtype], n_pad=2, chunks=chunks)
    for k, (gated, vs) in enumerate(((True, None), (False, None), (True, 1), (False, 16))):
        run_mla_post_case(B, H, 512, 128, dtype, gated, seed + 10 + k, POST_TOL[dtype], v_splits=vs)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
def test_mla_prep_dn_steps_gpu(B, monkeypatch):
    """The prep kernel walking dn in steps (W_UK's tile above MLA_GLUE_CONFIG["prep_elems"]) at model shapes."""
    monkeypatch.setitem(KN.MLA_GLUE_CONFIG, "prep_elems", 2048)
    for k, (dtype, H) in enumerate(((torch.bfloat16, 32), (torch.float32, 16))):
        run_mla_prep_case(B, H, 128, 64, 512, 16, dtype, 71 + k, PREP_TOL[dtype], n_pad=2)
        assert KN.MLA_GLUE_LAST_LAUNCH["prep"]["NB"] < 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [16, 32])
@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_decode_post_gpu(dtype, H, page_size):
    """The post step folded into the reduce (default split count) and after a one-split walk, at model shapes."""
    seed = seed_of("decode post gpu", str(dtype), H, page_size)
    tol = max(MLA_TOL[dtype], POST_TOL[dtype])
    for rows in ([777], [1, 2047, 3000, 64, 777, 16]):
        for k, (ns, gated) in enumerate(((None, True), (None, False), (1, True))):
            run_mla_case(
                rows, H, 512, 64, page_size, dtype, seed + 3 * len(rows) + k, tol, n_pad=2,
                post=(128, dtype, gated), num_splits=ns,
            )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("H,gated", [(32, False), (16, True)], ids=["48b-shape", "medium-shape"])
@pytest.mark.parametrize("B,early", [(4, True), (1, True), (4, False)], ids=["b4", "b1", "b4-late"])
def test_mla_glue_cuda_graph(H, gated, B, early, monkeypatch):
    """Prep + attention with the post step folded in, captured in one CUDA graph at model shapes (bf16); each
    replay writes the new tokens' latents at the rows the attention then reads as the rows' last tokens, and matches
    the reference steps on a copy of the cache (written rows, untouched rows, output). ``early``: the prep kernel
    loads W_UK before its wait for the kernel before it (programmatic dependent launch inside the graph), or after."""
    monkeypatch.setitem(KN.MLA_GLUE_CONFIG, "prep_early", early)
    gen = torch.Generator().manual_seed(seed_of("glue graph", H, B))
    dt, ps, maxp, DN, DR, DC, DV = torch.bfloat16, 16, 24, 128, 64, 512, 128
    kv = torch.randn(B * maxp + 1, ps, DC + DR, generator=gen).to(dt).to(DEV)
    table = torch.randperm(B * maxp, generator=gen).view(B, maxp).int().to(DEV)
    lens = torch.zeros(B, dtype=torch.int32, device=DEV)
    rows = torch.zeros(B, dtype=torch.long, device=DEV)
    wq = H * (DN + DR)
    proj = torch.zeros(B, wq + DC + DR + H * DV, dtype=dt, device=DEV)
    q = proj[:, :wq].view(B, H, DN + DR)
    c, kr = proj[:, wq : wq + DC], proj[:, wq + DC : wq + DC + DR]
    gate = proj[:, wq + DC + DR :] if gated else None
    norm_w = (1.0 + 0.2 * torch.randn(DC, generator=gen)).to(DEV)
    w_uk, w_uv = mla_weights(H, DN, DV, DC, dt, gen)
    scale = (DN + DR) ** -0.5

    def new_inputs():
        proj.copy_(2 * torch.randn(proj.shape, generator=gen))
        n = torch.randint(1, maxp * ps, (B,), generator=gen)
        lens.copy_(n)
        t = (n - 1).to(DEV)
        rows.copy_(table.long().gather(1, (t // ps)[:, None])[:, 0] * ps + t % ps)

    def step():
        ql = KN.mla_prep_triton(q, c, kr, norm_w, 1e-6, w_uk, kv, rows)
        return KN.mla_decode_triton(
            ql, kv, table, lens, scale=scale, kv_lora_rank=DC, w_uv=w_uv, gate=gate, out_dtype=dt
        )

    new_inputs()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g = step()
    for _ in range(2):
        new_inputs()
        kv_ref = kv.clone()
        g.replay()
        ql = mla_prep_reference(q, c, kr, norm_w, 1e-6, w_uk, kv_ref, rows)
        cbar = mla_decode_reference(ql, kv_ref, table, lens, scale=scale, kv_lora_rank=DC)
        check("graph glue o", o_g, mla_post_reference(cbar, w_uv, gate, dt), max(MLA_TOL[dt], POST_TOL[dt]))
        flat, ref = kv.view(-1, DC + DR), kv_ref.view(-1, DC + DR)
        check("graph glue latent", flat[rows], ref[rows], PREP_TOL[dt])
        others = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
        others[rows] = False
        assert torch.equal(flat[others], ref[others])


def test_mla_num_splits_fills_whole_waves(monkeypatch):
    """The split count fills the resident program slots in whole waves (132 SMs, 2 programs each = 264 slots)."""
    monkeypatch.setattr(KN, "_sm_count", lambda device: 132)
    # the least chunk of min_chunk for every batch first (few_min_chunk as large), then a smaller one for few rows
    monkeypatch.setitem(KN.MLA_CONFIG, "few_min_chunk", KN.MLA_CONFIG["min_chunk"])
    monkeypatch.setitem(KN.MLA_CONFIG, "few_min_chunk_rows", 16)
    dev = torch.device("cpu")

    def ns(B, H=16, L=8192, res=2):
        return KN.mla_num_splits(B, H, L, 16, dev, block_n=32, resident=res)

    # 256 programs in one wave (measured fastest: 3.30 TB/s vs 2.46 / 2.52 with 2 / 6 splits)
    assert ns(64) == 4
    assert ns(256) == 1 and ns(512) == 1  # already a wave (or more) without splitting
    assert ns(16) == 16  # 256 programs
    assert ns(1) == 64  # capped: max_splits, and at least min_chunk tokens per split
    assert ns(1, L=300) == 3  # cdiv(300, min_chunk)
    assert ns(64, res=1) == 2  # 128 of 132 slots
    for B in (1, 3, 16, 50, 64, 100, 300):
        n = ns(B)
        assert 1 <= n <= KN.MLA_CONFIG["max_splits"]
    # a smaller least chunk for few rows: short contexts at batch 1 get more splits, larger batches keep min_chunk
    monkeypatch.setitem(KN.MLA_CONFIG, "few_min_chunk", 32)
    assert ns(1, L=300) == 10 and ns(16, L=300) == 10  # cdiv(300, 32)
    assert ns(17, L=300) == 3  # above few_min_chunk_rows: cdiv(300, min_chunk)
    assert KN.mla_num_splits(17, 16, 300, 16, dev, block_n=32, resident=2, min_chunk=32) == 10  # explicit


@pytest.mark.gpu
def test_mla_decode_refuses_miscompiled_prefetch():
    """Register prefetch with 64-token blocks and <= 32 heads per program gave wrong results when compiled (Triton
    3.6, H200): it is refused with a clear error rather than run."""
    if not CUDA or KN.INTERPRET:
        pytest.skip("compiled kernels only")
    with pytest.raises(ValueError, match="not supported"):
        run_mla_case(
            [40, 9], 16, 512, 64, 16, torch.bfloat16, 11, 1e-2, prefetch=True, block_n=64, block_h=16
        )
