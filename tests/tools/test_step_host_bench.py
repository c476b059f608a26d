"""`python -m pd.tools.step_host_bench`: a decode step's host parts, timed on a real engine."""
import json

from kvcache.audit import assert_all_free

from pd.tools import step_host_bench


def test_measure_times_each_host_part_of_decode_steps_and_leaves_the_pool_free():
    engines = []
    ms = step_host_bench.measure(6, steps=3, engine_out=engines)
    assert set(ms) == {"schedule", "inputs", "update", "step"}
    assert all(v > 0 for v in ms.values())
    assert ms["schedule"] + ms["inputs"] + ms["update"] < ms["step"]  # parts of the step, not more
    assert_all_free(engines[0].kv_cache_manager)


def test_the_cli_prints_a_row_and_a_json_line_per_batch(capsys):
    assert step_host_bench.main(["--batches", "2", "5", "--steps", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [row["batch"] for row in lines] == [2, 5]
    for row in lines:
        host = row["schedule_ms"] + row["inputs_ms"] + row["update_ms"]
        assert abs(row["host_ms"] - host) < 1e-3
