"""The kernels' threads (OpenMP, shared with torch): the caller's floating-point mode, one runtime, fork; autograd versions."""

import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from infinity.optim import AdamHyper, CPUAdam, adam_step

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def _subnormals() -> list[torch.Tensor]:
    # Made outside flush mode: under it, torch.full itself would flush them to zero.
    n = 1 << 18  # enough for several threads
    return [torch.full((n,), 1e-39), torch.full((n,), 3e-39), torch.zeros(n), torch.zeros(n)]


def _step(buffers: list[torch.Tensor], threads: int) -> list[torch.Tensor]:
    adam_step(*buffers, HYPER, step=1, num_threads=threads)
    return buffers


def test_workers_follow_the_callers_flush_denormal_mode():
    """torch.set_flush_denormal sets the calling thread's MXCSR; the OpenMP threads must take it for our work, then drop it."""
    plain = _step(_subnormals(), 4)  # the OpenMP threads exist now, in the default mode
    inputs = [_subnormals(), _subnormals()]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal (FTZ/DAZ) mode to follow")
    try:
        flushed = [_step(inputs[0], 1), _step(inputs[1], 4)]
    finally:
        torch.set_flush_denormal(False)
    assert not torch.equal(flushed[0][2], plain[2]), (
        "flushing must change this step, or the test shows nothing"
    )
    for a, b in zip(*flushed, strict=True):
        assert torch.equal(a, b)
    # The threads are torch's: they must have their own mode back, or torch's
    # next parallel op would flush subnormals on some threads.
    # (Compared as integers: float ops on those threads are the thing under test.)
    doubled = (_subnormals()[0] * 2.0).view(torch.int32)
    expected = struct.unpack("<i", struct.pack("<f", 2e-39))[0]
    assert bool((doubled == expected).all())


def test_one_openmp_runtime_whatever_the_import_order():
    """_adam links libgomp by soname, so it shares the runtime torch loaded (or torch shares its)."""
    for first in (
        "import torch, infinity.optim",
        "import infinity._adam; import torch, infinity.optim",
    ):
        script = first + textwrap.dedent(
            """
            from infinity.optim import AdamHyper, adam_step
            t = [torch.ones(1 << 18) for _ in range(4)]
            h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
            adam_step(*t, h, step=1, num_threads=2)
            torch.ones(1 << 20).mul_(2.0)
            from infinity.host import mapped_paths
            names = ("libgomp", "libiomp", "libomp")
            print(sorted(p for p in mapped_paths() if any(n in p for n in names)))
            """
        )
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        runtimes = eval(r.stdout.strip().splitlines()[-1])
        assert len(runtimes) <= 1, f"{first}: {runtimes}"


def test_cpu_adam_bumps_autograd_versions():
    """A graph that saved a parameter refuses backward after the step, as with torch's optimizers."""
    w = torch.nn.Parameter(torch.randn(5))
    opt = CPUAdam([w])
    w.grad = torch.randn(5)
    loss = (w * w).sum()  # saves w for backward
    opt.step()
    try:
        loss.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        raise AssertionError("backward through a graph that saved a since-updated param must fail")


def test_forked_child_can_step():
    """libgomp's threads do not survive fork (a region would hang); a forked child steps on its own thread."""
    # Only our kernel runs in the child: torch's own OpenMP pool (libgomp) is
    # not fork-safe once used, so the buffers are made before the fork and
    # compared as bytes.
    script = textwrap.dedent(
        """
        import os, torch
        from infinity.optim import AdamHyper, adam_step
        h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
        n = 1 << 18
        parent = [torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
        child = [t.clone() for t in parent]
        adam_step(*parent, h, step=1, num_threads=2)  # the parent's OpenMP threads start
        pid = os.fork()
        if pid == 0:
            adam_step(*child, h, step=1, num_threads=2)
            os._exit(0 if child[0].numpy().tobytes() == parent[0].numpy().tobytes() else 3)
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
