"""Reading a config file as DeepSpeed does (hjson), with syntax errors reported where the mistake is.

DeepSpeed reads its config files with hjson, so comments, trailing commas,
commas omitted at line ends and unquoted keys are accepted; duplicate keys
are refused, as DeepSpeed does. Strict JSON is tried first (most files are
JSON); hjson reads the rest.

[Note: where a syntax error is]
hjson reads a value it cannot place as a "quoteless string" that runs to the
end of its line, so a comma missing in the middle of a line (``"enabled":
true "b": 1``) swallows the rest of the line and hjson fails only at the end
of the file. When hjson fails, a scanner for the JSON that hjson accepts in
practice -- JSON plus comments, trailing commas, line breaks as separators,
unquoted keys and quoteless values -- walks the text once more, but takes a
number, ``true``, ``false`` or ``null`` as complete: whatever follows one on
the same line, other than a comma, a closing bracket or a comment, is the
mistake. The earlier of its error and hjson's is reported, as line, column,
the line itself and a caret. When hjson succeeds the scanner runs too: a
number or literal followed on its line by a quoted string (``"stage": 3
"offload_param": {...}``) is a missing comma that hjson read as one string
value -- refused, where DeepSpeed would go on with that string.
"""

from __future__ import annotations

import collections
import json
import os
import re
from pathlib import Path
from typing import Any

import hjson

from infinity.config.errors import ConfigError

_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_KEY_END = frozenset(" \t\r\n:,{}[]")
_CLOSERS = {"{": "}", "[": "]"}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parses a config file the way DeepSpeed does (hjson), refusing duplicate keys and empty files."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (or is not a file)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
        ) from e
    if _blank(text):
        # hjson reads nothing as {}: a file truncated or saved empty would run all defaults.
        raise ConfigError(
            f"config file {str(p)!r} is empty (no JSON object, only whitespace and comments); write "
            'the config in it, e.g. {"zero_optimization": {"stage": 3}}, or pass no config for all '
            "defaults"
        )
    data = _parse(text, str(p))
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(p)!r} must hold a JSON object {{...}}; got {type(data).__name__}"
        )
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = collections.Counter(k for k, _ in pairs)
    dupes = sorted(k for k, n in counts.items() if n > 1)
    if dupes:
        raise ConfigError(f"duplicate key(s) in the config: {', '.join(dupes)}")
    return dict(pairs)


def _parse(text: str, name: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError:
        pass
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as e:
        pos, what = e.pos, e.msg
    except IndexError:  # hjson 3.1 runs off the end of an unclosed /* comment
        pos, what = len(text), "unexpected end of the file"
    else:
        try:
            _Scanner(text).document()
        except _SyntaxAt as mine:
            if mine.swallowed:
                what = f"{mine.what} (hjson, as DeepSpeed uses it, reads the rest of the line as one string)"
                raise ConfigError(
                    f"config file {name!r} is not valid JSON/hjson: {_where(text, mine.pos, what)}"
                ) from None
        return data
    try:
        _Scanner(text).document()
    except _SyntaxAt as mine:
        if mine.pos <= pos:
            pos, what = mine.pos, mine.what
    raise ConfigError(f"config file {name!r} is not valid JSON/hjson: {_where(text, pos, what)}")


def _where(text: str, pos: int, what: str) -> str:
    """'line L, column C: what' and the line with a caret under the column."""
    pos = min(pos, len(text))
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : len(text) if end < 0 else end].rstrip("\r")
    lineno = text.count("\n", 0, pos) + 1
    col = pos - start + 1
    pad = "".join("\t" if ch == "\t" else " " for ch in line[: col - 1])
    return f"line {lineno}, column {col}: {what}\n    {line}\n    {pad}^"


def _blank(text: str) -> bool:
    """Whether ``text`` holds nothing but whitespace and comments."""
    s = _Scanner(text)
    try:
        s.skip()
    except _SyntaxAt:
        return False  # an unclosed comment: a syntax error, reported as such
    return s.pos >= len(text)


class _SyntaxAt(Exception):
    def __init__(self, pos: int, what: str, *, swallowed: bool = False):
        super().__init__(what)
        self.pos = pos
        self.what = what
        self.swallowed = swallowed
        """A scalar followed by a quoted string on its line: hjson reads both as one string."""


class _Scanner:
    """Walks hjson as DeepSpeed configs use it; raises _SyntaxAt at the first mistake.

    See [Note: where a syntax error is]. Values are not built: only positions matter.
    """

    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def document(self) -> None:
        self.skip()
        if self._peek() in _CLOSERS:
            self.value()
        else:
            self.members(None, self.pos)  # hjson's root object without braces
        self.skip()
        if self.pos < len(self.text):
            raise _SyntaxAt(self.pos, f"unexpected {self._found()} after the end of the config")

    def skip(self) -> bool:
        """Skips whitespace and comments; returns whether a line break was crossed."""
        text, crossed = self.text, False
        while self.pos < len(text):
            c = text[self.pos]
            if c == "\n":
                crossed = True
                self.pos += 1
            elif c in " \t\r\ufeff":
                self.pos += 1
            elif c == "#" or text.startswith("//", self.pos):
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                if end < 0:
                    raise _SyntaxAt(self.pos, "this /* comment is never closed with */")
                crossed = crossed or "\n" in text[self.pos : end]
                self.pos = end + 2
            else:
                break
        return crossed

    def value(self) -> bool:
        """Skips one value; returns whether it was a number or literal (see scalar)."""
        self.skip()
        c = self._peek()
        if c == "":
            raise _SyntaxAt(self.pos, "expected a value, found the end of the file")
        if c in _CLOSERS:
            if c == "{":
                self.members("}", self.pos)
            else:
                self.items()
        elif c in "\"'":
            self.string()
        elif c in ",:]}":
            raise _SyntaxAt(self.pos, f"expected a value, found {self._found()}")
        else:
            return self.scalar()
        return False

    def members(self, close: str | None, opened: int) -> None:
        if close is not None:
            self.pos += 1
        while True:
            self.skip()
            c = self._peek()
            if c == "":
                if close is None:
                    return
                raise self._unclosed(opened, close)
            if c == close:
                self.pos += 1
                return
            if c in ",:]}":
                expected = f"a key or '{close}'" if close else "a key"
                raise _SyntaxAt(self.pos, f"expected {expected}, found {self._found()}")
            key = self.key()
            self.skip()
            if self._peek() != ":":
                raise _SyntaxAt(
                    self.pos, f"expected ':' after the key {key!r}, found {self._found()}"
                )
            self.pos += 1
            scalar = self.value()
            self.separator(close, f"the value of {key!r}", scalar)

    def items(self) -> None:
        opened = self.pos
        self.pos += 1
        while True:
            self.skip()
            c = self._peek()
            if c == "":
                raise self._unclosed(opened, "]")
            if c == "]":
                self.pos += 1
                return
            if c == ",":
                raise _SyntaxAt(self.pos, "expected a value or ']', found ','")
            scalar = self.value()
            self.separator("]", "a list item", scalar)

    def separator(self, close: str | None, after: str, scalar: bool) -> None:
        """After a member: a comma, the closing bracket, or a line break (hjson); else the mistake."""
        crossed = self.skip()
        c = self._peek()
        if c == ",":
            self.pos += 1
        elif c in ("", close) or crossed:
            return
        else:
            closing = f" or '{close}'" if close else ""
            raise _SyntaxAt(
                self.pos,
                f"expected ','{closing} after {after}, found {self._found()}: is a comma missing?",
                swallowed=scalar and c in "\"'",
            )

    def key(self) -> str:
        if self._peek() in "\"'":
            start = self.pos
            self.string()
            return self.text[start + 1 : self.pos - 1]
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _KEY_END:
            self.pos += 1
        return self.text[start : self.pos]

    def string(self) -> None:
        text, start = self.text, self.pos
        if text.startswith("'''", start):
            end = text.find("'''", start + 3)
            if end < 0:
                raise _SyntaxAt(start, "this ''' string is never closed")
            self.pos = end + 3
            return
        quote = text[start]
        i = start + 1
        while i < len(text) and text[i] not in (quote, "\n"):
            i += 2 if text[i] == "\\" else 1
        if i >= len(text) or text[i] != quote:
            raise _SyntaxAt(start, f"this string is not closed with {quote} on its line")
        self.pos = i + 1

    def scalar(self) -> bool:
        """Skips a number or literal (True), else hjson's quoteless string: the rest of the line."""
        m = _SCALAR.match(self.text, self.pos)
        if m is not None:
            end = m.end()
            rest = self.text[end : end + 2]
            if rest == "" or rest[0] in " \t\r\n,]}#" or rest in ("//", "/*"):
                self.pos = end
                return True
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end < 0 else end
        return False

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _found(self) -> str:
        if self.pos >= len(self.text):
            return "the end of the file"
        m = re.compile(r'"[^"\n]{0,30}"?|[^\s]{1,30}').match(self.text, self.pos)
        return repr(m.group(0)) if m else repr(self.text[self.pos])

    def _unclosed(self, opened: int, close: str) -> _SyntaxAt:
        return _SyntaxAt(
            opened,
            f"this '{self.text[opened]}' is never closed: a '{close}' is missing (or a "
            f"'{self.text[opened]}' is one too many)",
        )
