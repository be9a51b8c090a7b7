"""The checked-in type stub infinity/_aio.pyi names exactly what the built extension exports."""

import ast
from pathlib import Path

from infinity import _aio

STUB = Path(__file__).resolve().parents[2] / "infinity" / "_aio.pyi"
STUB_ONLY = {"RequestErrorInfo", "Segment"}  # typing helpers, not runtime objects


def stub_names() -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"
            }
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.Assign):
            names.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
    return names


def test_stub_matches_extension():
    stub = stub_names()
    runtime = {n for n in dir(_aio) if not n.startswith("_")}
    assert set(stub) - STUB_ONLY == runtime
    for name, members in stub.items():
        if members is None or name in STUB_ONLY:
            continue
        cls = getattr(_aio, name)
        public = {m for m in dir(cls) if not m.startswith("_")}
        assert members == public, name
