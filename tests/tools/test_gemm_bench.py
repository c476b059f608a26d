"""pd.tools.gemm_bench: each shape is timed through both GEMMs (packed where the CPU has it), and
the CLI refuses bad row counts."""
import subprocess
import sys

from pd.engine.cpu import kernels as cpu_kernels
from pd.tools.gemm_bench import shape_gflops


def test_every_shape_is_timed_through_both_gemms():
    module = cpu_kernels.load()
    g = shape_gflops(rows=3, in_features=32, out_features=40, repeats=2, copies=3)
    packed = module is not None and module.packed_gemm_available()
    expected = {"torch", "packed", "packed_gbs"} if packed else {"torch"}
    assert set(g) == expected and all(v > 0 for v in g.values())
    if packed:  # the weight-read rate is the FLOP rate over 2 flops per weight per row
        assert abs(g["packed_gbs"] - g["packed"] * 4 / (2 * 3)) <= 1e-9 * g["packed"]


def test_cli_prints_the_peak_the_stream_read_and_each_row_count():
    done = subprocess.run([sys.executable, "-m", "pd.tools.gemm_bench", "--rows", "1,5", "--hidden", "64",
                           "--kv-width", "32", "--intermediate", "96", "--vocab", "80", "--repeats", "1", "--warm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("torch.mm 2048^3 peak:") and "GB/s" in lines[1]
    rows = [line.split() for line in lines[3:]]
    assert [(r[0], r[2]) for r in rows] == [(s, m) for s in ("qkv", "o", "gate_up", "down", "lm_head") for m in "15"]


def test_cli_refuses_bad_rows():
    done = subprocess.run([sys.executable, "-m", "pd.tools.gemm_bench", "--rows", "8,x"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--rows must be comma-separated integers" in done.stderr


def test_peer_bench_prints_the_projections_gflops_beside_the_peak():
    """The in-process engine's rate as GFLOP/s of its projections: flops per token from the model's own
    modules (every projection and the lm_head, not the embedding), the line beside the torch.mm peak."""
    import torch

    from pd.engine.model.config import ModelConfig
    from pd.engine.model.llama import build_model
    from pd.tools.peer_bench.engine import projection_flops_per_token
    from pd.tools.peer_bench.report import format_engine

    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_model(cfg)
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48  # q, k, v, o, gate, up, down
    assert projection_flops_per_token(model) == 2 * (2 * per_layer + 32 * 100)
    assert any(isinstance(m, torch.nn.Embedding) for m in model.modules())
    engine = {1: {"tokens_per_s": 30.0, "ttft_p50_s": 0.05, "gemm_gflops": 8.1},
              8: {"tokens_per_s": 150.0, "ttft_p50_s": 0.2, "gemm_gflops": 40.5}}
    text = format_engine(engine, {}, threads=2, peak_gflops=162.0)
    assert "c=1 8.1 GFLOP/s (5%), c=8 40.5 GFLOP/s (25%) of a 162 GFLOP/s torch.mm 2048^3 peak" in text
    assert "GFLOP/s" not in format_engine({1: {"tokens_per_s": 30.0, "ttft_p50_s": 0.05}}, {}, threads=2)
