import pytest
import torch

from openk3.train.balance import (
    QuantileBalancer,
    admission_cutoff,
    exact_quantile_bias,
    expert_load,
    load_ratio,
    qb_target,
    sign_update_bias,
)


def _scores(m, n, *, seed, skew=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, n, generator=g, dtype=torch.float64)
    if skew is not None:
        logits = logits + skew.to(torch.float64)
    return torch.sigmoid(logits).to(dtype)


def _route(scores, bias, k):
    return torch.topk(scores.float() + bias.float(), k, dim=-1).indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_bias_admits_exactly_q(dtype):
    m, n, k = 3000, 32, 4
    scores = _scores(m, n, seed=0, skew=torch.linspace(-1.5, 1.5, n), dtype=dtype)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
    q = qb_target(m, k, n)
    assert q == m * k // n
    b_hat = exact_quantile_bias(scores, bias, k, center=False)
    a = admission_cutoff(scores, bias, k)
    margins = scores - a[:, None]
    x = -b_hat
    # x_j is the (q+1)-th largest margin of expert j
    assert ((margins > x).sum(0) <= q).all() and ((margins >= x).sum(0) >= q + 1).all()
    # Structural ties: for the expert at rank k+1 of token i, a_i = s_ij + b_j, so M_ij = -b_j exactly (up to
    # rounding). When the (q+1)-th largest margin falls into that cluster, b_hat_j = b_j and fewer than q
    # tokens are admitted. Every other expert gets exactly q tokens (SPEC §4.4 step 3).
    tied = (x + bias).abs() <= 1e-6
    assert int(tied.sum()) <= n // 4
    admitted = (scores + b_hat > a[:, None]).sum(0)  # step 3 as written
    assert torch.equal(admitted[~tied], torch.full((int((~tied).sum()),), q))
    assert (admitted[tied] <= q).all()
    centred = exact_quantile_bias(scores, bias, k)
    assert abs(float(centred.mean())) < 1e-6
    torch.testing.assert_close(centred, b_hat - b_hat.mean())


def test_exact_bias_continuous_case():
    # Experts 0..k-1 take every token (load m > q: quantile among strictly admitted tokens); each other
    # expert is at rank k+1 for only ~m/(n-k) < q tokens, so its (q+1)-th margin lies below its tie cluster.
    m, n, k = 2000, 16, 2
    scores = _scores(m, n, seed=11, dtype=torch.float64)
    bias = torch.zeros(n, dtype=torch.float64)
    bias[:k] = 2.0
    b_hat = exact_quantile_bias(scores, bias, k, center=False)
    a = admission_cutoff(scores, bias, k)
    admitted = (scores + b_hat > a[:, None]).sum(0)
    assert torch.equal(admitted, torch.full((n,), qb_target(m, k, n)))


def test_cutoff_is_k_plus_1th():
    s = torch.tensor([[0.9, 0.1, 0.5, 0.7, 0.3]])
    b = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0])
    # biased: 0.9, 0.6, 0.5, 0.7, 0.3 -> k=2: routes {0, 3}, cutoff 0.6
    assert float(admission_cutoff(s, b, 2)) == pytest.approx(0.6)


def test_histogram_within_one_bin_of_exact():
    m, n, k = 4000, 48, 6
    scores = _scores(m, n, seed=2, skew=torch.linspace(-2, 2, n))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.2
    for num_bins in (64, 512):
        qb = QuantileBalancer(n, k, num_bins=num_bins)
        qb.observe(scores, bias)
        assert int(qb.num_tokens()) == m
        est = qb.compute_bias(center=False)
        exact = exact_quantile_bias(scores, bias, k, center=False)
        w = qb.bin_width
        diff = est - exact
        assert diff.abs().max() <= w * (1 + 1e-4)
        # upper edge of the quantile's bin: the estimate never admits more than q tokens
        assert (diff <= 1e-6).all()
        a = admission_cutoff(scores, bias, k)
        admitted = (scores + est > a[:, None]).sum(0)
        assert (admitted <= qb_target(m, k, n)).all()
        new = qb.compute_bias()
        assert abs(float(new.mean())) < 1e-6
        assert qb.last_saturated == 0


def test_micro_batches_and_all_reduce_are_additive():
    m, n, k = 1000, 16, 2
    s1, s2 = _scores(m, n, seed=4), _scores(700, n, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.1
    two = QuantileBalancer(n, k, num_bins=128)
    two.observe(s1, bias)
    two.observe(s2, bias)
    one = QuantileBalancer(n, k, num_bins=128)
    one.observe(torch.cat([s1, s2]), bias)
    assert torch.equal(two.histogram_counts(), one.histogram_counts())
    assert torch.equal(two.compute_bias(), one.compute_bias())
    # two "ranks", counts summed (what all_reduce(SUM) does), token count recovered from the counts
    r0, r1 = QuantileBalancer(n, k, num_bins=128), QuantileBalancer(n, k, num_bins=128)
    r0.observe(s1, bias)
    r1.observe(s2, bias)
    summed = r0.histogram_counts() + r1.histogram_counts()
    r0.load_counts(summed, m=1700)
    assert torch.equal(r0.compute_bias(), one.compute_bias())
    with pytest.raises(ValueError):
        r1.load_counts(summed, m=5)
    r0.reset()
    assert int(r0.histogram_counts().sum()) == 0
    with pytest.raises(RuntimeError):
        r0.compute_bias()


def test_mask_excludes_padding():
    m, n, k = 600, 16, 2
    s = _scores(m, n, seed=7)
    bias = torch.zeros(n)
    mask = torch.rand(m, generator=torch.Generator().manual_seed(8)) > 0.3
    a, b = QuantileBalancer(n, k), QuantileBalancer(n, k)
    a.observe(s, bias, mask=mask)
    b.observe(s[mask], bias)
    assert torch.equal(a.histogram_counts(), b.histogram_counts())
    torch.testing.assert_close(
        exact_quantile_bias(s, bias, k, mask=mask), exact_quantile_bias(s[mask], bias, k), rtol=0, atol=0
    )
    # precomputed cutoffs give the same result
    c = QuantileBalancer(n, k)
    c.observe(s, bias, mask=mask, cutoff=admission_cutoff(s, bias, k))
    assert torch.equal(a.histogram_counts(), c.histogram_counts())


def test_skewed_router_gets_balanced():
    m, n, k = 2048, 32, 4
    skew = torch.zeros(n)
    skew[0] = 4.0  # one expert is (almost) always in the top-k
    skew[1:8] = 1.5
    bias = torch.zeros(n)
    idx0 = _route(_scores(m, n, seed=100, skew=skew), bias, k)
    before, _ = load_ratio(expert_load(idx0, n))
    assert float(before) > 4.0
    qb = QuantileBalancer(n, k)
    for step in range(4):
        qb.observe(_scores(m, n, seed=200 + step, skew=skew), bias)
        bias = qb.compute_bias()
        qb.reset()
    fresh = _scores(m, n, seed=999, skew=skew)
    hi, lo = load_ratio(expert_load(_route(fresh, bias, k), n))
    assert float(hi) < 1.3 and float(lo) > 0.65
    assert float(bias[0]) < float(bias[10])  # the hot expert is pushed down


def test_stacked_layers_match_single():
    L, m, n, k = 3, 500, 16, 3
    scores = torch.stack([_scores(m, n, seed=10 + i, skew=torch.linspace(-i, i, n)) for i in range(L)])
    bias = torch.randn(L, n, generator=torch.Generator().manual_seed(20)) * 0.1
    all_at_once = QuantileBalancer(n, k, num_layers=L, num_bins=256)
    all_at_once.observe(scores, bias)
    per_layer = QuantileBalancer(n, k, num_layers=L, num_bins=256)
    for i in range(L):
        per_layer.observe(scores[i], bias[i], layer=i)
    assert torch.equal(all_at_once.histogram_counts(), per_layer.histogram_counts())
    stacked = all_at_once.compute_bias()
    assert stacked.shape == (L, n)
    for i in range(L):
        single = QuantileBalancer(n, k, num_bins=256)
        single.observe(scores[i], bias[i])
        assert torch.equal(stacked[i], single.compute_bias())
    assert torch.equal(all_at_once.num_tokens(), torch.full((L,), m))
    with pytest.raises(ValueError):
        all_at_once.observe(scores[0], bias[0])  # stacked balancer needs layer= for a 2-D batch


def test_state_dict_round_trip_and_saturation():
    m, n, k = 800, 16, 2
    s = _scores(m, n, seed=30)
    bias = torch.zeros(n)
    qb = QuantileBalancer(n, k, num_bins=100, range=(-0.5, 0.5))
    qb.observe(s, bias)
    sd = qb.state_dict()
    qb2 = QuantileBalancer(n, k, num_bins=100, range=(-0.5, 0.5))
    qb2.load_state_dict(sd)
    assert torch.equal(qb.compute_bias(), qb2.compute_bias())
    qb2.observe(s, bias)
    assert int(qb.num_tokens()) == m and int(qb2.num_tokens()) == 2 * m  # state was copied, not shared
    with pytest.raises(ValueError):
        QuantileBalancer(n, k, num_bins=64).load_state_dict(sd)
    # a range too narrow for the margins saturates at its edge (and says so)
    tiny = QuantileBalancer(n, k, num_bins=10, range=(0.5, 0.6))
    tiny.observe(s, bias)
    est = tiny.compute_bias(center=False)
    assert tiny.last_saturated == n and torch.allclose(est, torch.full((n,), -0.5))


def test_sign_update_and_load_helpers():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1]])
    load = expert_load(idx, 5)
    assert load.tolist() == [3, 3, 1, 1, 0]
    assert expert_load(idx, 5, mask=torch.tensor([True, False, True, False])).tolist() == [2, 2, 0, 0, 0]
    hi, lo = load_ratio(load)
    assert float(hi) == pytest.approx(3 / 1.6) and float(lo) == 0.0
    bias = torch.zeros(5)
    new = sign_update_bias(bias, load, rate=0.01)
    assert new.tolist() == pytest.approx([-0.01, -0.01, 0.01, 0.01, 0.01])
    assert torch.equal(bias, torch.zeros(5))
    stacked = sign_update_bias(torch.zeros(2, 5), torch.stack([load, load.flip(0)]), rate=1.0)
    assert stacked[1].tolist() == [1.0, 1.0, 1.0, -1.0, -1.0]
