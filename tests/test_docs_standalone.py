"""The repository stands alone: no file in it cites a document that is not in it.

A person who clones the repository has nothing outside it, so every document a file names (a
Markdown, reStructuredText or text file: ``README.md``, ``docs/ARCHITECTURE.md``, a relative
Markdown link) must be a file of the repository, and no path may lead out of it (a relative path
that climbs above the root, an absolute path to a document). Cross-cutting design is written as
a named note in the code (``[Note: ...]``) or in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent

# What is checked: the code, its tests, benches, examples and docs, and the top-level documents.
SCOPE = ("infinity/", "tests/", "bench/", "examples/", "docs/", "csrc/", "docker/")
TOP_LEVEL = ("README.md",)
# Measured results are data written by the benches, not prose.
NOT_PROSE = ("bench/results/",)
# This file plants dangling references to show the check catches them.
PLANTED = ("tests/test_docs_standalone.py",)

DOC_SUFFIXES = ("md", "rst", "txt")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
# A path-like word ending in a document suffix: not inside a longer path or word.
_DOC_PATH = re.compile(
    r"(?<![\w/.~-])((?:\.{1,2}/|/|~/)?[\w.-]+(?:/[\w.-]+)*\.(?:" + "|".join(DOC_SUFFIXES) + r"))\b"
)
# A relative path that climbs out of its directory: ../x, ../../x (the first component after it).
_PARENT_PATH = re.compile(r"(?<![\w/.~-])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*)")
# A Markdown link's target: [text](target) or [text](target "title").
_MD_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def tracked_files(root: Path) -> list[str]:
    """The repository's files, POSIX-relative to ``root``: git's list where ``root`` is a checkout,
    else every file under it but hidden folders and build outputs (a clone without .git)."""
    if (root / ".git").exists():
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, check=True
        )
        return sorted(f for f in out.stdout.split("\0") if f and (root / f).is_file())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if not name.endswith((".so", ".pyc")):
                files.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(files)


def in_scope(path: str) -> bool:
    in_tree = path.startswith(SCOPE) or path in TOP_LEVEL
    return in_tree and not path.startswith(NOT_PROSE) and path not in PLANTED


def _normalise(path: PurePosixPath) -> str | None:
    """``a/b/../c`` -> ``a/c``; None where the path climbs above the repository's root."""
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/".join(parts)


class _Repository:
    def __init__(self, files: Iterable[str]):
        self.files = set(files)
        self.dirs = {str(p) for f in self.files for p in PurePosixPath(f).parents if str(p) != "."}
        self.names = {PurePosixPath(f).name for f in self.files}

    def has(self, path: str | None) -> bool:
        return path is not None and (path in self.files or path in self.dirs)

    def has_suffix(self, path: str) -> bool:
        """Some file of the repository is ``path`` or ends with ``/path`` (a path given from a
        folder the reader knows from context, such as ``config/data/seeds/x.json``)."""
        return any(f == path or f.endswith("/" + path) for f in self.files)

    def resolves(self, ref: str, source: str, *, suffix_ok: bool) -> bool:
        """Whether ``ref`` (as written in ``source``) names a file or folder of the repository."""
        if ref.startswith(("/", "~")):
            return False  # an absolute path is outside a clone by definition
        here = PurePosixPath(source).parent
        if self.has(_normalise(here / ref)) or self.has(_normalise(PurePosixPath(ref))):
            return True
        if ref.startswith("../"):
            return False  # a climb must land in the repository from where it is written
        if "/" not in ref:
            return ref in self.names
        return suffix_ok and self.has_suffix(ref)


def prose(source: str, text: str) -> str:
    """The text of ``source`` a reader reads as prose, line for line: a Python file's comments and
    docstrings (its other strings are data, such as a path a test feeds in); any other file
    whole."""
    if not source.endswith(".py"):
        return text
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, tokenize.TokenError):
        return text
    docstrings = {
        (node.lineno, node.col_offset)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    lines = [""] * (text.count("\n") + 1)
    for tok in tokens:
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and tok.start in docstrings
        ):
            for i, part in enumerate(tok.string.split("\n")):
                lines[tok.start[0] - 1 + i] += " " + part
    return "\n".join(lines)


def dangling_references(files: dict[str, str], repository: Iterable[str]) -> list[str]:
    """``path:line: ref`` for each reference in the prose of ``files`` (path -> text) to a document
    that is not in ``repository`` (the repository's file list) or to a path leading out of it."""
    repo = _Repository(repository)
    found = []
    for source, text in sorted(files.items()):
        for number, line in enumerate(prose(source, text).splitlines(), start=1):
            bare = _URL.sub(" ", line)
            # ref -> whether a path from a folder known by context may stand (prose, not a link)
            refs = dict.fromkeys(_DOC_PATH.findall(bare), True)
            for ref in _PARENT_PATH.findall(bare):
                refs[ref] = False
            if source.endswith(".md"):
                for target in _MD_LINK.findall(line):
                    if re.match(r"[a-z][a-z0-9+.-]*:|#", target, re.IGNORECASE):
                        continue  # a URL, mailto: or an anchor in the same page
                    refs[target.split("#", 1)[0]] = False
            for ref, suffix_ok in refs.items():
                if ref and not repo.resolves(ref, source, suffix_ok=suffix_ok):
                    found.append(f"{source}:{number}: {ref}")
    return found


def _read(root: Path, files: Iterable[str]) -> dict[str, str]:
    texts = {}
    for f in files:
        try:
            texts[f] = (root / f).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file names no document
    return texts


def test_no_file_cites_a_document_outside_the_repository():
    files = tracked_files(ROOT)
    checked = [f for f in files if in_scope(f)]
    assert "docs/ARCHITECTURE.md" in checked and any(f.startswith("infinity/") for f in checked)
    dangling = dangling_references(_read(ROOT, checked), files)
    assert not dangling, (
        "references to documents that are not in the repository (write the design down as a "
        "[Note: ...] or in docs/ARCHITECTURE.md, or drop the reference):\n" + "\n".join(dangling)
    )


def test_the_check_catches_planted_references():
    repo = ["README.md", "docs/ARCHITECTURE.md", "pkg/mod.py", "pkg/data/seeds/a.json", "docs/x.md"]
    design = "DESIGN.md"
    files = {
        "pkg/mod.py": (
            '"""See docs/ARCHITECTURE.md and README.md, ARCHITECTURE.md, data/seeds/a.json."""\n'
            f"# the house style (see {design}, section store)\n"
            "# copies of ../shared/configs\n"
            "# the guide (shared/seeds/guide-ko.txt)\n"
            "# https://github.com/org/repo/blob/main/DESIGN.md is a web page, not a file\n"
            'BAD_PATHS = ["../other/good", "NOTES.md"]  # data a test feeds in: see NOTES.md\n'
        ),
        "docs/x.md": (
            "[the map](ARCHITECTURE.md) [code](../pkg/mod.py) [top](#layers) "
            "[web](https://a.b/c.md)\n"
            "[gone](notes/gone.md) [up](../../outside.md) see /work/shared/BENCHMARKS.md\n"
        ),
    }
    assert dangling_references(files, repo) == [
        "docs/x.md:2: notes/gone.md",
        "docs/x.md:2: ../../outside.md",
        "docs/x.md:2: /work/shared/BENCHMARKS.md",
        f"pkg/mod.py:2: {design}",
        "pkg/mod.py:3: ../shared/configs",
        "pkg/mod.py:4: shared/seeds/guide-ko.txt",
        "pkg/mod.py:6: NOTES.md",
    ]
    files["pkg/mod.py"] = files["pkg/mod.py"].replace(design, "docs/x.md")
    assert f"pkg/mod.py:2: {design}" not in dangling_references(files, repo)
