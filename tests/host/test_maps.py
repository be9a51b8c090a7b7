"""infinity.host.maps: /proc/self/maps and smaps parsed from a fixed sample and from this process."""

import ctypes
import mmap

from infinity.host import MemoryMap, mapped_paths, memory_maps, parse_maps

SMAPS = """\
55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1234   /usr/bin/python3 (deleted)
Size:                132 kB
KernelPageSize:        4 kB
Rss:                 100 kB
VmFlags: rd mr mw me sd
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
KernelPageSize:        4 kB
AnonHugePages:      2048 kB
THPeligible:    1
7f1000000000-7f1000200000 rw-s 00000000 00:10 99                         /mnt/my file
Size:               2048 kB
KernelPageSize:     2048 kB
"""


def test_smaps_mappings_and_figures():
    maps = parse_maps(SMAPS)
    assert [(m.start, m.end, m.path) for m in maps] == [
        (0x55D0C0A00000, 0x55D0C0A21000, "/usr/bin/python3 (deleted)"),
        (0x7F0000000000, 0x7F0000400000, ""),
        (0x7F1000000000, 0x7F1000200000, "/mnt/my file"),
    ]
    assert maps[0].fields == {"Size": 132 << 10, "KernelPageSize": 4096, "Rss": 100 << 10}
    assert maps[1].fields["AnonHugePages"] == 2 << 20 and maps[1].fields["THPeligible"] == 1
    assert maps[2].fields["KernelPageSize"] == 2 << 20


def test_maps_lines_have_no_figures():
    head = "\n".join(line for line in SMAPS.splitlines() if "-" in line.split()[0])
    assert parse_maps(head) == [MemoryMap(m.start, m.end, m.path) for m in parse_maps(SMAPS)]
    assert all(not m.fields for m in parse_maps(head))


def test_this_process():
    with mmap.mmap(-1, 1 << 20) as mem:
        view = ctypes.c_char.from_buffer(mem)
        addr = ctypes.addressof(view)
        del view  # the mmap refuses to close while exported
        assert any(m.start <= addr < m.end for m in memory_maps())
        hit = next(m for m in memory_maps(detail=True) if m.start <= addr < m.end)
        assert hit.fields["KernelPageSize"] >= 4096 and hit.fields["Size"] >= 1 << 20
    assert any("python" in p or "libc" in p for p in mapped_paths())
