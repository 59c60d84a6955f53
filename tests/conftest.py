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


# the longest Triton-interpreter test (this file's kernel tests in a subprocess, ~14 min on a 2-core CI machine)
_LONGEST = "test_decode_kernels.py::test_interpreted"


def pytest_collection_modifyitems(config, items):
    # The Triton-interpreter tests take minutes each on a CPU. Under pytest-xdist (-n N --dist worksteal) each worker
    # first gets a contiguous share of the list (the first len // N tests, then the same of the rest, ...): put one
    # group of the interpreted tests at the head of each share, the longest alone in the first group, so that the
    # workers start on them together instead of one worker running them all in a row. Without xdist: them first.
    interp = [it for it in items if "interpreted" in it.name]
    rest = [it for it in items if "interpreted" not in it.name]
    n = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if n < 2 or len(interp) < 2:
        items[:] = interp + rest
    else:
        first = [it for it in interp if it.nodeid.endswith(_LONGEST)] or interp[:1]
        others = [it for it in interp if it not in first]
        groups = [first] + [others[g :: n - 1] for g in range(n - 1)]
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
