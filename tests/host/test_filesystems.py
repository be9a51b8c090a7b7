"""infinity.host.filesystems: /proc/mounts parsed from a fixed sample (escaped spaces, nested and stacked
mounts) and the mount of paths on this machine."""

import os

from infinity.host import Mount, find_mount, mount_of, mounts, parse_mounts, unescape

SAMPLE = r"""/dev/vda / ext4 rw,relatime,discard 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
/dev/nvme0n1p1 /mnt/fast\040disk xfs rw,noatime 0 0
/dev/nvme1n1 /mnt/fast ext4 rw 0 0
/dev/sdb1 /tmp/stacked ext4 rw 0 0
tmpfs /tmp/stacked tmpfs rw 0 0
odd\134name /mnt/tab\011and\012newline btrfs ro 0 0
"""


def test_entries_unescaped_in_order():
    table = parse_mounts(SAMPLE)
    assert len(table) == 8
    assert table[0] == Mount("/dev/vda", "/", "ext4", ("rw", "relatime", "discard"))
    assert table[3].mountpoint == "/mnt/fast disk" and table[3].fs_type == "xfs"
    assert table[7] == Mount("odd\\name", "/mnt/tab\tand\nnewline", "btrfs", ("ro",))


def test_unescape():
    assert unescape(r"/a\040b\134c") == "/a b\\c"
    assert unescape("/plain") == "/plain"


def test_longest_mount_point_holds_a_path():
    table = parse_mounts(SAMPLE)
    assert find_mount("/home/me/x", table).mountpoint == "/"
    assert find_mount("/tmp/a", table).fs_type == "tmpfs"
    assert find_mount("/tmp", table).fs_type == "tmpfs"
    assert find_mount("/mnt/fast disk/swap", table).device == "/dev/nvme0n1p1"
    assert find_mount("/mnt/fast/swap", table).device == "/dev/nvme1n1"
    # a prefix of the name is not a parent directory
    assert find_mount("/mnt/faster/swap", table).mountpoint == "/"
    assert find_mount("/tmpfoo", table).mountpoint == "/"


def test_the_last_of_stacked_mounts_wins():
    assert find_mount("/tmp/stacked/f", parse_mounts(SAMPLE)).fs_type == "tmpfs"


def test_no_table_no_mount():
    assert find_mount("/x", []) is None


def test_this_machine(tmp_path):
    table = mounts()
    assert any(m.mountpoint == "/" for m in table)
    root = mount_of("/")
    assert root is not None and root.mountpoint == "/" and root.fs_type
    # a path not created yet is on its parent's file system; links are followed
    assert mount_of(tmp_path / "not" / "yet") == mount_of(tmp_path)
    link = tmp_path / "link"
    os.symlink("/proc/self", link)
    assert mount_of(link).fs_type == "proc"
