from pathlib import Path

import pytest

from infinity.config import support

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def fresh_reports():
    """Each test sees the once-per-process 'no effect here' report afresh."""
    support._forget_reports()
    yield
    support._forget_reports()


@pytest.fixture
def data_dir() -> Path:
    return DATA
