"""The documentation is tested: the site builds strict, every Python block of docs/*.md and the
README runs, and the README stays short, each of its figures linked to the page and command that
give it.

A block that is not meant to run says why on the line before it: ``<!-- no-run: reason -->``.
The blocks of one page run in order in one fresh interpreter (a page is a tutorial: later blocks
use what earlier ones made), in a temporary working folder, so swap files and checkpoints the
examples write land there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [README]

_FENCE = re.compile(r"^```(\w*)\s*$")
_NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line of the first code line, code, the no-run reason or None) for each ```python block."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in ("python", "py"):
            marker = _NO_RUN.match(lines[i - 1].strip()) if i else None
            out.append((i + 2, "\n".join(lines[i + 1 : end]) + "\n", marker and marker.group(1)))
        i = end + 1
    return out


def _runnable(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code, reason in python_blocks(page.read_text()) if not reason]


# Runs the blocks it reads from stdin in one namespace; a traceback names the page and its line.
_DRIVER = """
import json, sys
scope = {"__name__": "__main__"}
for name, line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, name, "exec"), scope)
"""


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if _runnable(p)],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_the_python_blocks_of_a_page_run(page, tmp_path):
    name = page.relative_to(ROOT).as_posix()
    blocks = [(name, line, code) for line, code in _runnable(page)]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(blocks),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"a Python block of {name} failed:\n{r.stderr[-6000:]}"


def test_every_no_run_marker_gives_a_reason_and_stands_before_a_python_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if "no-run" in line and line.strip().startswith("<!--"):
                where = f"{page.relative_to(ROOT)}:{i + 1}"
                assert _NO_RUN.match(line.strip()), f"{where}: write <!-- no-run: reason -->"
                assert i + 1 < len(lines) and lines[i + 1].strip() in ("```python", "```py"), (
                    f"{where}: a no-run marker must be the line just before a ```python block"
                )


def test_the_block_reader_sees_markers_and_lines():
    text = "intro\n```python\nx = 1\n```\n<!-- no-run: needs a GPU -->\n```python\ny\n```\n```sh\nls\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", None), (7, "y\n", "needs a GPU")]


def test_getting_started_shows_the_readme_example():
    """Run once, from README.md; getting-started's copy is marked no-run and must stay the same."""
    (readme_example,) = [code for _, code, _ in python_blocks(README.read_text())]
    page = ROOT / "docs" / "getting-started.md"
    (example,) = [code for _, code, _ in python_blocks(page.read_text())]
    assert example == readme_example, (
        "docs/getting-started.md and README.md show different examples"
    )


def test_the_site_builds_strict(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "configuration-reference" / "index.html").is_file()


def test_the_readme_fits_two_screens():
    n = len(README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move detail to a docs/ page and link it"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs's toc both make it (for the headings used here)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"\d+(?:[.,]\d+)*", text))


def test_every_readme_figure_links_the_page_and_the_command_that_give_it():
    text = README.read_text()
    section = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| figure")
    ]
    assert len(rows) >= 5
    for row in rows:
        figure, command, page = [c.strip() for c in row.strip("|").split(" | ")]
        ((target, anchor),) = re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", page)
        doc = ROOT / target
        assert doc.is_file(), f"{target} (linked from the README) does not exist"
        headings = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
        assert not anchor or anchor in {_slug(h) for h in headings}, (
            f"{target} has no heading #{anchor}"
        )
        body = " ".join(doc.read_text().split())
        cmd = command.strip("`")
        assert command.startswith("`") and " ".join(cmd.split()) in body, (
            f"the command {cmd!r} is not on {target}, which the README links for it"
        )
        missing = _numbers(figure.replace("**", "")) - _numbers(body)
        assert not missing, f"{target} does not state the README's figures {missing} ({figure})"


@pytest.mark.parametrize(
    "config, arguments",
    [
        ({"zero_optimization": {"stage": 3, "offload_param": {"devise": "nvme"}}}, {}),
        ("bad.json", {}),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, {}),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, {"lr": 1e-3}),
        ({}, {"lrr": 1e-3}),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, {}),
    ],
    ids=["unknown-key", "syntax", "auto", "disagree", "keyword", "nvme-path"],
)
def test_troubleshooting_quotes_the_errors_the_config_raises(
    config, arguments, tmp_path, monkeypatch
):
    from infinity.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 3,, }}')
    with pytest.raises((ValueError, TypeError)) as raised:
        load_config(config, **arguments)
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert str(raised.value) in page, f"docs/troubleshooting.md no longer quotes: {raised.value}"


def test_the_nav_hook_drops_only_optional_pages_that_are_missing(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "optional_pages", ROOT / "docs" / "_hooks" / "optional_pages.py"
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    (tmp_path / "lora.md").write_text("# LoRA\n")
    nav = [
        {"Home": "index.md"},
        {"Guide": ["training.md", "lora.md", "tracing.md", {"Monitoring": "monitoring.md"}]},
        "typo.md",
    ]
    config = hook.on_config({"nav": nav, "docs_dir": str(tmp_path)})
    # the LoRA page exists, the tracing and monitoring pages do not; the misspelt name is no
    # optional page: kept, so that strict mode still refuses it
    assert config["nav"] == [{"Home": "index.md"}, {"Guide": ["training.md", "lora.md"]}, "typo.md"]
