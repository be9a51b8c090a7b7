"""``infinity doctor``: what this machine offers the runtime, and what to do where it falls short.

Checks io_uring (and why not), the back ends this build has, the path as ``initialize`` checks an
nvme_path (infinity.store.nvme_path, the same refusal and message), O_DIRECT and free space there,
huge pages, the locked-memory limit, CPU SIMD flags, torch and CUDA. Sizes are in binary units
(GiB, MiB) as everywhere in infinity. Nothing here changes the machine; a probe file is created and
removed under ``--path``.

Under ``torchrun`` (WORLD_SIZE > 1) it checks every node: local rank 0 of each node collects the
node's findings (``--path`` as that node sees it: node-local drives differ), with how many ranks
share the node and the host-memory budget each gets by default (the planner's, budget.py); rank 0
gathers them over a gloo process group and prints one block per node (``--json``: a list with one
object per node); the other ranks print nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Any

from infinity import host
from infinity.memory import format_nbytes
from infinity.store import nvme_path
from infinity.store.errors import NvmePathError

NAME = "doctor"
HELP = "check: io_uring, O_DIRECT and space at a path, huge pages, SIMD, torch, CUDA"

SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "asimd",
    "sve",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--path",
        type=Path,
        default=Path("infinity_nvme"),
        help="where swap files would go (default ./infinity_nvme)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def io_uring_report() -> dict[str, Any]:
    from infinity.aio import built_with_io_uring, io_uring_status

    built = built_with_io_uring()
    why = io_uring_status()
    report: dict[str, Any] = {"built": built, "usable": built and not why, "why_not": why}
    report["io_uring_disabled_sysctl"] = host.io_uring_disabled()
    if why:
        hints = []
        if not built:
            hints.append(
                "install liburing-dev and reinstall infinity (pip install -e .) to build the io_uring back end"
            )
        if report["io_uring_disabled_sysctl"]:
            hints.append(
                "kernel.io_uring_disabled is set: `sysctl kernel.io_uring_disabled=0` (root) enables it"
            )
        if "Operation not permitted" in why:
            hints.append(
                "in Docker, io_uring is blocked by the default seccomp profile: run with a profile that allows io_uring_setup/enter/register"
            )
        report["fix"] = hints
    return report


def path_report(path: Path) -> dict[str, Any]:
    """O_DIRECT support and free space where swap files would go (the nearest existing parent if absent)."""
    from infinity.aio import AioError, open_file
    from infinity.measure import mount_of

    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    report: dict[str, Any] = {
        "path": str(path.resolve()),
        "checked_at": str(where.resolve()),
        "filesystem": mount_of(where),
    }
    try:  # initialize's own check of an nvme_path: what it refuses, doctor refuses, in its words
        nvme_path.check_directory(path)
        report["usable"], report["refused"] = True, None
    except NvmePathError as e:
        report["usable"], report["refused"] = False, str(e)
    usage = shutil.disk_usage(where)
    report["free_bytes"] = usage.free
    report["total_bytes"] = usage.total
    try:
        fd, probe = tempfile.mkstemp(prefix=".infinity-doctor-", dir=where)
        os.close(fd)
    except OSError as e:
        report["writable"] = False
        report["o_direct"] = None
        report["why"] = f"cannot create a file there: {e.strerror}"
        return report
    report["writable"] = True
    try:
        # Ask the engine itself, so the answer is the one requests there will get.
        with open_file(probe, "rw", create=False, o_direct=True) as f:
            report["o_direct"] = f.direct
        if not report["o_direct"]:
            report["why"] = (
                "the file system refuses O_DIRECT; I/O there is buffered (slower, and reads may come "
                "from the page cache)"
            )
    except AioError as e:
        report["o_direct"] = False
        report["why"] = f"open with O_DIRECT failed: {e}"
    finally:
        os.unlink(probe)
    return report


def memory_report() -> dict[str, Any]:
    meminfo = host.meminfo()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "total_bytes": meminfo.get("MemTotal", 0),
        "available_bytes": meminfo.get("MemAvailable", 0),
        "transparent_huge_pages": host.transparent_hugepage_mode(),
        "hugetlb_pages_total": meminfo.get("HugePages_Total", 0),
        "hugetlb_pages_free": meminfo.get("HugePages_Free", 0),
        "memlock_limit_bytes": None if soft == resource.RLIM_INFINITY else soft,
    }


def cpu_report() -> dict[str, Any]:
    from infinity.aio import crc32c_is_hardware

    cpu = host.cpu_info()
    return {
        "model": cpu.model,
        "cpus": os.cpu_count(),
        "simd": [f for f in SIMD_FLAGS if f in cpu.flags],
        "crc32c_hardware": crc32c_is_hardware(),
    }


def torch_report() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if report["cuda_available"]:
        report["cuda_version"] = torch.version.cuda
        report["devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    else:
        report["cuda_build"] = torch.version.cuda is not None
    return report


def collect(path: Path) -> dict[str, Any]:
    import platform

    return {
        "kernel": platform.release(),
        "io_uring": io_uring_report(),
        "engines_built": ["io_uring", "threads"] if io_uring_report()["built"] else ["threads"],
        "path": path_report(path),
        "memory": memory_report(),
        "cpu": cpu_report(),
        "torch": torch_report(),
        "fio": shutil.which("fio") or "",
        "machine_view": machine_view_report(path),
    }


def machine_view_report(path: Path) -> dict[str, Any]:
    """The machine as ``infinity estimate`` and the pre-flight check see it (infinity.estimate.machine)."""
    import dataclasses

    from infinity.estimate.machine import machine_view

    return dataclasses.asdict(machine_view([path]))


def format_report(r: dict[str, Any]) -> str:
    u, p, m, c, t = r["io_uring"], r["path"], r["memory"], r["cpu"], r["torch"]
    ok, no = "ok  ", "NO  "
    lines = [f"infinity doctor (Linux {r['kernel']})"]
    lines.append(
        f"{ok if u['usable'] else no}io_uring: "
        + ("usable" if u["usable"] else f"not usable: {u['why_not']}")
    )
    for hint in u.get("fix", []):
        lines.append(f"      fix: {hint}")
    lines.append(
        f"{ok}engines built: {', '.join(r['engines_built'])}"
        + ("" if u["built"] else " (liburing was not found at build time)")
    )
    fs = p["filesystem"]
    lines.append(
        f"{ok if p['writable'] and p['usable'] else no}path: {p['path']} ({fs['type'] or '?'} on {fs['device'] or '?'}), {format_nbytes(p['free_bytes'])} free of {format_nbytes(p['total_bytes'])}"
    )
    if p["refused"]:
        lines.append(f"      fix: {p['refused']}")
    if fs["type"] in ("tmpfs", "ramfs"):
        lines.append(f"{no}   {fs['type']} is memory, not a drive: offloading there saves no RAM")
    if p["o_direct"]:
        lines.append(f"{ok}O_DIRECT: supported at {p['checked_at']}")
    else:
        lines.append(f"{no}O_DIRECT: {p.get('why', 'unknown')}")
    huge = f"THP {m['transparent_huge_pages'] or '?'}, hugetlb {m['hugetlb_pages_free']}/{m['hugetlb_pages_total']} pages free"
    good_huge = m["transparent_huge_pages"] in ("always", "madvise") or m["hugetlb_pages_free"] > 0
    lines.append(
        f"{ok if good_huge else no}huge pages: {huge}"
        + ("" if good_huge else " (I/O buffers fall back to 4 KiB pages: slower reads)")
    )
    lock = (
        "unlimited" if m["memlock_limit_bytes"] is None else format_nbytes(m["memlock_limit_bytes"])
    )
    if os.geteuid() == 0:
        lock += " (root: not enforced)"
    lines.append(
        f"{ok}memory: {format_nbytes(m['available_bytes'])} available of {format_nbytes(m['total_bytes'])}; locked-memory limit {lock}"
    )
    lines.append(
        f"{ok}cpu: {c['model'] or '?'} x {c['cpus']}; SIMD {' '.join(c['simd']) or 'none found'}; crc32c in hardware: {'yes' if c['crc32c_hardware'] else 'no'}"
    )
    cuda = (
        f"CUDA {t.get('cuda_version')} ({', '.join(t.get('devices', []))})"
        if t["cuda_available"]
        else "no CUDA device (CPU-only run)"
    )
    lines.append(f"{ok}torch {t['version']}: {cuda}")
    lines.append(
        f"{ok if r['fio'] else no}fio: {r['fio'] or 'not installed (only needed by --vs-fio; apt-get install fio)'}"
    )
    from infinity.estimate.machine import describe_machine

    lines.append(
        "what a run can use here (as `infinity estimate` and the pre-flight check see it):"
    )
    lines += ["      " + ln for ln in describe_machine(_view_from(r["machine_view"]))]
    return "\n".join(lines)


def _view_from(d: dict[str, Any]):
    from infinity.estimate.machine import DiskInfo, GPUInfo, MachineView

    return MachineView(
        **{
            **d,
            "gpus": tuple(GPUInfo(**g) for g in d["gpus"]),
            "disks": tuple(DiskInfo(**x) for x in d["disks"]),
        }
    )


def node_report(path: Path) -> dict[str, Any]:
    """This node as torchrun describes it (GROUP_RANK, LOCAL_WORLD_SIZE), with the host-memory
    budget each of its ranks gets by default and this node's findings (collect)."""
    import socket

    from infinity.estimate.budget import default_budget
    from infinity.estimate.machine import machine_view, ranks_on_this_node

    ranks = ranks_on_this_node()
    budget, how = default_budget(machine_view([path]), ranks)
    return {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "ranks_per_node": ranks,
        "budget_per_rank_bytes": budget,
        "budget_per_rank": how,
        "report": collect(path),
    }


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def gather_nodes(path: Path) -> list[dict[str, Any]] | None:
    """On rank 0, every node's node_report (local rank 0 of each collects it), by node; None on
    the other ranks. Joins (and leaves) a gloo process group from torchrun's environment."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        mine = node_report(path) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
        mine_ranks = (int(os.environ.get("GROUP_RANK", "0")), dist.get_rank())
        gathered: list[Any] | None = (
            [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        )
        dist.gather_object((mine_ranks, mine), gathered, dst=0)
    finally:
        if made:
            dist.destroy_process_group()
    if gathered is None:
        return None
    nodes: dict[int, dict[str, Any]] = {}
    ranks: dict[int, list[int]] = {}
    for (node, rank), report in gathered:
        ranks.setdefault(node, []).append(rank)
        if report is not None:
            nodes[node] = report
    missing = sorted(set(ranks) - set(nodes))
    if missing:
        raise RuntimeError(
            f"no local rank 0 reported for node(s) {missing}: torchrun's LOCAL_RANK and GROUP_RANK "
            "are inconsistent; run doctor with torchrun as the job itself is launched"
        )
    return [dict(nodes[k], ranks=sorted(ranks[k])) for k in sorted(nodes)]


def format_node(n: dict[str, Any]) -> str:
    head = (
        f"== node {n['node']} ({n['host']}): ranks {', '.join(map(str, n['ranks']))}; "
        f"{n['ranks_per_node']} rank(s) share its memory, each planned within {n['budget_per_rank']}"
    )
    return head + "\n" + format_report(n["report"])


def run(args: argparse.Namespace) -> int:
    if under_torchrun():
        nodes = gather_nodes(args.path)
        if nodes is not None:
            print(
                json.dumps(nodes, indent=2)
                if args.json
                else "\n\n".join(format_node(n) for n in nodes)
            )
        return 0
    report = collect(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
