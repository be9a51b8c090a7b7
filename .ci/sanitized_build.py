"""pytest plugin of .ci/sanitize.sh: the run stops unless ``infinity`` is the sanitized copy.

Only the sanitized build has the planted functions (CMake's INFINITY_SANITIZE); both
extensions must come from the same directory, the copy sanitize.sh made.
"""

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import infinity._adam
    import infinity._aio

    aio, adam = Path(infinity._aio.__file__), Path(infinity._adam.__file__)
    if not hasattr(infinity._aio, "_planted_use_after_free") or aio.parent != adam.parent:
        raise pytest.UsageError(f"sanitize.sh: imported {aio} and {adam}, not the sanitized build")


def pytest_report_header(config: pytest.Config) -> str:
    import infinity._aio

    return f"sanitized extensions (ASan + UBSan) from {Path(infinity._aio.__file__).parent}"
