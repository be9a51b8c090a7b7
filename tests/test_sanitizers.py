"""The aio and Adam extensions under AddressSanitizer + UndefinedBehaviorSanitizer.

.ci/sanitize.sh builds both once with ASan + UBSan (CMake's INFINITY_SANITIZE, in
build/sanitize) and runs their tests against that build. The run is shown to be real by the
bugs planted in that build only (INFINITY_PLANT_UAF): a use-after-free and a signed overflow,
each of which must end the process with the sanitizer's report.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import infinity._aio
from tests import background, sanitizer_runs

# The build and the sanitized run each take minutes (ASan slows the tests about 2x); the suite's
# 600 s limit per test stopped the run on a loaded machine, so these get more. Both run in the
# background from the start of a session that collects this file ([Note: checks in the
# background] in tests/background.py); the tests wait for them.
pytestmark = [pytest.mark.sanitize, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def build(request) -> tuple[background.Background, subprocess.CompletedProcess]:
    """Builds the sanitized extensions (once; later runs reuse build/sanitize) and runs the aio
    and Adam tests against them: the build's result is checked here, the tests' by the test."""
    bg = background.of(request.config)
    built, tests = bg.result(sanitizer_runs.NAME, sanitizer_runs.build_then_tests)
    assert built.returncode == 0, built.stdout + built.stderr
    return bg, tests


def _call(build, function: str) -> subprocess.CompletedProcess:
    code = f"import infinity._aio as a; a.{function}"
    return sanitizer_runs.sanitized(build[0], sys.executable, "-c", code, timeout=300)


def test_the_regular_build_has_no_planted_bugs():
    assert not hasattr(infinity._aio, "_planted_use_after_free")
    assert not hasattr(infinity._aio, "_planted_signed_overflow")


def test_a_planted_use_after_free_is_caught(build):
    r = _call(build, "_planted_use_after_free()")
    assert r.returncode == 86, r.stdout + r.stderr  # ASAN_OPTIONS exitcode in sanitize.sh
    assert "ERROR: AddressSanitizer: heap-use-after-free" in r.stderr, r.stderr
    assert "freed by thread" in r.stderr and "bindings.cc" in r.stderr, r.stderr


def test_a_planted_signed_overflow_is_caught(build):
    assert _call(build, "_planted_signed_overflow(0)").returncode == 0  # no overflow: no report
    r = _call(build, "_planted_signed_overflow(1)")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "runtime error: signed integer overflow" in r.stderr, r.stderr


def test_the_aio_and_adam_tests_are_clean_under_the_sanitizers(build):
    r = build[1]
    out = r.stdout + r.stderr
    # rc 0 also says the tests imported the sanitized build: .ci/sanitized_build.py stops the run
    # otherwise
    assert r.returncode == 0, out
    assert "AddressSanitizer" not in out and "runtime error:" not in out, out
    assert " passed" in out and " failed" not in out, out
