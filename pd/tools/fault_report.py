"""Turns the reliability tests' recorded outcomes into the markdown table of docs/reliability-and-security.md.

    PDKV_FAULT_REPORT=/tmp/faults.json python -m pytest tests/reliability -q [-m slow]
    python -m pd.tools.fault_report /tmp/faults.json [--out table.md]

Each row of the JSON file (written by tests/reliability/conftest.py) holds the
fault tried, where it was injected, what the user saw, what pdkv did and the
state of the KV pools afterwards. Rows for the same fault keep the latest.
"""
from __future__ import annotations

import argparse
import json
import sys

COLUMNS = (("fault", "Fault tried"), ("where", "Where"), ("user_saw", "What the user saw"),
           ("pdkv_did", "What pdkv did"), ("pools", "KV pools after"))


def render(rows: list[dict]) -> str:
    """A markdown table, one line per distinct fault, in the order first recorded."""
    latest: dict[str, dict] = {}
    for row in rows:
        latest[row.get("fault", "?")] = row
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in latest.values():
        cells = [str(row.get(key, "")).replace("|", "\\|").replace("\n", " ") for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.fault_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="JSON written by the reliability tests (PDKV_FAULT_REPORT)")
    parser.add_argument("--out", default=None, help="write the table here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        with open(args.results) as f:
            rows = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {args.results}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        print(f"error: {args.results} is not a list of result rows", file=sys.stderr)
        return 2
    table = render(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
