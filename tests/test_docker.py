"""docker/Dockerfile repeats the README's set-up, and the docs' container and estimator notes hold.

Docker cannot run on the machines these tests run on, so the Dockerfile is
checked by reading it: its one RUN step must be the README's test command,
run from a copy of the repository, on a Debian Python 3.11 base.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _readme_commands() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import readme_command
    finally:
        sys.path.pop(0)
    return readme_command.commands()


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    out = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
    return out


def test_the_dockerfile_runs_the_readme_test_command_verbatim():
    steps = _instructions(DOCKERFILE)
    runs = [args for op, args in steps if op == "RUN"]
    assert runs == [" ".join(_readme_commands()["tests"].split())], (
        "docker/Dockerfile must have exactly one RUN, the README's test command; got " + repr(runs)
    )


def test_the_dockerfile_starts_from_debian_python_311_and_runs_in_a_copy_of_the_repository():
    steps = _instructions(DOCKERFILE)
    ops = [op for op, _ in steps]
    base = dict(steps)["FROM"]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-(bookworm|trixie|bullseye)", base), base
    assert ops.index("WORKDIR") < ops.index("COPY") < ops.index("RUN")
    assert dict(steps)["COPY"] == ". ."
    # ENV may steer pip's index, never add install steps of its own.
    for op, args in steps:
        assert op in {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "CMD"}, f"unexpected {op} {args}"


def test_the_build_context_leaves_host_builds_out_and_keeps_what_setup_needs():
    ignore = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for built in (".venv/", "build/", "**/*.so"):
        assert built in ignore
    for needed in (
        "setup.sh",
        "pyproject.toml",
        "CMakeLists.txt",
        "csrc",
        "infinity",
        "tests",
        ".ci",
        "README.md",
    ):
        assert (ROOT / needed).exists()
        assert not any(needed == p.rstrip("/") for p in ignore), f"{needed} must reach the image"


def test_the_cuda_notes_exist():
    notes = (ROOT / "docker" / "README.md").read_text()
    for must in ("nvidia/cuda", "--gpus all", "seccomp", "nvme_path", "memlock"):
        assert must in notes


def test_the_fallback_line_troubleshooting_quotes_is_what_the_runtime_logs_once(nvme_dir):
    """Under a refused io_uring (Docker's seccomp, simulated) the threads engine runs and one line says so."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from infinity.aio import AioHandle\n"
        "a = AioHandle(); b = AioHandle()\n"
        "print(a.engine, b.engine)\n"
    )
    env = dict(os.environ, INFINITY_AIO_IO_URING_REFUSE="EPERM")
    r = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["threads", "threads"]
    lines = [ln for ln in r.stderr.splitlines() if "io_uring" in ln]
    assert len(lines) == 1, r.stderr
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    quoted = re.search(r"```text\n(io_uring is not available.*?)\n```", page, re.S).group(1)
    expected = lines[0].replace(" (simulated by INFINITY_AIO_IO_URING_REFUSE)", "")
    assert quoted == expected
    for ref in ("moby #46762", "containerd #9320", "threads engine"):
        assert ref in page


def test_the_estimate_example_of_the_docs_runs(capsys):
    from infinity.cli.main import main

    page = (ROOT / "docs" / "memory.md").read_text()
    block = re.search(r"```console\n\$ (infinity estimate [^\n]*)\n(.*?)```", page, re.S)
    assert block is not None, "docs/memory.md lost its infinity estimate example"
    argv = shlex.split(block.group(1))[1:]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in block.group(2).splitlines() if ln.startswith("setting"))
    assert header.split() == next(ln for ln in out.splitlines() if ln.startswith("setting")).split()
    for ln in block.group(2).splitlines():
        if ln.startswith("stage "):
            label = re.split(r"\s{2,}", ln)[0]
            assert label in out, f"docs/memory.md's row {label!r} is not in today's output"
    json_out = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", *argv, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(json_out.stdout)["num_params"] > 0


@pytest.mark.parametrize("name", ["main", "tests"])
def test_both_readme_commands_start_with_setup(name):
    assert _readme_commands()[name].startswith("./setup.sh")
