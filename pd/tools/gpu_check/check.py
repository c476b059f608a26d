"""One-shot GPU check: `python -m pd.tools.gpu_check [--out gpu_check_report.md] [--sections ...]`.

On one GPU, in one run, each section side by side with its anchor, in this order (SECTIONS):
- float32 (engine_compare.py `measure_agreement`): the engine's greedy tokens against transformers' on one
  float32 copy of the check model's weights, each prompt alone; first, so no time budget drops it;
- engine (engine_compare.py): the engine beside transformers with a static cache and torch.compile on
  the same random weights and prompts (the check model, `engine.CHECK_MODEL`): decode tokens/s and the
  ratio at batch 32, 128 and (time allowing, `--engine-budget-s`) 1, prefill against transformers'
  first token, the GPU-busy share of a decode step;
- transfer (transfer.py): the connector's GB/s CUDA pool -> CUDA pool on each path (host-staged tcp,
  shm, the CUDA IPC device path), beside the pinned serial copy and a plain device-to-device copy of
  the same pages, each stage's time, byte-exactness;
- tests: the `gpu`-marked tests (GPU_TEST_ARGS: the marker over the files that hold them, so neither the
  CPU Ray tests nor tests/triton's hypothesis sweep run here);
- served (served.py): through Ray and the router, colocated at c = 1, 8, 32, then 1P1D on one GPU
  (greedy tokens equal to colocated's, TTFT, TPOT, transfer time per request); last: it starts Ray.

`--sections` (or `--only`) runs a part; tests/gpu/device_session.sh runs each section as its own step
under its own time limit. The report is written after every section (and every engine batch and served
deployment), so
a run stopped part-way keeps what it measured: markdown to --out and the same figures as JSON beside it
(`.json`; `--json-only` writes just that), and the markdown is printed. `--dry-run` checks the arguments
and writes the plan as JSON, without CUDA. Exit status: 0 when the tests pass and every section ran
(byte-exact, tokens equal), 1 otherwise, 2 when CUDA is not available (nothing is measured; the message
says why). Speed targets are reported as met or not; they do not decide the exit status.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pd.tools.gpu_check.engine import CHECK_MODEL_DOC  # noqa: F401  (the report names the model)
from pd.tools.gpu_check.engine_compare import (CompareSettings, agreement_ok, engine_compare_ok, measure_agreement,
                                               measure_engine_compare, render_agreement, render_engine_compare)
from pd.tools.gpu_check.served import measure_served, render_served, served_ok
from pd.tools.gpu_check.transfer import measure_transfer, render_transfer, transfer_ok

SECTIONS = ("float32", "engine", "transfer", "tests", "served")
# The gpu tests, chosen precisely: the `gpu` marker over the files that hold such tests. Not `-m "gpu or not
# gpu"` and not tests/triton: those add the CPU tests beside them (Ray deployments among them) and a
# hypothesis sweep of about 100 Triton compiles. tests/gpu/device_session.sh runs this same selection.
GPU_TEST_ARGS = ("-m", "gpu", "tests/gpu", "tests/connectors/test_cuda.py",
                 "tests/engine/test_step_metadata.py::test_on_a_gpu_the_device_buffers_mirror_the_host_and_stay_put")

TEST_TIMEOUT_S = 200
ENGINE_SETTINGS = CompareSettings(agreement=False)  # gpu_check measures the agreement as its own section
REPO = Path(__file__).resolve().parents[3]


def cuda_missing_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return (f"pd.tools.gpu_check needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a GPU machine.")


# ---------------------------------------------------------------------- 1. gpu tests
def run_gpu_tests(timeout_s: float = TEST_TIMEOUT_S) -> dict:
    if not (REPO / "tests" / "gpu").exists():
        return {"ok": False, "summary": "tests not found next to the package (run from a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider",
           f"--timeout={int(timeout_s)}", *GPU_TEST_ARGS]
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
    if "float32" in report:
        lines += ["", "## Float32 greedy agreement, engine vs transformers (check model, float32 copy)", "",
                  *render_agreement(report["float32"])]
    for key, render in (("engine", render_engine_compare), ("transfer", render_transfer), ("served", render_served)):
        if key in report:
            lines += ["", *render(report[key])]
    return "\n".join(lines) + "\n"


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, the rest still runs
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def run_check(sections: tuple[str, ...] = SECTIONS, engine: CompareSettings = ENGINE_SETTINGS,
              on_update: Callable[[dict], None] | None = None) -> dict:
    """The report of the sections asked for, in the order of SECTIONS (the served run last: it starts Ray).
    `on_update` gets the report after every section, every engine batch and every served deployment."""
    t0 = time.perf_counter()
    update = on_update or (lambda _report: None)
    props = torch.cuda.get_device_properties(0)
    report: dict[str, object] = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "torch": torch.__version__, "cuda": torch.version.cuda, "count": torch.cuda.device_count()},
              "sections": list(sections)}
    report["tests"] = {"ok": True, "summary": "not asked for"}

    def part(key: str) -> Callable[[dict], None]:  # a section's figures so far, written before its next part
        def write(section: dict) -> None:
            report[key] = section
            update(report)
        return write

    measures: dict[str, Callable[[], dict]] = {
        "float32": lambda: measure_agreement(engine),
        "engine": lambda: measure_engine_compare(engine, on_part=part("engine")),
        "transfer": measure_transfer, "tests": run_gpu_tests,
        "served": lambda: measure_served(on_part=part("served"))}
    for key in sections:
        report[key] = _guarded(measures[key])
        report["seconds"] = round(time.perf_counter() - t0, 1)
        update(report)
        torch.cuda.empty_cache()  # the next section (the served workers above all) sizes pools from what is free
    return report


def report_ok(report: dict) -> bool:
    checks = (("float32", agreement_ok), ("transfer", transfer_ok), ("engine", engine_compare_ok),
              ("served", served_ok))
    return report["tests"].get("ok", False) and all(ok(report[key]) for key, ok in checks if key in report)


def parse_sections(text: str) -> tuple[str, ...]:
    asked = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(asked) - set(SECTIONS))
    if unknown or not asked:
        raise argparse.ArgumentTypeError(f"sections are a comma-separated subset of {','.join(SECTIONS)}; "
                                         f"got {text!r}")
    return tuple(name for name in SECTIONS if name in asked)


def _writer(out: Path, json_only: bool) -> Callable[[dict], None]:
    def write(report: dict) -> None:
        if not json_only:
            out.write_text(render_markdown(report))
        out.with_suffix(".json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check_report.md", help="markdown report path (JSON goes beside it)")
    parser.add_argument("--sections", "--only", type=parse_sections, default=SECTIONS,
                        help=f"comma-separated subset of {','.join(SECTIONS)}, run in that order (default: all)")
    parser.add_argument("--skip-tests", action="store_true", help="measure only (the same as leaving out tests)")
    parser.add_argument("--engine-batches", default="32,128,1", help="the engine section's batch sizes, in run order")
    parser.add_argument("--engine-budget-s", type=float, default=CompareSettings.time_budget_s,
                        help="a batch of the engine section that would start after this many seconds is skipped")
    parser.add_argument("--json-only", action="store_true", help="write only the JSON report (beside --out)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments and write the plan as JSON; needs no CUDA, measures nothing")
    args = parser.parse_args(argv)
    try:
        batches = tuple(int(b) for b in args.engine_batches.split(","))
    except ValueError:
        parser.error(f"--engine-batches takes comma-separated integers; got {args.engine_batches!r}")
    sections = tuple(name for name in args.sections if not (args.skip_tests and name == "tests"))
    engine = CompareSettings(batches=batches, time_budget_s=args.engine_budget_s, agreement=False)
    out = Path(args.out)
    if args.dry_run:
        plan = {"dry_run": True, "sections": list(sections), "engine_batches": list(batches),
                "engine_budget_s": args.engine_budget_s,
                "gpu_tests": list(GPU_TEST_ARGS) if "tests" in sections else []}
        out.with_suffix(".json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
        print(f"dry run: would run {', '.join(sections)}; report {out.with_suffix('.json')}", flush=True)
        return 0
    reason = cuda_missing_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    write = _writer(out, args.json_only)
    report = run_check(sections, engine, on_update=write)
    write(report)
    print(render_markdown(report), flush=True)
    print(f"report: {out.with_suffix('.json') if args.json_only else out}", flush=True)
    return 0 if report_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
