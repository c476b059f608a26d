"""A promtool-style lint of a Prometheus text exposition, on prometheus_client's parser,
plus `promtool check metrics` itself where promtool is installed."""
from __future__ import annotations

import re
import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

# vLLM's dashboards read these; pdkv must export them (histograms by their _count sample).
VLLM_SAMPLES = (
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
)
_PERCENTILE = re.compile(r"(quantile|percentile|_p\d{2,3}(_|$)|median)")
_COLON_LINT = re.compile(r"^(vllm:\S+) metric names should not contain ':'$")


def lint(text: str, model_name: str) -> dict[tuple[str, tuple], float]:
    """Checks the exposition and returns {(sample name, sorted labels): value}.

    Rules: every family has HELP and TYPE; counter samples end `_total`; no
    summary quantiles and no percentile-named series; no duplicate samples;
    every sample carries `model_name`; histogram buckets are cumulative and
    end at `_count`.
    """
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    helps = dict(re.findall(r"^# HELP (\S+) (.+)$", text, re.MULTILINE))
    assert types and set(types) == set(helps), sorted(set(types) ^ set(helps))
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name
        assert not _PERCENTILE.search(family.name), f"percentile series {family.name}"
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = sample.value
            assert sample.labels.get("model_name") == model_name, sample
            assert "quantile" not in sample.labels, sample
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
        if family.type == "histogram":
            _check_buckets(family)
    return samples


def _check_buckets(family) -> None:
    series: dict[tuple, list[tuple[float, float]]] = {}
    counts = {}
    for sample in family.samples:
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
        if sample.name.endswith("_bucket"):
            series.setdefault(labels, []).append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_count"):
            counts[labels] = sample.value
    for labels, buckets in series.items():
        values = [v for _, v in sorted(buckets)]
        assert values == sorted(values), (family.name, labels, buckets)
        assert max(buckets) == (float("inf"), counts[labels]), (family.name, labels)


def assert_counters_grew(before: dict, after: dict, before_text: str) -> int:
    """No counter sample (nor histogram _count/_sum/_bucket) present in both scrapes went down;
    returns how many rose."""
    counter_names = {n for n, t in re.findall(r"^# TYPE (\S+) (\S+)$", before_text, re.MULTILINE) if t == "counter"}
    histograms = {n for n, t in re.findall(r"^# TYPE (\S+) (\S+)$", before_text, re.MULTILINE) if t == "histogram"}
    rose = 0
    for key, value in before.items():
        name = key[0]
        monotonic = name in counter_names or any(name.startswith(h + "_") for h in histograms)
        if monotonic and key in after:
            assert after[key] >= value, (key, value, after[key])
            rose += after[key] > value
    return rose


def promtool_problems(text: str) -> list[str] | None:
    """`promtool check metrics` findings other than the ':' in vLLM's own names (which
    promtool reserves for recording rules, and which vLLM exports anyway); None
    without promtool."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode in (0, 3), out  # 3: lint findings; anything else: it could not parse the text
    lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return [line for line in lines if not _COLON_LINT.match(line)]
