"""pd.tools.peer_bench's pure parts: the workload, the figures and ratios computed from given
records, the printed breakdown, the llama-server command line and its absent / failing paths.
No timing is asserted; the slow test runs the bench end to end against pdkv colocated only."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pd.tools.llama_server_build import CACHE_ENV, build_for, cache_root
from pd.tools.loadgen.report import RequestRecord
from pd.tools.peer_bench.cli import find_llama, main
from pd.tools.peer_bench.report import (LLAMA, format_breakdown, format_engine, format_markdown, format_ratios,
                                        format_table)
from pd.cluster.config import TopologySection, load_deploy_config
from pd.tools.peer_bench.servers import (LlamaServer, LlamaServerSpec, ServerStartError, llama_server_command,
                                         pdkv_launch)
from pd.tools.peer_bench.stats import class_figures, ratios, served_share, ttft_breakdown, wave_figures
from pd.tools.peer_bench.workload import WARMUP, build_waves

REPO = Path(__file__).resolve().parents[2]


def test_no_prompt_repeats_within_a_wave_or_across_the_run():
    waves = build_waves([1, 8, 32], rounds=3)
    assert [(w.concurrency, w.round_index) for w in waves[:4]] == [(1, WARMUP), (1, 0), (1, 1), (1, 2)]
    assert len(waves) == 12 and sum(w.warmup for w in waves) == 3
    for w in waves:
        assert len(w.prompts) == w.concurrency == len(set(w.prompts))
    every = [p for w in waves for p in w.prompts]
    assert len(every) == 4 * (1 + 8 + 32) == len(set(every))
    # the same run twice gives the same prompts in the same order (each server gets the same workload)
    assert every == [p for w in build_waves([1, 8, 32], rounds=3) for p in w.prompts]
    with pytest.raises(ValueError, match="rounds"):
        build_waves([1], rounds=0)
    with pytest.raises(ValueError, match="concurrencies"):
        build_waves([0, 8], rounds=1)


def _rec(start: float, ttft: float, latency: float, tokens: int, timing: dict | None = None) -> RequestRecord:
    return RequestRecord(prompt_len=40, expected_output_len=tokens, success=True, output_tokens=tokens,
                         ttft_s=ttft, latency_s=latency, start_time=start, server_timing=timing)


def test_wave_and_class_figures_from_given_records():
    # two requests: 64 tokens each, the wave spans 0.0 .. 2.0 s -> 64 tok/s
    a = _rec(0.0, 0.1, 1.36, 64, {"stages": {"parse_s": 0.001, "prefill_compute_s": 0.05}, "ttft_s": 0.09,
                                  "num_cached_tokens": 16})
    b = _rec(0.0, 0.3, 2.0, 64, {"stages": {"parse_s": 0.003, "prefill_compute_s": 0.07, "kv_transfer_s": 0.02},
                                 "ttft_s": 0.25, "num_cached_tokens": 32})
    failed = RequestRecord(prompt_len=40, expected_output_len=64, error="HTTP 503: busy")
    w = wave_figures(2, [a, b, failed])
    assert (w.num_ok, w.num_failed, w.output_tokens) == (2, 1, 128)
    assert w.duration_s == pytest.approx(2.0) and w.tokens_per_s == pytest.approx(64.0)
    assert w.ttft_p50_s == pytest.approx(0.2) and w.ttft_p90_s == pytest.approx(0.28)
    assert w.tpot_p50_s == pytest.approx(((1.36 - 0.1) / 63 + (2.0 - 0.3) / 63) / 2)
    assert w.errors == ["HTTP 503: busy"]
    # three rounds: each figure is the median of the rounds' figures
    rounds = [wave_figures(2, [_rec(0, t, 2.0 * k, 64), _rec(0, t, 2.0 * k, 64)]) for t, k in
              ((0.1, 1.0), (0.5, 2.0), (0.2, 4.0))]
    fig = class_figures(rounds)
    assert fig["tokens_per_s"] == pytest.approx(32.0) and fig["ttft_p50_s"] == pytest.approx(0.2)
    assert fig["num_rounds"] == 3 and fig["breakdown"] is None and fig["output_tokens_per_request"] == 64
    b50 = ttft_breakdown(w.timings)
    assert b50["num_requests"] == 2 and b50["stages_p50_s"]["parse_s"] == pytest.approx(0.002)
    assert b50["stages_p50_s"]["kv_transfer_s"] == pytest.approx(0.02)  # only the request that has it
    assert b50["cached_tokens_p50"] == 24 and b50["server_ttft_p50_s"] == pytest.approx(0.17)


def _fig(tps: float, ttft: float, tpot: float) -> dict:
    return {"tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p90_s": ttft * 2, "tpot_p50_s": tpot,
            "tpot_p90_s": tpot * 2, "prompt_tokens_mean": 40.0, "output_tokens_per_request": 64.0, "num_failed": 0,
            "breakdown": None}


def test_ratios_shares_and_printed_tables():
    results = {"pdkv colocated": {1: _fig(60.0, 0.08, 0.015), 32: _fig(450.0, 0.2, 0.06)},
               LLAMA: {1: _fig(80.0, 0.04, 0.012), 32: _fig(300.0, 0.4, 0.07)}}
    r = ratios(results, LLAMA)
    assert set(r) == {"pdkv colocated"}
    assert r["pdkv colocated"][1]["throughput_x"] == pytest.approx(0.75)
    assert r["pdkv colocated"][1]["ttft_p50_x"] == pytest.approx(2.0)
    assert r["pdkv colocated"][32]["throughput_x"] == pytest.approx(1.5)
    assert ratios({"pdkv colocated": results["pdkv colocated"]}, LLAMA) == {}
    share = served_share(results, {1: 120.0, 32: 500.0})
    assert share["pdkv colocated"] == {1: pytest.approx(0.5), 32: pytest.approx(0.9)}
    engine = {1: {"tokens_per_s": 120.0, "ttft_p50_s": 0.03}, 32: {"tokens_per_s": 500.0, "ttft_p50_s": 0.15}}
    text = format_engine(engine, share, threads=2)
    assert "c=32 500.0 tok/s (TTFT p50 150 ms)" in text
    assert "pdkv colocated served / in-process: c=1 50%, c=32 90%" in text
    table = format_table(results)
    assert "pdkv colocated" in table and "450.0" in table and "200 ms" in table and "failed requests" not in table
    results[LLAMA][32]["errors"] = ["HTTP 503: busy"]
    assert "failed requests, llama-server F32 c=32: HTTP 503: busy" in format_table(results)
    md = format_markdown(results)
    assert "| pdkv colocated | 60 (0.08 s) | 450 (0.20 s) |" in md and "| llama-server F32 | 80 (0.04 s)" in md
    assert "c=32: throughput 1.50x, TTFT p50 0.50x" in format_ratios(r, LLAMA)
    assert "no pdkv and llama-server F32 figures side by side" in format_ratios({}, LLAMA)
    text = format_breakdown(results)
    assert "pdkv colocated c=1: no breakdown" in text and "llama-server" not in text
    results["pdkv colocated"][1]["breakdown"] = ttft_breakdown([{"stages": {"tokenize_s": 0.004}, "ttft_s": 0.07,
                                                                 "num_cached_tokens": 0}])
    assert "tokenize 4.0 ms; server TTFT p50 70 ms; cached prompt tokens p50 0" in format_breakdown(results)


def test_llama_server_absent_is_said_and_skipped(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "llama-server"
    msg = find_llama(str(missing), str(tmp_path), "1.0.0", None)
    assert isinstance(msg, str) and f"not found at {missing}" in msg and "pd.tools.llama_server_build" in msg
    assert "not found at" in find_llama(None, str(tmp_path), "1.0.0", None)  # an empty cache dir
    assert main(["--servers", "llama", "--llama-server", str(missing), "--no-engine"]) == 0
    out = capsys.readouterr().out
    assert f"llama-server: not found at {missing}; skipping it" in out and "no server ran" in out
    assert "load average at start" in out and "load average at end" in out


def test_cache_dir_from_flag_env_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    b = build_for("123.0.0", str(tmp_path))
    assert b.server == tmp_path / "123.0.0" / "build" / "bin" / "llama-server" and not b.built()
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root() == Path.home() / ".cache" / "pdkv" / "llama.cpp"


def test_llama_server_command_and_a_server_that_dies(tmp_path):
    spec = LlamaServerSpec(binary=tmp_path / "llama-server", model=tmp_path / "m.gguf", threads=2, parallel=32)
    cmd = llama_server_command(spec, 8123)
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("--parallel") + 1] == "32"
    assert int(cmd[cmd.index("-c") + 1]) == 32 * spec.ctx_per_slot and "--cont-batching" in cmd
    # a real process that exits at once: a clear error naming its log, with the log's tail
    spec.binary.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    spec.binary.chmod(spec.binary.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ServerStartError, match="cannot load model") as info:
        with LlamaServer(spec, tmp_path, start_timeout_s=20):
            pass
    assert str(tmp_path / "llama-server.log") in str(info.value)
    # the bench reports it and goes on
    spec.model.write_text("not a model")
    out = subprocess.run([sys.executable, "-m", "pd.tools.peer_bench", "--servers", "llama", "--no-engine",
                          "--llama-server", str(spec.binary), "--llama-model", str(spec.model),
                          "--concurrency", "1", "--rounds", "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert "llama-server did not become healthy" in out.stdout and "no server ran" in out.stdout


def test_pdkv_worker_threads_follow_the_bench(tmp_path):
    config = REPO / "deploy" / "smollm2-colocated.yaml"
    as_shipped = pdkv_launch(config, 0, tmp_path)
    assert (as_shipped.config_path, as_shipped.env) == (config, {})
    launch = pdkv_launch(config, 3, tmp_path)
    if "threads_per_worker" in TopologySection.model_fields:  # the config value, in a valid copy of the YAML
        assert launch.env == {} and launch.config_path.parent == tmp_path
        assert load_deploy_config(launch.config_path).topology.threads_per_worker == 3
    else:  # Ray leaves a preset OMP_NUM_THREADS alone, and torch follows it
        assert launch.env == {"OMP_NUM_THREADS": "3"} and launch.config_path == config
    assert "3" in launch.threads_note


@pytest.mark.slow
def test_peer_bench_end_to_end_against_pdkv_colocated(tmp_path):
    plot = tmp_path / "peer.png"
    out = subprocess.run([sys.executable, "-m", "pd.tools.peer_bench", "--servers", "colocated", "--concurrency",
                          "1,2", "--rounds", "1", "--output-len", "8", "--json", "--plot", str(plot)],
                         cwd=REPO, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    figs = result["results"]["pdkv colocated"]
    assert sorted(figs) == ["1", "2"]
    for fig in figs.values():
        assert fig["num_failed"] == 0 and fig["output_tokens_per_request"] == 8 and fig["tokens_per_s"] > 0
    assert set(result["engine_in_process"]) == {"1", "2"}
    pools = result["pools"]
    assert all(a["all_free"] and a["consistent"] for a in pools["pdkv colocated"].values()), pools
    assert pools["engine in-process"]["engine"]["all_free"], pools
    assert plot.stat().st_size > 1000


def test_more_pdkv_configs_run_after_the_named_servers_and_get_colocated_ratios(tmp_path, monkeypatch):
    from pd.tools.peer_bench import cli

    before = tmp_path / "smollm2-before.yaml"
    before.write_text((REPO / "deploy" / "smollm2.yaml").read_text())
    args = cli._parse_args(["--servers", "colocated,1p1d", "--pdkv-config", f"1P1D before={before}", "--no-engine",
                            "--pdkv-threads", "0"])  # (each config as it is: no copy with other threads)
    assert args.extra_pdkv == [("pdkv 1P1D before", before.resolve())]
    for bad in ("no-equals-sign", "=x.yaml", f"label={tmp_path / 'missing.yaml'}"):
        with pytest.raises(SystemExit):
            cli._parse_args(["--pdkv-config", bad])
    ran: list[tuple[str, Path]] = []

    def fake_measure(server, waves, output_len, pdkv):
        ran.append((server.log_path.name, server.config_path))
        ttft = {"pdkv-smollm2-colocated.log": 0.2}.get(server.log_path.name, 0.3)
        fig = {"tokens_per_s": 100.0, "ttft_p50_s": ttft, "tpot_p50_s": 0.05}
        return {c: fig for c in (8, 32)}, {}

    monkeypatch.setattr(cli, "measure", fake_measure)
    args.concurrencies = [8, 32]
    out = cli.run(args, lambda *a: None)
    assert [path for _, path in ran][-1] == before.resolve()  # the extra config, after --servers' two
    assert list(out["results"]) == ["pdkv colocated", "pdkv 1P1D", "pdkv 1P1D before"]
    for name in ("pdkv 1P1D", "pdkv 1P1D before"):
        ttft_x = {c: r["ttft_p50_x"] for c, r in out["ratios_colocated"][name].items()}
        assert ttft_x == pytest.approx({8: 1.5, 32: 1.5})
    assert "pdkv colocated" not in out["ratios_colocated"]
