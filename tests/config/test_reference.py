"""docs/configuration-reference.md is what ``python -m infinity.config.reference`` prints, and it
lists every key the config layer knows, each with the effect support.py gives it.

The keys are read back from the page's Markdown (not from ``reference.rows()``) and compared with
the schema's own lists and with what ``normalize`` accepts, so a key missing from the page, or a
page row naming no key, fails here.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from infinity.config import reference
from infinity.config.optim import SCHEDULE_PARAMS
from infinity.config.schema import alias_paths, known_paths, normalize
from infinity.config.support import NOT_ACTED_ON, OPAQUE
from infinity.config.values import hints, section_type

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration-reference.md"
REGENERATE = "python -m infinity.config.reference > docs/configuration-reference.md"


def _page_rows() -> dict[str, str]:
    """Key as the page writes it (``path`` or ``path (Scheduler)``) -> the row's effect cell."""
    out = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"\| `([^`]+)`( \(\w+\))?", line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            out[m.group(1) + (m.group(2) or "")] = cells[4]
    return out


def _page_verbatim() -> set[str]:
    text = PAGE.read_text().split("## Sections kept verbatim", 1)[1]
    return set(re.findall(r"`([^`]+)`", text))


def test_the_page_is_the_generators_output():
    assert PAGE.read_text() == reference.render(), f"the reference is stale: run {REGENERATE}"


def test_the_module_prints_the_page():
    r = subprocess.run(
        [sys.executable, "-m", "infinity.config.reference"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == reference.render()


def test_the_page_lists_every_key_the_config_knows_and_no_other():
    rows = _page_rows()
    paths = {key.split(" ", 1)[0] for key in rows}
    assert paths == set(known_paths()), (
        f"missing from the page: {sorted(set(known_paths()) - paths)}; "
        f"on the page but unknown: {sorted(paths - set(known_paths()))}"
    )
    assert _page_verbatim() == set(OPAQUE)
    # scheduler params: once per scheduler type, exactly the keys that type takes
    for kind, cls in SCHEDULE_PARAMS.items():
        listed = {k.split(" ")[0].rsplit(".", 1)[1] for k in rows if k.endswith(f"({kind})")}
        assert listed == {f.name for f in dataclasses.fields(cls)}, kind
    for alias in alias_paths():
        assert f"`{alias}`" in PAGE.read_text(), f"alias {alias} is not on the page"


def test_every_key_on_the_page_is_accepted_by_the_parser():
    for key in _page_rows():
        path, _, kind = key.partition(" ")
        if path.split(".")[0] == "scheduler":
            kind = kind.strip("()") or "WarmupLR"
            params = {
                f.name: 1 if f.default is dataclasses.MISSING else _plain(f.default)
                for f in dataclasses.fields(SCHEDULE_PARAMS[kind])
            }
            raw: dict = {"scheduler": {"type": kind, "params": params}}
        else:
            *parents, leaf = path.split(".")
            raw = {}
            node = raw
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _sample(path)
            if path.startswith("optimizer.") and path != "optimizer.type":
                raw["optimizer"]["type"] = "AdamW"
            if path == "optimizer":
                raw["optimizer"] = {"type": "AdamW"}
        parsed = normalize(raw)
        assert not parsed.unknown, (key, parsed.unknown)
        assert path in parsed.user_keys, (key, sorted(parsed.user_keys))


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def _sample(path: str) -> object:
    """A value of the key's own kind: an empty object for a section, else its default."""
    cls, name = known_paths()[path]
    if section_type(hints(cls)[name]) is not None:
        return {}
    default = next(f for f in dataclasses.fields(cls) if f.name == name).default
    if default is dataclasses.MISSING:
        return {"optimizer.type": "AdamW"}[path]
    return _plain(default)


def test_the_effect_column_is_support_pys():
    for key, effect in _page_rows().items():
        path = key.split(" ", 1)[0]
        expected = reference.NO_EFFECT if path in NOT_ACTED_ON else reference.ACTED_ON
        assert effect == expected, (key, effect)
