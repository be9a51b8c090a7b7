"""Which SIMD kernel set infinity's CPU Adam runs (scalar, AVX2 or AVX-512).

The widest set the CPU supports is chosen at run time from CPUID; the build
never depends on the build machine's CPU. ``INFINITY_ADAM_ISA`` (read at
import) or :func:`set_isa` force a narrower one: tests use that to check every
path this CPU can run. All sets give the same bits (csrc/adam/kernel_impl.h).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# torch first: its libgomp must be loaded before _adam's, so that both bind to
# that one OpenMP runtime ([Note: threads] in csrc/adam/parallel.h).
import torch  # noqa: F401, I001

from infinity import _adam

ENV_VAR = "INFINITY_ADAM_ISA"
ISAS = ("scalar", "avx2", "avx512")
_CODES = {"scalar": _adam.SCALAR, "avx2": _adam.AVX2, "avx512": _adam.AVX512}


def supported_isas() -> tuple[str, ...]:
    """The kernel sets this CPU (and OS) can run, narrowest first."""
    return tuple(name for name in ISAS if _adam.isa_supported(_CODES[name]))


def best_isa() -> str:
    """The widest kernel set this CPU supports."""
    return _adam.isa_name(_adam.best_isa())


def _resolve(name: str | None, source: str) -> int:
    if name is None:
        return _adam.best_isa()
    if name not in _CODES:
        raise ValueError(f"{source} must be one of {', '.join(ISAS)}, got {name!r}")
    if not _adam.isa_supported(_CODES[name]):
        raise ValueError(
            f"{source}={name!r}, but this CPU supports only {', '.join(supported_isas())}; "
            f"pick one of those (or leave it unset for the best, {best_isa()})"
        )
    return _CODES[name]


# The code the kernels are called with; read on every call (functional.py).
isa_code: int = _resolve(os.environ.get(ENV_VAR) or None, ENV_VAR)


def get_isa() -> str:
    """The kernel set in use."""
    return _adam.isa_name(isa_code)


def set_isa(name: str | None) -> None:
    """Use kernel set ``name`` from now on (None: the best one). Process-wide."""
    global isa_code
    isa_code = _resolve(name, "isa")


@contextmanager
def use_isa(name: str | None) -> Iterator[None]:
    """Run the block with kernel set ``name``, then restore the previous one."""
    global isa_code
    previous = isa_code
    set_isa(name)
    try:
        yield
    finally:
        isa_code = previous
