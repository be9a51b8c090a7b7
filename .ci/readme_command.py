"""Prints one of the README's two set-up commands ("main" or "tests").

The README is the single source of truth: CI runs its test command, and the
Dockerfile test checks it repeats the same steps.
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands() -> dict[str, str]:
    text = README.read_text()
    block = re.search(r"```(?:sh|bash)\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit("README.md has no ```sh block with the set-up commands")
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 2:
        raise SystemExit(f"README.md's first sh block must hold exactly two commands, found {len(lines)}")
    return {"main": lines[0], "tests": lines[1]}


if __name__ == "__main__":
    print(commands()[sys.argv[1]])
