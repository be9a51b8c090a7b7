"""docs/ARCHITECTURE.md and the import contract in pyproject.toml describe the same layers."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _contracts() -> list[dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def _contract_layers() -> list[str]:
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    return [" | ".join(part.strip() for part in layer.split("|")) for layer in layers]


def _doc_layers() -> list[str]:
    """The first column of the table under '## Layers', top to bottom."""
    section = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `infinity.")]
    return [re.match(r"\| `([^`]+)`", ln).group(1).replace("\\|", "|") for ln in rows]


def test_the_layer_table_is_the_import_contract():
    assert _doc_layers() == _contract_layers(), (
        "docs/ARCHITECTURE.md's layer table and pyproject.toml's layers contract differ; change both together"
    )


def test_every_package_has_a_place_in_the_map():
    text = DOC.read_text()
    packages = sorted(p.parent.name for p in (ROOT / "infinity").glob("*/__init__.py"))
    missing = [name for name in packages if not re.search(rf"`[^`]*\binfinity\.{name}\b", text)]
    assert not missing, f"packages with no row or paragraph in docs/ARCHITECTURE.md: {missing}"
    in_contracts = {m for layer in _contract_layers() for m in layer.split(" | ")}
    for contract in _contracts():
        in_contracts.update(contract.get("source_modules", []))
    unlisted = [name for name in packages if f"infinity.{name}" not in in_contracts]
    assert not unlisted, f"packages outside every import contract in pyproject.toml: {unlisted}"


def test_the_readme_links_the_map():
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text()


def test_the_cli_row_names_every_subcommand():
    from infinity.cli.main import COMMANDS

    row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| `infinity.cli` |"))
    modules = sorted(p.stem for p in (ROOT / "infinity" / "cli").glob("*.py"))
    registered = sorted(cmd.__name__.rsplit(".", 1)[1] for cmd in COMMANDS)
    assert modules == sorted(registered + ["__init__", "main"]), (
        "infinity/cli holds one module per subcommand registered in main.COMMANDS, and nothing else"
    )
    missing = [name for name in registered if f"`{name}`" not in row]
    assert not missing, f"docs/ARCHITECTURE.md's infinity.cli row omits subcommands {missing}"
