"""The tests' own layout stays as tests/conftest.py describes it.

- no test module or helper edits `sys.path` (shared helpers are the package `tests.helpers`, the repository
  root being on the path through pytest's `pythonpath` option);
- test folders hold no __init__.py, so each module's basename is unique across tests/;
- the module-scoped `ray_instance` fixture is written once, in tests/conftest.py;
- tests/gpu holds only tests marked `gpu` (CPU tests live with the package they test);
- every `tests/...` path the device scripts, the CI entry point and `gpu_check` name exists (a stale one
  costs a device session or a CI run, and test_docs_links.py only reads the manual).
"""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SYS_PATH_EDIT = re.compile(r"\bsys\.path\.(?:insert|append|extend)\(|\bsys\.path\s*(?:\+=|=[^=])")
TEST_PATH = re.compile(r"(?<![\w/])tests/[\w./-]*[\w/]")


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _in_package(path: Path) -> bool:
    """Inside a folder with an __init__.py below tests/ (tests/helpers, tests/kvcache/parity)."""
    return any((folder / "__init__.py").exists() for folder in path.parents if TESTS in folder.parents)


def test_no_test_edits_sys_path():
    me = Path(__file__).resolve()
    offenders = [str(p.relative_to(REPO)) for p in _python_files() if p != me and SYS_PATH_EDIT.search(p.read_text())]
    assert offenders == [], f"import from tests.helpers (or a helper beside the test) instead: {offenders}"


def test_module_basenames_are_unique_across_the_test_folders():
    seen: dict[str, list[str]] = {}
    for p in _python_files():
        if p.name != "conftest.py" and not _in_package(p):
            seen.setdefault(p.name, []).append(str(p.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
    packages = [str(p.parent.relative_to(REPO)) for p in TESTS.rglob("__init__.py") if any(p.parent.glob("test_*.py"))]
    assert packages == [], "a folder of test modules is not a package"


def test_ray_instance_is_defined_once_in_the_root_conftest():
    defines = re.compile(r"^def ray_instance\(", re.M)
    where = [str(p.relative_to(REPO)) for p in _python_files() if defines.search(p.read_text())]
    assert where == ["tests/conftest.py"]


def test_the_gpu_folder_holds_only_gpu_marked_tests():
    unmarked = [p.name for p in sorted((TESTS / "gpu").glob("test_*.py")) if "pytest.mark.gpu" not in p.read_text()]
    assert unmarked == [], f"CPU tests belong in the folder of the package they test: {unmarked}"


def test_paths_named_by_scripts_exist():
    sources = [*sorted((TESTS / "gpu").glob("*.sh")), REPO / ".ci" / "run",
               *sorted((REPO / "pd" / "tools" / "gpu_check").glob("*.py"))]
    named = {(src.relative_to(REPO), m) for src in sources for m in TEST_PATH.findall(src.read_text())}
    assert len(named) >= 5  # the scripts do name test paths: a regex that finds none checks nothing
    missing = sorted(f"{src}: {path}" for src, path in named if not (REPO / path.split("::")[0]).exists())
    assert missing == []
