"""The C++ extensions and their checked-in stubs (infinity/_aio.pyi, infinity/_adam.pyi) agree, and
no positional bool crosses the boundary (STYLE: options are keyword-only).

The runtime side is read from the signature line pybind11 writes into each docstring, so a
binding whose py::kw_only() moved, or a stub that forgot its ``*``, fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from infinity import _adam, _aio

ROOT = Path(__file__).resolve().parents[1] / "infinity"
EXTENSIONS = {"_aio": _aio, "_adam": _adam}
STUB_ONLY = {"RequestErrorInfo", "Segment"}  # typing helpers, not runtime objects


def stub_names(stub: Path) -> dict[str, set[str] | None]:
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(stub.read_text()).body:
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


Params = list[tuple[str, str]]
"""(name, kind) per parameter; kind is 'positional' or 'keyword'."""


def stub_signatures(stub: Path) -> dict[str, Params]:
    """'func' or 'Class.method' -> its parameters, for every function the stub declares."""
    out: dict[str, Params] = {}

    def params(f: ast.FunctionDef) -> Params:
        a = f.args
        # Positional-only stub parameters are unnamed in pybind11 (arg0, ...).
        return (
            [(p.arg if p.arg == "self" else "arg", "positional") for p in a.posonlyargs]
            + [(p.arg, "positional") for p in a.args]
            + [(p.arg, "keyword") for p in a.kwonlyargs]
        )

    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and not f.decorator_list:
                    out[f"{node.name}.{f.name}"] = params(f)
    return out


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def runtime_params(fn: object) -> list[tuple[str, str, str]]:
    """(name, kind, annotation) per parameter, from pybind11's signature line in the docstring."""
    line = (fn.__doc__ or "").splitlines()[0]
    open_at = line.index("(")
    depth = 0
    close_at = next(
        i
        for i in range(open_at, len(line))
        if (depth := depth + (line[i] == "(") - (line[i] == ")")) == 0
    )
    out, kind = [], "positional"
    for p in _split_top_level(line[open_at + 1 : close_at]):
        if p == "*":
            kind = "keyword"
            continue
        pname, _, ann = p.partition(":")
        ann = ann.split("=")[0].strip()
        out.append(("arg" if re.fullmatch(r"arg\d+", pname) else pname.strip(), kind, ann))
    return out


def runtime_object(module: object, qualname: str) -> object:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", EXTENSIONS)
def test_stub_names_match_extension(name):
    module, stub = EXTENSIONS[name], stub_names(ROOT / f"{name}.pyi")
    runtime = {n for n in dir(module) if not n.startswith("_")}
    assert set(stub) - STUB_ONLY == runtime
    for cls_name, members in stub.items():
        if members is None or cls_name in STUB_ONLY:
            continue
        public = {m for m in dir(getattr(module, cls_name)) if not m.startswith("_")}
        assert members == public, cls_name


@pytest.mark.parametrize("name", EXTENSIONS)
def test_stub_signatures_match_extension(name):
    """Same parameter names, in the same order, keyword-only in the stub where they are in C++."""
    module = EXTENSIONS[name]
    signatures = stub_signatures(ROOT / f"{name}.pyi")
    assert signatures
    for qualname, params in signatures.items():
        runtime = [(n, k) for n, k, _ in runtime_params(runtime_object(module, qualname))]
        assert runtime == params, qualname


@pytest.mark.parametrize("name", EXTENSIONS)
def test_no_positional_bool_crosses_the_boundary(name):
    module = EXTENSIONS[name]
    checked = 0
    for qualname in stub_signatures(ROOT / f"{name}.pyi"):
        for pname, kind, ann in runtime_params(runtime_object(module, qualname)):
            checked += ann == "bool"
            assert not (ann == "bool" and kind == "positional"), (
                f"{qualname}({pname}) is a positional bool"
            )
    assert checked  # the bindings do take bools: the test looked at them


def test_aio_bindings_refuse_positional_bools(tmp_path):
    path = str(tmp_path / "f")
    with pytest.raises(TypeError):
        _aio.open_file(path, "rw", True, False)
    f = _aio.open_file(path, "rw", create=True, direct=False)
    with pytest.raises(TypeError):
        _aio.AlignedBuffer(4096, False, True)
    buf = _aio.AlignedBuffer(4096, huge_pages=False, prefault=True)
    engine = _aio.Engine(
        block_size=4096,
        queue_depth=1,
        thread_count=1,
        backend="threads",
        submit_batch=1,
        overlap_events=True,
    )
    try:
        segments = [(buf.ptr, 4096, 0, f)]
        with pytest.raises(TypeError):
            engine.submit(True, segments, keep=buf)
        with pytest.raises(TypeError):
            engine.submit(segments, True, keep=buf)
        req = engine.submit(segments, write=True, keep=buf)
        assert req.wait() and req.error() is None and f.size() == 4096
    finally:
        engine.shutdown()
        f.close()


def test_adam_bindings_refuse_positional_arguments():
    import torch

    p, g, m, v = (torch.full((8,), x) for x in (1.0, 0.5, 0.0, 0.0))
    lists = [[t.data_ptr()] for t in (p, g, m, v)] + [[0], [8], [_adam.FLOAT32], [-1]]
    hyper = _adam.AdamHyper(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    with pytest.raises(TypeError):
        _adam.adam_step(*lists, hyper, 1.0, _adam.SCALAR, 1)
    with pytest.raises(
        TypeError
    ):  # the hyper-parameters cross as one AdamHyper, not a row of numbers
        _adam.adam_step(*lists, 0.1, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, _adam.SCALAR, 1)
    names = (
        "params",
        "grads",
        "exp_avgs",
        "exp_avg_sqs",
        "out_halfs",
        "numels",
        "grad_dtypes",
        "half_dtypes",
    )
    _adam.adam_step(
        **dict(zip(names, lists, strict=True)),
        hyper=hyper,
        step=1.0,
        isa=_adam.SCALAR,
        num_threads=1,
    )
    assert bool((p < 1.0).all())  # the step ran
    with pytest.raises(TypeError):
        _adam.has_overflow([g.data_ptr()], [8], [_adam.FLOAT32], _adam.SCALAR, 1)
    assert not _adam.has_overflow(
        [g.data_ptr()], [8], [_adam.FLOAT32], isa=_adam.SCALAR, num_threads=1
    )
    with pytest.raises(TypeError):
        _adam.sum_squares([g.data_ptr()], [8], _adam.SCALAR, 1)
    assert _adam.sum_squares([g.data_ptr()], [8], isa=_adam.SCALAR, num_threads=1) == 2.0
    with pytest.raises(TypeError):
        _adam.stream_bound(*lists[:4], [8], _adam.SCALAR, 1)
    step = torch.zeros((), dtype=torch.float64)
    with pytest.raises(TypeError):
        _adam.bump_step_counts([step.data_ptr()], [1], 1.0)
    assert _adam.bump_step_counts([step.data_ptr()], is_double=[1], increment=1.0) == [0.0]
    assert step.item() == 1.0
