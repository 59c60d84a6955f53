"""Peer oracle: transformers' native kimi_linear model (independent implementation of KDA + NoPE MLA + MoE)."""

import pytest
import torch

from openk3 import K3Config, K3ForCausalLM

transformers = pytest.importorskip(
    "transformers", reason="transformers is a test dependency (pip install -e .[test])"
)


def _hf_model(tmp_path, **over):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kw = dict(
        vocab_size=211,
        hidden_size=48,
        num_hidden_layers=6,
        num_attention_heads=3,
        num_key_value_heads=3,
        linear_num_heads=3,
        linear_head_dim=16,
        moe_intermediate_size=24,
        intermediate_size=80,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=6,
        v_head_dim=10,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(over)
    cfg = KimiLinearConfig(**kw)
    torch.manual_seed(torch.seed() % 2**31)
    m = _perturbed(KimiLinearForCausalLM(cfg).float().eval())
    m.save_pretrained(tmp_path)
    return m


def _perturbed(m):
    """``m`` with non-trivial values for the parameters and buffers that initialise to constants."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n:
                p.add_(0.1 * torch.randn_like(p))
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    return m


@pytest.mark.parametrize("q_lora", [None, 16])
def test_transformers_kimi_linear_logits_match(tmp_path, rel, q_lora):
    hf = _hf_model(tmp_path, q_lora_rank=q_lora)
    cfg = K3Config.from_pretrained(tmp_path)
    assert cfg.layer_types.count("mla") >= 1 and cfg.kda_gate_kind == "softplus"
    ours = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 29))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert rel(got, ref) < 1e-4, rel(got, ref)


@pytest.mark.parametrize("q_lora", [None, 16])
def test_our_export_loads_in_transformers(tmp_path, rel, q_lora):
    """The other direction: a Kimi-Linear-family model built and saved by openk3 (released names and layouts,
    config.json without K3-only fields) loads in transformers with no missing, unexpected or mismatched key, and
    its logits equal ours."""
    from transformers import AutoModelForCausalLM

    from openk3 import get_preset

    cfg = get_preset(
        "kimi-linear-48b",
        vocab_size=211,
        hidden_size=48,
        num_hidden_layers=6,
        kda_layers=[],
        full_attn_layers=[],
        num_attention_heads=3,
        num_key_value_heads=3,
        kda_num_heads=3,
        kda_head_dim=16,
        moe_intermediate_size=24,
        intermediate_size=80,
        num_experts=6,
        num_experts_per_token=2,
        kv_lora_rank=20,
        q_lora_rank=q_lora,
        qk_nope_head_dim=12,
        qk_rope_head_dim=6,
        v_head_dim=10,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    ours = _perturbed(K3ForCausalLM(cfg).float().eval())
    assert cfg.layer_types.count("mla") >= 1 and cfg.first_k_dense_replace == 1
    ours.save_pretrained(tmp_path)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert type(hf).__name__ == "KimiLinearForCausalLM"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), (kind, info.get(kind))
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    with torch.no_grad():
        got = ours(ids).logits
        ref = hf.eval()(ids).logits
    assert rel(got, ref) < 1e-4, rel(got, ref)


def test_transformers_cached_decode_matches(tmp_path, rel):
    """Our prefill + cached decode steps equal transformers' full forward."""
    hf = _hf_model(tmp_path)
    ours = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 211, (1, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = ours.new_cache()
        parts = [ours(ids[:, :15], cache=cache).logits]
        for t in range(15, 20):
            parts.append(ours(ids[:, t : t + 1], cache=cache).logits)
    assert rel(torch.cat(parts, 1), ref) < 1e-4


def test_engine_greedy_matches_transformers_generate(tmp_path):
    """The serving engine (paged cache with 4-token pages, continuous batching of ragged prompts, chunked prefill,
    prefix-cache hits on a second round) generates, greedily, the tokens transformers' ``generate`` does with its
    own cache, one prompt at a time; each step's log-probability agrees too. A different token is allowed only
    where transformers' top two candidates lie within 1e-4 of each other (a tie up to rounding), and never
    earlier than one."""
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams

    hf = _hf_model(tmp_path)
    ours = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    eng = Engine(
        ours, None, page_size=4, max_seqs=4, max_tokens=512, max_prefill_tokens=16, prefix_interval=8
    )
    steps = 24
    prompts = [torch.randint(0, 211, (n,)).tolist() for n in (5, 19, 33)]
    params = SamplingParams(max_tokens=steps, temperature=0, logprobs=1, ignore_eos=True)
    for round_ in range(2):  # the second round reuses cached prefixes
        reqs = eng.generate(prompts, params)
        for p, r in zip(prompts, reqs):
            with torch.no_grad():
                ids = torch.tensor(
                    [p]
                )  # (an explicit mask: with only pad_token_id, prompt ids equal to it are masked)
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                    output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                )  # fmt: skip
            want = out.sequences[0, len(p) :].tolist()
            assert len(r.output_ids) == steps
            for t, (a, b) in enumerate(zip(r.output_ids, want)):
                lp = torch.log_softmax(out.logits[t][0].float(), -1)
                assert abs(r.logprobs[t].logprob - lp[a].item()) < 1e-4, (round_, t)
                if a != b:
                    top2 = lp.topk(2).values
                    assert (top2[0] - top2[1]).item() < 1e-4, (round_, len(p), t, a, b)
                    break  # the two continuations differ from here on
    assert eng.stats()["prefix_cache_hit_tokens"] > 0
