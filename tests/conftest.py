import os

import pytest

import specrs


@pytest.fixture(scope="session")
def engine() -> specrs.Engine:
    """The default model (SmolLM2-135M-Instruct Q4_1), loaded once for the whole run."""
    return specrs.Engine()


@pytest.fixture(scope="session")
def model_path() -> str:
    return specrs.default_model_path()


def pytest_report_header(config):
    return f"specrs {specrs.__version__}, RAYON/CANDLE threads: {os.environ.get('CANDLE_NUM_THREADS', 'auto')}"
