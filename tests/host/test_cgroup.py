"""infinity.host.cgroup: the binding memory limit, from fixed samples, a fake hierarchy and a real cgroup."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity import host
from infinity.host import cgroup
from infinity.host.filesystems import Mount

HYBRID = """\
9:name=systemd:/
4:memory:/process_api/57620c1be2d5d2bc87bdfa98639ab0a2
3:cpuset:/
0::/
"""
UNIFIED = "0::/system.slice/job.service\n"
COMBINED_V1 = "5:cpu,memory,cpuacct:/docker/abc\n2:pids:/docker/abc\n"

V1_STAT = "cache 4096\ninactive_file 100\nactive_file 50\ntotal_inactive_file 300\nhierarchical_memory_limit 7\n"
V2_STAT = "anon 8192\nfile 4096\ninactive_file 2048\nactive_file 2048\n"


def test_proc_cgroup_lines():
    assert cgroup.parse_proc_cgroup(HYBRID) == {
        "v1": "/process_api/57620c1be2d5d2bc87bdfa98639ab0a2",
        "v2": "/",
    }
    assert cgroup.parse_proc_cgroup(UNIFIED) == {"v2": "/system.slice/job.service"}
    assert cgroup.parse_proc_cgroup(COMBINED_V1) == {"v1": "/docker/abc"}
    assert cgroup.parse_proc_cgroup("") == {}


def test_memory_stat_inactive_file():
    assert cgroup.parse_memory_stat(V2_STAT) == {
        "anon": 8192,
        "file": 4096,
        "inactive_file": 2048,
        "active_file": 2048,
    }
    assert (
        cgroup.inactive_file_nbytes(cgroup.parse_memory_stat(V1_STAT), "v1") == 300
    )  # hierarchical if given
    assert cgroup.inactive_file_nbytes(cgroup.parse_memory_stat("inactive_file 100\n"), "v1") == 100
    assert cgroup.inactive_file_nbytes(cgroup.parse_memory_stat(V2_STAT), "v2") == 2048
    assert cgroup.inactive_file_nbytes(cgroup.parse_memory_stat(""), "v2") == 0


def test_available_counts_reclaimable_cache():
    c = host.CgroupMemory("/x", "v2", limit_nbytes=1000, usage_nbytes=900, inactive_file_nbytes=300)
    assert c.available_nbytes == 400
    assert host.CgroupMemory("/x", "v2", 1000, 1200, 0).available_nbytes == 0


def _fake_hierarchy(tmp_path, monkeypatch, version, levels):
    """A cgroup tree under tmp_path: ``levels`` from the root down, each None (no limit) or
    (limit, usage, inactive_file); this process sits in the innermost."""
    root = tmp_path / "memory"
    directory = root
    names = [f"l{i}" for i in range(1, len(levels))]
    for i, level in enumerate(levels):
        if i:
            directory = directory / names[i - 1]
        directory.mkdir(parents=True)
        if version == "v2":
            (directory / "memory.max").write_text("max\n" if level is None else f"{level[0]}\n")
            (directory / "memory.current").write_text(f"{0 if level is None else level[1]}\n")
            (directory / "memory.stat").write_text(
                f"inactive_file {0 if level is None else level[2]}\n"
            )
        else:
            (directory / "memory.limit_in_bytes").write_text(
                "9223372036854771712\n" if level is None else f"{level[0]}\n"
            )
            (directory / "memory.usage_in_bytes").write_text(
                f"{0 if level is None else level[1]}\n"
            )
            (directory / "memory.stat").write_text(
                f"total_inactive_file {0 if level is None else level[2]}\n"
            )
    proc = tmp_path / "cgroup"
    path = "/" + "/".join(names)
    proc.write_text(f"0::{path}\n" if version == "v2" else f"4:memory:{path}\n")
    fs_type, options = ("cgroup2", ("rw",)) if version == "v2" else ("cgroup", ("rw", "memory"))
    monkeypatch.setattr(cgroup, "PROC_SELF_CGROUP", str(proc))
    monkeypatch.setattr(cgroup, "mounts", lambda: [Mount("cgroup", str(root), fs_type, options)])


level = st.one_of(
    st.none(), st.tuples(st.integers(1, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 1 << 38))
)


@settings(max_examples=60, deadline=None)
@given(version=st.sampled_from(["v1", "v2"]), levels=st.lists(level, min_size=1, max_size=5))
def test_the_level_with_least_room_binds(tmp_path_factory, version, levels):
    tmp_path = tmp_path_factory.mktemp("cg")
    with pytest.MonkeyPatch.context() as mp:
        _fake_hierarchy(tmp_path, mp, version, levels)
        found = cgroup.memory_cgroups()
        binding = cgroup.memory_cgroup()
    limited = [lv for lv in levels if lv is not None]
    assert len(found) == len(limited)  # every limited ancestor, none of the unlimited ones
    assert sorted(c.limit_nbytes for c in found) == sorted(lv[0] for lv in limited)
    if not limited:
        assert binding is None
        return
    least = min(max(0, lim - use + inactive) for lim, use, inactive in limited)
    assert binding.available_nbytes == least
    assert binding.version == version


def test_a_container_without_a_cgroup_namespace_finds_its_own_mount(tmp_path, monkeypatch):
    # Docker on v1 without cgroupns: /proc/self/cgroup names the host's path, the mount is the container's
    root = tmp_path / "memory"
    root.mkdir()
    (root / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (root / "memory.usage_in_bytes").write_text(f"{1 << 28}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/0123abcd\n")
    monkeypatch.setattr(cgroup, "PROC_SELF_CGROUP", str(proc))
    monkeypatch.setattr(
        cgroup, "mounts", lambda: [Mount("cgroup", str(root), "cgroup", ("rw", "memory"))]
    )
    c = cgroup.memory_cgroup()
    assert (
        c is not None and c.limit_nbytes == 1 << 30 and c.available_nbytes == (1 << 30) - (1 << 28)
    )


def test_unreadable_means_no_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "PROC_SELF_CGROUP", str(tmp_path / "missing"))
    assert cgroup.memory_cgroups() == [] and cgroup.memory_cgroup() is None


def _memory_root() -> tuple[Path, str] | None:
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return v2, "memory.max"
    if (v2 / "memory" / "memory.limit_in_bytes").exists():
        return v2 / "memory", "memory.limit_in_bytes"
    return None


PROBE = """
import json, os, sys
from pathlib import Path
(Path(sys.argv[1]) / "cgroup.procs").write_text(str(os.getpid()))
from infinity.estimate.machine import describe_machine, machine_view
v = machine_view()
print(json.dumps({"available": v.mem_available_nbytes, "limit": v.cgroup and v.cgroup.limit_nbytes,
                  "path": v.cgroup and v.cgroup.path, "described": describe_machine(v)}))
"""


def test_a_process_in_a_limited_cgroup_sees_the_limit(tmp_path):
    where = _memory_root()
    if where is None or os.geteuid() != 0:
        pytest.skip("needs root and a memory cgroup controller to make a limited cgroup")
    root, limit_file = where
    path = root / f"infinity-test-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    limit = 768 << 20
    try:
        (path / limit_file).write_text(str(limit))
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=120
        )
    finally:
        os.rmdir(path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["limit"] == limit and seen["path"] == str(path)
    assert (
        0 < seen["available"] < limit
    )  # torch is imported inside it: less than the whole limit is left
    assert any(line.startswith("memory limit 768") for line in seen["described"])
