import os
import sys
from pathlib import Path

# `python -m pytest` in the repository puts its root on sys.path, where kernels/ (installed as
# cswap.kernels) would be found as Hugging Face's `kernels` package, which transformers imports
# (5.25: hub_kernels). cswap runs installed, so the root is not needed there.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import torch  # noqa: E402

# Without CUDA, Triton kernels run in its CPU interpreter; this must be set
# before triton (imported by cswap) is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    _share_cores_between_workers()
    _refuse_triton_36_with_numpy_24()


def _share_cores_between_workers():
    """pytest -n N runs N workers side by side: with each at torch's default of one
    thread per core, their OpenMP threads spin against each other's."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _refuse_triton_36_with_numpy_24():
    """Triton 3.6's CPU interpreter turns 1-element arrays into ints with int(array),
    which NumPy 2.4 refuses (Triton 3.7 fixed it): every interpreted kernel would fail
    with a TypeError. Say so once, with the fix, instead."""
    if torch.cuda.is_available():
        return
    import triton
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.7") and Version(np.__version__) >= Version("2.4"):
        raise pytest.UsageError(f"Triton {triton.__version__}'s CPU interpreter, which runs the kernels in these tests "
                                f"without a GPU, does not work with NumPy {np.__version__} (Triton 3.7 fixed it): "
                                f"python -m pip install 'numpy<2.4'")


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
