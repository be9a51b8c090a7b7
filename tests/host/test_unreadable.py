"""Where the kernel's file cannot be read (hidden in a container, not Linux), probes say "unknown"."""

import pytest

from infinity.host import cpu, filesystems, kernel, memory
from infinity.host._read import read_text


@pytest.fixture
def missing(tmp_path):
    return str(tmp_path / "missing")


def test_read_text(tmp_path, missing):
    assert read_text(missing) is None
    assert read_text(tmp_path) is None  # a directory
    (tmp_path / "f").write_bytes(b"ok \xff\n")
    assert read_text(tmp_path / "f") == "ok \ufffd\n"


def test_probes_report_unknown(monkeypatch, missing):
    monkeypatch.setattr(memory, "MEMINFO", missing)
    monkeypatch.setattr(memory, "THP_ENABLED", missing)
    monkeypatch.setattr(cpu, "CPUINFO", missing)
    monkeypatch.setattr(filesystems, "MOUNTS", missing)
    assert memory.meminfo() == {}
    assert memory.hugetlb_free_nbytes() == 0
    assert memory.transparent_hugepage_mode() == ""
    assert cpu.cpu_model() == "" and cpu.cpu_flags() == frozenset()
    assert filesystems.mounts() == [] and filesystems.mount_of("/") is None
    monkeypatch.setattr(kernel, "sysctl_path", lambda name: missing)
    assert kernel.sysctl("vm.drop_caches") is None and kernel.io_uring_disabled() is None
    assert kernel.can_drop_caches() is False
