"""A random serving scenario for the engine: requests of random prompts (many sharing a prefix with an earlier one),
random sampling options and lengths, arriving at random steps, some aborted a few steps after they arrive, run
through an engine with a small cache pool (preemption), short prefix-cache intervals, short prefill pieces and an
odd page size. The tests compare what each request got with the same request served alone."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from openk3.infer.sampling import SamplingParams


def pin_routing(model, seed: int = 0):
    """Pin each MoE layer's routing of ``model`` to a fixed expert set (a large correction bias), in place; returns
    it. At random init some tokens sit on near-tied experts, where a last-bit difference of their input (another
    batch, another prefill piece) flips an expert and moves that token's logits by ~1 % (bench/NOTES.md v50): a
    comparison of a request served in a batch with it served alone is exact only without such ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                gate = layer.block_sparse_moe.gate
                gate.e_score_correction_bias[
                    torch.randperm(gate.weight.shape[0], generator=g)[: gate.top_k]
                ] = 10.0
    return model


@dataclass
class Scenario:
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrive: list[int]  # the engine step at which each request is submitted
    abort_after: dict[int, int]  # request index -> steps after its arrival at which it is aborted
    engine_kw: dict = field(default_factory=dict)


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randrange(1, 40), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1 << 30))
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([2.0, 0.5])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([1.0, -1.0])
    if rng.random() < 0.3:
        kw["presence_penalty"] = 0.7
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(5, vocab) for _ in range(20)]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(5, vocab): rng.choice([5.0, -100.0]) for _ in range(3)}
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 3])
    return SamplingParams(**kw)


def scenario(
    seed: int, vocab: int, n: int = 32, *, overlap: bool = False, pool_tokens: int = 200
) -> Scenario:
    rng = random.Random(seed)
    bases = [[rng.randrange(5, vocab) for _ in range(rng.randrange(20, 120))] for _ in range(4)]
    prompts = []
    for _ in range(n):
        b = rng.choice(bases)
        tail = [rng.randrange(5, vocab) for _ in range(rng.randrange(0, 30))]
        prompts.append(b[: rng.randrange(1, len(b) + 1)] + tail)
    params = [_params(rng, vocab) for _ in range(n)]
    arrive = [rng.randrange(0, 60) for _ in range(n)]
    abort_after = {i: rng.randrange(1, 20) for i in range(n) if rng.random() < 0.12}
    engine_kw = dict(
        page_size=rng.choice([3, 5]),
        max_seqs=rng.choice([3, 6]),
        max_tokens=pool_tokens,
        prefix_interval=rng.choice([8, 16]),
        max_prefill_tokens=rng.choice([16, 48]),
        prefix_cache_outputs=rng.random() < 0.5,
        overlap=overlap,
    )
    return Scenario(prompts, params, arrive, abort_after, engine_kw)


def drive(engine, sc: Scenario, max_steps: int = 20000) -> list:
    """Submit each request at its step and abort the chosen ones; step until all are finished. Returns the
    requests in scenario order."""
    order = sorted(range(len(sc.prompts)), key=lambda i: sc.arrive[i])
    reqs: dict[int, object] = {}
    born: dict[int, int] = {}
    step = 0
    while order or not all(r.finished for r in reqs.values()):
        while order and sc.arrive[order[0]] <= step:
            i = order.pop(0)
            reqs[i] = engine.submit(sc.prompts[i], sc.params[i], request_id=f"chaos-{i}")
            born[i] = step
        for i, after in sc.abort_after.items():
            if i in reqs and step == born[i] + after and not reqs[i].finished:
                engine.abort(f"chaos-{i}")
        engine.step()
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    return [reqs[i] for i in range(len(sc.prompts))]
