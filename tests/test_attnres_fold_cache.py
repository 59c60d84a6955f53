"""The Triton AttnRes reader's cache of folded queries (``norm_weight * query``, fp32), used while gradients are off:
the cached value equals a fresh fold, and it is never served for another tensor or after an in-place update."""

import gc

import pytest
import torch

attnres = pytest.importorskip("openk3.fast.attnres")


def _pairs(n, D, g):
    return [
        (
            torch.randn(1, D, generator=g).to(torch.bfloat16),
            (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16),
        )
        for _ in range(n)
    ]


def _fresh(pairs):
    return torch.stack([nw.float() * q.float().reshape(-1) for q, nw in pairs])


def test_fold_cache_matches_and_is_reused():
    g = torch.Generator().manual_seed(0)
    pairs = _pairs(3, 64, g)
    with torch.no_grad():
        a = attnres._fold_stack(pairs)
        b = attnres._fold_stack(pairs)
        one = attnres._fold(*pairs[1])
    assert torch.equal(a, _fresh(pairs))
    assert b is a  # the second call is served from the cache
    assert torch.equal(one, _fresh(pairs[1:2])[0])


def test_fold_cache_invalidated_by_in_place_update():
    g = torch.Generator().manual_seed(1)
    pairs = _pairs(2, 32, g)
    with torch.no_grad():
        a = attnres._fold_stack(pairs).clone()
        pairs[0][0].mul_(3.0)  # e.g. an optimizer step or load_state_dict
        pairs[1][1].add_(1.0)
        b = attnres._fold_stack(pairs)
    assert not torch.equal(a, b)
    assert torch.equal(b, _fresh(pairs))


def test_fold_cache_never_serves_a_recycled_tensor():
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(20):  # new tensors, often at the addresses (and ids) of freed ones
            pairs = _pairs(2, 16, g)
            assert torch.equal(attnres._fold_stack(pairs), _fresh(pairs))
            del pairs
            gc.collect()
    assert len(attnres._FOLDS._entries) <= 1  # entries of dead tensors are dropped


def test_fold_not_cached_with_gradients():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, generator=g, requires_grad=True)
    nw = torch.randn(8, generator=g, requires_grad=True)
    w = attnres._fold(q, nw)
    assert w.requires_grad
    w.sum().backward()
    assert torch.equal(q.grad.reshape(-1), nw.detach()) and torch.equal(nw.grad, q.detach().reshape(-1))


def test_fold_of_inference_tensors_is_not_cached():
    """Tensors made under inference_mode have no version counter, so an in-place update could not be seen: they are
    folded afresh every time (and do not raise)."""
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        pairs = _pairs(2, 16, g)
        a = attnres._fold_stack(pairs)
        pairs[0][0].mul_(2)
        b = attnres._fold_stack(pairs)
    assert torch.equal(a, _fresh([(pairs[0][0] / 2, pairs[0][1]), pairs[1]]))
    assert torch.equal(b, _fresh(pairs))
