"""parse_counters: the one ``name<sep>count`` line parser behind /proc/<pid>/io and memory.stat."""

from hypothesis import given
from hypothesis import strategies as st

from infinity.host._read import parse_counters

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20)


@given(st.dictionaries(names, st.integers(0, 2**63)), st.sampled_from([":", " "]))
def test_counters_written_as_the_kernel_writes_them_read_back(counters, sep):
    pad = " " if sep == ":" else ""  # /proc/<pid>/io: "read_bytes: 4096"; memory.stat: "anon 4096"
    text = "".join(f"{k}{sep}{pad}{v}\n" for k, v in counters.items())
    assert parse_counters(text, sep) == counters


def test_lines_without_a_plain_count_are_skipped():
    assert parse_counters("a 1\nb -2\nc x\nd\n\ne 3 kB\nf 4\n", " ") == {"a": 1, "f": 4}
