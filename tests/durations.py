"""Write tests/durations.json (seconds per test id, setup + call + teardown) from a log of
`pytest --durations=0`, for the scheduler in tests/fixtures/scheduling.py.

    python tests/durations.py pytest.log
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+::\S.*?)\s*$")


def parse(text: str) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            seconds[match[3]] = round(seconds.get(match[3], 0.0) + float(match[1]), 2)
    return seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = parse(Path(argv[0]).read_text())
    if not seconds:
        print(f"no --durations lines in {argv[0]}", file=sys.stderr)
        return 1
    out = Path(__file__).with_name("durations.json")
    out.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{out}: {len(seconds)} tests, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
