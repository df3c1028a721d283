import os
import sys
from pathlib import Path

import pytest

import specrs


@pytest.fixture(scope="session")
def engine() -> specrs.Engine:
    """The default model (SmolLM2-135M-Instruct Q4_1), loaded once for the whole run."""
    return specrs.Engine()


@pytest.fixture(scope="session")
def model_path() -> str:
    return specrs.default_model_path()


@pytest.fixture
def cuda() -> str:
    """"cuda", or a skip where no GPU can be used (a CPU-only build, or no device that opens). The
    probe only opens the device (scripts/gpu_check.py's open_device), so a kernel that fails to
    compile or launch on a present GPU raises in the test itself: a failure, not a skip."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    from gpu_check import open_device

    try:
        open_device(specrs, "cuda")
    except specrs.DeviceError as e:
        pytest.skip(f"no CUDA here: {e}")
    return "cuda"


def pytest_report_header(config):
    return f"specrs {specrs.__version__}, RAYON/CANDLE threads: {os.environ.get('CANDLE_NUM_THREADS', 'auto')}"


def pytest_addoption(parser):
    parser.addoption("--run-install", action="store_true",
                     help="run the tests marked `install` (clean venvs from PyPI: minutes, GBs; make test-install)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-install"):
        return
    skip = pytest.mark.skip(reason="installs from PyPI into clean venvs: run with --run-install (make test-install)")
    for item in items:
        if "install" in item.keywords:
            item.add_marker(skip)
