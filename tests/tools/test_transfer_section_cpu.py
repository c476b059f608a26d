"""gpu_check's transfer section without a GPU: its ratios, verdicts and rendering."""
from __future__ import annotations

import torch

from pd.tools.gpu_check import transfer
from pd.tools.gpu_check.transfer_peer import fill


def _section(**paths_over) -> dict:
    paths = {"tcp": {"gbps": 20.0, "ms": 26.8, "byte_exact": True, "streams": ["tcp"] * 4},
             "shm": {"gbps": 30.0, "ms": 17.9, "byte_exact": True, "streams": ["shm_staged"]},
             "cuda_ipc": {"gbps": 800.0, "ms": 0.67, "byte_exact": True, "streams": ["cuda_ipc"]},
             "cuda_ipc_checked": {"gbps": 16.0, "ms": 33.5, "byte_exact": True, "streams": ["cuda_ipc"]}}
    paths.update(paths_over)
    return {"pages": 256, "page_bytes": transfer.PAGE_BYTES, "bytes_per_load": 256 * transfer.PAGE_BYTES,
            "baseline": {"d2h_gbps": 54.0, "h2d_gbps": 56.0, "d2h_then_h2d_gbps": 27.5},
            "d2d": {"plain_gbps": 1000.0, "gather_by_id_gbps": 450.0},
            "stages": {"d2h_ms": 10.0, "wire_ms": 40.0, "h2d_ms": 10.0, "serial_ms": 60.0, "wire_gbps": 13.4},
            "paths": paths}


def test_ratios_follow_from_the_measured_figures():
    r = transfer.transfer_ratios(_section())
    assert r["host_tcp_vs_pinned_serial"] == round(20.0 / 27.5, 2)
    assert r["shm_vs_tcp"] == 1.5
    assert r["device_vs_plain_d2d"] == 0.8
    assert r["device_checksums_cost"] == round(33.5 / 0.67, 2)
    assert r["tcp_vs_serial_stages"] == round(60.0 / 26.8, 2)
    missing = transfer.transfer_ratios(_section(cuda_ipc={"error": "RuntimeError: no", "byte_exact": False}))
    assert missing["device_vs_plain_d2d"] is None and missing["device_checksums_cost"] is None


def test_ok_needs_every_path_exact_and_targets_only_when_asked():
    assert transfer.transfer_ok(_section())
    assert transfer.transfer_ok(_section(), require_targets=True)
    assert not transfer.transfer_ok(_section(shm={"gbps": 30.0, "byte_exact": False}))
    assert not transfer.transfer_ok(_section(tcp={"error": "RuntimeError: load failed", "byte_exact": False}))
    assert not transfer.transfer_ok({"error": "no CUDA"}) and not transfer.transfer_ok({"paths": {}})
    slow = _section(tcp={"gbps": 10.0, "ms": 53.7, "byte_exact": True})  # 0.36x the serial copy
    assert transfer.transfer_ok(slow) and not transfer.transfer_ok(slow, require_targets=True)


def test_rendering_names_every_path_baseline_stage_and_verdict():
    text = "\n".join(transfer.render_transfer(_section(shm={"gbps": 15.0, "ms": 35.8, "byte_exact": True})))
    for needle in ("| tcp | 20.0 | 26.8 | True | tcp, tcp, tcp, tcp |", "| cuda_ipc | 800.0 | 0.67 | True | cuda_ipc |",
                   "pinned D2H then H2D, serial | 27.5", "plain D2D copy of the same pages | 1000.0",
                   "D2H 10.0 ms, wire 40.0 ms (13.4 GB/s), H2D 10.0 ms; serial sum 60.0 ms",
                   "host tcp vs pinned serial: **0.73** (target >= 0.7: met)",
                   "shm vs tcp: **0.75** (target >= 1.0: MISSED)",
                   "device vs plain d2d: **0.8** (target >= 0.7: met)", "256 pages of 2 MiB"):
        assert needle in text, needle
    broken = _section(cuda_ipc={"error": "DeviceUnavailable: x", "byte_exact": False})
    failed = "\n".join(transfer.render_transfer(broken))
    assert "| cuda_ipc | error: DeviceUnavailable: x | | False | |" in failed
    assert "device vs plain d2d: **None** (target >= 0.7: unmeasured)" in failed
    assert transfer.render_transfer({"error": "boom"})[-1] == "- error: boom"


def test_the_producer_fill_is_the_same_bytes_in_every_process():
    a, b = fill(4, 64, 7, device="cpu"), fill(4, 64, 7, device="cpu")
    assert a.dtype == torch.uint8 and torch.equal(a, b) and not torch.equal(a, fill(4, 64, 8, device="cpu"))


def test_a_cpu_dry_run_moves_every_path_exact_through_a_producer_process():
    """The section's own machinery without a GPU: the producer process, leases, every path's loads
    checked byte for byte; the device path, unavailable here, falls back to the host path."""
    section = transfer.measure_transfer(transfer.TransferRun(device="cpu", pages=8, page_bytes=16 * 1024, reps=1))
    paths = section["paths"]
    assert set(paths) == {"tcp", "shm", "cuda_ipc", "cuda_ipc_checked", "cuda_ipc_scattered"}
    assert all(r.get("byte_exact") is True and r["loads"] == 1 for r in paths.values()), paths
    assert set(paths["tcp"]["streams"]) == {"tcp"} and paths["shm"]["streams"] == ["shm_mapped"]
    assert paths["cuda_ipc"]["streams"] == ["shm_mapped"]  # fell back: a CPU pool has nothing to export
    assert transfer.transfer_ok(section) and "baseline" not in section
    assert section["ratios"]["host_tcp_vs_pinned_serial"] is None  # no GPU: no baseline, said so
    assert any("(target >= 0.7: unmeasured)" in line for line in transfer.render_transfer(section))
