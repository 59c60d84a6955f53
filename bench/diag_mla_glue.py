"""Diagnostic: the MLA half of one decode step, from the layer's projection outputs to o_proj's input, with the
engine's unfused glue and with the fused glue steps (``EngineConfig.fuse_mla_glue``: ``mla_prep_triton``, then
``mla_decode_triton`` with the post step folded in), per batch size.

Shapes: ``48b`` (H 32, no output gate) and ``medium`` (H 16, output gate), both dn 128, dr 64, dc 512, dv 128, bf16,
page size 16, every row at ``--context`` tokens. ``--layers`` copies of the layer (own weights, own cache) run one
after the other in a CUDA graph, so weights and cache come from memory as in a model; the time per layer is a replay
divided by that count (median of 5). The kernel count per layer comes from a profiled eager call of one copy. The
unfused sequence mirrors the engine's (``Engine._decode_forward_body``, MLA branch): the latent's RMSNorm module, the
cache write, ``bmm`` over fp32 ``W_UK`` + ``cat``, the attention, ``bmm`` over fp32 ``W_UV``, the cast, the gate.

    python3 bench/diag_mla_glue.py [--shapes 48b,medium] [--batches 1,2,4,8,16] [--context 1024] [--min-chunk 32]
    TRITON_INTERPRET=1 python3 bench/diag_mla_glue.py --device cpu   # smoke run: both paths once, compared
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

SHAPES = {
    "48b": dict(H=32, gate=False),
    "medium": dict(H=16, gate=True),
    "tiny": dict(H=2, gate=True, DN=16, DR=16, DC=32, DV=16),  # (the CPU smoke run)
}


class Layer:
    """One MLA layer's decode-time tensors: weights (kv_b_proj-like, its fp32 absorbed copies and model-dtype views),
    the latent norm, a paged cache with ``B`` rows of ``context`` tokens, and the projection outputs of a step."""

    def __init__(self, B, context, H, gate, dev, dt, gen, DN=128, DR=64, DC=512, DV=128, ps=16):
        from openk3.modules.norm import RMSNorm

        def rnd(*shape, s=1.0):
            return (s * torch.randn(*shape, generator=gen)).to(dev)

        self.H, self.DN, self.DR, self.DC, self.DV = H, DN, DR, DC, DV
        w = rnd(H, DN + DV, DC, s=DC**-0.5).to(dt)
        self.w_uk, self.w_uv = w[:, :DN], w[:, DN:]  # views, as the fused path reads them
        self.w_uk32, self.w_uv32 = self.w_uk.float().contiguous(), self.w_uv.float().contiguous()
        self.norm = RMSNorm(DC, 1e-6).to(dev)
        with torch.no_grad():
            self.norm.weight.copy_(1.0 + 0.2 * torch.randn(DC, generator=gen))
        pages = -(-context // ps)
        self.kv = rnd(B * pages + 1, ps, DC + DR).to(dt)
        self.table = torch.randperm(B * pages, generator=gen).view(B, pages).int().to(dev)
        self.lengths = torch.full((B,), context, dtype=torch.int32, device=dev)
        t = context - 1
        self.rows = (self.table[:, t // ps].long() * ps + t % ps).contiguous()
        wq = H * (DN + DR)
        # one projection output per row, as the fused input GEMM leaves it: q | latent | rope key | gate
        self.proj = rnd(B, wq + DC + DR + (H * DV if gate else 0)).to(dt)
        self.q = self.proj[:, :wq].reshape(B, H, DN + DR)
        self.c, self.kr = self.proj[:, wq : wq + DC], self.proj[:, wq + DC : wq + DC + DR]
        self.g = self.proj[:, wq + DC + DR :] if gate else None
        self.scale = (DN + DR) ** -0.5

    def unfused(self, mla):
        B = self.q.shape[0]
        c = self.norm(self.c)
        self.kv.view(-1, self.DC + self.DR).index_copy_(
            0, self.rows, torch.cat([c, self.kr.to(c.dtype)], dim=-1).to(self.kv.dtype)
        )
        qa = torch.bmm(self.q[..., : self.DN].float().transpose(0, 1), self.w_uk32)
        ql = torch.cat([qa.transpose(0, 1), self.q[..., self.DN :].float()], dim=-1)
        cbar = mla(ql, self.kv, self.table, self.lengths, scale=self.scale, kv_lora_rank=self.DC)
        o = torch.bmm(cbar.transpose(0, 1), self.w_uv32.transpose(1, 2))
        o = o.transpose(0, 1).to(self.q.dtype).reshape(B, self.H * self.DV)
        return o if self.g is None else torch.sigmoid(self.g) * o

    def fused(self, mla, prep):
        ql = prep(self.q, self.c, self.kr, self.norm.weight, self.norm.eps, self.w_uk, self.kv, self.rows)
        return mla(
            ql, self.kv, self.table, self.lengths, scale=self.scale, kv_lora_rank=self.DC, w_uv=self.w_uv,
            gate=self.g, out_dtype=self.q.dtype,
        )  # fmt: skip


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="48b,medium")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="layer copies per CUDA graph")
    ap.add_argument(
        "--min-chunk", type=int, default=None, help="least tokens per split (MLA_CONFIG otherwise)"
    )
    ap.add_argument(
        "--device", default="cuda", help="cpu: one call of each path, compared (TRITON_INTERPRET=1)"
    )
    a = ap.parse_args()
    if a.device != "cpu":
        import openk3.fast  # noqa: F401  (the fast RMSNorm the engine's unfused path uses on CUDA)
    from diag_mla import graph_us
    from openk3.infer.kernels import MLA_LAST_LAUNCH, mla_decode_triton, mla_prep_triton

    dev = torch.device(a.device)
    cpu = dev.type == "cpu"
    if not cpu and not torch.cuda.is_available():
        sys.exit("diag_mla_glue.py needs a CUDA device (or --device cpu under TRITON_INTERPRET=1)")
    shapes = ["tiny"] if cpu else a.shapes.split(",")
    batches = [1, 3] if cpu else [int(b) for b in a.batches.split(",")]
    context = 40 if cpu else a.context
    n_layers = 1 if cpu else a.layers
    if cpu and a.min_chunk is None:
        a.min_chunk = 8  # several splits: the post step folded into the reduce

    def mla(*args, **kw):
        return mla_decode_triton(*args, min_chunk=a.min_chunk, **kw)

    print(
        f"{'shape':8s} {'B':>3s} {'splits':>6s} {'unfused us':>10s} {'fused us':>9s} {'saved us':>9s}"
        f" {'kernels':>9s} {'rel diff':>9s}"
    )
    for name in shapes:
        for B in batches:
            gen = torch.Generator().manual_seed(B)
            kw = {k: v for k, v in SHAPES[name].items() if k not in ("H", "gate")}
            layers = [
                Layer(B, context, SHAPES[name]["H"], SHAPES[name]["gate"], dev, torch.bfloat16, gen, **kw)
                for _ in range(n_layers)
            ]
            lay = layers[0]
            kv0 = lay.kv.clone()
            o_u = lay.unfused(mla)
            kv_u, lay.kv = lay.kv, kv0
            o_f = lay.fused(mla, mla_prep_triton)
            splits = MLA_LAST_LAUNCH["splits"]
            diff = float((o_f.double() - o_u.double()).norm() / o_u.double().norm())
            latent = float((lay.kv.double() - kv_u.double()).norm() / kv_u.double().norm())
            # (the same attention over the same cache: only sum orders and roundings at their edges differ)
            assert diff < 1e-2 and latent < 1e-3, (
                f"the two paths disagree: output {diff:.1e}, cache {latent:.1e}"
            )
            if cpu:
                print(f"{name:8s} {B:3d} {splits:6d} {'-':>10s} {'-':>9s} {'-':>9s} {'-':>9s} {diff:9.1e}")
                continue
            n_u = kernels_per_call(lambda lay=lay: lay.unfused(mla))
            n_f = kernels_per_call(lambda lay=lay: lay.fused(mla, mla_prep_triton))
            t_u = graph_us([lambda lay=lay: lay.unfused(mla) for lay in layers])
            t_f = graph_us([lambda lay=lay: lay.fused(mla, mla_prep_triton) for lay in layers])
            print(
                f"{name:8s} {B:3d} {splits:6d} {t_u:10.1f} {t_f:9.1f} {t_u - t_f:9.1f} {f'{n_u}->{n_f}':>9s}"
                f" {diff:9.1e}",
                flush=True,
            )
            layers = lay = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
