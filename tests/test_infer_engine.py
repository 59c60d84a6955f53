"""Inference engine on CPU: paged hybrid cache, decode steps, continuous batching, prefix cache, preemption."""

import copy
import dataclasses
import json

import pytest
import torch

import engine_chaos
from openk3.config import get_preset
from openk3.infer.cache import CacheLayout, PagedHybridCache, plan_pool
from openk3.infer.decode import (
    FAST_KDA_DECODE,
    FAST_MLA_DECODE,
    kda_decode_reference,
    mla_decode_reference,
)
from openk3.infer.engine import Engine, EngineConfig, IncrementalDetokenizer
from openk3.infer.sampling import SamplingParams
from openk3.model import K3ForCausalLM
from openk3.ops.mla import mla_absorbed_attention

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset("tiny").replace(attn_res_init="normal"))
    with torch.no_grad():  # slow decay, so a wrong or stale KDA state would show in the logits
        for layer in m.model.layers:
            if layer.attn_type == "kda":
                layer.self_attn.dt_bias.uniform_(-6.0, -1.0)
    return m.eval()


def _prompts(seed, lengths, vocab=4096):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_against_full_forward(model, reqs, tol=1e-4):
    """Every recorded decode-step logit row equals a full re-forward of the final sequence (teacher forced)."""
    for r in reqs:
        assert len(r.logits_log) == len(r.output_ids)
        seq = torch.tensor([r.all_ids[:-1]])
        with torch.no_grad():
            ref = model(seq).logits[0, r.num_prompt - 1 :].float()
        got = torch.stack(r.logits_log)
        assert got.shape == ref.shape
        assert _rel(got, ref) < tol, (r.num_prompt, _rel(got, ref))
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # argmax is well defined
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
        assert r.output_ids == got.argmax(-1).tolist()  # greedy picked the engine's own argmax


# ------------------------------------------------------------------------------------------------ decode steps
def test_kda_decode_reference_matches_module(tiny, rel):
    cfg = tiny.config
    layer = tiny.model.layers[0].self_attn
    B, T = 3, 9
    x = torch.randn(B, T + 1, cfg.hidden_size)
    cache = {}
    with torch.no_grad():
        layer(x[:, :T], cache=cache)  # module fills its own contiguous cache
        ref_cache = {k: v.clone() for k, v in cache.items()}
        ref = layer(x[:, T:], cache=ref_cache)[:, 0]
        S, Wm1 = 5, cfg.short_conv_kernel_size - 1
        HK = layer.num_heads * layer.head_dim
        conv = torch.randn(S, 3, HK, Wm1)
        state = torch.randn(S, layer.num_heads, layer.head_dim, layer.head_dim)
        slots = torch.tensor([4, 0, 2])
        conv[slots] = torch.stack([cache["conv_q"], cache["conv_k"], cache["conv_v"]], dim=1)
        state[slots] = cache["state"]
        untouched = conv[[1, 3]].clone(), state[[1, 3]].clone()
        xx = x[:, T]
        gate = layer.g_proj(xx)
        o = kda_decode_reference(
            layer,
            layer.q_proj(xx),
            layer.k_proj(xx),
            layer.v_proj(xx),
            layer.f_b_proj(layer.f_a_proj(xx)),
            layer.b_proj(xx),
            gate,
            conv,
            state,
            slots,
        )
        got = layer.o_proj(o)
    assert rel(got, ref) < 1e-5
    assert rel(state[slots], ref_cache["state"]) < 1e-5
    assert (
        rel(conv[slots], torch.stack([ref_cache["conv_q"], ref_cache["conv_k"], ref_cache["conv_v"]], 1))
        < 1e-6
    )
    assert torch.equal(conv[[1, 3]], untouched[0]) and torch.equal(state[[1, 3]], untouched[1])


@pytest.mark.parametrize("B,mode", [(2, "prefix"), (1, "prefix"), (1, "rounds")])
def test_kda_snapshots_inside_a_chunk_equal_separate_runs(tiny, rel, B, mode, monkeypatch):
    """cache["snap_at"]: the KDA layer hands back its state and conv histories after p tokens of the chunk (one
    of them inside the first W - 1 tokens, where the history still reaches into the chunk's initial state), equal
    to running the first p tokens alone; the output and the final cache equal an unsplit run. One sequence (B == 1)
    takes the packed path's mode (kda.SNAP_MODE); a batch, and the "rounds" mode, run the recurrence in segments."""
    import openk3.modules.kda as kda_mod

    monkeypatch.setattr(kda_mod, "SNAP_MODE", mode)
    monkeypatch.setattr(kda_mod, "_PLAN", [None])
    cfg = tiny.config
    layer = tiny.model.layers[0].self_attn
    T0, T = 5, 40
    x = torch.randn(B, T0 + T, cfg.hidden_size)
    with torch.no_grad():
        start = {}
        layer(x[:, :T0], cache=start)  # a non-trivial state and conv history to start from
        plain = {k: v.clone() for k, v in start.items()}
        want = layer(x[:, T0:], cache=plain)
        split = {k: v.clone() for k, v in start.items()} | {"snap_at": [2, 17, 33]}
        got = layer(x[:, T0:], cache=split)
        assert (kda_mod._PLAN[0] is not None) == (B == 1 and mode == "prefix")  # which path ran
        assert rel(got, want) < 1e-5
        for name in ("state", "conv_q", "conv_k", "conv_v"):
            assert rel(split[name], plain[name]) < 1e-5, name
        assert len(split["snaps"]) == 3
        for p, (state, conv) in zip([2, 17, 33], split["snaps"]):
            alone = {k: v.clone() for k, v in start.items()}
            layer(x[:, T0 : T0 + p], cache=alone)
            assert rel(state, alone["state"]) < 1e-5, p
            for n in ("q", "k", "v"):
                assert rel(conv[n], alone[f"conv_{n}"]) < 1e-6, (p, n)
        with pytest.raises(ValueError, match="snap_at"):
            layer(x[:, T0:], cache={k: v.clone() for k, v in start.items()} | {"snap_at": [0, 5]})


@pytest.mark.parametrize("mode", ["rounds", "prefix", "prefix-capped"])
def test_kda_snapshots_inside_packed_sequences_equal_separate_runs(tiny, rel, mode, monkeypatch):
    """cache["snap_at"] with cu_seqlens: one list of positions per packed sequence (one of them empty); each
    snapshot equals running that sequence's first p tokens alone from its own state, and the outputs and final
    caches equal the packed run without snapshots; with the recurrence in rounds and over the snapshots' prefixes
    (kda.SNAP_MODE); "prefix" turns to rounds where the prefixes would hold too many tokens."""
    import openk3.modules.kda as kda_mod

    monkeypatch.setattr(kda_mod, "SNAP_MODE", mode.split("-")[0])
    if mode == "prefix-capped":  # the prefixes hold 1 + 16 + 3 + 8 + 32 + 40 = 100 tokens for 73: over 1.2x
        monkeypatch.setattr(kda_mod, "SNAP_PREFIX_MAX_RATIO", 1.2)
    cfg = tiny.config
    layer = tiny.model.layers[0].self_attn
    lens, T0 = [23, 9, 41], 4
    at = [[1, 16], [], [3, 8, 32, 40]]
    xs = [torch.randn(1, T0 + n, cfg.hidden_size) for n in lens]
    with torch.no_grad():
        starts = []
        for x in xs:  # each sequence's own state and conv history to start from
            c = {}
            layer(x[:, :T0], cache=c)
            starts.append(c)
        start = {k: torch.cat([c[k] for c in starts]) for k in starts[0]}
        packed = torch.cat([x[:, T0:] for x in xs], dim=1)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        plain = {k: v.clone() for k, v in start.items()}
        want = layer(packed, cu_seqlens=cu, cache=plain)
        split = {k: v.clone() for k, v in start.items()} | {"snap_at": at}
        got = layer(packed, cu_seqlens=cu, cache=split)
        assert rel(got, want) < 1e-5
        for name in ("state", "conv_q", "conv_k", "conv_v"):
            assert rel(split[name], plain[name]) < 1e-5, name
        assert [len(s) for s in split["snaps"]] == [len(a) for a in at]
        for n, (x, ps) in enumerate(zip(xs, at)):
            for p, (state, conv) in zip(ps, split["snaps"][n]):
                alone = {k: v.clone() for k, v in starts[n].items()}
                layer(x[:, T0 : T0 + p], cache=alone)
                assert state.shape == alone["state"].shape and rel(state, alone["state"]) < 1e-5, (n, p)
                for name in ("q", "k", "v"):
                    assert rel(conv[name], alone[f"conv_{name}"]) < 1e-6, (n, p, name)
        assert kda_mod._PLAN[0][3].mode == {"prefix-capped": "rounds"}.get(mode, mode)
        for bad in ([[1], [2]], [[0], [], [5]], [[5, 3], [], []], [1, 2, 3], [[], [9], []]):
            with pytest.raises(ValueError, match="snap_at"):
                layer(
                    packed, cu_seqlens=cu, cache={k: v.clone() for k, v in start.items()} | {"snap_at": bad}
                )


@pytest.mark.parametrize("mode", ["rounds", "prefix"])
def test_kda_snapshots_from_an_empty_cache(tiny, rel, mode, monkeypatch):
    """cache["snap_at"] in a cache without a state or conv history (the sequences start from zeros): the same
    outputs, final state and snapshots as with explicit zero states."""
    import openk3.modules.kda as kda_mod

    monkeypatch.setattr(kda_mod, "SNAP_MODE", mode)
    cfg = tiny.config
    layer = tiny.model.layers[0].self_attn
    H, K, HK, W = layer.num_heads, layer.head_dim, layer.num_heads * layer.head_dim, layer.conv_size
    x = torch.randn(1, 30, cfg.hidden_size)
    cu = torch.tensor([0, 12, 30])
    at = [[5], [4, 11]]
    zeros = {"state": torch.zeros(2, H, K, K)} | {f"conv_{n}": torch.zeros(2, HK, W - 1) for n in "qkv"}
    with torch.no_grad():
        empty, given = {"snap_at": at}, zeros | {"snap_at": at}
        got, want = layer(x, cu_seqlens=cu, cache=empty), layer(x, cu_seqlens=cu, cache=given)
    assert rel(got, want) < 1e-6 and rel(empty["state"], given["state"]) < 1e-6
    for a, b in zip(empty["snaps"], given["snaps"]):
        assert len(a) == len(b) and all(rel(s, t) < 1e-6 for (s, _), (t, _) in zip(a, b))


@pytest.mark.parametrize("full_rank_gate", [True, False])
def test_kda_prefill_reads_the_fused_projections(rel, full_rank_gate):
    """The engine hands each KDA layer its decode step's fused input buffer and the q / k / v conv weights in one
    buffer (views: the modules' weights share their memory); the layer's forward then takes one GEMM and one conv
    call, and equals the separate projections and convs (packed sequences with a cache and snapshots inside, and
    one sequence without a cache); with autograd recording, the separate modules run."""
    torch.manual_seed(1)
    cfg = get_preset("tiny").replace(use_full_rank_gate=full_rank_gate)
    model = K3ForCausalLM(cfg).eval()
    Engine(model, None, max_seqs=2, max_tokens=64)
    kda_layers = [layer.self_attn for layer in model.model.layers if layer.attn_type == "kda"]
    assert kda_layers
    for m in kda_layers:
        buf, sizes = m.fused_input
        assert m.q_proj.weight.data_ptr() == buf.data_ptr() and sum(sizes) == buf.shape[0]
        assert m.fused_conv.shape[0] == 3 * m.num_heads * m.head_dim
        assert m.v_conv1d.weight.data_ptr() == m.fused_conv[2 * m.num_heads * m.head_dim :].data_ptr()
    m = kda_layers[0]
    H, K, W = m.num_heads, m.head_dim, m.conv_size
    x = torch.randn(1, 30, cfg.hidden_size)
    cu = torch.tensor([0, 12, 30])
    start = {"state": torch.randn(2, H, K, K) * 0.1} | {
        f"conv_{n}": torch.randn(2, H * K, W - 1) for n in "qkv"
    }

    def run(fused: bool):
        saved = m.fused_input, m.fused_conv
        if not fused:
            m.fused_input = m.fused_conv = None
        try:
            with torch.no_grad():
                c = {k: v.clone() for k, v in start.items()} | {"snap_at": [[5], [4, 11]]}
                y = m(x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), cache=c)
                y1 = m(x[:, :9])
        finally:
            m.fused_input, m.fused_conv = saved
        return y, y1, c

    (y, y1, c), (y_ref, y1_ref, c_ref) = run(True), run(False)
    assert rel(y, y_ref) < 1e-5 and rel(y1, y1_ref) < 1e-5
    for name in ("state", "conv_q", "conv_k", "conv_v"):
        assert rel(c[name], c_ref[name]) < 1e-5, name
    for a, b in zip(c["snaps"], c_ref["snaps"]):
        for (s1, h1), (s2, h2) in zip(a, b):
            assert rel(s1, s2) < 1e-5 and all(rel(h1[n], h2[n]) < 1e-6 for n in "qkv")
    # a perturbed fused buffer shows (the fused path is the one that ran)
    with torch.no_grad():
        m.fused_input[0][-1].add_(1.0)
        y_bad = m(x, cu_seqlens=cu, cache={k: v.clone() for k, v in start.items()})
        m.fused_input[0][-1].sub_(1.0)
    assert rel(y_bad, y_ref) > 1e-3
    # a weight replaced after the engine set the buffers: the stale buffer is not used
    old = m.k_proj.weight
    m.k_proj.weight = torch.nn.Parameter(old.detach() * 2)
    try:
        assert m._fused_buffers() is None
        with torch.no_grad():
            y_new = m(x, cu_seqlens=cu, cache={k: v.clone() for k, v in start.items()})
        assert rel(y_new, y_ref) > 1e-3
        m.fused_input, m.fused_conv = None, None
        with torch.no_grad():
            y_sep = m(x, cu_seqlens=cu, cache={k: v.clone() for k, v in start.items()})
        assert rel(y_new, y_sep) < 1e-6
    finally:
        m.k_proj.weight = old
    # while autograd records, the separate modules run (their weights get gradients)
    x.requires_grad_(True)
    m(x).sum().backward()
    assert m.q_proj.weight.grad is not None and m.v_conv1d.weight.grad is not None


def test_prefix_snapshots_inside_one_prefill_chunk(tiny):
    """With a snapshot interval shorter than the prefill budget, a prompt is prefilled in one forward and still
    leaves a snapshot at every multiple of the interval."""
    eng = Engine(
        tiny, None, page_size=8, max_seqs=2, max_tokens=1024, prefix_interval=16, max_prefill_tokens=512
    )
    forwards = []
    inner = eng._prefill_chunk
    eng._prefill_chunk = lambda req, a, b: (forwards.append((a, b)), inner(req, a, b))
    prompt = _prompts(17, [90])[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    (first,) = eng.generate([prompt], params)
    assert forwards == [(0, 89)]
    assert eng.prefix.inserts == 5  # 16, 32, 48, 64, 80
    (again,) = eng.generate([prompt[:70] + [7, 8, 9]], params)
    assert again.prefix_hit == 64 and forwards[1:] == [(64, 72)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("outputs", [False, True])
def test_prefix_cache_outputs_snapshots_generated_tokens(tiny, overlap, outputs):
    """EngineConfig.prefix_cache_outputs: decode also leaves snapshots where the cache reaches a multiple of the
    interval past the prompt, so a prompt that repeats the conversation so far (prompt + reply) restores from the
    last one; the continuation equals an engine without prefix caching. Off: only the prompt's snapshot is hit."""
    kw = dict(page_size=8, max_seqs=2, max_tokens=1024, record_logits=True, overlap=overlap)
    eng = Engine(tiny, None, prefix_interval=16, prefix_cache_outputs=outputs, **kw)
    prompt = _prompts(31, [20])[0]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (first,) = eng.generate([prompt], greedy)
    # the cache held 20 + 40 - 1 = 59 tokens: snapshots at 16 (prefill), then 32 and 48 (decode)
    assert eng.prefix.inserts == (3 if outputs else 1)
    follow = prompt + first.output_ids[:35] + _prompts(32, [4])[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    (again,) = eng.generate([follow], params)
    assert again.prefix_hit == (48 if outputs else 16)
    (fresh,) = Engine(tiny, None, prefix_cache=False, **kw).generate([follow], params)
    assert again.output_ids == fresh.output_ids
    assert _rel(torch.stack(again.logits_log), torch.stack(fresh.logits_log)) < 1e-5


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mla_decode_reference_matches_contiguous(rel, page_size):
    torch.manual_seed(1)
    B, H, dn, dr, dc, dv = 3, 4, 8, 4, 16, 8
    lengths = [1, 13, 30]
    S = max(lengths)
    c, kr = torch.randn(B, S, dc), torch.randn(B, S, dr)
    q_nope, q_rope = torch.randn(B, 1, H, dn), torch.randn(B, 1, H, dr)
    w_uk, w_uv = torch.randn(H, dn, dc), torch.randn(H, dv, dc)
    ref = mla_absorbed_attention(q_nope, q_rope, c, kr, w_uk, w_uv, scale=0.3, lengths=torch.tensor(lengths))[
        :, 0
    ]
    n_pages = 50
    kv = torch.randn(n_pages + 1, page_size, dc + dr)  # garbage everywhere else
    perm = torch.randperm(n_pages).tolist()
    width = -(-S // page_size)
    table = torch.full((B, width), n_pages, dtype=torch.int32)
    for b, L in enumerate(lengths):
        pages = [perm.pop() for _ in range(-(-L // page_size))]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for t in range(L):
            kv[pages[t // page_size], t % page_size] = torch.cat([c[b, t], kr[b, t]])
    qa = torch.einsum("bhn,hnc->bhc", q_nope[:, 0], w_uk)
    out = mla_decode_reference(
        torch.cat([qa, q_rope[:, 0]], -1),
        kv,
        table,
        torch.tensor(lengths, dtype=torch.int32),
        scale=0.3,
        kv_lora_rank=dc,
    )
    got = torch.einsum("bhc,hvc->bhv", out, w_uv)
    assert rel(got, ref) < 1e-5


def test_fast_path_hooks_are_used(tiny):
    calls = {"kda": 0, "mla": 0}

    def kda(*a, **k):
        calls["kda"] += 1
        return kda_decode_reference(*a, **k)

    def mla(*a, **k):
        calls["mla"] += 1
        return mla_decode_reference(*a, **k)

    FAST_KDA_DECODE["test-hook"], FAST_MLA_DECODE["test-hook"] = kda, mla
    try:
        eng = Engine(tiny, None, max_seqs=2, max_tokens=256, decode_backend="test-hook")
        eng.generate([[7, 8, 9]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finally:
        del FAST_KDA_DECODE["test-hook"], FAST_MLA_DECODE["test-hook"]
    lay = CacheLayout.from_config(tiny.config)
    assert calls == {"kda": 2 * len(lay.kda_layers), "mla": 2 * len(lay.mla_layers)}
    with pytest.raises(ValueError, match="no kda decode step"):
        Engine(tiny, None, max_seqs=1, max_tokens=64, decode_backend="missing")


# ------------------------------------------------------------------------------------------------ engine == model
def test_cached_decode_equals_full_forward_64_tokens_ragged(tiny):
    eng = Engine(
        tiny, None, page_size=16, max_seqs=8, max_tokens=2048, record_logits=True, prefix_interval=16
    )
    reqs = eng.generate(
        _prompts(1, [1, 7, 23, 40]), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    )
    assert [len(r.output_ids) for r in reqs] == [64] * 4
    assert all(r.finish_reason == "length" for r in reqs)
    _check_against_full_forward(tiny, reqs)
    s = eng.stats()
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == 8  # finished requests freed everything


@pytest.mark.parametrize("page_size", [1, 5, 64])
def test_paged_cache_page_sizes_and_chunked_prefill(tiny, page_size):
    eng = Engine(
        tiny,
        None,
        page_size=page_size,
        max_seqs=4,
        max_tokens=1024,
        max_prefill_tokens=9,
        prefix_cache=False,
        record_logits=True,
    )
    reqs = eng.generate(
        _prompts(2, [2, 31, 70]), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    _check_against_full_forward(tiny, reqs)


def test_prefix_cache_hit_equals_miss(tiny):
    base = _prompts(3, [90])[0]
    other = _prompts(4, [30])[0]
    p_hit = base[:50] + other  # shares 50 tokens -> snapshot at 48
    p_near = base[:40] + other  # shares 40 tokens -> snapshot at 32, never 48
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(
        page_size=5, max_seqs=4, max_tokens=1024, record_logits=True
    )  # 48 % 5 != 0: partial page copied
    eng = Engine(tiny, None, prefix_interval=16, **kw)
    eng.generate([base], params)
    (hit,) = eng.generate([p_hit], params)
    (near,) = eng.generate([p_near], params)
    assert hit.prefix_hit == 48 and near.prefix_hit == 32
    fresh = Engine(tiny, None, prefix_cache=False, **kw)
    miss_hit, miss_near = fresh.generate([p_hit, p_near], params)
    for a, b in ((hit, miss_hit), (near, miss_near)):
        assert a.output_ids == b.output_ids
        assert _rel(torch.stack(a.logits_log), torch.stack(b.logits_log)) < 1e-5
    _check_against_full_forward(tiny, [hit, near])
    s = eng.stats()
    assert s["prefix_cache_hits"] == 2 and s["prefix_cache_hit_tokens"] == 80
    # the base prompt again: longest snapshot (80 of 89 known tokens), output identical to the first run
    (again,) = eng.generate([base], params)
    assert again.prefix_hit == 80
    assert again.output_ids == miss_base_ids(tiny, base, params, kw)


def miss_base_ids(model, prompt, params, kw):
    (r,) = Engine(model, None, prefix_cache=False, **kw).generate([prompt], params)
    return r.output_ids


def test_prefix_cache_evicts_and_frees(tiny):
    eng = Engine(
        tiny, None, page_size=4, max_seqs=2, max_tokens=64, prefix_interval=8, prefix_cache_bytes=1 << 30
    )
    for p in _prompts(5, [40, 40, 40]):  # each prompt's snapshots pin pages until the pool needs them
        (r,) = eng.generate([p], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert r.finish_reason == "length"
    s = eng.stats()
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == 2
    assert s["pages_free"] + s["pages_held_by_prefix_cache_only"] == s["pages_total"]
    eng.prefix.clear()
    assert eng.stats()["pages_free"] == s["pages_total"]


def test_preemption_recomputes_exactly(tiny):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = _prompts(6, [20, 25, 30])
    small = Engine(tiny, None, page_size=4, max_seqs=3, max_tokens=72, prefix_cache=False, record_logits=True)
    reqs = small.generate(prompts, params)
    assert small.stats()["preemptions_total"] > 0
    _check_against_full_forward(tiny, reqs)
    big = Engine(tiny, None, page_size=4, max_seqs=3, max_tokens=1024, prefix_cache=False)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in big.generate(prompts, params)]
    assert small.stats()["pages_free"] == small.pool.num_pages


@pytest.mark.parametrize(
    "penalty",
    [dict(repetition_penalty=0.3), dict(frequency_penalty=-1.5), dict(presence_penalty=-1.5)],
    ids=["repetition", "frequency", "presence"],
)
def test_preemption_keeps_each_requests_penalty_history(tiny_pinned, penalty):
    """A request preempted after some tokens and recomputed keeps its penalties' history (the tokens it has seen and
    how often it wrote each): the same tokens as on a pool that never preempts. Penalties that favour repeats make
    the history decide the next token."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **penalty)
    # short prompts: most of what a request has seen is its own reply; both fit at first, and the newer one is
    # preempted ~20 tokens into its reply
    prompts = _prompts(6, [3, 3])
    small = Engine(tiny_pinned, None, page_size=4, max_seqs=2, max_tokens=48, prefix_cache=False)
    outs_at_preemption = []
    preempt = small._preempt
    small._preempt = lambda r: (outs_at_preemption.append(len(r.output_ids)), preempt(r))
    reqs = small.generate(prompts, params)
    assert outs_at_preemption and min(outs_at_preemption) >= 10
    big = Engine(tiny_pinned, None, page_size=4, max_seqs=2, max_tokens=1024, prefix_cache=False)
    want = [r.output_ids for r in big.generate(prompts, params)]
    assert [r.output_ids for r in reqs] == want
    plain = big.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [r.output_ids for r in plain] != want  # (the penalty does change the replies)


def _check_logprobs(model, r, tol=1e-4):
    """A request's logprobs / prompt logprobs against log_softmax of a full re-forward of its final sequence:
    each chosen token's value, and the top-k ids (where the k-th is clearly above the next) and values."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([r.all_ids[:-1]])).logits[0].float(), -1)
    n = r.num_prompt
    rows = []  # (position predicting the token, TokenLogprob, k)
    if r.params.logprobs is not None:
        assert [e.id for e in r.logprobs] == r.output_ids
        rows += [(n - 1 + j, e, r.params.logprobs) for j, e in enumerate(r.logprobs)]
    if r.params.prompt_logprobs is not None:
        pl = r.prompt_logprobs
        assert len(pl) == n and pl[0] is None
        assert [e.id for e in pl[1:]] == r.prompt_ids[1:]
        rows += [(p, e, r.params.prompt_logprobs) for p, e in enumerate(pl[1:])]
    assert rows
    for p, e, k in rows:
        assert abs(e.logprob - float(lp[p, e.id])) < tol, (p, e.logprob, float(lp[p, e.id]))
        assert len(e.top) == k
        if k:
            ref = lp[p].topk(k + 1)
            got_v = torch.tensor([v for _, v in e.top])
            assert float((got_v - ref.values[:k]).abs().max()) < tol
            clear = ref.values[:-1] - ref.values[1:] > 1e-3
            ids = [i for i, _ in e.top]
            assert all(ids[j] == int(ref.indices[j]) for j in range(k) if clear[j])


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_max_tokens_zero_scores_the_prompt(tiny, overlap):
    """max_tokens 0: the prompt is prefilled and its logprobs reported (those of a full forward), no token is drawn,
    the request finishes with "length" and frees its pages; a generating request beside it is unaffected."""
    eng = Engine(tiny, None, page_size=8, max_seqs=4, max_tokens=1024, overlap=overlap, prefix_interval=8)
    prompts = _prompts(43, [1, 9, 40, 12])
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    gen = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = eng.generate(prompts, [score, score, score, gen])
    for r in reqs[:3]:
        assert r.output_ids == [] and r.finish_reason == "length"
        if r.num_prompt > 1:
            _check_logprobs(tiny, r)
        else:
            assert r.prompt_logprobs == [None]
    alone = eng.generate([prompts[3]], gen)[0]
    assert len(reqs[3].output_ids) == 6 and reqs[3].output_ids == alone.output_ids
    assert eng.stats()["requests_running"] == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1).validate()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_logprobs_match_full_forward(tiny, overlap):
    """SamplingParams.logprobs / prompt_logprobs: log_softmax of the model's logits at every generated and prompt
    token (sampled, greedy and penalised rows in one batch; a one-token prompt); a request asking for prompt
    logprobs does not take a cached prefix (the second run of the same prompt would hit it), and gets the same
    values again; prompt logprobs survive a preemption (recomputed positions are not recorded twice)."""
    eng = Engine(tiny, None, page_size=16, max_seqs=4, max_tokens=1024, overlap=overlap, prefix_interval=16)
    prompts = _prompts(41, [1, 9, 40])
    sp = [
        SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, prompt_logprobs=5, ignore_eos=True),
    ]
    reqs = eng.generate(prompts, sp)
    for r in reqs:
        _check_logprobs(tiny, r)
    assert reqs[1].prompt_logprobs is None and reqs[2].logprobs == []
    again = eng.generate([prompts[2]], sp[2])[
        0
    ]  # alone now, packed beside the others before: equal to rounding
    assert again.prefix_hit == 0 and len(again.prompt_logprobs) == len(reqs[2].prompt_logprobs)
    for a, b in zip(again.prompt_logprobs[1:], reqs[2].prompt_logprobs[1:]):
        assert a.id == b.id and abs(a.logprob - b.logprob) < 1e-4
        assert len(a.top) == len(b.top) and all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a.top, b.top))
    plain = eng.generate([prompts[2]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prefix_hit > 0  # the cache had the prefix
    small = Engine(tiny, None, page_size=4, max_seqs=3, max_tokens=72, prefix_cache=False, overlap=overlap)
    lp = SamplingParams(max_tokens=30, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    reqs = small.generate(_prompts(6, [20, 25, 30]), lp)
    assert small.stats()["preemptions_total"] > 0
    for r in reqs:
        _check_logprobs(tiny, r)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_frequency_presence_penalties_match_reference(tiny, overlap):
    """Greedy decoding with frequency / presence penalties (and a repetition penalty on one row): every token is the
    argmax of a full re-forward's logits after the penalties over the output so far (where that argmax is clear);
    a small pool that preempts gives the same tokens (the counts rebuilt from the output on re-admission)."""
    sp = [  # a negative frequency penalty rewards repeats, so the output changes visibly
        SamplingParams(
            max_tokens=24, temperature=0, presence_penalty=1.0, repetition_penalty=1.4, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=24, temperature=0, frequency_penalty=-2.0, presence_penalty=0.5, ignore_eos=True
        ),
    ]
    prompts = _prompts(61, [6, 20])
    eng = Engine(tiny, None, page_size=16, max_seqs=4, max_tokens=1024, overlap=overlap, record_logits=True)
    reqs = eng.generate(prompts, sp)
    plain = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert reqs[1].output_ids != plain[1].output_ids  # the penalties changed something
    checked = 0
    for r in reqs:
        n, sp_ = r.num_prompt, r.params
        with torch.no_grad():
            logits = tiny(torch.tensor([r.all_ids[:-1]])).logits[0, n - 1 :].float()
        for j, t in enumerate(r.output_ids):
            x = logits[j].clone()
            if sp_.repetition_penalty != 1.0:
                seen = torch.zeros_like(x, dtype=torch.bool)
                seen[r.all_ids[: n + j]] = True
                x = torch.where(
                    seen, torch.where(x > 0, x / sp_.repetition_penalty, x * sp_.repetition_penalty), x
                )
            c = torch.bincount(torch.tensor(r.output_ids[:j], dtype=torch.long), minlength=x.shape[0]).float()
            x = x - sp_.frequency_penalty * c - sp_.presence_penalty * (c > 0).float()
            top2 = x.topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:
                assert t == int(x.argmax()), (j, t, int(x.argmax()))
                checked += 1
    assert checked >= 40
    small = Engine(tiny, None, page_size=4, max_seqs=2, max_tokens=48, prefix_cache=False, overlap=overlap)
    again = small.generate(prompts, sp)
    assert small.stats()["preemptions_total"] > 0
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_logit_bias(tiny, overlap):
    """SamplingParams.logit_bias (OpenAI semantics): -100 bans a token from a greedy row, +100 forces one on a
    sampled row, in one batch with a row without a bias, which keeps the tokens it gets without any bias in the
    batch; the forced row's logprobs stay the model's (against a full forward); ids past the vocabulary are
    refused."""

    eng = Engine(tiny, None, page_size=16, max_seqs=4, max_tokens=1024, overlap=overlap, prefix_cache=False)
    prompts = _prompts(43, [7, 12, 20])
    plain = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    ]
    base = [r.output_ids for r in eng.generate(prompts, plain)]
    banned = base[0][0]
    forced = next(t for t in range(5, 100) if t not in base[1])
    sp = [
        dataclasses.replace(plain[0], logit_bias={banned: -100.0}),
        dataclasses.replace(plain[1], logit_bias={forced: 100, 3: -5.0}, logprobs=1),
        plain[2],
    ]
    reqs = eng.generate(prompts, sp)
    assert banned not in reqs[0].output_ids and reqs[0].output_ids[0] != base[0][0]
    assert reqs[1].output_ids == [forced] * 6
    assert reqs[2].output_ids == base[2]
    _check_logprobs(tiny, reqs[1])
    V = tiny.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        eng.make_request([1, 2], SamplingParams(logit_bias={V: 1.0}))
    # a stop token the model can never draw would silently never stop anything
    with pytest.raises(ValueError, match="stop_token_ids") as e:
        eng.make_request([1, 2], SamplingParams(stop_token_ids=[5, V]))
    assert e.value.param == "stop_token_ids"
    eng.make_request([1, 2], SamplingParams(stop_token_ids=[V - 1]))


def test_logit_bias_validation():
    for bad in ({-1: 1.0}, {True: 1.0}, {"5": 1.0}, {5: 101.0}, {5: float("nan")}, {5: "1"}, [5, 1.0]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad).validate()
    assert SamplingParams(logit_bias={7: -100, 8: 2}).validate().logit_bias == {7: -100.0, 8: 2.0}
    assert SamplingParams(logit_bias={}).validate().logit_bias is None


def test_logprobs_params_validation():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad).validate()
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()
    SamplingParams(logprobs=0, prompt_logprobs=20).validate()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_continuous_batching_and_chunked_prefill_do_not_stall(tiny, overlap):
    eng = Engine(
        tiny, None, page_size=8, max_seqs=4, max_tokens=2048, max_prefill_tokens=32, prefix_cache=False,
        overlap=overlap,
    )  # fmt: skip
    a = eng.submit(_prompts(7, [5])[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert len(a.output_ids) == (2 if overlap else 3)  # with overlap a step's tokens arrive one step later
    b = eng.submit(_prompts(8, [200])[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    steps = 0
    while not b.output_ids:  # B needs ~7 steps of prefill; A gets a token in every one of them
        n = len(a.output_ids)
        eng.step()
        steps += 1
        assert len(a.output_ids) == n + 1
    assert steps >= 200 // 32
    while not (a.finished and b.finished):
        eng.step()
    assert eng.stats()["pages_used_by_sequences"] == 0


@pytest.mark.parametrize("batch", [False, True], ids=["one", "packed"])
@pytest.mark.parametrize("prefix", [False, True])
def test_prefill_defers_pieces_cut_short_by_the_leftover_budget(tiny, prefix, batch):
    """A prefill forward costs about the same whatever its length: a piece that the step's leftover budget would
    cut to under a quarter of max_prefill_tokens waits for the next step (whole budget); a prompt that fits in the
    leftover still goes. The same pieces with and without batch_prefill; the tokens are those of a full
    re-forward either way."""
    eng = Engine(
        tiny, None, page_size=8, max_seqs=4, max_tokens=2048, max_prefill_tokens=32, prefix_cache=prefix,
        prefix_interval=32, record_logits=True, batch_prefill=batch,
    )  # fmt: skip
    pieces = []
    inner, inner_packed = eng._prefill_chunk, eng._prefill_packed

    def spy(req, start, end):
        pieces.append((id(req), start, end))
        inner(req, start, end)

    def spy_packed(planned):
        pieces.extend((id(req), start, end) for req, start, end in planned)
        inner_packed(planned)

    eng._prefill_chunk, eng._prefill_packed = spy, spy_packed
    # targets (prompt - 1): 30, 30, 2, 70 -> step 1: A 30, C fits the leftover 2 (B would get 2 < 8: deferred);
    # step 2: B 30, D 2 would be cut to 2: deferred; then D 32, 32, 6
    prompts = _prompts(13, [31, 31, 3, 71])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    reqs = [eng.submit(p, params) for p in prompts]
    eng.step()
    ids = {id(r): k for k, r in zip("ABCD", reqs)}
    assert [(ids[r], a, b) for r, a, b in pieces] == [("A", 0, 30), ("C", 0, 2)]
    while not all(r.finished for r in reqs):
        eng.step()
    got = [(ids[r], a, b) for r, a, b in pieces]
    assert got[2:] == [("B", 0, 30), ("D", 0, 32), ("D", 32, 64), ("D", 64, 70)]
    assert all(b - a >= 8 or b == len(prompts["ABCD".index(k)]) - 1 for k, a, b in got)
    _check_against_full_forward(tiny, reqs)


def test_prefill_reads_and_norms_through_read_normed(tiny, monkeypatch):
    """With fuse_read_norm (the default) the prefill forward takes each AttnRes read and the RMSNorm after it through
    the reader's ``read_normed`` (one launch with the fast reader), as the model's own forward does; without it, the
    read then the norm. The tokens and logits agree either way (the reference reader: the same operations)."""
    from openk3.ops.attnres.reference import AttnResReader

    in_prefill, calls = [False], []
    inner = AttnResReader.read_normed

    def spy(self, *a):
        calls.append(in_prefill[0])
        return inner(self, *a)

    monkeypatch.setattr(AttnResReader, "read_normed", spy)
    prompts = _prompts(31, [23, 9, 40])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    runs = {}
    for fuse in (True, False):
        eng = Engine(tiny, None, fuse_read_norm=fuse, prefix_cache=False, record_logits=True)
        prefill = eng._prefill_pieces

        def watched(*a, prefill=prefill):
            in_prefill[0] = True
            try:
                return prefill(*a)
            finally:
                in_prefill[0] = False

        eng._prefill_pieces = watched
        calls.clear()
        runs[fuse] = (eng.generate(prompts, params), calls.count(True))
    fused, unfused = runs[True][1], runs[False][1]
    assert fused >= 2 * len(tiny.model.layers) and unfused == 0, (fused, unfused)
    for a, b in zip(runs[True][0], runs[False][0]):
        assert a.output_ids == b.output_ids
        assert _rel(torch.stack(a.logits_log), torch.stack(b.logits_log)) < 1e-6


@pytest.mark.parametrize("prefix", [False, True, "rounds"])
def test_batch_prefill_equals_one_sequence_per_forward(tiny, prefix, monkeypatch):
    """EngineConfig.batch_prefill packs one piece of each prefilling request into one forward (varlen KDA from each
    sequence's own state and conv history, per-sequence MLA over its cached prefix): the logits equal the
    one-sequence-per-forward engine's and a full re-forward, with ragged prompts longer than a step's budget (so
    pieces continue from cached state), a one-token prompt, prefix-cache hits and prompt logprobs."""
    kw = dict(page_size=5, max_seqs=6, max_tokens=2048, max_prefill_tokens=48, record_logits=True)
    kw |= dict(prefix_interval=16) if prefix else dict(prefix_cache=False)
    # packed snapshots from the recurrence in rounds (default: over the prefixes)
    if prefix == "rounds":
        monkeypatch.setattr("openk3.modules.kda.SNAP_MODE", "rounds")
    base = _prompts(21, [70])[0]
    prompts = _prompts(22, [2, 37, 90, 17]) + [base[:40] + _prompts(23, [9])[0]]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    runs = []
    for batch in (False, True):
        eng = Engine(tiny, None, batch_prefill=batch, **kw)
        forwards = []
        for name in ("_prefill_chunk", "_prefill_packed"):
            inner = getattr(eng, name)

            def spy(*a, inner=inner, name=name, forwards=forwards):
                forwards.append(name)
                return inner(*a)

            setattr(eng, name, spy)
        eng.generate([base], params[0])  # leaves snapshots of base's prefix behind when prefix caching is on
        runs.append((eng.generate(prompts, params), forwards))
        runs[-1] += (eng.prefix.inserts if prefix else 0,)
    (one, one_fw, one_snaps), (packed, packed_fw, packed_snaps) = runs
    assert "_prefill_packed" in packed_fw and "_prefill_packed" not in one_fw
    assert len(packed_fw) < len(
        one_fw
    )  # fewer forwards for the same prompts (snapshots taken inside the pieces)
    if prefix:
        assert packed[4].prefix_hit == one[4].prefix_hit == 32
        assert packed_snaps == one_snaps > 0  # a snapshot at every multiple of the interval either way
    for a, b in zip(packed, one):
        assert a.output_ids == b.output_ids
        assert _rel(torch.stack(a.logits_log), torch.stack(b.logits_log)) < 1e-5
    _check_logprobs(tiny, packed[1])  # prompt logprobs from the packed forward against a full re-forward
    _check_against_full_forward(tiny, packed)


def test_batch_prefill_survives_preemption(tiny):
    """Pages run out while a packed step is planned: the preempted request restarts from scratch and every output
    equals a full re-forward."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng = Engine(
        tiny, None, page_size=4, max_seqs=3, max_tokens=72, prefix_cache=False, record_logits=True,
        batch_prefill=True, max_prefill_tokens=64,
    )  # fmt: skip
    reqs = eng.generate(_prompts(6, [20, 25, 30]), params)
    assert eng.stats()["preemptions_total"] > 0
    _check_against_full_forward(tiny, reqs)


def test_abort_frees_pages_and_slot(tiny):
    eng = Engine(tiny, None, page_size=4, max_seqs=2, max_tokens=512, prefix_cache=False)
    outs = []
    a = eng.submit(_prompts(9, [30])[0], SamplingParams(max_tokens=100, temperature=0), on_output=outs.append)
    b = eng.submit(_prompts(10, [10])[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.stats()["pages_used_by_sequences"] > 0
    eng.abort(a.id)
    eng.step()
    assert a.finished and a.finish_reason == "abort" and outs[-1].finished
    assert a.slot is None and not a.pages
    while not b.finished:
        eng.step()
    assert b.finish_reason == "length" and len(b.output_ids) == 5
    s = eng.stats()
    assert s["pages_free"] == s["pages_total"] and s["slots_free"] == 2


@pytest.fixture(scope="module")
def tiny_pinned(tiny):
    """``tiny`` with pinned routing (``engine_chaos.pin_routing``), for exact batch-against-alone comparisons."""
    return engine_chaos.pin_routing(copy.deepcopy(tiny))


@pytest.mark.parametrize("seed,overlap", [(3, False), (4, True)], ids=["sequential", "overlap"])
def test_random_serving_scenario_equals_each_request_alone(tiny_pinned, seed, overlap):
    """Random arrivals, prompts sharing prefixes, mixed sampling options (greedy and seeded draws, penalties, stop
    ids, min_tokens, logit bias, logprobs) and aborts, through a small pool (preemption), short prefix intervals and
    prefill pieces: each request gets exactly what it gets alone on a roomy engine without a prefix cache."""
    sc = engine_chaos.scenario(seed, tiny_pinned.config.vocab_size, overlap=overlap)
    eng = Engine(tiny_pinned, None, record_logits=True, **sc.engine_kw)
    got = engine_chaos.drive(eng, sc)
    s = eng.stats()
    # the scenario did exercise what it is for
    assert s["preemptions_total"] > 0 and s["prefix_cache_hits"] > 0
    aborted = [i for i, r in enumerate(got) if r.finish_reason == "abort"]
    assert aborted and set(aborted) <= set(sc.abort_after)
    alone_eng = Engine(tiny_pinned, None, max_seqs=2, max_tokens=4096, prefix_cache=False, record_logits=True)
    for i, (p, sp) in enumerate(zip(sc.prompts, sc.params)):
        (alone,) = alone_eng.generate([p], sp)
        r = got[i]
        n = len(r.output_ids)
        # each step's logits too: a token can survive a small error that the logits show (a stale cache row)
        if n:
            assert _rel(torch.stack(r.logits_log), torch.stack(alone.logits_log[:n])) < 1e-5, i
        if i in aborted:  # what an aborted request got is the start of its whole reply
            assert r.output_ids == alone.output_ids[:n], i
            continue
        assert (r.output_ids, r.finish_reason) == (alone.output_ids, alone.finish_reason), (i, sp)
        if sp.logprobs is not None:
            assert [e.id for e in r.logprobs] == r.output_ids
            for a, b in zip(r.logprobs, alone.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-5
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # every page is free or held by the prefix cache alone, every slot free
    assert s["pages_free"] + s["pages_held_by_prefix_cache_only"] == s["pages_total"]
    assert s["slots_free"] == sc.engine_kw["max_seqs"] and s["pages_used_by_sequences"] == 0


def test_seeded_sampling_is_batch_independent(tiny):
    eng = Engine(tiny, None, max_seqs=4, max_tokens=1024)
    p = _prompts(11, [12])[0]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    (alone,) = eng.generate([p], sp)
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    with_others = eng.generate([_prompts(12, [7])[0], p, _prompts(13, [3])[0]], [others, sp, others])
    assert alone.output_ids == with_others[1].output_ids
    (other_seed,) = eng.generate(
        [p], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other_seed.output_ids != alone.output_ids


def test_stop_token_and_limits(tiny):
    eng = Engine(tiny, None, max_seqs=2, max_tokens=256, record_logits=True)
    p = _prompts(14, [6])[0]
    (r,) = eng.generate([p], GREEDY)
    t = r.output_ids[3]
    first = r.output_ids.index(t)
    (s,) = eng.generate([p], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[t]))
    assert s.finish_reason == "stop" and s.output_ids == r.output_ids[: first + 1]
    with pytest.raises(ValueError, match="context length"):
        eng.submit(list(range(5, 5 + eng.max_model_len)), GREEDY)
    with pytest.raises(ValueError, match="maximum context length.*the cache pool holds 256 tokens"):
        eng.submit([5, 6], SamplingParams(max_tokens=eng.max_model_len))
    capped = Engine(tiny, None, max_seqs=2, max_tokens=256, max_model_len=64)
    with pytest.raises(ValueError, match="limit comes from max_model_len"):
        capped.submit([5, 6], SamplingParams(max_tokens=63))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.submit([5, 6], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="token ids"):
        eng.submit([5, 10**6], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], GREEDY)
    eng.make_request([tiny.config.vocab_size - 1], GREEDY)  # no tokenizer: the model's whole vocabulary
    # prompts given as token ids: any integer sequence, a 1-D integer tensor or array; a float id would be truncated
    # to another token and a bool read as 0 / 1, so they are refused, as are other containers
    import numpy as np

    for ok in (
        (5, 6),
        range(5, 8),
        [np.int64(5), 6],
        torch.tensor([5, 6]),
        np.array([5, 6], dtype=np.uint16),
    ):
        assert eng.make_request(ok, GREEDY).prompt_ids == [int(t) for t in ok]
    for bad, match in (
        ([5, 1.0], "must be integers, got 1.0"),
        ([True, 5], "must be integers, got True"),
        ([[5]], "must be integers"),
        (None, "a string or a sequence of token ids, got NoneType"),
        (b"ab", "got bytes"),
        (torch.tensor([5.0]), "1-D integer token ids"),
        (torch.tensor([[5]]), "1-D integer token ids"),
        (np.array([5.0]), "1-D integer token ids"),
    ):
        with pytest.raises(ValueError, match=match):
            eng.make_request(bad, GREEDY)
    # settings that leave no request servable, or no memory to plan with, are refused when the engine is built
    for kw, match in (
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": -5}, "max_model_len"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": -1.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        # option types: a string switch is not read as on, a float or string size fails here, not in an allocation
        ({"prefix_cache": "no"}, "prefix_cache must be True or False"),
        ({"overlap": 1}, "overlap must be True or False"),
        ({"page_size": "16"}, "page_size must be an integer"),
        ({"max_prefill_tokens": 512.0}, "max_prefill_tokens must be an integer"),
        ({"prefix_cache_bytes": True}, "prefix_cache_bytes must be an integer"),
        ({"prefix_cache_bytes": 0}, "prefix_cache_bytes must be >= 1"),
        ({"cuda_graph_max_batch": 0}, "cuda_graph_max_batch must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            Engine(tiny, None, max_seqs=2, max_tokens=256, **kw)
    with pytest.raises(ValueError, match="max_seqs must be an integer"):
        Engine(tiny, None, config=EngineConfig(max_seqs=2.5, max_tokens=256))
    assert Engine(tiny, None, max_seqs=2, max_tokens=256, max_model_len=2).max_model_len == 2


def test_prompt_ids_past_the_tokenizer_are_refused(tiny):
    """With a tokenizer smaller than the model's vocabulary (its rows padded), a prompt id in the padding is an
    error, as the sampler never draws one; a tokenizer larger than the model's vocabulary is refused up front."""
    from openk3.train.data import default_corpus
    from openk3.train.tokenizer import Tokenizer

    tok = Tokenizer.train_bpe(default_corpus(max_bytes=200_000), vocab_size=600)
    V = tiny.config.vocab_size
    assert tok.vocab_size < V
    eng = Engine(tiny, tok, max_seqs=2, max_tokens=256)
    eng.make_request([5, tok.vocab_size - 1], GREEDY)
    for bad in (tok.vocab_size, V - 1):
        with pytest.raises(ValueError, match=rf"prompt token ids must lie in \[0, {tok.vocab_size}\)"):
            eng.make_request([5, bad], GREEDY)
    small = K3ForCausalLM(dataclasses.replace(tiny.config, vocab_size=512)).eval()
    with pytest.raises(ValueError, match="the tokenizer has .* tokens but the model only 512"):
        Engine(small, tok, max_seqs=2, max_tokens=256)


def test_cuda_graph_flag_is_a_noop_on_cpu(tiny):
    eng = Engine(tiny, None, max_seqs=2, max_tokens=128, use_cuda_graphs=True)
    assert not eng.graphs_enabled
    (r,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(r.output_ids) == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_background_thread(tiny, overlap):
    eng = Engine(tiny, None, max_seqs=4, max_tokens=512, overlap=overlap)
    eng.start()
    try:
        reqs = eng.generate(
            _prompts(15, [4, 9]), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        )
        assert all(len(r.output_ids) == 5 for r in reqs)
        pending = eng.submit([5, 6], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    finally:
        eng.shutdown()
    assert eng._thread is None
    assert pending.done_event.is_set() and pending.finish_reason in ("abort", "length")
    assert eng.stats()["pages_used_by_sequences"] == 0 and eng._pending is None


# ------------------------------------------------------------------------------------------------ memory
def test_memory_accounting_matches_spec():
    lay = CacheLayout.from_config(get_preset("k3"))
    assert len(lay.mla_layers) == 24 and len(lay.kda_layers) == 69
    assert lay.bytes_per_token(torch.bfloat16) == 27_648  # SPEC.md §2.5
    state = 69 * 96 * 128 * 128 * 4  # SPEC.md §1.5: 434 MB fp32
    assert lay.bytes_per_sequence() == state + 69 * 3 * 96 * 128 * 3 * 4
    kl = CacheLayout.from_config(get_preset("kimi-linear-48b"))
    assert kl.bytes_per_token(torch.bfloat16) == 7 * 576 * 2


def test_pool_plan_and_allocation(tiny):
    plan = plan_pool(tiny.config, page_size=16, max_seqs=4)
    assert plan.max_tokens == 32768 and "CPU default" in plan.source
    plan = plan_pool(tiny.config, page_size=16, max_seqs=4, max_tokens=100)
    assert plan.num_pages == 7
    pool = PagedHybridCache(tiny.config, num_pages=3, page_size=2, max_seqs=2)
    assert (
        pool.nbytes() == 4 * pool.bytes_per_token * 2 + 3 * pool.bytes_per_sequence
    )  # + scratch page and slot
    pages = [pool.alloc_page() for _ in range(3)]
    assert pool.alloc_page() is None
    pool.snap_ref(pages[:2])
    pool.release_pages(pages)
    assert pool.num_free_pages == 1 and pool.num_reclaimable_pages == 3
    pool.share_page(pages[0])
    assert pool.num_reclaimable_pages == 2 and pool.num_seq_pages == 1
    pool.release_pages([pages[0]])
    pool.snap_unref(pages[:2])
    assert pool.num_free_pages == 3
    with pytest.raises(RuntimeError):
        pool.release_pages([pages[0]])


def test_incremental_detokenizer_matches_full_decode(tmp_path):
    from openk3.train.tokenizer import Tokenizer

    tok = Tokenizer.train_bpe(
        ["héllo wörld ünïcode 漢字 " * 20, "def f(x):\n    return x\n" * 20], vocab_size=300
    )
    ids = tok.encode("héllo 漢字 wörld def f(x): ünïcode")
    d = IncrementalDetokenizer(tok)
    text = "".join(d.push(t) for t in ids) + d.flush()
    assert text == tok.decode(ids)


def test_step_error_fails_requests_but_engine_survives(tiny, monkeypatch):
    eng = Engine(tiny, None, max_seqs=2, max_tokens=256)
    outs = []
    r = eng.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), on_output=outs.append)

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(eng, "_decode_forward", boom)
    eng.step()
    assert r.finished and r.finish_reason == "error" and "injected failure" in outs[-1].error
    assert eng.stats()["engine_errors_total"] == 1 and eng.stats()["pages_used_by_sequences"] == 0
    monkeypatch.undo()
    (ok,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert ok.finish_reason == "length" and len(ok.output_ids) == 4


def test_cli_generate_chat_help_and_errors(tmp_path, monkeypatch, capsys):
    import io

    from openk3.cli import main

    monkeypatch.chdir(tmp_path)  # no runs/default here: the embedded tiny model is used
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    common = ["-n", "4", "--temperature", "0", "--max-total-tokens", "512"]
    assert main(["generate", "--prompt", "def f(x):", "-q", *common]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\n/help\nagain\n/exit\nnever sent\n"))
    assert main(["chat", *common]) == 0
    out = capsys.readouterr()
    assert out.out.strip()  # replies were printed
    assert "history cleared" in out.err and out.err.count("/reset clears the history") == 2  # banner + /help
    for cmd in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and "example" in capsys.readouterr().out
    assert main(["generate", "--ckpt", str(tmp_path / "missing"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert main(["generate", "-q", "--top-p", "0", *common]) == 2
    assert "top_p" in capsys.readouterr().err
    # bad sampling flags and a bad API key are refused before any model loads (here: before the missing checkpoint)
    missing = str(tmp_path / "missing")
    for cmd in ("generate", "chat"):
        assert main([cmd, "--ckpt", missing, "--top-p", "0", *common[:2]]) == 2, cmd
        err = capsys.readouterr().err
        assert "top_p" in err and "does not exist" not in err, (cmd, err)
    assert main(["serve", "--ckpt", missing, "--api-key", "two words"]) == 2
    err = capsys.readouterr().err
    assert "printable ASCII" in err and "does not exist" not in err, err
    # a prompt the engine refuses (longer than the context) is not echoed before the one-line error
    assert main(["generate", "-q", "--prompt", "x " * 600, *common]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "context" in out.err


def test_random_model_and_cli_preset(tmp_path, monkeypatch, capsys):
    """``--preset NAME``: a freshly initialised model of that preset (random weights, built on the device in the
    dtype asked for, SPEC §5.3's fp32 parameters and buffers kept fp32), served under its own name, even where a
    trained default run exists; refused beside ``--ckpt`` and for unknown names."""
    from openk3.cli import build_parser, main
    from openk3.config import get_preset
    from openk3.infer.engine import free_memory, load_for_inference, random_model

    m = random_model(
        "small", dtype=torch.bfloat16, seed=3, num_hidden_layers=2, kda_layers=[1], full_attn_layers=[2]
    )
    assert m.config.num_hidden_layers == 2 and not m.training
    kept = [n for n, p in m.named_parameters() if getattr(p, "_keep_fp32", False)]
    assert kept, "the model has parameters SPEC §5.3 keeps in fp32"
    for n, p in m.named_parameters():
        assert p.dtype == (torch.float32 if n in kept else torch.bfloat16), n
        assert not p.requires_grad
    assert all(b.dtype == torch.float32 for b in m.buffers() if b.is_floating_point())
    again = random_model(
        "small", dtype=torch.bfloat16, seed=3, num_hidden_layers=2, kda_layers=[1], full_attn_layers=[2]
    )
    other = random_model(
        "small", dtype=torch.bfloat16, seed=4, num_hidden_layers=2, kda_layers=[1], full_attn_layers=[2]
    )
    w = lambda mm: mm.model.embed_tokens.weight  # noqa: E731
    assert torch.equal(w(m), w(again)) and not torch.equal(w(m), w(other))
    with pytest.raises(ValueError, match="floating-point"):
        random_model("tiny", dtype=torch.int32)
    # a preset larger than the device's free memory is refused before anything is allocated (K3: ~5.6 TB in bf16)
    assert free_memory(torch.device("cpu")) > 0
    with pytest.raises(RuntimeError, match=r"preset 'k3' needs \d+\.\d GB of weights in bfloat16, more than"):
        random_model("k3", dtype=torch.bfloat16)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    # a default run directory exists, yet --preset takes the preset
    (tmp_path / "runs" / "default" / "final").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "final" / "config.json").write_text("{}")
    model, tok, name, source = load_for_inference(preset="small", device="cpu")
    assert model.config.name == "small" and name == "openk3-small-random" and "random weights" in source
    assert model.config.vocab_size == get_preset("small").vocab_size >= tok.vocab_size
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="not both"):
        load_for_inference(str(tmp_path / "x"), preset="tiny")
    # a device the engine cannot run on: one line naming it, before any model is built
    bad = ["meta", "mps"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])
    if torch.cuda.is_available():
        bad.append(f"cuda:{torch.cuda.device_count()}")
    for dev in bad:
        assert main(["generate", "-q", "--preset", "tiny", "--device", dev, "-n", "2"]) == 2, dev
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and dev in err[0] and "Traceback" not in err[0], (dev, err)
    common = ["-n", "3", "--temperature", "0", "--max-total-tokens", "256"]
    assert main(["generate", "--preset", "tiny", "--prompt", "ab", "-q", *common]) == 0
    assert capsys.readouterr().out.startswith("ab")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--preset", "tiny", "--ckpt", str(tmp_path), "-q", *common])
    assert "not both" in str(e.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--preset", "no-such-preset"])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_max_tokens_is_new_tokens():
    """``--max-tokens`` means new tokens, as the API's ``max_tokens`` (the same as ``-n`` / ``--max-new-tokens``);
    the cache pool's size is ``--max-total-tokens``; ``serve`` takes no ``--max-tokens`` (requests carry theirs)."""
    from openk3.cli import build_parser

    parser = build_parser()
    for cmd in ("generate", "chat"):
        for flag in ("--max-tokens", "--max-new-tokens", "-n"):
            a = parser.parse_args([cmd, flag, "7", "--max-total-tokens", "512"])
            assert a.max_new_tokens == 7 and a.pool_tokens == 512, (cmd, flag)
        a = parser.parse_args([cmd])
        assert a.max_new_tokens in (128, 256) and a.pool_tokens is None
    assert parser.parse_args(["serve", "--max-total-tokens", "64"]).pool_tokens == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-tokens", "64"])


def test_decode_step_refused_when_unsupported(monkeypatch):
    """A fast decode step whose ``supports(config)`` says no: the reference with a notice under auto, a clear
    error when forced; the kernels' own checks follow their shape limits."""
    from openk3.infer import decode as D
    from openk3.infer import kernels as KN

    def fast(*a, **k):
        raise AssertionError("must not run")

    fast.supports = lambda cfg: (cfg.kda_head_dim == 128, "head_dim must be 128")
    monkeypatch.setitem(D.FAST_KDA_DECODE, "fake", fast)
    tiny_cfg, small_cfg = get_preset("tiny"), get_preset("small")
    assert D.resolve_kda_decode(True, None, None, tiny_cfg) is D.kda_decode_reference
    assert D.resolve_kda_decode(True, None, None, small_cfg) is fast
    with pytest.raises(ValueError, match="head_dim must be 128"):
        D.resolve_kda_decode(True, None, "fake", tiny_cfg)
    assert D.resolve_kda_decode(False, None, None, small_cfg) is D.kda_decode_reference  # CPU
    # the Triton kernels' limits: tiny's shared key (8 values) is too narrow for the MLA kernel
    assert KN.mla_supports(tiny_cfg)[0] is False and "shared key" in KN.mla_supports(tiny_cfg)[1]
    assert KN.mla_supports(small_cfg) == (True, "") and KN.kda_supports(small_cfg) == (True, "")
    assert KN.kda_supports(get_preset("tiny").replace(kda_head_dim=24))[0] is False


def test_pool_plan_from_free_gpu_memory(tiny, monkeypatch):
    """On CUDA without --max-total-tokens the pool takes the free memory times the utilisation, minus the reserve
    and the per-sequence state; too little memory is a clear error (the CUDA query is stubbed: runs on CPU)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (10 * gib, 80 * gib))
    lay = CacheLayout.from_config(tiny.config)
    bpt, bps = lay.bytes_per_token(torch.bfloat16), lay.bytes_per_sequence()
    plan = plan_pool(
        tiny.config, device="cuda", dtype=torch.bfloat16, page_size=16, max_seqs=8,
        gpu_memory_utilization=0.5, reserve_bytes=gib,
    )  # fmt: skip
    want = (5 * gib - gib - 9 * bps) // (bpt * 16)
    assert plan.num_pages == want and "10.0 GiB free x 0.5" in plan.source
    assert plan.num_pages * 16 * bpt + 9 * bps <= 4 * gib  # within the budget
    with pytest.raises(RuntimeError, match="not enough free GPU memory"):
        plan_pool(tiny.config, device="cuda", page_size=16, max_seqs=8, reserve_bytes=20 * gib)


def test_capture_graphs_is_a_noop_on_cpu(tiny):
    eng = Engine(tiny, None, max_seqs=4, max_tokens=256)  # CUDA graphs on by default: ignored on CPU
    assert eng.cfg.use_cuda_graphs and not eng.graphs_enabled
    assert eng.capture_graphs() == 0
    r = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(r.output_ids) == 3


@pytest.mark.parametrize("variant", ["tiny", "low-rank gate, no q-lora, no MLA gate"])
def test_fused_projections_match(tiny, variant):
    """fuse_projections: one GEMM over the input projections stored side by side per attention layer gives the
    decode logits of the unfused engine and of a full re-forward; the modules' weights become views of that buffer
    (same values, no second copy)."""
    model = tiny
    if variant != "tiny":
        torch.manual_seed(1)
        cfg = get_preset("tiny").replace(
            attn_res_init="normal", use_full_rank_gate=False, q_lora_rank=None, mla_use_output_gate=False
        )
        model = K3ForCausalLM(cfg).eval()
    prompts = _prompts(21, [5, 23, 40], model.config.vocab_size)
    runs = []
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for fuse in (False, True):
        eng = Engine(model, None, max_seqs=4, max_tokens=512, record_logits=True, fuse_projections=fuse)
        reqs = eng.generate(prompts, GREEDY)
        _check_against_full_forward(model, reqs)
        runs.append((eng, reqs))
    (e0, r0), (e1, r1) = runs
    for a, b in zip(r0, r1):
        assert a.output_ids == b.output_ids
        assert _rel(torch.stack(b.logits_log), torch.stack(a.logits_log)) < 1e-5
    assert e0.memory_report()["fused_projection_layers"] == 0
    assert e1.memory_report()["fused_projection_layers"] == len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        buf, sizes = e1._fused[i]
        mods = Engine._input_projections(layer)
        assert sizes == [m.weight.shape[0] for m in mods]
        for m in mods:  # views into the one buffer, not copies
            assert m.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("flag", ["fuse_read_norm", "fuse_kda_lowrank"])
def test_decode_fusion_flags_match(tiny, flag):
    """EngineConfig.fuse_read_norm (each AttnRes read and the RMSNorm after it through the reader's read_normed;
    here the reference reader, which norms its read) and fuse_kda_lowrank (a no-op without the Triton KDA step)
    give the unfused engine's decode logits and those of a full re-forward."""
    prompts = _prompts(23, [5, 29, 12], tiny.config.vocab_size)
    runs = []
    for fuse in (False, True):
        eng = Engine(tiny, None, max_seqs=4, max_tokens=512, record_logits=True, **{flag: fuse})
        assert getattr(eng.cfg, flag) is fuse
        if flag == "fuse_kda_lowrank":
            assert eng._kda_lowrank == {}  # CPU: the reference step keeps its GEMV
        reqs = eng.generate(prompts, GREEDY)
        _check_against_full_forward(tiny, reqs)
        runs.append(reqs)
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids
        assert torch.equal(torch.stack(a.logits_log), torch.stack(b.logits_log))


@pytest.mark.parametrize(
    "variant,fuse_proj",
    [("tiny", True), ("tiny", False), ("no q-lora, no MLA gate", True), ("no q-lora, no MLA gate", False)],
    ids=["tiny", "tiny-unfused-proj", "plain-q-nogate", "plain-q-nogate-unfused-proj"],
)
def test_fuse_mla_glue_matches(tiny, variant, fuse_proj):
    """EngineConfig.fuse_mla_glue (CPU: the PyTorch reference prep and post steps, given the same inputs as the
    Triton kernels on CUDA: the raw latent and rope key, the absorbed weights, the gate projection) gives the decode
    logits of the engine without it and of a full re-forward, with and without the output gate and q LoRA, with the
    input projections fused or not."""
    model = tiny
    if variant != "tiny":
        torch.manual_seed(3)
        cfg = get_preset("tiny").replace(attn_res_init="normal", q_lora_rank=None, mla_use_output_gate=False)
        model = K3ForCausalLM(cfg).eval()
    mla = [layer.self_attn for layer in model.model.layers if layer.attn_type != "kda"]
    assert mla and all((m.q_lora_rank is None) == (variant != "tiny") for m in mla)
    assert all(m.use_gate == (variant == "tiny") for m in mla)
    prompts = _prompts(25, [5, 29, 12], model.config.vocab_size)
    runs = []
    for glue in (False, True):
        eng = Engine(
            model, None, max_seqs=4, max_tokens=512, record_logits=True, fuse_projections=fuse_proj,
            fuse_mla_glue=glue,
        )  # fmt: skip
        assert eng.memory_report()["fused_mla_glue_layers"] == (len(mla) if glue else 0)
        reqs = eng.generate(prompts, GREEDY)
        _check_against_full_forward(model, reqs)
        runs.append(reqs)
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids
        assert _rel(torch.stack(b.logits_log), torch.stack(a.logits_log)) < 1e-6


def test_fuse_mla_glue_row_limit(tiny, monkeypatch):
    """fuse_mla_glue runs the glue steps for batches of at most MLA_GLUE_MAX_ROWS rows and the unfused sequence
    above (both in one generation as the batch shrinks); the prep step writes the cache the later steps read."""
    from openk3.infer import engine as E

    calls = []
    eng = Engine(tiny, None, max_seqs=4, max_tokens=512, record_logits=True, fuse_mla_glue=True)
    prep, post, weights = eng._mla_glue
    eng._mla_glue = (lambda *a: calls.append(a[0].shape[0]) or prep(*a), post, weights)
    monkeypatch.setattr(E, "MLA_GLUE_MAX_ROWS", 2)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 12, 8)]
    reqs = eng.generate(_prompts(26, [5, 29, 12], tiny.config.vocab_size), params)
    _check_against_full_forward(tiny, reqs)
    assert calls and max(calls) <= 2  # batches of 3 took the unfused path
    assert len(set(calls)) == 2  # batches of 2 and of 1


def test_kda_lowrank_call_path(tiny):
    """The engine's fuse_kda_lowrank branch (normally taken with the Triton step on CUDA), driven on CPU by a step
    that applies the low-rank projections it is handed the way the kernel does: the calls carry the activations
    instead of the projections, and the decode logits equal the engine's without the branch."""
    from openk3.infer.kernels import kda_lowrank_ok

    calls = []

    def step(m, q, k, v, z, bl, gate, conv, state, slots, z_lowrank=None, gate_lowrank=None):
        calls.append((z is None, gate is None))
        z = m.f_b_proj(z_lowrank) if z is None else z
        gate = m.g_b_proj(gate_lowrank) if gate is None else gate
        return kda_decode_reference(m, q, k, v, z, bl, gate, conv, state, slots)

    prompts = _prompts(24, [5, 19], tiny.config.vocab_size)
    runs = []
    for fuse in (False, True):
        eng = Engine(tiny, None, max_seqs=4, max_tokens=512, record_logits=True)
        if fuse:
            eng._kda_step, eng._kda_lowrank = step, eng._plan_kda_lowrank(kda_lowrank_ok)
        runs.append(eng.generate(prompts, GREEDY))
    assert calls and all(zl for zl, _ in calls)  # the decay projection was always left to the step
    low_rank_gate = any(
        not layer.self_attn.full_rank_gate for layer in tiny.model.layers if layer.attn_type == "kda"
    )
    assert all(gl == low_rank_gate for _, gl in calls)
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids
        assert torch.equal(torch.stack(a.logits_log), torch.stack(b.logits_log))


@pytest.mark.parametrize("variant", ["tiny", "plain MoE", "latent MoE without shared experts"])
def test_fused_ffn_and_residual_match(tiny, variant):
    """fuse_ffn_projections (one GEMM per FFN over the projections that read its input: dense gate/up, MoE latent
    down + shared gate/up; and one over the output projections' inputs side by side: latent up + shared down) and
    fuse_residual (residual adds folded into the last GEMM of attention and FFN) give the decode logits of the
    unfused engine and of a full re-forward; a layer with a single such projection stays unfused; the weights become
    views of the buffers (no copies) and keep their values."""
    model = tiny
    if variant != "tiny":
        torch.manual_seed(2)
        over = (
            dict(routed_expert_hidden_size=None)
            if variant == "plain MoE"
            else dict(num_shared_experts=0, first_k_dense_replace=0)
        )
        model = K3ForCausalLM(get_preset("tiny").replace(attn_res_init="normal", **over)).eval()
    prompts = _prompts(22, [4, 31, 17], model.config.vocab_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    combos = [(False, False), (True, False), (False, True), (True, True)]
    for ffn, res in combos:
        eng = Engine(
            model,
            None,
            max_seqs=4,
            max_tokens=512,
            record_logits=True,
            fuse_ffn_projections=ffn,
            fuse_residual=res,
        )
        reqs = eng.generate(prompts, GREEDY)
        _check_against_full_forward(model, reqs)
        runs.append((eng, reqs))
    e0, r0 = runs[0]
    for (ffn, res), (_e, r) in zip(combos[1:], runs[1:]):
        for a, b in zip(r0, r):
            assert a.output_ids == b.output_ids, (ffn, res)
            assert _rel(torch.stack(b.logits_log), torch.stack(a.logits_log)) < 1e-5, (ffn, res)
    layers = model.model.layers
    want_in = [i for i, layer in enumerate(layers) if len(layer.ffn_input_projections()) >= 2]
    want_out = [
        i
        for i, layer in enumerate(layers)
        if len(layer.ffn_output_projections()) >= 2 and None not in layer.ffn_output_projections()
    ]
    assert e0.memory_report()["fused_ffn_layers"] == 0 == e0.memory_report()["fused_ffn_output_layers"]
    e1 = runs[-1][0]
    assert sorted(e1._fused_ffn) == want_in and e1.memory_report()["fused_ffn_layers"] == len(want_in)
    assert sorted(e1._fused_ffn_out) == want_out and e1.memory_report()["fused_ffn_output_layers"] == len(
        want_out
    )
    if variant == "latent MoE without shared experts":
        assert want_in == [] == want_out  # one projection per side: nothing to fuse
    elif variant == "plain MoE":
        assert want_in and want_out == []  # the routed mixture is added as it is
    else:
        assert want_in and want_out
    for i in want_in:
        buf, sizes = e1._fused_ffn[i]
        mods = layers[i].ffn_input_projections()
        assert sizes == [m.weight.shape[0] for m in mods]
        for m in mods:
            assert m.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    for i in want_out:
        buf = e1._fused_ffn_out[i]
        mods = layers[i].ffn_output_projections()
        assert buf.shape == (model.config.hidden_size, sum(m.weight.shape[1] for m in mods))
        for m in mods:
            assert m.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_moe_small_tokens_is_checked(tmp_path):
    """`--moe-small-tokens N` / OPENK3_MOE_SMALL_N and `--moe-tiled N` / OPENK3_MOE_TILED: a negative count or a
    non-integer is a clear one-line error; a valid one runs (on CPU neither path applies: the layer's backend
    runs)."""
    import os
    import subprocess
    import sys

    def run(*extra, env=None):
        cmd = [sys.executable, "-m", "openk3", "generate", "--prompt", "def f", "-n", "2", *extra]
        env = dict(os.environ, **(env or {}))
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)

    r = run("--moe-small-tokens", "-1")
    assert r.returncode != 0 and "--moe-small-tokens must be >= 0" in r.stderr
    r = run(env={"OPENK3_MOE_SMALL_N": "four"})
    assert r.returncode != 0 and "OPENK3_MOE_SMALL_N must be a non-negative integer" in r.stderr
    r = run("--moe-small-tokens", "4", "--fuse-ffn-projections", "--fuse-residual")
    assert r.returncode == 0, r.stderr
    r = run("--moe-tiled", "-2")
    assert r.returncode != 0 and "--moe-tiled must be >= 0" in r.stderr
    r = run(env={"OPENK3_MOE_TILED": "x"})
    assert r.returncode != 0 and "OPENK3_MOE_TILED must be a non-negative integer" in r.stderr
    r = run("--moe-tiled", "16")
    assert r.returncode == 0, r.stderr
    r = run(  # (empty OPENK3_MOE_SMALL_N: the default count)
        "--no-fuse-ffn-projections", "--no-fuse-read-norm", "--no-fuse-kda-lowrank", "--pdl", "--overlap",
        "--no-triton-gemv", "--fuse-glu-gemv",
        env={"OPENK3_MOE_SMALL_N": ""},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_moe_small_env_default(monkeypatch):
    """OPENK3_MOE_SMALL_N: unset or empty gives the default token count (16), 0 turns the path off, anything but
    a non-negative integer is a ValueError naming the variable."""
    from openk3.fast.moe_small import _env_tokens

    for raw, want in ((None, 16), ("", 16), (" ", 16), ("0", 0), ("3", 3)):
        if raw is None:
            monkeypatch.delenv("OPENK3_X_TOKENS", raising=False)
        else:
            monkeypatch.setenv("OPENK3_X_TOKENS", raw)
        assert _env_tokens("OPENK3_X_TOKENS", 16) == want, raw
    for raw in ("-1", "four", "1.5"):
        monkeypatch.setenv("OPENK3_X_TOKENS", raw)
        with pytest.raises(ValueError, match="OPENK3_X_TOKENS must be a non-negative integer"):
            _env_tokens("OPENK3_X_TOKENS", 16)


def test_cli_backend_choice_is_checked(tmp_path):
    """`openk3 generate --backend OP=NAME`: a clear one-line error for an unknown op or a backend this device
    cannot run; a valid choice is applied."""
    import subprocess
    import sys

    def run(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "openk3",
                "generate",
                "--prompt",
                "def f",
                "--max-new-tokens",
                "2",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    r = run("--backend", "nope=x")
    assert r.returncode != 0 and "unknown op 'nope'" in r.stderr
    if not torch.cuda.is_available():
        r = run("--backend", "mla=sdpa")
        assert r.returncode != 0 and "not available" in r.stderr
    r = run("--backend", "kda=reference", "--backend", "moe=auto")
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------ overlap
def _overlap_pair(model, **kw):
    return [Engine(model, None, record_logits=True, overlap=ov, **kw) for ov in (False, True)]


@pytest.mark.parametrize("scenario", ["greedy", "sampled", "stops", "preemption"])
def test_overlap_gives_the_same_tokens(tiny, scenario):
    """EngineConfig.overlap (step t+1 launched before step t's tokens reach the host) against the sequential
    engine: the same tokens and the same decode logits, for ragged prompts with different lengths to go, seeded
    sampling with penalties, stop tokens, and a pool small enough to preempt; nothing leaks."""
    V = tiny.config.vocab_size
    prompts = _prompts(30, [5, 23, 11, 2], V)
    kw = dict(max_seqs=4, max_tokens=1024, prefix_cache=False)
    if scenario == "greedy":
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 1, 17, 4)]
    elif scenario == "sampled":
        params = [
            SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
            SamplingParams(
                max_tokens=8, temperature=1.1, top_k=40, repetition_penalty=1.3, seed=8, ignore_eos=True
            ),
            SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.7, seed=9, ignore_eos=True),
        ]
    elif scenario == "stops":
        free = Engine(tiny, None, **kw).generate(prompts, GREEDY)
        params = [
            SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[r.output_ids[k]], ignore_eos=True)
            for r, k in zip(free, (2, 0, 7, 4))
        ]
    else:
        kw = dict(page_size=4, max_seqs=4, max_tokens=60, prefix_cache=False)
        params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    seq, ovl = _overlap_pair(tiny, **kw)
    a = seq.generate(prompts, params)
    b = ovl.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids and x.finish_reason == y.finish_reason
        if (
            scenario == "stops"
        ):  # a row that stops still runs one more forward: other batch shapes, other sums
            assert _rel(torch.stack(y.logits_log), torch.stack(x.logits_log)) < 1e-5
        else:  # the same batches step by step: bit for bit
            assert torch.equal(torch.stack(x.logits_log), torch.stack(y.logits_log))
    if scenario == "stops":
        assert all(r.finish_reason == "stop" for r in b)
    if scenario == "preemption":
        assert ovl.stats()["preemptions_total"] > 0
    if scenario == "greedy":
        _check_against_full_forward(tiny, b)
    assert ovl._pending is None and not ovl.has_work()
    s = ovl.stats()
    assert s["pages_used_by_sequences"] == 0 and s["slots_free"] == kw["max_seqs"]


def test_overlap_continuous_batching_and_abort(tiny):
    """With overlap: a request that joins while another decodes, and one aborted mid-way: the others get the tokens
    they get alone, the aborted one a prefix of its own, tokens reach the host one step behind the forward, and
    every page and slot comes back."""
    V = tiny.config.vocab_size
    pa, pb, pc = _prompts(31, [6, 40, 9], V)
    gp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    alone = Engine(tiny, None, max_seqs=4, max_tokens=1024, prefix_cache=False)
    want = {
        k: alone.generate([p], gp(n))[0].output_ids
        for k, p, n in (("a", pa, 20), ("b", pb, 6), ("c", pc, 30))
    }
    eng = Engine(tiny, None, page_size=8, max_seqs=4, max_tokens=1024, prefix_cache=False, overlap=True)
    a = eng.submit(pa, gp(20))
    c = eng.submit(pc, gp(30))
    eng.step()
    assert not a.output_ids and eng._pending is not None  # the first token is still on its way
    eng.step()
    assert len(a.output_ids) == 1
    b = eng.submit(pb, gp(6))
    for _ in range(4):
        eng.step()
    eng.abort(c.id)
    while eng.has_work():
        eng.step()
    assert a.output_ids == want["a"] and b.output_ids == want["b"]
    assert c.finish_reason == "abort" and c.output_ids == want["c"][: len(c.output_ids)] and c.output_ids
    s = eng.stats()
    assert s["pages_free"] == s["pages_total"] and s["slots_free"] == 4


@pytest.mark.parametrize(
    "variant", ["tiny", "no AttnRes, plain MoE", "no AttnRes, latent MoE without shared experts"]
)
@pytest.mark.parametrize("fuse_ffn", [True, False])
def test_parallel_ffn_and_add_norm_match(tiny, variant, fuse_ffn, monkeypatch):
    """parallel_ffn (MoE branches on a second stream; on CPU the same branch structure in place) and fuse_add_norm
    (residual add + the next RMSNorm in one call, models without AttnRes) give the decode logits of the engine
    without them, bit for bit on CPU (same ops, same order), and of a full re-forward. fuse_add_norm leaves an
    AttnRes model's walk alone."""
    import openk3.infer.engine as E

    model = tiny
    if variant != "tiny":
        torch.manual_seed(5)
        over = dict(attn_res_block_size=None)
        if "plain" in variant:
            over["routed_expert_hidden_size"] = None
        else:
            over.update(num_shared_experts=0)
        model = K3ForCausalLM(get_preset("tiny").replace(**over)).eval()
        assert not model.config.use_attn_res
    calls = []
    real = E.add_rms_norm
    monkeypatch.setattr(E, "add_rms_norm", lambda *a: calls.append(len(a[1])) or real(*a))
    prompts = _prompts(25, [6, 27, 13], model.config.vocab_size)
    runs = []
    for on in (False, True):
        calls.clear()
        eng = Engine(model, None, max_seqs=4, max_tokens=512, record_logits=True, fuse_ffn_projections=fuse_ffn,
                     parallel_ffn=on, fuse_add_norm=on)  # fmt: skip
        reqs = eng.generate(prompts, GREEDY)
        _check_against_full_forward(model, reqs)
        runs.append(reqs)
        fused_walk = on and not model.config.use_attn_res
        # per decode step: one call per layer half plus the final norm; the first one adds nothing
        L = len(model.model.layers)
        assert (len(calls) > 0) == fused_walk
        if fused_walk:
            assert len(calls) % (2 * L + 1) == 0 and calls[: 2 * L + 1].count(0) == 1
    for a, b in zip(*runs):
        assert a.output_ids == b.output_ids
        assert torch.equal(torch.stack(a.logits_log), torch.stack(b.logits_log))


@pytest.mark.parametrize("pdl", [True, False])
def test_pdl_scope_follows_row_count(tiny, pdl, monkeypatch):
    """EngineConfig.pdl switches programmatic dependent launch on only for decode steps of at most PDL_MAX_ROWS
    rows (the switch openk3's kernels read while the step runs); the process default is back afterwards."""
    import openk3.infer.engine as E
    from openk3.fast import _triton as TR

    seen = []
    body = E.Engine._decode_forward_body

    def spy(self, ids, *a):
        seen.append((ids.shape[0], TR.PDL["on"]))
        return body(self, ids, *a)

    monkeypatch.setattr(E.Engine, "_decode_forward_body", spy)
    before = TR.PDL["on"]
    eng = Engine(tiny, None, max_seqs=4, max_tokens=1024, prefix_cache=False, pdl=pdl)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 8)]
    eng.generate(_prompts(31, [4, 9], tiny.config.vocab_size), params)
    rows = {b for b, _ in seen}
    assert rows >= {1, 2}, seen
    assert all(on == (pdl and b <= E.PDL_MAX_ROWS) for b, on in seen), seen
    assert TR.PDL["on"] == before


def test_cli_engine_flag_defaults_match_engine_config():
    """Every on/off decode switch of `openk3 generate/chat/serve` defaults to EngineConfig's own default (a CLI
    default that drifted from it would run the commands with another configuration than the measured one)."""
    import argparse

    from openk3.infer import cli
    from openk3.infer.engine import EngineConfig

    p = argparse.ArgumentParser()
    cli._add_engine_args(p)
    args = vars(p.parse_args([]))
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if isinstance(f.default, bool)}
    checked = {name for name in fields if name in args}
    assert {
        "pdl",
        "triton_gemv",
        "fuse_glu_gemv",
        "fuse_norm_gemv",
        "gemv_residual",
        "fold_norms",
        "parallel_ffn",
        "overlap",
        "fuse_mla_glue",
    } <= checked, checked
    for name in checked:
        assert args[name] == fields[name], (name, args[name], fields[name])


def test_swap_ids_in_place_and_reordered():
    """Overlap's token hand-over: row b takes src[k] for each (b, k); rows continuing in place are one copy, other
    pairings (a row finished, one joined) go through their indices; rows without a pair keep their ids."""
    from openk3.infer.engine import _swap_ids

    src = torch.tensor([11, 12, 13])
    for pairs, want in (
        ([(0, 0), (1, 1)], [11, 12, 7, 8]),
        ([(0, 0), (1, 1), (2, 2)], [11, 12, 13, 8]),
        ([(1, 0), (2, 2)], [5, 11, 13, 8]),
        ([(0, 1), (1, 0)], [12, 11, 7, 8]),
        ([(1, 1)], [5, 12, 7, 8]),
    ):
        ids = torch.tensor([5, 6, 7, 8])
        _swap_ids(ids, (pairs, src))
        assert ids.tolist() == want, (pairs, ids.tolist())
    ids = torch.tensor([5, 6])
    _swap_ids(ids, None)
    assert ids.tolist() == [5, 6]


def test_latency_histogram_buckets():
    """Prometheus' bucket rule (v counts in every bucket with le >= v, a value on a bound in that bound's bucket),
    cumulative counts, sum and count; bad bounds are refused."""
    from openk3.infer.engine import LatencyHistogram

    h = LatencyHistogram([0.1, 1.0, 10.0])
    values = [0.05, 0.1, 0.10001, 1.0, 3.0, 11.0, 0.0]
    for v in values:
        h.observe(v)
    bounds, cumulative, total, count = h.snapshot()
    assert bounds == (0.1, 1.0, 10.0)
    assert cumulative == [sum(v <= b for v in values) for b in bounds] == [3, 5, 6]
    assert count == len(values) and total == pytest.approx(sum(values))
    for bad in ([], [1.0, 0.5], [0.0, 1.0], [1.0, 1.0], [float("nan")]):
        with pytest.raises(ValueError, match="buckets"):
            LatencyHistogram(bad)


def test_engine_latency_histograms(tiny):
    """Each request is observed once in each latency histogram that applies, with durations that fit its own
    timestamps: queue time <= time to first token <= end-to-end; time per output token over the tokens after the
    first; an aborted request counts in end-to-end only."""
    eng = Engine(tiny, None, max_seqs=2, max_tokens=512)
    prompts = _prompts(31, [5, 9, 3])
    reqs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    lone = eng.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0))[0]
    snap = {k: h.snapshot() for k, h in eng.latency.items()}
    assert snap["request_queue_time_seconds"][3] == 4
    assert snap["time_to_first_token_seconds"][3] == 4
    assert snap["e2e_request_latency_seconds"][3] == 4
    assert snap["time_per_output_token_seconds"][3] == 3  # the one-token request has no gap
    for r in reqs + [lone]:
        assert r.arrival <= r.admit_time <= r.first_token_time
    q, t, e = (
        snap[k][2]
        for k in ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds")
    )
    assert 0 <= q <= t <= e
    ttft = sum(r.first_token_time - r.arrival for r in reqs + [lone])
    assert t == pytest.approx(ttft, abs=1e-9)

    r = eng.submit(prompts[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    eng.abort(r.id)
    while not r.finished:
        eng.step()
    after = {k: h.snapshot()[3] for k, h in eng.latency.items()}
    assert after["e2e_request_latency_seconds"] == 5 and after["time_per_output_token_seconds"] == 3


def test_engine_is_freed_when_deleted(tiny):
    """A deleted engine is collected with its cache pool and buffers: engines made one after the other on one model
    leave the same set of reachable tensors, and take the fused projection buffers that the first made (the model's
    weights are views of them) instead of copying the weights again; the same tokens from each."""
    import gc
    import weakref

    def reachable() -> int:
        gc.collect()
        return sum(x.untyped_storage().nbytes() for x in gc.get_objects() if isinstance(x, torch.Tensor))

    sizes, ptrs, outs = [], [], []
    for _ in range(3):
        eng = Engine(tiny, None, page_size=4, max_seqs=2, max_tokens=256, prefix_cache=True)
        assert eng._fused, "the tiny model's input projections are fused"
        # later engines take the fused buffers the first one made (the modules' weights are already their views)
        ptrs.append({i: buf.data_ptr() for i, (buf, _) in eng._fused.items()})
        params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 2
        reqs = eng.generate(_prompts(40, [9, 21], tiny.config.vocab_size), params)
        outs.append([r.output_ids for r in reqs])
        ref = weakref.ref(eng)
        del eng, reqs
        gc.collect()
        assert ref() is None, "the engine is still referenced after del"
        sizes.append(reachable())
    assert sizes[0] == sizes[1] == sizes[2], sizes
    assert ptrs[0] == ptrs[1] == ptrs[2]
    assert outs[0] == outs[1] == outs[2]


def test_bad_word_sequences_follow_vllm(tiny):
    """bad_words are banned as vLLM forms their token sequences: the word with its leading spaces stripped, and the
    word after a space only where that is as many tokens with another first token (a word inside the text); blank
    words ban nothing, and without a tokenizer they are refused."""
    from openk3.train.tokenizer import Tokenizer

    tok = Tokenizer.train_bpe(["def return value self.value\n" * 50, "return x\n" * 50], vocab_size=300)
    eng = Engine(tiny, tok, page_size=16, max_seqs=2, max_tokens=256, prefix_cache=False)
    enc = lambda s: tuple(tok.encode(s, allow_special=False))  # noqa: E731
    cases = 0
    for word in ("return", "  value", "zq", "x"):
        bare, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
        want = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        cases += len(want) == 2
        assert eng._bad_word_ids([word]) == want, (word, bare, spaced)
    assert cases >= 1  # the spaced form taken at least once, left out at least once ("zq": other lengths)
    assert len(eng._bad_word_ids(["zq"])) == 1
    req = eng.make_request("def", SamplingParams(bad_words=["return", " "], max_tokens=4))
    assert req.bad_seqs == eng._bad_word_ids(["return"])
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        Engine(tiny, None, max_seqs=2, max_tokens=256).make_request([5, 6], SamplingParams(bad_words=["a"]))


def _hf_tok():
    from openk3.train.data import default_corpus
    from openk3.train.tokenizer import Tokenizer

    return Tokenizer.train_bpe(default_corpus(max_bytes=200_000), vocab_size=600)


def _tiktoken_tok(tmp_path):
    """A tiktoken-backed tokenizer (the bytes and a few merges, BOS / EOS after them): the other backend."""
    import base64

    from openk3.train.tokenizer import Tokenizer

    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"re", b"tu", b"rn", b" x", b"00", b"ab"]
    path = tmp_path / "tiktoken.model"
    path.write_bytes(
        b"".join(base64.b64encode(t) + b" " + str(i).encode() + b"\n" for i, t in enumerate(ranks))
    )
    n = len(ranks)
    return Tokenizer.from_file(path, special_tokens={"<|bos|>": n, "<|eos|>": n + 1})


@pytest.mark.parametrize("backend", ["hf", "tiktoken"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_guided_decoding(tiny, tmp_path, backend, overlap):
    """Structured output (llguidance): sampled replies of a regex, a choice and a JSON schema match them and end
    with "stop" where the match is complete, whatever the seed, with either tokenizer backend; an unguided request
    in the same batch gets the tokens it gets alone; invalid specs are SamplingParamErrors naming ``guided``."""
    import re

    pytest.importorskip("llguidance")
    from openk3.infer.sampling import SamplingParamError

    tok = _hf_tok() if backend == "hf" else _tiktoken_tok(tmp_path)
    eng = Engine(tiny, tok, page_size=16, max_seqs=8, max_tokens=4096, max_model_len=256, overlap=overlap)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "k": {"enum": ["a", "bc"]}},
        "required": ["ok", "k"],
        "additionalProperties": False,
        "x-guidance": {
            "whitespace_flexible": False
        },  # (a random model would pad flexible JSON with whitespace)
    }
    plain = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    alone = eng.generate(["x = 1"], plain)[0].output_ids
    specs = [{"regex": "[0-9]{2}-[a-c]{3}"}, {"choice": ["north", "south", "up"]}, {"json": schema}]
    for seed in range(3):
        ps = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, guided=g) for g in specs]
        rs = eng.generate(["a", "bb", "ccc", "x = 1"], ps + [plain])
        assert re.fullmatch("[0-9]{2}-[a-c]{3}", rs[0].text), rs[0].text
        assert rs[1].text in ("north", "south", "up")
        obj = json.loads(rs[2].text)
        assert isinstance(obj["ok"], bool) and obj["k"] in ("a", "bc") and set(obj) == {"ok", "k"}
        assert all(r.finish_reason == "stop" for r in rs[:3]), [r.finish_reason for r in rs]
        assert rs[3].output_ids == alone  # the masks are per row
    for bad in ({"regex": "[0-9"}, {"json": {"type": "object", "properties": 5}}, {"json": "{not json"}):
        with pytest.raises(SamplingParamError, match="guided") as e:
            eng.make_request("a", SamplingParams(guided=bad))
        assert e.value.param == "guided"
    with pytest.raises(SamplingParamError, match="needs a tokenizer"):
        Engine(tiny, None, max_seqs=2, max_tokens=256).make_request(
            [5], SamplingParams(guided={"choice": ["a"]})
        )


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_guided_start_token_ids_defer_the_grammar(tiny, overlap):
    """``guided_start_token_ids`` (a thinking model's end of reasoning): the grammar applies only after the first
    such token. Drawn from {"a", "b", X} (``allowed_token_ids``), a reply is free before X (it holds "a"s, which the
    grammar never allows) and exactly the grammar's "bbb" after it; without the option no reply holds "a" or X."""
    pytest.importorskip("llguidance")
    tok = _hf_tok()
    a, b = (tok.encode(c, allow_special=False) for c in "ab")
    assert len(a) == len(b) == 1
    x = tok.special_tokens["<|im_start|>"]
    eng = Engine(tiny, tok, page_size=16, max_seqs=8, max_tokens=4096, max_model_len=256, overlap=overlap)
    base = dict(max_tokens=40, temperature=1.0, allowed_token_ids=[a[0], b[0], x], guided={"regex": "b{3}"})
    before_x = []
    for seed in range(8):
        r = eng.generate(["x = 1"], SamplingParams(seed=seed, guided_start_token_ids=[x], **base))[0]
        ids = r.output_ids
        if x not in ids:  # (the reply ran out before X: all free)
            assert r.finish_reason == "length"
            continue
        k = ids.index(x)
        before_x += ids[:k]
        assert ids[k + 1 :] == b * 3 and r.finish_reason == "stop", ids
        r = eng.generate(["x = 1"], SamplingParams(seed=seed, **base))[0]
        assert r.output_ids == b * 3 and r.finish_reason == "stop"
    assert a[0] in before_x  # free before X: a token the grammar never allows


def test_guided_json_whitespace_follows_the_option():
    """JSON with whitespace between its tokens is a match by default (vLLM's default) and not with
    guided_compact_json (vLLM's disable_any_whitespace); a schema's x-guidance overrides the engine's choice."""
    pytest.importorskip("llguidance")
    from openk3.infer.guided import GuidedCompiler

    tok = _hf_tok()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spaced = tok.encode('{ "ok" : true }', allow_special=False)
    tight = tok.encode('{"ok":true}', allow_special=False)
    for compact in (False, True):
        gc = GuidedCompiler(tok, {tok.eos_id}, compact_json=compact)
        for spec in ({"json": schema}, {"json_object": True}):
            assert gc.matcher(spec).consume_tokens(spaced) is (not compact), (compact, spec)
            assert gc.matcher(spec).consume_tokens(tight)
        flip = {**schema, "x-guidance": {"whitespace_flexible": compact}}
        assert gc.matcher({"json": flip}).consume_tokens(spaced) is compact


def test_guided_spec_shapes():
    """SamplingParams.guided takes exactly one of the kinds, each with a value of its type."""
    from openk3.infer.sampling import SamplingParamError

    for good in ({"json": {"type": "object"}}, {"json": "{}"}, {"json_object": True}, {"regex": "a+"},
                 {"choice": ["a", "b"]}, {"grammar": 'start: "a"'}):  # fmt: skip
        assert SamplingParams(guided=good).validate().guided == good
    for bad in ({}, {"json": {}, "regex": "a"}, {"xml": "<a/>"}, {"json": 5}, {"json_object": 1}, {"regex": ""},
                {"choice": []}, {"choice": ["a", ""]}, {"choice": "a"}, {"grammar": "  "}, ["json"], "json"):  # fmt: skip
        with pytest.raises(SamplingParamError, match="guided") as e:
            SamplingParams(guided=bad).validate()
        assert e.value.param == "guided"


def test_cli_structured_output(tmp_path, monkeypatch, capsys):
    """openk3 generate's structured-output options: a regex, a choice and a schema (inline and from a file) shape
    the reply; two at once, a schema that is not JSON and a pattern llguidance rejects are one-line errors."""
    import re

    pytest.importorskip("llguidance")
    from openk3.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    common = ["-q", "--prompt", "id", "-n", "24", "--seed", "3", "--max-total-tokens", "512"]
    common += ["--guided-compact-json"]
    assert main(["generate", *common, "--regex", "[0-9]{3}-[a-z]{2}"]) == 0
    assert re.fullmatch("id[0-9]{3}-[a-z]{2}", capsys.readouterr().out.strip())
    assert main(["generate", *common, "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("idyes", "idno")
    schema = {
        "type": "object",
        "properties": {"t": {"enum": ["a", "b"]}},
        "required": ["t"],
        "additionalProperties": False,
    }
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for arg in (json.dumps(schema), str(tmp_path / "s.json")):
        assert main(["generate", *common, "--json-schema", arg]) == 0
        assert json.loads(capsys.readouterr().out.strip()[2:])["t"] in ("a", "b")
    with pytest.raises(SystemExit) as e:
        main(["generate", *common, "--regex", "a", "--choice", "b"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
    for bad, msg in ((["--json-schema", "{not json"], "not JSON"), (["--regex", "[0-9"], "regex")):
        assert main(["generate", *common, *bad]) != 0
        assert msg in capsys.readouterr().err


def test_guided_masks_of_several_rows_equal_one_by_one():
    """The batch's masks in one parallel llguidance call equal each matcher's own mask, at several points of their
    matches (a regex, a choice, a schema), and turn into the same boolean rows."""
    pytest.importorskip("llguidance")
    import numpy as np

    from openk3.infer.guided import GuidedCompiler, mask_words_to_bool

    tok = _hf_tok()
    gc = GuidedCompiler(tok, {tok.eos_id})
    specs = [{"regex": "[0-9]{2}-[a-c]{3}"}, {"choice": ["north", "south"]}, {"json": {"type": "object"}}]
    texts = ["12-a", "no", '{"k": 1']
    ms = [gc.matcher(s) for s in specs]
    for step in range(4):
        if step:  # advance each matcher by one more token of its text
            for m, t in zip(ms, texts):
                ids = tok.encode(t, allow_special=False)
                if step - 1 < len(ids):
                    assert m.consume_token(ids[step - 1])
        par = gc.mask_words(ms)
        one = np.stack([np.frombuffer(m.compute_bitmask(), dtype=np.int32) for m in ms])
        assert np.array_equal(par, one), step
        for b, m in enumerate(ms):  # one row alone: the same words, in a writable array (no torch warning)
            alone = gc.mask_words([m])
            assert alone.flags.writeable and np.array_equal(alone[0], one[b]), (step, b)
        rows = mask_words_to_bool(torch.from_numpy(par), tok.vocab_size + 7)
        for b, m in enumerate(ms):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            want = np.zeros(tok.vocab_size + 7, dtype=bool)
            n = min(len(bits), len(want))
            want[:n] = bits[:n].astype(bool)
            assert np.array_equal(rows[b].numpy(), want), (step, b)
            assert rows[b].any()
