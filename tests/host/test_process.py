"""infinity.host.process: /proc/<pid>/status and stat parsed from fixed samples and from this process."""

import os
import subprocess
import sys

from infinity import host

STATUS = """\
Name:\tpython3
Umask:\t0022
State:\tR (running)
Pid:\t4242
Threads:\t7
VmPeak:\t 3060 kB
VmHWM:\t    1772 kB
VmRSS:\t    1540 kB
RssAnon:\t     116 kB
HugetlbPages:\t   4096 kB
Cpus_allowed_list:\t0-1
"""


def test_status_memory_fields_in_bytes():
    st = host.parse_status(STATUS)
    assert st == {
        "VmPeak": 3060 * 1024,
        "VmHWM": 1772 * 1024,
        "VmRSS": 1540 * 1024,
        "RssAnon": 116 * 1024,
        "HugetlbPages": 4 << 20,
    }


def test_start_time_survives_a_command_name_with_spaces_and_parentheses():
    fields = " ".join(str(i) for i in range(3, 53))  # fields 3.. after "pid (comm)"
    stat = f"4242 (a) b (c) {fields}\n"
    assert host.parse_start_time(stat) == 22  # starttime is field 22


def test_this_process():
    st = host.process_status()
    assert st["VmHWM"] >= st["VmRSS"] > 0
    assert host.peak_rss_nbytes() >= host.rss_nbytes() > 0
    assert host.peak_resident_host_nbytes() >= host.resident_host_nbytes() > 0
    assert host.hugetlb_nbytes() >= 0
    assert host.process_status(os.getpid()).keys() == st.keys()
    me = host.process_start_time(os.getpid())
    assert me is not None and me > 0
    assert host.process_start_time(os.getpid()) == me


def test_host_memory_figures_add_the_hugetlb_pages_the_kernels_rss_leaves_out(monkeypatch):
    from infinity.host import process

    status = {"VmHWM": 7 << 20, "VmRSS": 5 << 20, "HugetlbPages": 4 << 20}
    monkeypatch.setattr(process, "process_status", lambda pid=None: status)
    assert (host.rss_nbytes(), host.peak_rss_nbytes()) == (5 << 20, 7 << 20)
    assert host.resident_host_nbytes() == 9 << 20
    assert host.peak_resident_host_nbytes() == 11 << 20
    monkeypatch.setattr(process, "process_status", lambda pid=None: {})
    assert host.resident_host_nbytes() == host.peak_resident_host_nbytes() == 0  # unknown


def test_a_process_that_is_gone_has_no_start_time():
    p = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    assert host.process_start_time(int(p.stdout)) is None


def test_peak_rises_with_touched_memory_and_resets():
    script = (
        "import numpy as np\n"
        "from infinity import host\n"
        "before = host.peak_rss_nbytes()\n"
        "a = np.ones(64 << 20, dtype=np.uint8)\n"
        "high = host.peak_rss_nbytes()\n"
        "del a\n"
        "ok = host.reset_peak_rss()\n"
        "print(high - before, ok, high - host.peak_rss_nbytes())\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    grown, ok, dropped = r.stdout.split()
    assert int(grown) >= 60 << 20
    if ok == "True":  # clear_refs may be refused (some sandboxes)
        assert int(dropped) >= 32 << 20


def test_open_fds_sees_a_new_descriptor():
    before = host.open_fds()  # the listing's own descriptor is in every listing
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert fd in host.open_fds()
        assert len(host.open_fds()) == len(before) + 1
    finally:
        os.close(fd)
    assert host.open_fds() == before


IO = """\
rchar: 4096
wchar: 123
syscr: 3
syscw: 1
read_bytes: 1048576
write_bytes: 8192
cancelled_write_bytes: 0
"""


def test_io_counters():
    io = host.parse_io(IO)
    assert (
        io["read_bytes"] == 1 << 20
        and io["write_bytes"] == 8192
        and io["cancelled_write_bytes"] == 0
    )
    assert len(io) == 7


def test_block_io_counts_direct_writes(nvme_dir):
    # O_DIRECT bypasses the page cache: every byte written reaches the block layer, from this thread
    import mmap

    n = 4 << 20
    buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
    buf.write(b"x" * n)
    path = os.path.join(nvme_dir, "block-io.dat")
    _, written0 = host.block_io_nbytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        assert os.pwritev(fd, [buf], 0) == n
    finally:
        os.close(fd)
        os.unlink(path)
    _, written1 = host.block_io_nbytes()
    assert written1 - written0 >= n
