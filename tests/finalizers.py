"""Helper for the finalizer tests: which Python functions run while a test drops an object.

[Note: finalizers run no Python] (infinity/aio/handle.py): a ``__del__`` or a
weakref callback written in Python runs in whatever thread drops the last
reference, and a KeyboardInterrupt that lands there is lost. The tests drop
each kind of runtime object under ``sys.setprofile`` and require that no
Python function of infinity, or of the weakref machinery (WeakSet,
WeakMethod, weakref.finalize, which all run Python callbacks), ran meanwhile.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

import infinity

PACKAGE = str(Path(infinity.__file__).resolve().parent)
WEAKREF_FILES = ("weakref.py", "_weakrefset.py")


def python_calls_while(drop: Callable[[], None]) -> list[str]:
    """Runs ``drop()`` and returns 'file:function' of every Python function of infinity or of the
    weakref machinery that was called meanwhile in this thread."""
    calls: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE) or path.endswith(WEAKREF_FILES):
                back = frame.f_back
                via = (
                    f" (from {Path(back.f_code.co_filename).name}:{back.f_code.co_name})"
                    if back
                    else ""
                )
                calls.append(f"{Path(path).name}:{frame.f_code.co_name}{via}")

    # The objects go by reference counting alone; with the collector off, garbage left by earlier
    # tests (whose own weakref callbacks may be Python, e.g. torch's WeakKeyDictionary) is not
    # collected meanwhile and cannot show up here.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        drop()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls
