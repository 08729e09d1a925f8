import os

import torch

# Without CUDA, Triton kernels run in its CPU interpreter; this must be set
# before triton (imported by cswap) is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _isolated_cswap_home(tmp_path_factory):
    """Profiles a developer made with cswap-tune must not change what tests see."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CSWAP_HOME", str(tmp_path_factory.mktemp("cswap_home")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
