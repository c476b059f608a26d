"""One-shot GPU check: `python -m pd.tools.gpu_check [--out gpu_check_report.md] [--sections ...]`.

On one GPU, in one run, each section side by side with its anchor:
- tests: the `gpu` tests (`pytest -m gpu tests/gpu tests/connectors/test_cuda.py`);
- transfer (transfer.py): the connector's GB/s CUDA pool -> CUDA pool on each path (host-staged tcp,
  shm, the CUDA IPC device path), beside the pinned serial copy and a plain device-to-device copy of
  the same pages, each stage's time, byte-exactness;
- engine (engine_compare.py): the engine beside transformers with a static cache and torch.compile on
  the same random weights and prompts (the check model, `engine.CHECK_MODEL`): decode tokens/s and the
  ratio at batch 1, 32 and 128, prefill against transformers' first token, the GPU-busy share of a
  decode step, float32 greedy agreement;
- served (served.py): through Ray and the router, colocated at c = 1, 8, 32, then 1P1D on one GPU
  (greedy tokens equal to colocated's, TTFT, TPOT, transfer time per request).

About 8 minutes in all on an H200 (the transformers compile is most of it); `--sections` runs a part.
It writes a markdown report to --out and the same figures as JSON beside it (`.json`), and prints the
markdown. Exit status: 0 when the tests pass and every section ran (byte-exact, tokens equal), 1
otherwise, 2 when CUDA is not available (nothing is measured; the message says why). Speed targets
are reported as met or not; they do not decide the exit status.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from pd.tools.gpu_check.engine import CHECK_MODEL_DOC  # noqa: F401  (the report names the model)
from pd.tools.gpu_check.engine_compare import engine_compare_ok, measure_engine_compare, render_engine_compare
from pd.tools.gpu_check.served import measure_served, render_served, served_ok
from pd.tools.gpu_check.transfer import measure_transfer, render_transfer, transfer_ok

SECTIONS = ("tests", "transfer", "engine", "served")

TEST_TIMEOUT_S = 200
REPO = Path(__file__).resolve().parents[3]


def cuda_missing_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return (f"pd.tools.gpu_check needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a GPU machine.")


# ---------------------------------------------------------------------- 1. gpu tests
def run_gpu_tests(timeout_s: float = TEST_TIMEOUT_S) -> dict:
    paths = [p for p in ("tests/gpu", "tests/connectors/test_cuda.py") if (REPO / p).exists()]
    if not paths:
        return {"ok": False, "summary": "tests not found next to the package (run from a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
           f"--timeout={int(timeout_s)}", *paths]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"pytest did not finish within {timeout_s + 30:.0f} s",
                "seconds": timeout_s + 30}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    # on a GPU machine nothing may skip: a skip would hide the very path this check is for
    ok = proc.returncode == 0 and "passed" in summary and "skipped" not in summary
    return {"ok": ok, "returncode": proc.returncode, "summary": summary, "failed": failed[:20],
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[1:])}


# ---------------------------------------------------------------------- report
def render_markdown(report: dict) -> str:
    dev, tests = report.get("device", {}), report.get("tests", {})
    lines = [f"# pdkv GPU check ({report.get('when', '?')})", "",
             f"- device: {dev.get('name', '?')} ({dev.get('memory_gib', '?')} GiB), torch {dev.get('torch', '?')}, "
             f"CUDA {dev.get('cuda', '?')}; total run {report.get('seconds', '?')} s",
             f"- gpu tests: **{'PASSED' if tests.get('ok') else 'FAILED'}** - {tests.get('summary', 'not run')}"]
    lines += [f"  - {f}" for f in tests.get("failed", [])]
    for key, render in (("transfer", render_transfer), ("engine", render_engine_compare), ("served", render_served)):
        if key in report:
            lines += ["", *render(report[key])]
    return "\n".join(lines) + "\n"


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, the rest still runs
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def run_check(sections: tuple[str, ...] = SECTIONS) -> dict:
    """The report of the sections asked for, in the order of SECTIONS (the served run last: it starts Ray)."""
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    report: dict[str, object] = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "torch": torch.__version__, "cuda": torch.version.cuda, "count": torch.cuda.device_count()}}
    report["tests"] = run_gpu_tests() if "tests" in sections else {"ok": True, "summary": "not asked for"}
    for key, measure in (("transfer", measure_transfer), ("engine", measure_engine_compare),
                         ("served", measure_served)):
        if key in sections:
            report[key] = _guarded(measure)
            torch.cuda.empty_cache()  # the next section (the served workers above all) sizes pools from what is free
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def report_ok(report: dict) -> bool:
    checks = (("transfer", transfer_ok), ("engine", engine_compare_ok), ("served", served_ok))
    return report["tests"].get("ok", False) and all(ok(report[key]) for key, ok in checks if key in report)


def parse_sections(text: str) -> tuple[str, ...]:
    asked = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(asked) - set(SECTIONS))
    if unknown or not asked:
        raise argparse.ArgumentTypeError(f"sections are a comma-separated subset of {','.join(SECTIONS)}; "
                                         f"got {text!r}")
    return tuple(name for name in SECTIONS if name in asked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check_report.md", help="markdown report path (JSON goes beside it)")
    parser.add_argument("--sections", type=parse_sections, default=SECTIONS,
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--skip-tests", action="store_true", help="measure only (the same as leaving out tests)")
    args = parser.parse_args(argv)
    reason = cuda_missing_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    sections = tuple(name for name in args.sections if not (args.skip_tests and name == "tests"))
    report = run_check(sections)
    text = render_markdown(report)
    out = Path(args.out)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(text, flush=True)
    print(f"report: {out} and {out.with_suffix('.json')}", flush=True)
    return 0 if report_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
