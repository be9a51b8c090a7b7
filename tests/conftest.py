import os
import sys
from pathlib import Path

import pytest

# Test directories are packages (test file names repeat across them); the
# helper modules beside the tests (aio_util, adam_helpers, ...) are imported
# by their bare names, so each test directory is also on sys.path.
for _d in sorted(Path(__file__).resolve().parent.iterdir()):
    if (_d / "__init__.py").exists() and str(_d) not in sys.path:
        sys.path.append(str(_d))


@pytest.fixture
def nvme_dir(tmp_path_factory) -> Path:
    """A directory on a disk file system (O_DIRECT works there), not tmpfs.

    pytest's tmp_path may be on tmpfs on some machines; swap files belong on
    the disk, so this lives under INFINITY_TEST_NVME (default ~/.cache).
    """
    root = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root.mkdir(parents=True, exist_ok=True)
    d = tmp_path_factory.mktemp("nvme", numbered=True)
    target = root / f"{os.getpid()}-{d.name}"
    target.mkdir(parents=True, exist_ok=True)
    yield target
    import shutil

    shutil.rmtree(target, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests that ask for the io_uring engine by name skip, saying why, where this process cannot
    use it: Docker's default seccomp profile (moby #46762), kernel.io_uring_disabled, a build
    without liburing. Everything else runs on the threads engine there (see docs/troubleshooting.md)."""
    from infinity.aio import io_uring_status

    reason = io_uring_status()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"io_uring is not available here: {reason}")
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and any(
            v == "io_uring" or (isinstance(v, tuple) and "io_uring" in v)
            for v in spec.params.values()
        ):
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The long checks this session will read start now, in the background ([Note: checks in the
    background] in tests/background.py)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        if item.path.name == "test_sanitizers.py" and "build" in item.fixturenames:
            from tests import background, sanitizer_runs

            background.of(session.config).start(
                sanitizer_runs.NAME, sanitizer_runs.build_then_tests
            )
        if item.path.name == "test_repo.py" and item.originalname == "test_mypy_clean":
            from tests import background, test_repo

            background.of(session.config).start(test_repo.MYPY, test_repo.mypy)


def pytest_sessionfinish(session):
    background = sys.modules.get("tests.background")
    if background is not None and background.KEY in session.config.stash:
        session.config.stash[background.KEY].stop()
