"""The step host-time benchmark: runs a real engine for a few decode steps and reports its own timings."""
import json

import pytest

from pd.tools import step_host_bench


def test_measure_reports_each_part_of_the_step():
    row = step_host_bench.measure(batch=4, steps=3, warmup=1, prompt_len=8)
    assert row["batch"] == 4 and row["steps"] == 3
    for key in ("schedule_us", "inputs_us", "update_us", "model_us", "host_us"):
        assert row[key] >= 0, key
    assert row["inputs_us"] > 0  # the input build is timed apart from the model


def test_json_output_has_one_row_per_batch(capsys):
    assert step_host_bench.main(["--batches", "2", "3", "--steps", "2", "--warmup", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["rows"]] == [2, 3]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        step_host_bench.measure(batch=0, steps=3, warmup=1)
