"""The private framework APIs infinity uses are the ones infinity/integrations/private_api.py lists.

For each entry: the installed framework still has it, with the parameters we rely on (a failure
names the entry, the modules that use it, the installed version and the version the table was
checked against). Then the source of each module the table covers is read (ast) for every private
name it touches on a framework object (an attribute ``x._name``, a method ``def _name`` that a
framework base class defines, ``getattr(x, "_name")``, ``from framework import _name``): each must
be in the table, so it cannot drift. Every module of infinity that imports or looks up a framework
(transformers, peft, accelerate, lightning) is read too: one the table does not cover must touch no
private name, so a new module cannot escape the check.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from infinity.integrations.private_api import PINNED, PRIVATE_APIS, PrivateApi

INFINITY = Path(__file__).resolve().parents[2] / "infinity"
# Python's own API under a leading underscore (documented: namedtuple's _fields), not a framework's.
PYTHON_API = {"_fields"}
# The modules the table covers, as paths relative to the infinity package.
MODULES = (
    "integrations._shared",
    "integrations._lightning_shared",
    "integrations.accelerate",
    "integrations.lightning",
    "integrations.fabric",
    "integrations.transformers",
    "zero.hf_init",
    "engine.saving",
    "weights.hf_layout",
)
FRAMEWORKS = ("transformers", "peft", "accelerate", "lightning")


def _source(module: str) -> str:
    return (INFINITY / f"{module.replace('.', '/')}.py").read_text()


def _file(module: str) -> str:
    return f"infinity/{module.replace('.', '/')}.py"


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@functools.cache
def _sets(owner: object, name: str) -> bool:
    """``owner`` (a class or a base of it, or a module) defines ``name``, or its own code uses it
    (``x.<name>``, ``"<name>"``)."""
    for base in inspect.getmro(owner) if isinstance(owner, type) else (owner,):
        if name in vars(base):
            return True
        try:
            if re.search(rf"\.{name}\b|[\"']{name}[\"']", inspect.getsource(base)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _changed(entry: PrivateApi, what: str) -> str:
    return (
        f"{entry.name} ({entry.kind}, used in {', '.join(map(_file, entry.used_in))}): {what} in "
        f"{entry.framework} {version(entry.framework)}; the table was checked against "
        f"{entry.framework} {PINNED[entry.framework]}. Why we use it: {entry.why}. Update the "
        "module and the table together."
    )


@pytest.mark.parametrize("entry", PRIVATE_APIS, ids=lambda e: e.name)
def test_each_private_api_exists_with_its_parameters(entry: PrivateApi):
    if entry.kind == "attribute":
        owner_name, attr = entry.name.rsplit(".", 1)
        try:
            owner = _resolve(owner_name)
        except (ImportError, AttributeError) as e:
            pytest.fail(_changed(entry, f"its owner {owner_name} is gone ({e})"))
        assert _sets(owner, attr), _changed(entry, f"{owner_name} no longer has or sets {attr}")
        return
    try:
        obj = _resolve(entry.name)
    except (ImportError, AttributeError) as e:
        pytest.fail(_changed(entry, f"it is gone ({e})"))
    if entry.params is not None:
        got = tuple(inspect.signature(obj).parameters)
        assert got == entry.params, _changed(entry, f"its parameters are {got}, not {entry.params}")


def test_the_table_names_pinned_frameworks_and_covered_modules():
    names = {e.name for e in PRIVATE_APIS}
    for entry in PRIVATE_APIS:
        assert entry.framework in PINNED, entry
        assert entry.kind in ("override", "patch", "call", "attribute", "import", "order"), entry
        assert set(entry.used_in) <= set(MODULES), entry
        assert not entry.attribute.startswith("__"), entry
        # A public-looking name is listed only as part of a private API's interface.
        assert entry.attribute.startswith("_") or entry.through in names, entry
        assert not entry.through or set(entry.used_in) <= set(
            next(e.used_in for e in PRIVATE_APIS if e.name == entry.through)
        ), entry


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _framework_bases(module: str, class_name: str) -> list[type]:
    cls = getattr(importlib.import_module(f"infinity.{module}"), class_name, None)
    if not isinstance(cls, type):  # a class defined inside a function: not a module attribute
        return []
    return [
        b
        for b in inspect.getmro(cls)
        if not b.__module__.startswith("infinity") and b is not object
    ]


def _uses(module: str) -> dict[str, int]:
    """The private names ``module`` touches on framework objects, with a line each."""
    tree = ast.parse(_source(module))
    touched: dict[str, int] = {}
    own: set[str] = set()
    framework: set[str] = set()
    in_methods: set[int] = set()  # ``self.x`` / ``cls.x`` read inside a class: judged with it
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = _framework_bases(module, cls.name)
        for node in ast.walk(cls):
            name = None
            if isinstance(node, ast.FunctionDef) and _private(node.name):
                name = node.name
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                name = node.attr
                in_methods.add(id(node))
            if name is None:
                continue
            if any(_sets(b, name) for b in bases):
                framework.add(name)
                touched.setdefault(name, node.lineno)
            else:
                own.add(name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            # A local named ``cls`` outside a class (a framework class being patched) counts.
            if id(node) not in in_methods:
                touched.setdefault(node.attr, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            touched.setdefault(node.args[1].value, node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and not node.module.startswith("infinity")
        ):
            for alias in node.names:
                if _private(alias.name):
                    touched.setdefault(alias.name, node.lineno)
    return {n: line for n, line in touched.items() if n in framework or n not in own}


def _framework_facing() -> list[str]:
    """Every module of infinity that imports a framework or looks one up by name."""
    found = []
    for path in sorted(INFINITY.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                tops = [node.module.split(".")[0]]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                tops = [node.value]
            else:
                continue
            if any(t in FRAMEWORKS for t in tops):
                module = path.relative_to(INFINITY).with_suffix("").as_posix().replace("/", ".")
                found.append(module.removesuffix(".__init__"))
                break
    return found


@functools.cache
def _own_everywhere() -> frozenset[str]:
    """Private names infinity's own classes define (methods, or fields they set that no framework
    base class has): a module reaching such a field of another infinity object is not using a
    framework API."""
    own: set[str] = set()
    for module in sorted({*MODULES, *_framework_facing()}):
        tree = ast.parse(_source(module))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = _framework_bases(module, cls.name)
            for node in ast.walk(cls):
                name = (
                    node.name
                    if isinstance(node, ast.FunctionDef)
                    else (
                        node.attr
                        if isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Name)
                        and node.value.id == "self"
                        else None
                    )
                )
                if name and _private(name) and not any(_sets(b, name) for b in bases):
                    own.add(name)
    return frozenset(own)


def _unlisted(module: str) -> dict[str, int]:
    """The private framework names ``module`` touches that the table does not list for it."""
    listed = {e.attribute for e in PRIVATE_APIS if module in e.used_in and module in MODULES}
    skip = listed | _own_everywhere() | PYTHON_API
    return {n: line for n, line in _uses(module).items() if n not in skip}


@pytest.mark.parametrize("module", MODULES)
def test_every_private_name_a_module_touches_is_in_the_table(module):
    missing = _unlisted(module)
    assert not missing, (
        f"{_file(module)} touches private framework names not listed for it in "
        "infinity/integrations/private_api.py: "
        + ", ".join(f"{n} (line {line})" for n, line in sorted(missing.items()))
    )


def test_every_module_that_uses_a_framework_privately_is_covered():
    facing = _framework_facing()
    # The search finds the covered modules that import a framework (the shared ones do not).
    assert {m for m in MODULES if not m.startswith("integrations._")} <= set(facing), facing
    escaped = {m: sorted(_unlisted(m)) for m in facing if m not in MODULES and _unlisted(m)}
    assert not escaped, (
        "modules that use a framework touch private names the table does not cover; add their "
        "entries to infinity/integrations/private_api.py and the module to MODULES in "
        f"tests/integrations/test_private_api.py: {escaped}"
    )


def test_every_table_entry_is_used_where_it_says():
    for entry in PRIVATE_APIS:
        for module in entry.used_in:
            assert entry.attribute in _source(module), (
                f"{entry.name} is listed as used in {_file(module)}, which does not mention it: "
                "remove it from the table"
            )
