import pytest
import torch

# The test models are tiny: one intra-op thread is as fast as several on a quiet machine and far faster on a busy
# one (thread synchronisation stalls when cores are shared).
torch.set_num_threads(1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture
def rel():
    return rel_err


# Minutes each Triton-interpreter test takes on a 2-core CI machine with both workers busy (measured; an unlisted
# one counts as 1): the groups below are balanced by them
_INTERP_MINUTES = {
    "test_attnres_read_normed_training_interpreted_on_cpu": 5.6,
    "test_interpreted[mla-persist-engine]": 4.0,
    "test_engine_fold_norms_interpreted": 3.8,
    "test_interpreted[kda-sampling]": 3.6,
    "test_moe_small_interpreted_on_cpu": 3.3,
    "test_interpreted[mla-rest]": 3.3,
    "test_gemv_interpreted": 2.3,
    "test_triton_kernels_interpreted_on_cpu": 2.1,
    "test_engine_triton_gemv_interpreted[tiny]": 1.15,
    "test_engine_triton_gemv_interpreted[plain-moe]": 1.1,
    "test_moe_tiled_interpreted_on_cpu": 0.75,
    "test_fla_norm_conv_interpreted_on_cpu": 0.2,
    "test_glu_triton_interpreted_on_cpu": 0.15,
    "test_add_rms_norm_interpreted": 0.15,
    "test_gated_rms_norm_rows_interpreted": 0.1,
}


def pytest_collection_modifyitems(config, items):
    # The Triton-interpreter tests take minutes each on a CPU. Under pytest-xdist (-n N --dist worksteal) each worker
    # first gets a contiguous share of the list (the first len // N tests, then the same of the rest, ...): the
    # interpreted tests are dealt into N groups of about equal minutes (the longest first, each to the lightest
    # group), and each group goes at the head of one worker's share, so that the workers run them side by side
    # instead of one worker running them in a row. Without xdist: them first, the longest first.
    interp = [it for it in items if "interpreted" in it.name]
    rest = [it for it in items if "interpreted" not in it.name]
    interp.sort(key=lambda it: -_INTERP_MINUTES.get(it.name, 1.0))
    n = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if n < 2 or len(interp) < 2:
        items[:] = interp + rest
    else:
        groups: list[list] = [[] for _ in range(n)]
        load = [0.0] * n
        for it in interp:
            g = load.index(min(load))
            groups[g].append(it)
            load[g] += _INTERP_MINUTES.get(it.name, 1.0)
        order, left = [], len(items)
        for w, group in enumerate(groups):  # worker w's share: left // (n - w) tests, its group first
            share = left // (n - w)
            take = max(0, share - len(group))
            order += group + rest[:take]
            rest = rest[take:]
            left -= len(group) + take
        items[:] = order + rest
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
