import pytest

from infinity.config import support
from infinity.zero import checkpointing


@pytest.fixture(autouse=True)
def fresh_checkpointing(monkeypatch):
    """infinity.checkpointing's settings are process-wide (as DeepSpeed's): each test starts from the
    defaults and leaves them as it found them."""
    monkeypatch.setattr(checkpointing, "_settings", checkpointing.CheckpointSettings())
    monkeypatch.setattr(checkpointing, "_configured", False)
    support._forget_reports()
    yield
    support._forget_reports()
