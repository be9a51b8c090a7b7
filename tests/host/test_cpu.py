"""infinity.host.cpu: /proc/cpuinfo parsed from fixed x86 and arm64 samples and from this machine."""

import platform

from infinity.host import CpuInfo, cpu_flags, cpu_info, cpu_model, parse_cpuinfo

X86 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: Another Model
flags\t\t: fpu
"""

ARM = """\
processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
"""


def test_first_processor_stands_for_all():
    info = parse_cpuinfo(X86)
    assert info.model == "AMD EPYC 9654 96-Core Processor"
    assert info.flags == {"fpu", "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw"}


def test_arm_features_are_flags_and_there_is_no_model():
    assert parse_cpuinfo(ARM) == CpuInfo("", frozenset({"fp", "asimd", "evtstrm", "aes", "sve"}))


def test_empty_text():
    assert parse_cpuinfo("") == CpuInfo("", frozenset())


def test_this_machine():
    info = cpu_info()
    assert cpu_model() == info.model and cpu_flags() == info.flags
    if platform.machine() in ("x86_64", "AMD64"):
        assert info.model
        assert "sse2" in info.flags  # every x86-64 CPU has it
