"""Distributed layer on CPU/gloo with 2 processes: expert parallelism, FSDP2, QB all-reduce, DCP.

All scenarios run in one pair of spawned processes (a module fixture) to keep start-up cost low; each test then
checks the numbers its scenario recorded. References are single-process runs on the same global batch.
"""

from __future__ import annotations

import copy
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------------------------------
# helpers used inside the worker processes


def _tiny():
    from openk3.config import get_preset

    return get_preset("tiny")


def _model(seed: int):
    from openk3.model import K3ForCausalLM

    torch.manual_seed(seed)
    m = K3ForCausalLM(_tiny())
    with torch.no_grad():  # non-zero AttnRes queries and router spread, so every path carries gradient
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight") or n.endswith("gate.weight"):
                p.normal_(0.0, 0.1)
    return m


def _batch(B: int = 4, T: int = 16):
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, _tiny().vocab_size, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full(model, name: str, t: torch.Tensor) -> torch.Tensor:
    """Full (unsharded, all experts) copy of parameter-shaped tensor ``t`` of parameter ``name``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    is_expert = name.split(".")[-2:-1] == ["experts"]
    st = (
        getattr(model.get_submodule(name[: -len("experts.w1")].rstrip(".")), "_openk3_ep", None)
        if is_expert
        else None
    )
    if st is None:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(st.ep)]
    dist.all_gather(parts, t.detach().contiguous(), group=st.group)
    return torch.cat(parts)


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: _full(model, n, p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: _full(model, n, p) for n, p in model.named_parameters()}


def _full_optim(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"{n}.{k}"] = _full(model, n, v)
            else:
                out[f"{n}.{k}"] = torch.as_tensor(v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def _max_rel(a: dict, b: dict) -> tuple[float, list[str]]:
    """Largest relative error over common keys; keys of only one side that are not all-zero (a parameter without
    gradient on one side may have a zero one on the other)."""
    missing = sorted(k for k in set(a) ^ set(b) if bool((a if k in a else b)[k].any()))
    return max((_rel(a[k], b[k]) for k in set(a) & set(b)), default=0.0), missing


def _reference_step(seed: int):
    """Single process, whole batch: loss, full grads, global grad norm."""
    model = _model(seed)
    ids, tg = _batch()
    out = model(ids, targets=tg)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(out.loss), grads, float(norm), out.logits.detach()


def _dist_step(model, rank: int, mesh):
    """One forward/backward on this rank's half of the batch; returns (global loss, full grads, norm, logits)."""
    from openk3.train.distributed import allreduce_grads, clip_grad_norm_, reduce_mean

    ids, tg = _batch()
    half = ids.shape[0] // WORLD
    sl = slice(rank * half, (rank + 1) * half)
    out = model(ids[sl], targets=tg[sl])
    out.loss.backward()
    allreduce_grads(model, mesh)
    norm = clip_grad_norm_(model, None, mesh)
    return float(reduce_mean(out.loss)), _full_grads(model), float(norm), out.logits.detach(), sl


def _compare_step(model, rank, mesh) -> dict:
    loss_ref, grads_ref, norm_ref, logits_ref = _reference_step(0)
    loss, grads, norm, logits, sl = _dist_step(model, rank, mesh)
    grad_err, missing = _max_rel(grads, grads_ref)
    worst = max(grads, key=lambda k: _rel(grads[k], grads_ref[k]) if k in grads_ref else 0.0)
    return {
        "loss": loss,
        "loss_ref": loss_ref,
        "logits_err": _rel(logits, logits_ref[sl]),
        "grad_err": grad_err,
        "worst": worst,
        "missing": missing,
        "num_grads": len(grads),
        "norm": norm,
        "norm_ref": norm_ref,
    }


# ------------------------------------------------------------------------------------------------------------------
# scenarios


def _sc_ep_layer(rank, tmp):
    """One SparseMoE (tiny preset): EP over 2 ranks vs the unsharded layer, forward and every gradient."""
    from openk3.modules.moe import SparseMoE
    from openk3.train.distributed import allreduce_grads, apply_expert_parallel, build_mesh

    cfg = _tiny()
    torch.manual_seed(0)
    moe = SparseMoE(cfg, 1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    ref = copy.deepcopy(moe)
    mesh = build_mesh(WORLD, ep=2)
    apply_expert_parallel(moe, mesh)

    def inputs(r):
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(2, 11 + 3 * r, cfg.hidden_size, generator=g), torch.randn(
            2, 11 + 3 * r, cfg.hidden_size, generator=g
        )

    x, gy = inputs(rank)
    x.requires_grad_(True)
    y = moe(x)
    (y * gy).sum().backward()
    allreduce_grads(moe, mesh)

    xr_grad = y_ref = None
    for s in range(WORLD):  # reference: mean of the per-rank losses
        xs, gs = inputs(s)
        xs.requires_grad_(True)
        ys = ref(xs)
        ((ys * gs).sum() / WORLD).backward()
        if s == rank:
            y_ref, xr_grad = ys.detach(), xs.grad * WORLD
    grads = _full_grads(moe)
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}
    grad_err, missing = _max_rel(grads, grads_ref)
    counts = torch.bincount(moe.gate(x.detach().reshape(-1, cfg.hidden_size))[0].reshape(-1), minlength=8)
    return {
        "y_err": _rel(y, y_ref),
        "x_grad_err": _rel(x.grad, xr_grad),
        "grad_err": grad_err,
        "missing": missing,
        "local_shape": tuple(moe.experts.w1.shape),
        "offset": moe.expert_offset,
        "remote_tokens": int(counts[(1 - rank) * 4 : (2 - rank) * 4].sum()),
    }


def _sc_ep_model(rank, tmp):
    from openk3.train.distributed import apply_expert_parallel, build_mesh

    mesh = build_mesh(WORLD, ep=2)
    model = apply_expert_parallel(_model(0), mesh)
    return _compare_step(model, rank, mesh)


def _sc_fsdp(rank, tmp):
    from torch.distributed.tensor import DTensor

    from openk3.train.distributed import apply_fsdp, build_mesh

    mesh = build_mesh(WORLD, ep=1)
    model = apply_fsdp(_model(0), mesh, param_dtype=torch.float32, replicate_fp32_params=True)
    n_dt = sum(isinstance(p, DTensor) for p in model.parameters())
    n_plain = sum(not isinstance(p, DTensor) for p in model.parameters())
    return {**_compare_step(model, rank, mesh), "dtensors": n_dt, "plain": n_plain}


def _sc_ep_fsdp(rank, tmp):
    from openk3.train.distributed import apply_expert_parallel, apply_fsdp, build_mesh

    mesh = build_mesh(WORLD, ep=2)
    model = apply_fsdp(apply_expert_parallel(_model(0), mesh), mesh, param_dtype=torch.float32)
    return _compare_step(model, rank, mesh)


def _sc_qb(rank, tmp):
    import torch.distributed as dist

    from openk3.train.balance import QuantileBalancer
    from openk3.train.distributed import allreduce_balancer

    L, n, k, m = 3, 8, 2, 40
    bias = torch.randn(L, n, generator=torch.Generator().manual_seed(7)) * 0.05

    def scores(r):
        return torch.rand(L, m + 5 * r, n, generator=torch.Generator().manual_seed(50 + r))

    bal = QuantileBalancer(n, k, num_layers=L, num_bins=128)
    bal.observe(scores(rank), bias)
    allreduce_balancer(bal)
    b = bal.compute_bias()
    both = [torch.empty_like(b) for _ in range(WORLD)]
    dist.all_gather(both, b)
    single = QuantileBalancer(n, k, num_layers=L, num_bins=128)
    for r in range(WORLD):
        single.observe(scores(r), bias)
    return {
        "ranks_equal": bool(torch.equal(both[0], both[1])),
        "single_equal": bool(torch.equal(b, single.compute_bias())),
        "tokens": bal.num_tokens().tolist(),
        "tokens_ref": single.num_tokens().tolist(),
        "bias_spread": float(b.std()),
    }


def _sc_qk_clip(rank, tmp):
    """QK-Clip on FSDP2-sharded MLA weights (DTensors) scales the same rows as on a plain model."""
    from openk3.train.distributed import apply_fsdp, build_mesh
    from openk3.train.optim import qk_clip_

    c = _tiny()
    ref = _model(0)
    mesh = build_mesh(WORLD, ep=1)
    model = apply_fsdp(_model(0), mesh, param_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    out = {"sharded": 0, "err": 0.0, "clipped": 0}
    for name, mod in ref.named_modules():
        if not hasattr(mod, "kv_b_proj"):
            continue
        ml = 50.0 + 100.0 * torch.rand(c.num_attention_heads, generator=g)  # some heads above tau = 100
        pairs = []
        for m in (mod, model.get_submodule(name)):
            qw = m.q_proj.weight if m.q_lora_rank is None else m.q_b_proj.weight
            pairs.append((qw, m.kv_b_proj.weight))
        kw = dict(
            tau=100.0,
            num_heads=c.num_attention_heads,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
        )
        with torch.no_grad():
            gamma = qk_clip_(*pairs[0], ml, **kw)
            qk_clip_(*pairs[1], ml, **kw)
        out["clipped"] += int((gamma < 1).sum())
        for a, b in zip(pairs[0], pairs[1]):
            out["sharded"] += int(hasattr(b, "full_tensor"))
            full = _full(model, name, b)
            out["err"] = max(out["err"], float((full - a).abs().max()))
    return out


def _train_one_step(model, rank, mesh):
    from openk3.train.distributed import allreduce_grads

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids, tg = _batch()
    half = ids.shape[0] // WORLD
    model(ids[rank * half : (rank + 1) * half], targets=tg[rank * half : (rank + 1) * half]).loss.backward()
    allreduce_grads(model, mesh)
    opt.step()
    opt.zero_grad()
    return opt


def _sc_dcp(rank, tmp):
    """Save after one AdamW step, load into fresh models: same layout (FSDP dp=2; EP=2 + FSDP) and across layouts
    (EP=2 checkpoint into a plain FSDP dp=2 model)."""
    from openk3.train.distributed import apply_expert_parallel, apply_fsdp, build_mesh, load_dcp, save_dcp

    res = {}
    mesh1 = build_mesh(WORLD, ep=1)
    mesh2 = build_mesh(WORLD, ep=2)
    make = {
        "fsdp": lambda s: apply_fsdp(_model(s), mesh1, param_dtype=torch.float32),
        "ep_fsdp": lambda s: apply_fsdp(
            apply_expert_parallel(_model(s), mesh2), mesh2, param_dtype=torch.float32
        ),
    }
    meshes = {"fsdp": mesh1, "ep_fsdp": mesh2}
    for src, dsts in (("fsdp", ["fsdp"]), ("ep_fsdp", ["ep_fsdp", "fsdp"])):
        path = os.path.join(tmp, f"ck_{src}")
        model = make[src](0)
        opt = _train_one_step(model, rank, meshes[src])
        if src == "fsdp":  # a first save, then an overwrite in place (atomic rename path)
            save_dcp(path, model, opt, extra={"step": 5, "rank": rank})
        save_dcp(path, model, opt, extra={"step": 6, "rank": rank})
        p_ref, o_ref = _full_params(model), _full_optim(model, opt)
        bufs = dict(model.named_buffers())
        for dst in dsts:
            fresh = make[dst](1)
            opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3, weight_decay=0.1)
            extra = load_dcp(path, fresh, opt2)
            p_new, o_new = _full_params(fresh), _full_optim(fresh, opt2)
            _, p_missing = _max_rel(p_new, p_ref)
            res[f"{src}->{dst}"] = {
                "params_exact": set(p_new) == set(p_ref)
                and all(torch.equal(a, p_ref[k]) for k, a in p_new.items()),
                "missing": p_missing,
                "optim_exact": set(o_new) == set(o_ref)
                and all(torch.equal(o_new[k], o_ref[k]) for k in o_ref),
                "optim_keys": len(o_ref),
                "buffers_exact": all(torch.equal(b, bufs[n]) for n, b in fresh.named_buffers()),
                "extra": extra,
                "leftover": sorted(f for f in os.listdir(tmp) if f.endswith((".tmp", ".old"))),
            }
    return res


SCENARIOS = {
    "ep_layer": _sc_ep_layer,
    "ep_model": _sc_ep_model,
    "fsdp": _sc_fsdp,
    "ep_fsdp": _sc_ep_fsdp,
    "qb": _sc_qb,
    "qk_clip": _sc_qk_clip,
    "dcp": _sc_dcp,
}


def _worker(rank: int, port: int, out_dir: str, tmp: str):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from openk3.train.distributed import destroy_distributed, init_distributed

    info = init_distributed("gloo", timeout_s=120)
    results = {"_info": (info.rank, info.world_size, str(info.device), info.backend)}
    results["_seconds"] = times = {}
    for name, fn in SCENARIOS.items():
        t0 = time.perf_counter()
        try:
            results[name] = fn(rank, tmp)
            times[name] = round(time.perf_counter() - t0, 2)
        except Exception:  # later collectives may be out of step: stop here and report
            results[name] = {"error": traceback.format_exc()}
            break
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


def _spawn_world():
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(_free_port(), out, tmp), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="module")
def results():
    # gloo on a loaded 2-core machine has, rarely, killed a rank with SIGSEGV inside the library (seen in CI, not
    # reproducible locally: 3 of 3 reruns passed). A rank that dies of a signal gets one fresh run; a Python error
    # in a scenario is never retried (it is reported by the tests below), and neither is a second signal death.
    try:
        return _spawn_world()
    except mp.ProcessExitedException as e:
        if not getattr(e, "signal_name", None):
            raise
        return _spawn_world()


def _get(results, name):
    rs = [r.get(name) for r in results]
    for r in rs:
        assert r is not None, f"scenario {name} did not run (an earlier one failed)"
        assert "error" not in r, r.get("error")
    return rs


# ------------------------------------------------------------------------------------------------------------------
# tests


def test_world(results):
    print("scenario seconds (rank 0):", results[0]["_seconds"])
    assert [r["_info"][:2] for r in results] == [(0, 2), (1, 2)]
    assert results[0]["_info"][3] == "gloo"


def test_ep_layer_matches_unsharded(results):
    for r, res in enumerate(_get(results, "ep_layer")):
        assert res["local_shape"][0] == 4 and res["offset"] == 4 * r
        assert res["remote_tokens"] > 0, "test should route tokens to the other rank"
        assert res["y_err"] < TOL, res
        assert res["x_grad_err"] < TOL, res
        assert res["grad_err"] < TOL and not res["missing"], res


@pytest.mark.parametrize("name", ["ep_model", "fsdp", "ep_fsdp"])
def test_one_step_matches_single_process(results, name):
    for res in _get(results, name):
        assert abs(res["loss"] - res["loss_ref"]) < 1e-5 * abs(res["loss_ref"]), res
        assert res["logits_err"] < TOL, res
        assert res["grad_err"] < TOL and not res["missing"], res
        assert abs(res["norm"] - res["norm_ref"]) < 1e-5 * res["norm_ref"], res
    a, b = _get(results, name)
    assert a["loss"] == b["loss"] and a["norm"] == b["norm"]


def test_fsdp_layout(results):
    res = _get(results, "fsdp")[0]
    assert res["dtensors"] > 0 and res["plain"] > 0  # fp32-pinned KDA params stay replicated when asked


def test_qb_allreduce(results):
    for res in _get(results, "qb"):
        assert res["ranks_equal"] and res["single_equal"], res
        assert res["tokens"] == res["tokens_ref"] == [85] * 3
        assert res["bias_spread"] > 0


def test_qk_clip_on_fsdp_shards(results):
    for res in _get(results, "qk_clip"):
        assert res["clipped"] > 0 and res["sharded"] > 0, res
        assert res["err"] == 0.0, res


@pytest.mark.parametrize("case", ["fsdp->fsdp", "ep_fsdp->ep_fsdp", "ep_fsdp->fsdp"])
def test_dcp_round_trip(results, case):
    for r, all_res in enumerate(_get(results, "dcp")):
        res = all_res[case]
        assert res["params_exact"] and not res["missing"], res
        assert res["optim_exact"] and res["optim_keys"] > 0, res
        assert res["buffers_exact"], res
        assert res["extra"] == {"step": 6, "rank": r}
        assert res["leftover"] == []


def test_launch_command():
    from openk3.train.distributed import launch_command

    cmd = launch_command(4, ["train", "--nproc", "4", "--preset", "tiny", "--nproc=4"])
    i = cmd.index("torch.distributed.run")
    assert cmd[i + 1 :] == ["--standalone", "--nproc_per_node=4", "-m", "openk3", "train", "--preset", "tiny"]
    with pytest.raises(ValueError):
        launch_command(0, [])


def test_world_size_one_without_env(monkeypatch):
    """No torchrun variables: a one-process group; EP is a no-op, allreduce/balancer pass through."""
    import torch.distributed as dist

    from openk3.train.distributed import (
        allreduce_grads,
        apply_expert_parallel,
        destroy_distributed,
        init_distributed,
    )

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    info = init_distributed("gloo")
    try:
        assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
        model = _model(0)
        w1 = model.model.layers[1].block_sparse_moe.experts.w1
        apply_expert_parallel(model)
        assert model.model.layers[1].block_sparse_moe.experts.w1 is w1
        allreduce_grads(model)
    finally:
        destroy_distributed()
