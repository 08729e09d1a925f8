"""Pin every dependency cswap declares to its floor: pip constraints for CI's oldest job.

    python scripts/lowest_constraints.py > lowest.txt
    python -m pip install -c lowest.txt -e ".[test]"

Reads pyproject.toml's dependencies and the test extra and prints `name==floor`
for each lower bound (">=2.11" gives "torch==2.11"), so the oldest job installs
exactly the versions pyproject.toml claims to support at the bottom of each range.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# "name>=1.2,<2; marker": runs in a fresh venv before anything is installed, so no
# `packaging`; our own requirements are this simple, and anything else is refused.
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*([^;]*?)\s*(;.*)?$")
_LOWER = re.compile(r">=\s*([0-9][0-9A-Za-z.]*)")


def floors(pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = []
    for text in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        parsed = _REQUIREMENT.match(text)
        lower = _LOWER.search(parsed.group(2)) if parsed else None
        if lower is None:
            raise SystemExit(f"{pyproject}: {text!r} declares no lower bound (>=); every dependency needs one")
        lines.append(f"{parsed.group(1)}=={lower.group(1)}{parsed.group(3) or ''}")
    return lines


if __name__ == "__main__":
    print("\n".join(floors(Path(sys.argv[1]) if len(sys.argv) > 1 else PYPROJECT)))
