"""``infinity --version`` and ``infinity.__version__`` say pyproject.toml's ``[project] version``,
the one place it is written; CHANGELOG.md has a section for it."""

from pathlib import Path

import pytest

import infinity
from infinity._version import DISTRIBUTION, checkout_version
from infinity.cli.main import main

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == DISTRIBUTION
    return project["version"]


def test_the_package_says_pyprojects_version():
    assert infinity.__version__ == _pyproject_version()


def test_infinity_dash_dash_version_prints_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"infinity {_pyproject_version()}"


def test_the_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{_pyproject_version()}]" in text


def test_another_projects_pyproject_is_not_taken_for_infinitys(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    assert checkout_version(tmp_path / "pyproject.toml") is None
    assert checkout_version(tmp_path / "missing.toml") is None
    (tmp_path / "pyproject.toml").write_text(
        f'[build-system]\nrequires = []\n\n[project]\nname = "{DISTRIBUTION}"\nversion = "1.2.3"\n'
    )
    assert checkout_version(tmp_path / "pyproject.toml") == "1.2.3"
