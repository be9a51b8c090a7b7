"""docs/ARCHITECTURE.md and the import contract in pyproject.toml describe the same layers."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip(
    "tomllib", reason="tomllib is in the standard library from Python 3.11"
)

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


TYPING_ONLY_CYCLE = frozenset(
    {
        "infinity.store.device",
        "infinity.store.integrity",
        "infinity.store.read_path",
        "infinity.store.state",
        "infinity.store.store",
        "infinity.store.write_path",
    }
)
"""The one cycle left, and only through imports under ``if TYPE_CHECKING:`` (StoreState names the
TieredStore and DeviceTier that hold it): listed so that it cannot grow unseen; remove it once the
store's state no longer names its owners."""


def _cycles(exclude_type_checking_imports: bool) -> list[set[str]]:
    """The sets of infinity's modules that import one another (each module that imports, directly or
    through others, a module that imports it back, with all such modules)."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    graph = grimp.build_graph(
        "infinity", exclude_type_checking_imports=exclude_type_checking_imports, cache_dir=None
    )
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(imports[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(imports.get(m, ()))
        return seen

    reach = {m: reachable(m) for m in graph.modules}
    cycles: list[set[str]] = []
    for m in sorted(graph.modules):
        if m in reach[m] and not any(m in c for c in cycles):
            cycles.append({n for n in reach[m] if m in reach[n]})
    return cycles


def test_no_import_cycle_between_modules():
    """No module of infinity imports, directly or through others, a module that imports it back: each
    concept sits below what uses it. Imports inside functions run, and count."""
    assert _cycles(exclude_type_checking_imports=True) == [], (
        "import cycles (modules that import one another)"
    )


def test_no_import_cycle_even_for_type_checking_but_the_listed_one():
    """Imports under ``if TYPE_CHECKING:`` never run, but a cycle through them is still two concepts
    that name each other: none but TYPING_ONLY_CYCLE, which is still there (else drop it from the list)."""
    cycles = _cycles(exclude_type_checking_imports=False)
    assert cycles == [set(TYPING_ONLY_CYCLE)], (
        f"import cycles through typing-only imports: {cycles}"
    )
