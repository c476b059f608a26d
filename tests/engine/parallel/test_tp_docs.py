"""docs/tensor-parallel.md's mapping table is the code's rule: every row's plan and unread P ranks are
what `transfer_plan` gives, and the page keeps at least the six cases the design started from."""
from __future__ import annotations

import re
from pathlib import Path

from pd.engine.parallel.tp import describe_plan, transfer_plan

PAGE = Path(__file__).resolve().parents[3] / "docs" / "tensor-parallel.md"
ROW = re.compile(r"^\| (\d+) \| (\d+) \| (\d+) \| `([^`]*)` \| ([^|]*) \|$", re.M)


def test_the_mapping_table_is_the_codes_rule():
    rows = ROW.findall(PAGE.read_text())
    cases = {(int(a), int(b), int(h)) for a, b, h, _, _ in rows}
    assert cases >= {(2, 1, 2), (1, 2, 2), (4, 2, 8), (4, 2, 2), (2, 4, 2), (4, 1, 2)}
    for a, b, h, plan, unread in rows:
        want = transfer_plan(int(a), int(b), int(h))
        assert plan == describe_plan(want), (a, b, h)
        read = {s.p_rank for s in want}
        assert unread.strip() == (", ".join(f"P{r}" for r in range(int(a)) if r not in read) or "none"), (a, b, h)


def test_the_page_says_where_tp_was_verified():
    """TP has run with gloo on the CPU only: the page's opening says so, and names what is not built."""
    text = PAGE.read_text()
    opening = text.split("\n## ", 1)[0]
    assert "gloo on the CPU" in opening and "only" in opening
    assert "nothing\nhere has run with NCCL" in opening or "nothing here has run with NCCL" in opening
    assert "## Not built yet" in text
