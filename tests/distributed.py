"""Run a function on N real processes joined by a gloo process group (world size as the caller says),
or in one child process of its own (Child), both forked from one preloaded server.

[Note: ranks forked from a preloaded server]
Each rank is a fresh process, as under torchrun, but not a fresh interpreter: ranks are forked by
multiprocessing's fork server, which has imported torch once for the whole session (most of a
spawned rank's start-up is that import, seconds each, for every rank of every call). The server
imports nothing else and runs nothing, so a rank starts as a spawned one would: its own process,
no threads inherited, the test's module imported anew, and the environment of the caller at the
call (passed with the call: the server's is the one it started with).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch"])


def _worker(rank: int, world_size: int, port: int, env: dict, fn, args, queue) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, *args)
        # Tensors cross as numpy arrays: torch would share them by file
        # descriptor, which dies with this process.
        queue.put((rank, "ok", _plain(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _plain(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _child(env: dict, out: str, err: str, fn, args) -> None:
    os.environ.clear()
    os.environ.update(env)
    # fds 1 and 2, so that what C++, faulthandler and a dying process write lands there too
    for path, fd in ((out, 1), (err, 2)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    fn(*args)


class Child:
    """fn(*args) in one fresh process forked from the preloaded server, as run_distributed's ranks
    are (no process group): for a test whose child must end on its own terms (a signal, an exit
    code) without paying a spawned interpreter's torch import. Its stdout and stderr go to files
    under ``logs``; a KeyboardInterrupt or other exception leaves its traceback last in stderr and
    exit code 1, SystemExit(n) exit code n, signal N exit code -N (multiprocessing's rules)."""

    def __init__(self, fn, *args, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / "stdout", logs / "stderr"
        self.process = _CONTEXT.Process(
            target=_child, args=(dict(os.environ), str(self.out_path), str(self.err_path), fn, args)
        )
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if it still runs after ``timeout`` seconds."""
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stdout(self) -> str:
        return self.out_path.read_text() if self.out_path.exists() else ""

    def stderr(self) -> str:
        return self.err_path.read_text() if self.err_path.exists() else ""

    def first_line(self, timeout: float) -> str:
        """The first complete line of its stdout, once written ("" if it exits or ``timeout``
        passes first: a safety net, not a timing check)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            out = self.stdout()
            if "\n" in out:
                return out.split("\n", 1)[0] + "\n"
            if self.process.exitcode is not None:
                return ""
            time.sleep(0.02)
        return ""


def run_distributed(fn, *args, world_size: int = 2, timeout: float = 600.0) -> list:
    """fn(rank, *args) on every rank; returns the results by rank, or raises with each failing rank's traceback."""
    queue = _CONTEXT.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [
        _CONTEXT.Process(target=_worker, args=(r, world_size, port, env, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
