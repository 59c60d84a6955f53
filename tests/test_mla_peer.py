"""FlashInfer as the engine's MLA decode step (``EngineConfig.mla_backend="flashinfer"``), on the CPU: the block
table and lengths turned into FlashInfer's page lists, checked through a stand-in for ``flashinfer.mla`` that
attends exactly what those lists name (FlashInfer itself needs a CUDA GPU: tests/gpu/test_mla_peer_gpu.py); and the
engine's refusals."""

import sys
import types

import pytest
import torch

from openk3.config import get_preset
from openk3.infer import mla_peer
from openk3.infer.decode import mla_decode_reference
from openk3.infer.engine import Engine
from openk3.model import K3ForCausalLM


class _Wrapper:
    """Stand-in for ``flashinfer.mla.BatchMLAPagedAttentionWrapper``: plan records the page lists (as FlashInfer's
    plan takes them: int32, one query per row), run attends row b's tokens in pages kv_indices[kv_indptr[b]:
    kv_indptr[b+1]], its first kv_len[b] of them, in fp32."""

    plans = []

    def __init__(self, ws, backend="auto", use_cuda_graph=False, **bufs):
        self._backend = "fake"
        self.graph = use_cuda_graph
        self.bufs = bufs

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, heads, dc, dr, ps, causal, scale, qdt, kvdt):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len):
            assert t.dtype == torch.int32
        assert not causal and qdt == kvdt
        B = kv_len.shape[0]
        assert torch.equal(qo_indptr, torch.arange(B + 1, dtype=torch.int32))
        if self.graph:  # the lists fit the fixed buffers
            assert (
                B + 1 == self.bufs["kv_indptr"].shape[0]
                and kv_indices.numel() <= self.bufs["kv_indices"].numel()
            )
        self.p = (kv_indptr.clone(), kv_indices.clone(), kv_len.clone(), heads, dc, dr, ps, scale)
        _Wrapper.plans.append(self.p)

    def run(self, q_nope, q_pe, ckv, kpe, out=None):
        kv_indptr, kv_indices, kv_len, heads, dc, dr, ps, scale = self.p
        assert q_nope.shape[1:] == (heads, dc) and q_pe.shape[1:] == (heads, dr)
        outs = []
        for b in range(q_nope.shape[0]):
            pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            n = int(kv_len[b])
            assert pages.numel() == -(-n // ps)  # exactly the pages the length needs
            c = ckv[pages].reshape(-1, dc)[:n].float()
            r = kpe[pages].reshape(-1, dr)[:n].float()
            s = (q_nope[b].float() @ c.T + q_pe[b].float() @ r.T) * scale
            outs.append(torch.softmax(s, -1) @ c)
        return torch.stack(outs).to(q_nope.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _Wrapper
    pkg = types.ModuleType("flashinfer")
    pkg.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(mla_peer, "flashinfer_available", lambda: (True, ""))
    _Wrapper.plans = []
    return _Wrapper


def _case(seed, B, H, ps, max_len, width):
    g = torch.Generator().manual_seed(seed)
    P = B * width + 3
    kv = torch.randn(P + 1, ps, 576, generator=g).bfloat16()
    table = torch.randperm(P, generator=g)[: B * width].view(B, width).int()
    lengths = torch.randint(1, max_len + 1, (B,), generator=g).int()
    q = torch.randn(B, H, 576, generator=g)
    return q, kv, table, lengths


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("graph", [True, False])
def test_flashinfer_step_page_lists(fake_flashinfer, ps, graph):
    """Ragged lengths (page boundaries, one token), tables wider than the rows need: the step's output is the
    reference's over the same cache (bf16 query and output as FlashInfer takes them), re-planned for new lengths."""
    H, scale = 4, 192**-0.5
    step = mla_peer.FlashInferDecodeStep(
        torch.device("cpu"), num_heads=H, page_size=ps, scale=scale, kv_lora_rank=512, rope_dim=64,
        dtype=torch.bfloat16, max_pages_per_seq=-(-40 // ps) + 2,
    )  # fmt: skip
    for seed in range(3):
        q, kv, table, lengths = _case(seed, 5, H, ps, 40, -(-40 // ps) + 2)
        lengths[0], lengths[1] = 1, ps  # one token; exactly one full page
        step.plan(table, lengths, graph=graph)
        got = step(q, kv, table, lengths, scale=scale, kv_lora_rank=512)
        ref = mla_decode_reference(q.bfloat16().float(), kv, table, lengths, scale=scale, kv_lora_rank=512)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert float((got - ref).norm() / ref.norm()) < 1e-2
    # graph plans of one row count share one wrapper (its buffers are what a captured graph reads)
    assert len(step._wrappers) == 1


def test_flashinfer_step_refusals(fake_flashinfer):
    step = mla_peer.FlashInferDecodeStep(
        torch.device("cpu"), num_heads=4, page_size=4, scale=0.1, kv_lora_rank=512, rope_dim=64,
        dtype=torch.bfloat16, max_pages_per_seq=4,
    )  # fmt: skip
    q, kv, table, lengths = _case(0, 3, 4, 4, 16, 4)
    with pytest.raises(RuntimeError, match="planned for None rows"):
        step(q, kv, table, lengths, scale=0.1, kv_lora_rank=512)
    with pytest.raises(ValueError, match=">= 1"):
        step.plan(table, torch.tensor([3, 0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="more pages"):
        step.plan(table, torch.tensor([3, 17, 2], dtype=torch.int32))
    step.plan(table, lengths)
    with pytest.raises(RuntimeError, match="planned for 3 rows, called with 2"):
        step(q[:2], kv, table[:2], lengths[:2], scale=0.1, kv_lora_rank=512)
    with pytest.raises(ValueError, match="another scale"):
        step(q, kv, table, lengths, scale=0.2, kv_lora_rank=512)
    with pytest.raises(ValueError, match="post"):
        step(q, kv, table, lengths, scale=0.1, kv_lora_rank=512, w_uv=None)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        mla_peer.FlashInferDecodeStep(
            torch.device("cpu"), num_heads=4, page_size=4, scale=0.1, kv_lora_rank=512, rope_dim=64,
            dtype=torch.float32, max_pages_per_seq=4,
        )  # fmt: skip


def test_flashinfer_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(mla_peer, "flashinfer_available", lambda: (False, "flashinfer not importable: test"))
    with pytest.raises(RuntimeError, match="flashinfer not importable"):
        mla_peer.FlashInferDecodeStep(
            torch.device("cpu"), num_heads=4, page_size=4, scale=0.1, kv_lora_rank=512, rope_dim=64,
            dtype=torch.bfloat16, max_pages_per_seq=4,
        )  # fmt: skip


def test_engine_mla_backend_refusals():
    model = K3ForCausalLM(get_preset("tiny")).eval()
    with pytest.raises(ValueError, match="mla_backend must be one of"):
        Engine(model, None, mla_backend="flashmla", max_tokens=256)
    assert any(layer.attn_type == "mla" for layer in model.model.layers)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model, None, mla_backend="flashinfer", max_tokens=256)
