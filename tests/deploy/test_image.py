"""deploy/Dockerfile's build steps, checked without a container builder.

No Docker daemon runs on the test machines, so the image is never built here.
This test instead reads the Dockerfile and runs its pdkv steps for real: the
`pip install /opt/pdkv[...]` step into a fresh virtual environment (with the
system site packages standing in for the base image's Ray and torch, and
`--no-deps --no-build-isolation` so it takes seconds and needs no network),
then the image's smoke step from outside the repository, so that it imports
the installed copy. It also checks that the COPY steps bring every package
pyproject.toml installs, that the extras named exist, and both variants' bases.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_variants_and_copies():
    steps = _instructions()
    bases = {rest.split(" AS ")[1]: rest.split(" AS ")[0] for word, rest in steps if word == "FROM" and " AS " in rest}
    assert set(bases) == {"base-cpu", "base-cuda"}
    assert all(b.startswith("rayproject/ray:") for b in bases.values()) and bases["base-cuda"].endswith("-gpu")
    assert ("FROM", "base-${VARIANT}") in steps
    copied = {shlex.split(rest)[-2] for word, rest in steps if word == "COPY"} | {
        src for word, rest in steps if word == "COPY" for src in shlex.split(rest)[1:-1]}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"the image does not COPY the package {pattern}"
    assert {"pyproject.toml", "README.md", "deploy"} <= copied


def test_pip_and_smoke_steps_run_in_a_fresh_venv(tmp_path):
    steps = [rest for word, rest in _instructions() if word == "RUN"]
    install = [s for s in steps if "/opt/pdkv[" in s]
    assert len(install) == 1, steps
    args = shlex.split(install[0])
    target = next(a for a in args if a.startswith("/opt/pdkv["))
    extras = set(target[len("/opt/pdkv["):-1].split(","))
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras <= set(declared), f"the Dockerfile installs extras pyproject.toml lacks: {extras - set(declared)}"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    run = subprocess.run(pip + [f"{REPO}[{','.join(sorted(extras))}]"], env=env, capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr

    smoke = [s for s in steps if s.startswith("python ")]
    assert smoke, "the Dockerfile has no smoke step"
    for step in smoke:
        shell = step.replace("python ", f"{python} ")
        done = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)
        assert done.returncode == 0, f"{step}: {done.stdout}{done.stderr}"
    where = subprocess.run([python, "-c", "import pd, sys; print(pd.__file__)"], env=env, capture_output=True,
                           text=True, timeout=60, cwd=tmp_path)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr  # the installed copy, not the checkout
