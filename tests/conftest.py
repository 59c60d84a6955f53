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


def pytest_collection_modifyitems(config, items):
    # the Triton-interpreter tests take minutes each on a CPU: run them first, so that parallel workers
    # (pytest -n 2) start on them together and share out the short tests afterwards
    items.sort(key=lambda item: "interpreted" not in item.name)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
