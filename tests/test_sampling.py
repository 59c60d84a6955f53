"""Sampling transforms and stop-string helpers (pure functions)."""

import os
import random

import pytest
import torch

from openk3.infer.sampling import (
    SamplingParamError,
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    find_stop,
    gumbel_argmax_reference,
    sample,
    sample_keys,
    stop_holdback,
    top_k_filter,
    top_p_filter,
)


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))
    # a greedy row stays greedy next to sampled rows
    out = sample(logits, temperature=[0.0, 1.0, 0.0, 1.0, 0.0], generators=_gens(1, 2, 3, 4, 5))
    assert out[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_greedy_on_low_precision_logits():
    """All-greedy rows without a penalty take the argmax of the logits as they are: bf16 logits (ties made by the
    rounding, a NaN row) give the indices of their fp32 copy, as int64; a penalty or a sampled row still works on
    the fp32 copy."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 300, generator=g) * 3).to(torch.bfloat16)
    x[1, 7] = x[1, 250] = x[1].max() + 1  # a tie: the first index wins
    x[2, 5] = float("nan")
    got = sample(x, temperature=0.0)
    assert got.dtype == torch.long and torch.equal(got, x.float().argmax(-1)), (got, x.float().argmax(-1))
    assert int(got[1]) == 7 and int(got[2]) == 5
    seen = torch.zeros(4, 300, dtype=torch.bool)
    seen[0, int(got[0])] = True
    pen = sample(x, temperature=0.0, repetition_penalty=50.0, seen=seen)
    want = apply_repetition_penalty(x.float(), seen, [50.0] * 4).argmax(-1)
    assert torch.equal(pen, want) and int(pen[0]) != int(got[0])


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    a = sample(logits, temperature=1.0, generators=_gens(7, 8, 9, 10))
    b = sample(logits, temperature=1.0, generators=_gens(7, 8, 9, 10))
    assert torch.equal(a, b)
    # row 2 alone, same generator seed: same token as inside the batch
    alone = sample(logits[2:3], temperature=1.0, generators=_gens(9))
    assert alone.item() == a[2].item()
    draws = {tuple(sample(logits, temperature=1.0, generators=_gens(s, s, s, s)).tolist()) for s in range(20)}
    assert len(draws) > 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(4000, 4).contiguous()
    g = torch.Generator().manual_seed(0)
    toks = sample(logits, temperature=1.0, generators=[g] * 4000)
    freq = torch.bincount(toks, minlength=4).float() / 4000
    assert (freq - probs).abs().max() < 0.03  # ~4 sigma for 4000 draws, fixed seed


def test_keyed_sampling_is_reproducible_and_batch_independent():
    """keys (the engine's draws): a row's token depends on its own (seed, position) only."""
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    keys = sample_keys([7, 8, 9, 10], [3, 3, 3, 3])
    a = sample(logits, temperature=1.0, keys=keys)
    assert torch.equal(a, sample(logits, temperature=1.0, keys=keys))
    alone = sample(logits[2:3], temperature=1.0, keys=sample_keys([9], [3]))
    assert alone.item() == a[2].item()
    # next to greedy rows and with other rows' settings changed: the same token
    mixed = sample(logits, temperature=[0.0, 2.0, 1.0, 0.0], keys=keys)
    assert mixed[2].item() == a[2].item() and mixed[0].item() == logits[0].argmax().item()
    # other seeds and other positions draw other tokens (some of 20)
    assert (
        len(
            {
                tuple(sample(logits, temperature=1.0, keys=sample_keys([s] * 4, [3] * 4)).tolist())
                for s in range(20)
            }
        )
        > 1
    )
    assert (
        len({sample(logits[:1], temperature=1.0, keys=sample_keys([7], [c])).item() for c in range(20)}) > 1
    )
    with pytest.raises(ValueError, match="keys"):
        sample(logits, temperature=1.0, keys=keys[:3])


def test_sample_keys_are_distinct():
    keys = sample_keys([s for s in range(50) for _ in range(40)], [c for _ in range(50) for c in range(40)])
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**32 for k in keys)
    big = sample_keys([2**62 + 1, -5, 2**40], [0, 0, 2**33])
    assert len(set(big)) == 3


def test_keyed_sampling_follows_the_distribution():
    """One seed, 20000 positions: token frequencies match softmax(logits), also after top-k / top-p (and only
    the kept tokens appear)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log()[None].expand(n, 4).contiguous()
    keys = sample_keys([123] * n, list(range(n)))
    toks = sample(logits, temperature=1.0, keys=keys)
    freq = torch.bincount(toks, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.015  # ~4 sigma for 20000 draws
    kept = sample(logits, temperature=1.0, top_k=2, keys=keys)
    assert set(kept.tolist()) == {0, 1}
    f2 = torch.bincount(kept, minlength=2).float() / n
    assert abs(f2[0] - 0.5 / 0.8) < 0.015
    # the reference draw itself: -inf entries are never chosen
    x = torch.randn(50, 30)
    x[:, ::2] = float("-inf")
    assert (gumbel_argmax_reference(x, torch.tensor(sample_keys(range(50), [0] * 50))) % 2 == 1).all()


def test_temperature_scales_logits():
    x = torch.tensor([[1.0, 2.0, -4.0], [1.0, 2.0, -4.0]])
    y = apply_temperature(x, [2.0, 0.0])
    assert torch.allclose(y[0], x[0] / 2) and torch.equal(y[1], x[1])
    g = torch.Generator().manual_seed(0)
    cold = sample(torch.tensor([[0.0, 1.0, 0.5]]).expand(200, 3), temperature=0.01, generators=[g] * 200)
    assert (cold == 1).all()


def test_top_k_keeps_k_largest_and_ties():
    x = torch.tensor([[3.0, 1.0, 2.0, 5.0, 4.0], [1.0, 1.0, 1.0, 0.0, 2.0]])
    y = top_k_filter(x, torch.tensor([2, 2]))
    assert torch.isfinite(y[0]).tolist() == [False, False, False, True, True]
    assert torch.isfinite(y[1]).tolist() == [True, True, True, False, True]  # ties with the k-th are kept
    assert torch.equal(top_k_filter(x, 0), x) and torch.equal(top_k_filter(x, 99), x)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 30).expand(300, 30)
    toks = sample(logits, temperature=1.0, top_k=3, generators=[g] * 300)
    assert set(toks.tolist()) <= set(logits[0].topk(3).indices.tolist())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    torch.manual_seed(1)
    x = torch.randn(6, 40) * 2
    y = top_p_filter(x, p)
    probs = torch.softmax(x, -1)
    for row in range(6):
        kept = torch.isfinite(y[row])
        mass = probs[row][kept].sum().item()
        assert mass >= p - 1e-6
        # minimal: dropping the least likely kept token falls below p
        least = probs[row][kept].min().item()
        assert mass - least < p or kept.sum() == 1
        # nucleus = most likely tokens: every kept token beats every dropped one
        if (~kept).any():
            assert probs[row][kept].min() >= probs[row][~kept].max()
    assert torch.equal(top_p_filter(x, 1.0), x)
    assert torch.isfinite(top_p_filter(x, 1e-9)).sum(-1).tolist() == [1] * 6  # the top token always survives


def test_top_p_keeps_tied_tokens_together():
    """Equal logits straddling the nucleus boundary are kept or dropped as a group, in any column order: a token is
    dropped only when the mass of the strictly more likely tokens reaches p (the draw kernels' rule)."""
    torch.manual_seed(2)
    for trial in range(20):
        V = 64
        x = torch.randn(1, V)
        group = torch.randperm(V)[:5]
        x[0, group] = x[0].sort(descending=True).values[3].item()  # a run of 5 equal values near the top
        x = x.to(torch.bfloat16).float()  # bf16 values: more ties elsewhere too
        probs = torch.softmax(x[0], -1)
        for p in (0.2, 0.4, 0.6, 0.9):
            kept = torch.isfinite(top_p_filter(x, p)[0])
            above = torch.stack([probs[x[0] > v].sum() for v in x[0]])  # mass strictly above each token
            expect = above < p
            expect[x[0].argmax()] = True
            assert torch.equal(kept, expect), (trial, p)
            perm = torch.randperm(V)
            kept_perm = torch.isfinite(top_p_filter(x[:, perm], p)[0])
            assert torch.equal(kept_perm, kept[perm]), (trial, p)


def test_repetition_penalty_hf_semantics():
    x = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    y = apply_repetition_penalty(x, seen, 2.0)
    assert y.tolist() == [[1.0, -4.0, 3.0, -1.0]]  # positive / p, negative * p, unseen unchanged
    assert torch.equal(apply_repetition_penalty(x, seen, 1.0), x)
    # greedy choice moves away from a seen token
    z = torch.tensor([[3.0, 2.5]])
    assert sample(z, temperature=0.0, repetition_penalty=1.5, seen=torch.tensor([[True, False]])).item() == 1


def test_inputs_are_not_modified():
    x = torch.randn(2, 10)
    keep = x.clone()
    top_k_filter(x, 3)
    top_p_filter(x, 0.5)
    apply_repetition_penalty(x, torch.ones(2, 10, dtype=torch.bool), 1.3)
    sample(x, temperature=0.7, top_k=4, top_p=0.9, generators=_gens(1, 2))
    assert torch.equal(x, keep)


def test_stop_helpers():
    assert find_stop("hello world", ["wor", "xyz"]) == 6
    assert find_stop("hello world", ["o w", "llo"]) == 2
    assert find_stop("hello", ["zz"]) == -1
    assert find_stop("abcabc", ["abc"], start=4) == 3  # only matches ending after `start`
    assert stop_holdback("the end is ne", ["near", "xyz"]) == 2
    assert stop_holdback("abc", ["c!", "bc?"]) == 2
    assert stop_holdback("abc", ["zz"]) == 0
    assert stop_holdback("", ["zz"]) == 0
    rng = random.Random(0)
    for _ in range(3000):  # against the definition, on small alphabets (many partial matches)
        text = "".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(1, 9))) for _ in range(3)]
        want = max(
            [k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])],
            default=0,
        )
        assert stop_holdback(text, stops) == want, (text, stops)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"temperature": 10**400}, "temperature"),  # past the float range: an error, not an OverflowError
        ({"logit_bias": {5: -(10**400)}}, "logit_bias"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        # 0 (1e-300) or a subnormal (1e-45) in fp32: positive logits of seen tokens become inf and tie, so the
        # draw takes the first of them whatever their logits; 1e300 is inf in fp32
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-45}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 101}, "repetition_penalty"),
        ({"seed": 2**64 + 5}, "seed"),  # past 64 bits: it would draw as seed 5
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 10**5000}, "seed"),
        ({"stop": 5}, "stop"),  # not a list: was a TypeError from iterating it
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),  # a truthy string is not a switch
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),  # nothing could be drawn
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"bad_words": [3]}, "bad_words"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
        ({"truncation_side": "both"}, "truncation_side"),
    ],
)
def test_params_validation(kw, match):
    with pytest.raises(SamplingParamError, match=match) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == match


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###").validate()
    assert p.stop == ["###"] and not p.greedy
    assert SamplingParams(temperature=0).validate().greedy
    assert SamplingParams(max_tokens=None).validate().max_tokens is None
    assert SamplingParams(top_k=-1).validate().top_k == -1 and SamplingParams(top_k=0).validate().top_k == 0
    for pen in (0.01, 0.5, 1, 100):
        assert SamplingParams(repetition_penalty=pen).validate().repetition_penalty == pen
    for seed in (-(2**63), -1, 0, 2**63 - 1):  # every signed 64-bit seed is taken
        assert SamplingParams(seed=seed).validate().seed == seed
    for mp in (0, 0.05, 1):
        assert SamplingParams(min_p=mp).validate().min_p == mp
    assert SamplingParams(min_tokens=16).validate().min_tokens == 16  # == max_tokens (16) is allowed
    assert SamplingParams(min_tokens=500, max_tokens=None).validate().min_tokens == 500
    p = SamplingParams(bad_words="word", allowed_token_ids=(4, 5), truncate_prompt_tokens=-1).validate()
    assert p.bad_words == ["word"] and p.allowed_token_ids == [4, 5] and p.truncate_prompt_tokens == -1
    assert SamplingParams(bad_words=["", "  "]).validate().bad_words == []  # blank words ban nothing


def test_min_p_keeps_tokens_within_the_ratio_of_the_best():
    """min_p keeps token i iff p_i >= min_p * p_max (probabilities in fp64, away from the boundary), whatever the
    scale; the best token and its ties always stay, 0 keeps every token, 1 only the best (and ties)."""
    from openk3.infer.sampling import min_p_filter

    torch.manual_seed(0)
    x = torch.randn(32, 300) * torch.tensor([0.3, 1.0, 4.0, 10.0]).repeat(8)[:, None]
    x[0, :3] = x[0].max() + 1  # a three-way tie at the top
    for mp in (0.0, 1e-3, 0.1, 0.5, 1.0):
        got = min_p_filter(x, mp)
        pr = torch.softmax(x.double(), -1)
        ratio = pr / pr.amax(-1, keepdim=True)
        decided = (ratio - mp).abs() > 1e-9
        assert torch.equal(torch.isfinite(got)[decided], (ratio >= mp)[decided]), mp
        assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(got)])  # kept logits unchanged
        assert bool(torch.isfinite(got[0, :3]).all())  # tied best tokens stay
        if mp == 0.0:
            assert torch.equal(got, x)
    per_row = min_p_filter(x[:2], [0.0, 1.0])
    assert bool(torch.isfinite(per_row[0]).all()) and int(torch.isfinite(per_row[1]).sum()) == 1


def test_sample_refuses_bad_shapes_and_an_unavailable_fast_path():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="one value per row"):
        sample(x, temperature=[1.0, 1.0, 1.0], keys=[1, 2])
    with pytest.raises(ValueError, match="seen"):
        sample(x, repetition_penalty=1.2, seen=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="keys"):
        sample(x, keys=[1])
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="fast=True"):
            sample(x, keys=[1, 2], fast=True)


@pytest.mark.parametrize("V,k", [(8192, 5), (3000, 3), (2048, 0), (4096, 20)])
def test_token_logprobs_match_log_softmax(V, k):
    """token_logprobs (logsumexp; two-stage top-k over whole 1,024-wide chunks, or one topk) against
    log_softmax + topk."""
    from openk3.infer.sampling import token_logprobs

    g = torch.Generator().manual_seed(V + k)
    x = (3 * torch.randn(4, V, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, V, (4,), generator=g)
    chosen, vals, idx = token_logprobs(x, ids, k)
    lp = torch.log_softmax(x.float(), -1)
    assert (chosen - lp.gather(1, ids[:, None])[:, 0]).abs().max() < 1e-5
    ref = lp.topk(k, dim=-1)
    assert vals.shape == (4, k) and idx.shape == (4, k) and idx.dtype == torch.long
    assert torch.allclose(vals, ref.values, rtol=0, atol=1e-5)
    # same values at the returned ids (bf16 logits tie often: ids may differ only among equal values)
    assert torch.allclose(lp.gather(1, idx), ref.values, rtol=0, atol=1e-5)
    assert bool((vals[:, :-1] >= vals[:, 1:]).all())


def test_count_penalties_openai_semantics_and_order():
    """frequency / presence penalties subtract ``f * count + p * (count > 0)``; they come after the repetition
    penalty (vLLM's order): a case where the other order picks another token."""
    from openk3.infer.sampling import apply_count_penalties

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 50, generator=g)
    counts = torch.randint(0, 3, (3, 50), generator=g).float()
    got = apply_count_penalties(x, counts, [0.5, 0.0, -1.0], [0.0, 1.5, 0.3])
    f = torch.tensor([[0.5], [0.0], [-1.0]])
    p = torch.tensor([[0.0], [1.5], [0.3]])
    assert torch.allclose(got, x - f * counts - p * (counts > 0).float())
    ids = sample(
        x,
        temperature=0.0,
        counts=counts,
        frequency_penalty=[0.5, 0.0, -1.0],
        presence_penalty=[0.0, 1.5, 0.3],
    )
    assert torch.equal(ids, got.argmax(-1))
    # order: repetition penalty (3.0 / 2 = 1.5), then frequency (1.5 - 0.5 = 1.0 < 1.2): token 1;
    # the other order would give (3.0 - 0.5) / 2 = 1.25 > 1.2: token 0
    y = torch.tensor([[3.0, 1.2]])
    kw = dict(temperature=0.0, seen=torch.tensor([[True, False]]), repetition_penalty=2.0)
    assert sample(y, counts=torch.tensor([[1.0, 0.0]]), frequency_penalty=0.5, **kw).tolist() == [1]
    assert sample(y, counts=torch.tensor([[1.0, 0.0]]), **kw).tolist() == [0]  # penalties of 0: no change
    with pytest.raises(ValueError, match="counts"):
        sample(y, counts=torch.zeros(1, 3), frequency_penalty=0.5)
    for name in ("frequency_penalty", "presence_penalty"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 2.5}).validate()
        SamplingParams(**{name: -2.0}).validate()


def top_hash_hits(V: int, want: int, start: int = 0) -> list[tuple[int, int]]:
    """(key, token) pairs whose 24-bit hash is the largest, 2**24 - 1 (the uniform that rounds to 1.0 in fp32),
    found by brute force over the keys of seeds start, start + 1, ... at position 0."""
    from openk3.infer.sampling import _h32, sample_keys

    hv = _h32(torch.arange(V, dtype=torch.long))
    hits, seed = [], start
    while len(hits) < want:
        keys = torch.tensor(sample_keys(range(seed, seed + 4096), [0] * 4096))
        h = _h32(hv[None, :] ^ keys[:, None]) >> 8
        for r, i in (h == 2**24 - 1).nonzero().tolist():
            hits.append((int(keys[r]), i))
        seed += 4096
    return hits[:want]


def test_gumbel_noise_stays_finite_at_the_top_hash():
    """The uniform of the largest hash used to round to 1.0: +inf noise (that token won whatever its probability:
    about 1 draw in 100 at 163,840 tokens), NaN for a banned (-inf) token, which argmax then picked. Now finite."""
    from openk3.infer.sampling import gumbel_argmax_reference, gumbel_scores

    V = 4096
    for key, i in top_hash_hits(V, 3):
        keys = torch.tensor([key])
        x = torch.zeros(1, V)
        sc = gumbel_scores(x, keys)
        assert torch.isfinite(sc).all(), (key, i)
        # a token with a tiny probability is not drawn because of its noise
        x = torch.full((1, V), -30.0)
        j = (i + 1) % V
        x[0, j] = 0.0
        assert int(gumbel_argmax_reference(x, keys)) == j
        # a banned token scores -inf, never NaN, so it is never the draw
        x[0, i] = float("-inf")
        sc = gumbel_scores(x, keys)
        assert sc[0, i] == float("-inf") and int(gumbel_argmax_reference(x, keys)) == j
