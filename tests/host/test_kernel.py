"""infinity.host.kernel: kernel settings by name."""

from pathlib import Path

from infinity.host import can_drop_caches, io_uring_disabled, sysctl, sysctl_int
from infinity.host.kernel import sysctl_path


def test_names_map_to_proc_sys():
    assert sysctl_path("kernel.io_uring_disabled") == "/proc/sys/kernel/io_uring_disabled"
    assert sysctl_path("vm.nr_hugepages") == "/proc/sys/vm/nr_hugepages"


def test_this_machine():
    assert sysctl("kernel.ostype") == "Linux"
    assert sysctl_int("kernel.ostype") is None  # not a number
    assert sysctl_int("vm.nr_hugepages") == int(Path("/proc/sys/vm/nr_hugepages").read_text())
    assert sysctl("no.such.setting") is None
    assert io_uring_disabled() in (None, 0, 1, 2)
    assert isinstance(can_drop_caches(), bool)
