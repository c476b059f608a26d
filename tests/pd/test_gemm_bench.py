"""pd.tools.gemm_bench: each shape is timed through both GEMMs (packed where the CPU has it), and
the CLI refuses bad row counts."""
import subprocess
import sys

from pd.engine import cpu_kernels
from pd.tools.gemm_bench import shape_gflops


def test_every_shape_is_timed_through_both_gemms():
    module = cpu_kernels.load()
    g = shape_gflops(rows=3, in_features=32, out_features=40, repeats=2)
    expected = {"torch", "packed"} if module is not None and module.packed_gemm_available() else {"torch"}
    assert set(g) == expected and all(v > 0 for v in g.values())


def test_cli_refuses_bad_rows():
    done = subprocess.run([sys.executable, "-m", "pd.tools.gemm_bench", "--rows", "8,x"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--rows must be comma-separated integers" in done.stderr
