"""The private framework APIs the adapters use are the ones infinity/integrations/private_api.py lists.

For each entry: the installed framework still has it, with the parameters the adapters rely on (a
failure names the entry, the installed version and the version the table was checked against).
Then the adapters' source is read (ast) for every private name they touch on a framework object (an
attribute ``x._name``, a method ``def _name`` that a framework base class defines, ``getattr(x,
"_name")``, ``from framework import _name``): each must be in the table, so it cannot drift.
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

ADAPTERS = Path(__file__).resolve().parents[2] / "infinity" / "integrations"
# Python's own API under a leading underscore (documented: namedtuple's _fields), not a framework's.
PYTHON_API = {"_fields"}
MODULES = ("_shared", "_lightning_shared", "accelerate", "lightning", "fabric", "transformers")


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
def _sets(cls: type, name: str) -> bool:
    """``cls`` (or a base) defines ``name``, or its own code uses it (``x.<name>``, ``"<name>"``)."""
    for base in inspect.getmro(cls):
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
        f"{entry.name} ({entry.kind}, used in infinity/integrations/{', '.join(entry.used_in)}.py): {what} in "
        f"{entry.framework} {version(entry.framework)}; the table was checked against {entry.framework} "
        f"{PINNED[entry.framework]}. Why we use it: {entry.why}. Update the adapter and the table together."
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


def test_the_table_names_pinned_frameworks_and_known_adapters():
    for entry in PRIVATE_APIS:
        assert entry.framework in PINNED, entry
        assert entry.kind in ("override", "call", "attribute", "import"), entry
        assert set(entry.used_in) <= set(MODULES), entry
        assert entry.attribute.startswith("_") and not entry.attribute.startswith("__"), entry


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _framework_bases(module_name: str, class_name: str) -> list[type]:
    cls = getattr(importlib.import_module(f"infinity.integrations.{module_name}"), class_name)
    return [
        b
        for b in inspect.getmro(cls)
        if not b.__module__.startswith("infinity") and b is not object
    ]


def _uses(module_name: str) -> dict[str, int]:
    """The private names ``module_name`` touches on framework objects, with a line each."""
    tree = ast.parse((ADAPTERS / f"{module_name}.py").read_text())
    touched: dict[str, int] = {}
    own: set[str] = set()
    framework: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = _framework_bases(module_name, cls.name)
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
            if name is None:
                continue
            if any(_sets(b, name) for b in bases):
                framework.add(name)
                touched.setdefault(name, node.lineno)
            else:
                own.add(name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
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
            and not node.module.startswith("infinity")
        ):
            for alias in node.names:
                if _private(alias.name):
                    touched.setdefault(alias.name, node.lineno)
    return {n: line for n, line in touched.items() if n in framework or n not in own}


@functools.cache
def _own_everywhere() -> frozenset[str]:
    """Private names the adapters' own classes define (methods, or fields they set that no framework
    base class has): an adapter reaching such a field of another adapter object is not a framework API."""
    own: set[str] = set()
    for module_name in MODULES:
        tree = ast.parse((ADAPTERS / f"{module_name}.py").read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = _framework_bases(module_name, cls.name)
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


@pytest.mark.parametrize("module_name", MODULES)
def test_every_private_name_an_adapter_touches_is_in_the_table(module_name):
    listed = {e.attribute for e in PRIVATE_APIS if module_name in e.used_in}
    own = _own_everywhere()
    missing = {
        n: line for n, line in _uses(module_name).items() if n not in listed | own | PYTHON_API
    }
    assert not missing, (
        f"infinity/integrations/{module_name}.py touches private framework names not listed for it in "
        f"infinity/integrations/private_api.py: {', '.join(f'{n} (line {line})' for n, line in sorted(missing.items()))}"
    )


def test_every_table_entry_is_used_where_it_says():
    for entry in PRIVATE_APIS:
        for module_name in entry.used_in:
            assert entry.attribute in (ADAPTERS / f"{module_name}.py").read_text(), (
                f"{entry.name} is listed as used in {module_name}.py, which does not mention it: remove it from "
                "the table"
            )
