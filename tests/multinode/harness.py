"""Several "nodes" on one host: one ``torchrun`` agent per node, each in its own namespaces.

The multi-node harness the tests and the benches use (issue 25). ``run_nodes`` starts one
``python -m torch.distributed.run --nnodes N --node-rank k --nproc-per-node P --rdzv-backend c10d``
agent per node on loopback (gloo), each inside its own mount and PID namespaces
(``unshare --mount --propagation private --pid --fork --kill-child --mount-proc``):

- **Private storage under shared names.** Every node sees its own empty directory at each of the
  same paths (``node_paths``: e.g. the config's ``nvme_path`` and a checkpoint root), bind-mounted
  from ``<workdir>/nodes/node<k>/<i>``; the folder holding every node's backing directories is then
  hidden under an empty tmpfs inside the namespace, so a rank that reaches for another node's
  files does not find them, as on separate machines. ``MultiNodeRun.node_dir(k, path)`` is node
  k's backing directory of ``path``, for the test to inspect after (or during) the run.
- **A node dies as a machine does.** ``Kill(node, marker=..., after_s=...)`` sends SIGKILL to that
  node's agent once a line containing ``marker`` has appeared in the output (of the node
  ``watch``, or of any node), ``after_s`` seconds later. The agent is the init of its PID
  namespace, so its workers (which torchrun starts in sessions of their own) die with it.
  With ``reboot=True`` the node's agent is started again on the same storage, as a scheduler
  would restart the machine, and rejoins the rendezvous; the surviving agents restart their
  workers within ``max_restarts`` (torchrun's ``--max-restarts``).
- **The rendezvous outlives any node.** The c10d rendezvous store is a ``TCPStore`` held by this
  process (every agent runs with ``is_host=false``), so any node, rank 0's included, can be killed.
- **What ranks say comes back.** A script calls ``report(**fields)`` (below): one JSON line per
  call, stamped with the rank's global rank, local rank, the rendezvous' node rank (GROUP_RANK),
  the harness's node index (which may differ: c10d hands out node ranks in arrival order), the
  world sizes, torchrun's restart count and the node's launch number. ``MultiNodeRun.reports``
  holds them all in order; ``final()`` the last one of each global rank.

Script side (in the torchrun workers): ``report``, ``node_index``, ``node_paths``, ``open_files``
(the regular files this process has open, from /proc/self/fd) and ``files_outside`` (those not
under given directories).

Where user namespaces or mounts are not permitted (a container without CAP_SYS_ADMIN),
``namespaces_unavailable()`` says why and ``run_nodes`` raises ``NamespacesUnavailable``; tests
call ``skip_unless_namespaces()``. The workdir should be on a disk file system (O_DIRECT works
there; the ``nvme_dir`` fixture is such a place): every node's storage lives below it.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_ENV_NODE = "INFINITY_TEST_NODE"
_ENV_LAUNCH = "INFINITY_TEST_NODE_LAUNCH"
_ENV_RESULTS = "INFINITY_TEST_RESULTS"
_ENV_PATHS = "INFINITY_TEST_NODE_PATHS"

_UNSHARE = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
)


class NamespacesUnavailable(RuntimeError):
    """This host does not let the harness give each node its own mount and PID namespace."""


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why nodes cannot be made here (None when they can): unshare and a bind mount are probed."""
    probe = Path(f"/tmp/.infinity-multinode-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        cmd = [*_UNSHARE, "sh", "-c", f"mount --bind {probe} {probe} && mount -t tmpfs x {probe}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            return "the unshare command (util-linux) is not installed"
        if done.returncode != 0:
            return (
                "this process may not make mount and PID namespaces with bind mounts "
                f"({' '.join(_UNSHARE)}: {done.stderr.strip() or done.returncode}); the multi-node "
                "harness needs CAP_SYS_ADMIN (root, or a container run with --privileged)"
            )
        return None
    finally:
        probe.rmdir()


def skip_unless_namespaces() -> None:
    """pytest.skip, with the reason, where namespaces_unavailable() says nodes cannot be made."""
    reason = namespaces_unavailable()
    if reason:
        import pytest

        pytest.skip(f"multi-node harness unavailable: {reason}")


@dataclass(frozen=True)
class Kill:
    """SIGKILL node ``node``'s agent (and so every process of that node) once ``marker`` has
    appeared in the output of node ``watch`` (any node when None; no marker: from the start),
    ``after_s`` seconds later. ``reboot``: start that node's agent again on the same storage."""

    node: int
    marker: str | None = None
    after_s: float = 0.0
    watch: int | None = None
    reboot: bool = False


@dataclass
class NodeRun:
    """One node over the run: each launch's exit status (negative: killed by that signal), the
    output of every launch (agent and workers, stdout and stderr interleaved), kills sent."""

    node: int
    returncodes: list[int | None] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    kills: int = 0

    @property
    def launches(self) -> int:
        return len(self.returncodes)

    @property
    def ok(self) -> bool:
        return bool(self.returncodes) and self.returncodes[-1] == 0


@dataclass
class MultiNodeRun:
    """What ``run_nodes`` saw. ``reports``: every ``report`` call's JSON object, in time order."""

    workdir: Path
    node_paths: tuple[Path, ...]
    nodes: list[NodeRun]
    reports: list[dict]
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(n.ok for n in self.nodes)

    def check(self) -> MultiNodeRun:
        """Self, or an AssertionError with each failing node's exit statuses and output tail."""
        if self.ok:
            return self
        lines = ["multi-node run failed" + (" (timed out)" if self.timed_out else "")]
        for n in self.nodes:
            if not n.ok:
                lines.append(f"--- node {n.node}: exit statuses by launch {n.returncodes}")
                lines.append(n.output[-1][-6000:] if n.output else "(no output)")
        raise AssertionError("\n".join(lines))

    def text(self, node: int) -> str:
        """Every launch's output of ``node``, joined."""
        return "".join(self.nodes[node].output)

    def final(self) -> dict[int, dict]:
        """The last report of each global rank, by rank."""
        last: dict[int, dict] = {}
        for r in self.reports:
            last[r["rank"]] = r
        return dict(sorted(last.items()))

    def restarts(self) -> dict[int, int]:
        """torchrun's restart count (TORCHELASTIC_RESTART_COUNT) as each node's last report says
        it: how often that node's agent restarted its workers (a rebooted agent counts afresh)."""
        last: dict[int, int] = {}
        for r in self.reports:
            last[r["node"]] = r["restart_count"]
        return dict(sorted(last.items()))

    def node_dir(self, node: int, path: str | os.PathLike) -> Path:
        """Node ``node``'s own directory behind the shared ``path`` (one of ``node_paths``)."""
        p = Path(path).absolute()
        if p not in self.node_paths:
            raise ValueError(f"{p} is not one of the node paths {list(map(str, self.node_paths))}")
        return _backing(self.workdir, node, self.node_paths.index(p))


def _backing(workdir: Path, node: int, index: int) -> Path:
    return workdir / "nodes" / f"node{node}" / str(index)


def run_nodes(
    script: str | os.PathLike,
    nnodes: int,
    nproc_per_node: int,
    *,
    workdir: str | os.PathLike,
    node_paths: Sequence[str | os.PathLike] = ("nvme", "ckpt"),
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    kill: Kill | None = None,
    timeout: float = 300.0,
) -> MultiNodeRun:
    """Runs ``script`` (a Python file, with ``args``) on ``nnodes`` nodes of ``nproc_per_node``
    ranks each and waits for every agent to exit (or ``timeout`` seconds: then all are killed and
    the result says ``timed_out``). Never raises for a failed run: call ``.check()``.

    ``node_paths``: the paths at which each node sees its own storage; relative ones are taken
    under ``<workdir>/node/`` (so the defaults are ``<workdir>/node/nvme`` and
    ``<workdir>/node/ckpt``). They must not lie under ``<workdir>/nodes`` (hidden in every node).
    ``env``: added to the workers' environment (over this process's). ``max_restarts``: torchrun's
    ``--max-restarts``. ``kill``: one node to kill during the run (see ``Kill``).
    """
    reason = namespaces_unavailable()
    if reason:
        raise NamespacesUnavailable(reason)
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes ({nnodes}) and nproc_per_node ({nproc_per_node}) must be >= 1")
    if kill is not None and not 0 <= kill.node < nnodes:
        raise ValueError(f"Kill.node {kill.node} is not a node of 0..{nnodes - 1}")
    workdir = Path(workdir).absolute()
    hidden = workdir / "nodes"
    paths = tuple(Path(p) if Path(p).is_absolute() else workdir / "node" / p for p in node_paths)
    for p in paths:
        if p == hidden or hidden in p.parents:
            raise ValueError(f"node path {p} lies under {hidden}, which every node hides")
        p.mkdir(parents=True, exist_ok=True)  # the mount point, empty in this namespace
    for k in range(nnodes):
        for i in range(len(paths)):
            _backing(workdir, k, i).mkdir(parents=True, exist_ok=True)
    results = workdir / "results"
    results.mkdir(parents=True, exist_ok=True)

    from torch.distributed import TCPStore

    # The rendezvous store, outside every node (see the module docstring).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_id = uuid.uuid4().hex[:12]
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, base_env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    base_env.setdefault("OMP_NUM_THREADS", "1")
    # A node that rejoins after a kill waits forever for the next round's MASTER_ADDR when the
    # agents share their rendezvous TCPStore with the workers (torch 2.13: the surviving rank-0
    # agent keeps the last round's address and never writes it for the new round).
    base_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    base_env[_ENV_RESULTS] = str(results)
    base_env[_ENV_PATHS] = os.pathsep.join(map(str, paths))

    def command(k: int) -> list[str]:
        mounts = [
            ["mount", "--bind", str(_backing(workdir, k, i)), str(p)] for i, p in enumerate(paths)
        ]
        agent = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node-rank={k}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}",
            # Each node its own loopback address: the agents' PIDs are all 1 (each is its PID
            # namespace's init), and c10d tells nodes apart by address and PID.
            f"--local-addr=127.0.0.{k + 1}",
            f"--rdzv-id={run_id}",
            "--rdzv-conf=is_host=false,join_timeout=120",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            os.fspath(script),
            *args,
        ]
        shell = " && ".join(
            [
                *map(shlex.join, mounts),
                shlex.join(["mount", "-t", "tmpfs", "-o", "size=1m", "hidden", str(hidden)]),
            ]
        )
        shell += " && exec " + shlex.join(agent)
        return [*_UNSHARE, "sh", "-c", shell]

    nodes = [NodeRun(k) for k in range(nnodes)]
    procs: dict[int, subprocess.Popen] = {}
    readers: list[threading.Thread] = []
    lock = threading.Condition()
    kill_at: list[float] = []  # when the kill is due, once its marker has been seen

    def start(k: int) -> None:
        node_env = dict(base_env, **{_ENV_NODE: str(k), _ENV_LAUNCH: str(nodes[k].launches)})
        proc = subprocess.Popen(
            command(k),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=node_env,
            text=True,
            errors="replace",
        )
        nodes[k].returncodes.append(None)
        nodes[k].output.append("")
        procs[k] = proc
        reader = threading.Thread(target=read, args=(k, proc), daemon=True)
        readers.append(reader)
        reader.start()

    def read(k: int, proc: subprocess.Popen) -> None:
        launch = nodes[k].launches - 1
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                with lock:
                    nodes[k].output[launch] += line
                    if (
                        kill is not None
                        and kill.marker is not None
                        and not kill_at
                        and kill.watch in (None, k)
                        and kill.marker in line
                    ):
                        kill_at.append(time.monotonic() + kill.after_s)
                        lock.notify_all()
        proc.wait()
        with lock:
            nodes[k].returncodes[launch] = proc.returncode
            lock.notify_all()

    started = time.monotonic()
    if kill is not None and kill.marker is None:
        kill_at.append(started + kill.after_s)
    killed = False
    timed_out = False
    try:
        for k in range(nnodes):
            start(k)
        with lock:
            while True:
                now = time.monotonic()
                if kill is not None and not killed and kill_at and now >= kill_at[0]:
                    killed = True
                    victim = procs[kill.node]
                    if victim.poll() is None:
                        victim.send_signal(signal.SIGKILL)  # unshare --kill-child: the node's init
                        nodes[kill.node].kills += 1
                        if kill.reboot:
                            lock.wait_for(lambda: nodes[kill.node].returncodes[-1] is not None, 30)
                            start(kill.node)
                if all(n.returncodes[-1] is not None for n in nodes):
                    break
                if now - started > timeout:
                    timed_out = True
                    break
                due = [kill_at[0] - now] if kill_at and not killed else []
                lock.wait(min([0.5, *due]) if due else 0.5)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for reader in readers:
            reader.join()  # each ends when its agent has exited and its pipe is read to the end
    return MultiNodeRun(workdir, paths, nodes, _read_reports(results), timed_out)


def _read_reports(results: Path) -> list[dict]:
    reports = []
    for f in sorted(results.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                reports.append(json.loads(line))
    return sorted(reports, key=lambda r: r["time"])


# --- the script side: called in the torchrun workers ------------------------------------------


def node_index() -> int:
    """The harness's index of this worker's node (its storage), not the rendezvous' GROUP_RANK."""
    return int(os.environ[_ENV_NODE])


def node_paths() -> list[Path]:
    """The paths at which this node sees its own storage, as given to run_nodes."""
    return [Path(p) for p in os.environ[_ENV_PATHS].split(os.pathsep)]


def report(**fields) -> dict:
    """Appends one JSON object (``fields`` and who says it) to this process's results file."""
    e = os.environ
    record = {
        "time": time.time(),
        "pid": os.getpid(),
        "node": node_index(),
        "launch": int(e[_ENV_LAUNCH]),
        "rank": int(e["RANK"]),
        "local_rank": int(e["LOCAL_RANK"]),
        "group_rank": int(e["GROUP_RANK"]),
        "world_size": int(e["WORLD_SIZE"]),
        "local_world_size": int(e["LOCAL_WORLD_SIZE"]),
        "restart_count": int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
        **fields,
    }
    path = Path(e[_ENV_RESULTS]) / f"node{record['node']}-{record['launch']}-{os.getpid()}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return record


def open_files() -> list[str]:
    """The regular files this process has open (from /proc/self/fd), as this node names them."""
    found = []
    fd_dir = "/proc/self/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed since the listing
        if target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
            target = target.removesuffix(" (deleted)")
            try:
                if not Path(target).exists() or Path(target).is_file():
                    found.append(target)
            except OSError:
                continue
    return sorted(found)


def files_outside(files: Sequence[str], allowed: Sequence[str | os.PathLike]) -> list[str]:
    """The ``files`` that lie under none of the ``allowed`` directories."""
    roots = [Path(a).absolute() for a in allowed]
    return [f for f in files if not any(r == Path(f) or r in Path(f).parents for r in roots)]
