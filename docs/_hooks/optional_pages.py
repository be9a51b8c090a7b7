"""MkDocs hook: nav entries for pages other branches add are kept only once the page exists.

Every other nav entry must name a page that exists (``mkdocs build --strict`` fails otherwise);
these few are written by other work in progress, so the site builds strict with or without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPTIONAL = frozenset(
    {"installing.md", "migrating-from-deepspeed.md", "monitoring.md", "tracing.md", "lora.md"}
)


def _present(entry: Any, docs: Path) -> bool:
    page = next(iter(entry.values())) if isinstance(entry, dict) else entry
    return not (isinstance(page, str) and page in OPTIONAL and not (docs / page).is_file())


def _prune(nav: list[Any], docs: Path) -> list[Any]:
    out = []
    for entry in nav:
        if isinstance(entry, dict) and isinstance(next(iter(entry.values())), list):
            ((title, children),) = entry.items()
            out.append({title: _prune(children, docs)})
        elif _present(entry, docs):
            out.append(entry)
    return out


def on_config(config: Any) -> Any:
    config["nav"] = _prune(config["nav"], Path(config["docs_dir"]))
    return config
