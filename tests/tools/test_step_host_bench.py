"""The step host-time benchmark: runs a real engine for a few decode steps and reports its own timings, one
row per batch, every request decoding through every measured step (measure() checks), the pool free after."""
import json

import pytest

from pd.tools import step_host_bench


def test_measure_reports_each_part_of_the_step():
    row = step_host_bench.measure(batch=4, steps=3, warmup=1, prompt_len=8)
    assert row["batch"] == 4 and row["steps"] == 3
    for key in ("schedule_us", "inputs_us", "update_us", "model_us", "host_us"):
        assert row[key] >= 0, key
    assert row["inputs_us"] > 0  # the input build is timed apart from the model


def test_json_rows(capsys):
    assert step_host_bench.main(["--batches", "2", "5", "--steps", "4", "--warmup", "1", "--repeat", "2",
                                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [2, 5]
    for r in rows:
        assert r["steps"] == 4 and r["runs"] == 2
        parts = [r["schedule_us"], r["inputs_us"], r["update_us"], r["model_us"]]
        assert all(p > 0 for p in parts), r
        assert r["host_us"] > 0


def test_table(capsys):
    assert step_host_bench.main(["--batches", "3", "--steps", "2", "--warmup", "0", "--prefix-caching"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["batch", "schedule", "inputs", "update", "host", "model"]
    assert lines[2].split()[0] == "3"


@pytest.mark.parametrize("kwargs", [{"batch": 0}, {"steps": 0}, {"warmup": -1}, {"prompt_len": 0}])
def test_bad_sizes_refused(kwargs):
    args = {"batch": 2, "steps": 2, "warmup": 0, **kwargs}
    with pytest.raises(ValueError):
        step_host_bench.measure(**args)


def test_bad_repeat_refused():
    with pytest.raises(SystemExit):
        step_host_bench.main(["--repeat", "0", "--batches", "2"])
