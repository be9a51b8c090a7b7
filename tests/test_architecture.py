"""docs/ARCHITECTURE.md and the import contract in pyproject.toml describe the same layers, and the
import rules that package docstrings state are the imports the code makes."""

import ast
import re
import sys
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


def test_the_cli_row_names_every_subcommand():
    from infinity.cli.main import COMMANDS

    row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("| `infinity.cli"))
    modules = sorted(p.stem for p in (ROOT / "infinity" / "cli").glob("*.py"))
    registered = sorted(cmd.__name__.rsplit(".", 1)[1] for cmd in COMMANDS)
    assert modules == sorted(registered + ["__init__", "main"]), (
        "infinity/cli holds one module per subcommand registered in main.COMMANDS, and nothing else"
    )
    missing = [name for name in registered if f"`{name}`" not in row]
    assert not missing, f"docs/ARCHITECTURE.md's infinity.cli row omits subcommands {missing}"


# [Note: stated import rules]
# A package's docstring may say what it imports, in one sentence: "Imports only infinity.aio and
# infinity.host (and torch)." or "Imports only the standard library." The sentence is exact: it
# names every package of infinity the package imports and every third-party one (the standard
# library is always allowed; so is infinity's root package, where the built extensions _aio and
# _adam live). The tests below check it against the imports grimp finds.
_RULE = re.compile(r"Imports only (.+?)\.(?:\s|$)", re.DOTALL)
_NOT_NAMES = {"and", "the", "standard", "library"}


def stated_imports(docstring: str) -> tuple[set[str], set[str]] | None:
    """(infinity packages, third-party packages) an "Imports only ..." sentence names; None without."""
    m = _RULE.search(" ".join(docstring.split()))
    if m is None:
        return None
    names = {n for n in re.findall(r"[A-Za-z_][\w.]*", m.group(1)) if n not in _NOT_NAMES}
    ours = {n for n in names if n.startswith("infinity.")}
    return ours, names - ours


def actual_imports(graph, package: str) -> tuple[set[str], set[str]]:
    """(infinity packages, third-party packages) any module of ``package`` imports directly."""
    ours, theirs = set(), set()
    for module in graph.find_descendants(package) | {package}:
        for imported in graph.find_modules_directly_imported_by(module):
            parts = imported.split(".")
            if parts[0] == "infinity":
                if (
                    len(parts) > 1
                    and not parts[1].startswith("_")
                    and parts[1] != package.split(".")[1]
                ):
                    ours.add(f"infinity.{parts[1]}")
            elif parts[0] not in sys.stdlib_module_names:
                theirs.add(parts[0])
    return ours, theirs


@pytest.fixture(scope="module")
def graph():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the test extra)")
    return grimp.build_graph("infinity", include_external_packages=True)


def test_package_docstrings_state_the_imports_the_code_makes(graph):
    checked, wrong = [], []
    for init in sorted((ROOT / "infinity").glob("*/__init__.py")):
        package = f"infinity.{init.parent.name}"
        stated = stated_imports(ast.get_docstring(ast.parse(init.read_text())) or "")
        if stated is None:
            continue
        checked.append(package)
        actual = actual_imports(graph, package)
        if stated != actual:
            wrong.append(
                f"{package}: the docstring says {sorted(stated[0] | stated[1])}, "
                f"the code imports {sorted(actual[0] | actual[1])}"
            )
    assert not wrong, (
        "package docstrings whose import rule is not what the code does:\n" + "\n".join(wrong)
    )
    assert {"infinity.host", "infinity.aio", "infinity.memory", "infinity.store"} <= set(checked)


def test_a_false_import_rule_is_caught(graph):
    assert stated_imports("Reads files. Imports only the standard library.") == (set(), set())
    assert stated_imports("Imports only infinity.aio and infinity.host\n(and torch, numpy).") == (
        {"infinity.aio", "infinity.host"},
        {"torch", "numpy"},
    )
    assert stated_imports("A store. See docs/ARCHITECTURE.md.") is None
    # The store's docstring as it read before: the code imports infinity.host too.
    planted = stated_imports("Imports only infinity.memory and infinity.aio (and torch).")
    assert planted != actual_imports(graph, "infinity.store")
    assert actual_imports(graph, "infinity.store")[0] == planted[0] | {
        "infinity.host",
        "infinity.timeline",
    }


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
