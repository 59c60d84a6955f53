"""openk3.infer.row_graphs.RowGraphs on CPU (its padded fixed-shape call, ``capture=False``) and the engine's prefill
FFN calls through it; the CUDA graphs themselves: tests/gpu/test_engine_gpu.py."""

import pytest
import torch

from openk3.config import get_preset
from openk3.infer.engine import Engine
from openk3.infer.row_graphs import RowGraphs
from openk3.infer.sampling import SamplingParams
from openk3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(get_preset("tiny").replace(attn_res_init="normal")).eval()


def _ffns(model):
    layers = model.model.layers
    moe = next(i for i, layer in enumerate(layers) if layer.is_moe)
    dense = next(i for i, layer in enumerate(layers) if not layer.is_moe)
    return {"moe": layers[moe].ffn, "dense": layers[dense].ffn}


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("T", [1, 16, 37])
def test_padded_call_matches_direct(tiny, kind, T, rel):
    """A call of T rows runs fn on the bucket's rows (T rounded up to the step, zero rows past T): the real rows equal
    fn on the T rows alone, with and without the residual add; the copy out is a tensor of its own."""
    fn = _ffns(tiny)[kind]
    D = tiny.config.hidden_size
    rg = RowGraphs(64, step=16, capture=False)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(1, T, D, generator=g)
    res = torch.randn(1, T, D, generator=g)
    with torch.no_grad():
        ref = fn(x)
        y = rg.run(("layer", kind), fn, x)
        y_add = rg.run(("layer", kind), fn, x, add=res)
        assert y.shape == ref.shape == x.shape and y_add.shape == x.shape
        assert rel(y, ref) < 1e-5
        assert rel(y_add, res + ref) < 1e-5
        # the bucket's rows past T were zeroed, so a smaller call after a larger one sees no stale rows
        big = torch.randn(60, D, generator=g)
        rg.run(("layer", kind), fn, big)
        y2 = rg.run(("layer", kind), fn, x)
    assert rel(y2, ref) < 1e-5 and y.data_ptr() != y2.data_ptr()
    assert rg.bucket(T) == -(-T // 16) * 16
    assert rg.stats == {"replays": 0, "captures": 0, "eager": 4}


def test_rows_of_a_padded_call_are_independent(tiny):
    """The MoE layer is row-wise: a row's output does not depend on the other rows of the call (top-k routing has no
    capacity limit at inference), which is what makes the padded call exact on the real rows."""
    fn = _ffns(tiny)["moe"]
    x = torch.randn(24, tiny.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = fn(x.unsqueeze(0))[0]
        alone = torch.cat([fn(x[t : t + 1].unsqueeze(0))[0] for t in range(24)])
    assert float((whole - alone).abs().max()) <= 1e-5 * float(alone.abs().max())


def test_declines_what_it_cannot_take(tiny):
    fn = _ffns(tiny)["dense"]
    D = tiny.config.hidden_size
    rg = RowGraphs(40, step=16, capture=False)
    assert rg.max_rows == 48 and rg.bucket(48) == 48 and rg.bucket(49) is None and rg.bucket(0) is None
    with torch.no_grad():
        assert rg.run(0, fn, torch.randn(49, D)) is None  # past max_rows
        with pytest.raises(ValueError, match="add has shape"):
            rg.run(0, fn, torch.randn(5, D), add=torch.randn(4, D))
    assert rg.run(0, fn, torch.randn(5, D)) is None  # autograd on: eager (no graph records a backward)
    # capture on and a CPU tensor: eager
    assert RowGraphs(64).run(0, fn, torch.randn(5, D)) is None
    with pytest.raises(ValueError, match="must be >= 1"):
        RowGraphs(0)
    with pytest.raises(ValueError, match="must be >= 1"):
        RowGraphs(64, step=0)


def test_engine_prefill_through_row_graphs(tiny, rel):
    """The engine's prefill walk sends every FFN layer through its RowGraphs (here the padded eager form): the same
    greedy tokens and logits as the eager walk, for ragged packed prompts spanning several prefill steps."""
    kw = dict(
        page_size=8,
        max_seqs=4,
        max_tokens=1024,
        max_prefill_tokens=40,
        record_logits=True,
        prefix_cache=False,
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 4096, (n,), generator=g).tolist() for n in (3, 29, 61, 11)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        eng = Engine(tiny, None, **kw)
        if graphs:
            eng._ffn_graphs = RowGraphs(eng.cfg.max_prefill_tokens, step=16, capture=False)
        runs.append(eng.generate(prompts, params))
        if graphs:
            layers = sum(1 for _ in tiny.model.layers)
            assert eng._ffn_graphs.stats["eager"] >= 2 * layers  # at least two prefill forwards, every layer
            st = eng.stats()
            assert st["prefill_ffn_graph_eager_calls"] == eng._ffn_graphs.stats["eager"]
        else:
            assert "prefill_ffn_graph_replays" not in eng.stats()
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids
        assert rel(torch.stack(a.logits_log), torch.stack(b.logits_log)) < 1e-5


def test_engine_takes_ffn_graphs_only_where_capturable(tiny, monkeypatch):
    """The engine's gate for prefill_ffn_graphs (consulted on CUDA): a MoE model qualifies in bf16 with
    torch._grouped_mm; not in fp32 or without grouped GEMMs (one GEMM per expert reads the row counts back), nor on
    the reference MoE path; the allowance it sets aside grows with the prefill budget."""
    import openk3.fast.moe as FM
    from openk3.ops import backend

    eng = Engine(tiny, None, page_size=8, max_seqs=2, max_tokens=256, prefix_cache=False)
    assert eng._ffn_graphs is None  # CPU: never
    real = backend.resolve
    moe_be = {"name": "fast"}  # what the "moe" backend resolves to on a GPU (CPU: the reference)
    monkeypatch.setattr(backend, "resolve", lambda op, *a: moe_be["name"] if op == "moe" else real(op, *a))
    monkeypatch.setattr(FM, "grouped_mm_ok", lambda dtype=torch.bfloat16: True)
    assert not eng._ffn_graphs_ok()  # fp32 model
    monkeypatch.setattr(eng, "dtype", torch.bfloat16)
    assert eng._ffn_graphs_ok()
    monkeypatch.setattr(FM, "grouped_mm_ok", lambda dtype=torch.bfloat16: False)
    assert not eng._ffn_graphs_ok()
    monkeypatch.setattr(FM, "grouped_mm_ok", lambda dtype=torch.bfloat16: True)
    moe_be["name"] = "reference"
    assert not eng._ffn_graphs_ok()
    small = eng._ffn_graph_bytes()
    monkeypatch.setattr(eng.cfg, "max_prefill_tokens", 4 * eng.cfg.max_prefill_tokens)
    assert eng._ffn_graph_bytes() > 3 * small > 0
