"""Peer oracle for the token draw: transformers' logits processors (repetition penalty, temperature, min-p, top-k,
top-p: vLLM's order, which is ``generate``'s but for min-p, applied there after top-p) give the distribution; the same counter-based Gumbel noise draws from it. The
engine's ``sample`` must pick the same token on every row, greedy rows included."""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from openk3.infer.sampling import gumbel_argmax_reference, sample, sample_keys  # noqa: E402


def _hf_scores(logits, input_ids, temperature, top_k, top_p, penalty, min_p=0.0):
    """One row's processed scores as transformers computes them (greedy: the penalty alone, then argmax)."""
    procs = LogitsProcessorList()
    if penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature > 0:
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if min_p > 0:
            procs.append(MinPLogitsWarper(min_p))
        if top_k > 0:
            procs.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
    return procs(input_ids[None], logits[None].clone())[0]


@pytest.mark.parametrize("V", [97, 1000])
def test_sample_matches_transformers_processors(V):
    rng = random.Random(V)
    torch.manual_seed(V)
    B, L, rows = 16, 24, 0
    for trial in range(12):
        logits = torch.randn(B, V) * rng.choice([0.5, 2.0, 4.0])
        input_ids = torch.randint(0, V, (B, L))
        seen = torch.zeros(B, V, dtype=torch.bool).scatter_(1, input_ids, True)
        temps = [rng.choice([0.0, 0.3, 0.7, 1.0, 1.5]) for _ in range(B)]
        ks = [rng.choice([0, 1, 5, 50, V]) for _ in range(B)]
        ps = [rng.choice([1.0, 0.95, 0.5, 0.1]) for _ in range(B)]
        pens = [rng.choice([1.0, 1.3, 0.8]) for _ in range(B)]
        mps = [rng.choice([0.0, 0.0, 0.02, 0.2, 0.7]) for _ in range(B)]
        keys = sample_keys([rng.getrandbits(63) for _ in range(B)], [rng.randrange(1000) for _ in range(B)])
        got = sample(
            logits, temperature=temps, top_k=ks, top_p=ps, repetition_penalty=pens, seen=seen, keys=keys,
            min_p=mps, fast=False,
        )  # fmt: skip
        for b in range(B):
            s = _hf_scores(logits[b], input_ids[b], temps[b], ks[b], ps[b], pens[b], mps[b])
            if temps[b] == 0:
                want = int(s.argmax())
            else:
                want = int(gumbel_argmax_reference(s[None], torch.tensor([keys[b]]))[0])
            assert int(got[b]) == want, (trial, b, temps[b], ks[b], ps[b], pens[b], mps[b])
            rows += 1
    assert rows == 12 * B


def _near_top_p_boundary(logits: torch.Tensor, p: float, tol: float = 3e-7) -> torch.Tensor:
    """Tokens whose fate under top-p is not decided in fp32: the probability mass of the tokens more likely than
    them (computed in fp64) lies within ``tol`` of ``p``, where fp32 sums in any order (ours descending,
    transformers' ascending) may fall on either side."""
    z = logits.double()
    vals, idx = z.sort(dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    before = probs.cumsum(-1) - probs
    near = (before - p).abs() < tol
    return torch.zeros_like(near).scatter(1, idx, near)


def test_filters_keep_what_transformers_keeps():
    """The kept sets of top-k and top-p (no ties in fp32 random logits) equal transformers' at many settings,
    except for tokens whose preceding mass is within 3e-7 of p (fp32 rounding decides those; a handful in all)."""
    from openk3.infer.sampling import apply_temperature, top_k_filter, top_p_filter

    torch.manual_seed(3)
    x = torch.randn(64, 500) * 3
    undecided = 0
    for t in (0.5, 1.0, 2.0):
        for k in (1, 3, 40, 499):
            for p in (0.05, 0.3, 0.9, 0.999):
                tk = top_k_filter(apply_temperature(x, t), k)
                ours = top_p_filter(tk, p)
                hf = LogitsProcessorList(
                    [TemperatureLogitsWarper(t), TopKLogitsWarper(k), TopPLogitsWarper(p)]
                )(torch.zeros(64, 1, dtype=torch.long), x.clone())
                decided = ~_near_top_p_boundary(tk, p)
                undecided += int((~decided & torch.isfinite(tk)).sum())
                assert torch.equal(torch.isfinite(ours) & decided, torch.isfinite(hf) & decided), (t, k, p)
                both = torch.isfinite(ours) & torch.isfinite(hf)
                assert torch.equal(ours[both], hf[both]), (t, k, p)
    assert undecided <= 8, undecided  # the exclusion stays a handful of boundary tokens (4 here) out of ~1.5M


def test_min_p_keeps_what_transformers_keeps():
    """min-p's kept set equals transformers' ``MinPLogitsWarper`` (probabilities there, log space here) at several
    temperatures and ratios, away from the boundary; with top-k the two filters commute, so transformers' top-k then
    min-p keeps what our min-p then top-k keeps."""
    from openk3.infer.sampling import apply_temperature, min_p_filter, top_k_filter

    torch.manual_seed(5)
    x = torch.randn(64, 500) * 3
    zeros = torch.zeros(64, 1, dtype=torch.long)
    undecided = 0
    for t in (0.5, 1.0, 2.0):
        xs = apply_temperature(x, t)
        gap = (xs.double() - xs.double().amax(-1, keepdim=True)).double()
        for mp in (0.001, 0.05, 0.3, 0.9):
            decided = (gap - torch.log(torch.tensor(mp, dtype=torch.float64))).abs() > 1e-5
            undecided += int((~decided).sum())
            ours = min_p_filter(xs, mp)
            hf = LogitsProcessorList([TemperatureLogitsWarper(t), MinPLogitsWarper(mp)])(zeros, x.clone())
            assert torch.equal(torch.isfinite(ours)[decided], torch.isfinite(hf)[decided]), (t, mp)
            for k in (1, 5, 60):
                ours_k = top_k_filter(min_p_filter(xs, mp), k)
                hf_k = LogitsProcessorList(
                    [TemperatureLogitsWarper(t), TopKLogitsWarper(k), MinPLogitsWarper(mp)]
                )(zeros, x.clone())
                assert torch.equal(torch.isfinite(ours_k)[decided], torch.isfinite(hf_k)[decided]), (t, mp, k)
    assert undecided <= 8, undecided
