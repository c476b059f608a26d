"""The deploy YAML's `tracing:` section: OpenTelemetry tracing of requests, off by default.

    tracing:
      exporter: otlp          # otlp | console | file | none (none: no span is ever created)
      endpoint: http://127.0.0.1:4318/v1/traces   # otlp: OTLP/HTTP protobuf; empty: the OTEL_* variables
      sample_ratio: 1.0       # traces started here (no incoming traceparent) kept with this probability
      include_content: false  # true: the prompt's token ids go into the router's root span
      file_dir: /tmp/spans    # file: one JSON-lines file per process (spans-<service>-<pid>.jsonl)

With `exporter: none` (the default) the standard variables still switch tracing on in a process:
`OTEL_TRACES_EXPORTER=otlp|console`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or `..._ENDPOINT`),
`OTEL_TRACES_SAMPLER_ARG`; `OTEL_SDK_DISABLED=true` turns it off whatever the YAML says
(`resolve_tracing`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from pd.cluster.schema import FieldError, StrictModel

ExporterName = Literal["otlp", "console", "file", "none"]
_ENV_EXPORTERS = {"otlp": "otlp", "console": "console", "none": "none"}


class TracingSection(StrictModel):
    exporter: ExporterName = Field("none", description="none: tracing off (no span created), unless OTEL_* says")
    endpoint: str | None = Field(None, description="otlp: the OTLP/HTTP traces URL; empty: OTEL_EXPORTER_OTLP_*")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="for traces that start here; a parent's flag wins")
    include_content: bool = Field(False, description="true: the prompt's token ids go into the router's root span")
    file_dir: str | None = Field(None, description="file: the directory of the per-process JSON-lines files")
    batch_delay_s: float = Field(1.0, gt=0.0, le=60.0, description="the span batch's longest wait before export")

    @model_validator(mode="after")
    def _exporter_has_its_target(self) -> TracingSection:
        if self.exporter == "file" and not self.file_dir:
            raise FieldError("file_dir", "exporter 'file' needs file_dir")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise FieldError("endpoint", "must be an http:// or https:// URL (OTLP over HTTP)")
        return self


@dataclasses.dataclass(frozen=True)
class TracingSettings:
    """What one process does, after the YAML and its environment are weighed (`resolve_tracing`)."""

    exporter: ExporterName = "none"
    endpoint: str | None = None
    sample_ratio: float = 1.0
    include_content: bool = False
    file_dir: str | None = None
    batch_delay_s: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"


def resolve_tracing(section: TracingSection, environ: Mapping[str, str] | None = None) -> TracingSettings:
    """The YAML's settings; where it says `none`, the standard OTEL_* variables of this process."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingSettings()
    exporter, endpoint, ratio = section.exporter, section.endpoint, section.sample_ratio
    if exporter == "none":
        named = env.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
        exporter = _ENV_EXPORTERS.get(named, "none")  # type: ignore[assignment]
        if exporter != "none":
            try:
                ratio = min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", ratio))))
            except ValueError:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG is not a number: {env['OTEL_TRACES_SAMPLER_ARG']!r}") \
                    from None
    return TracingSettings(exporter, endpoint, ratio, section.include_content, section.file_dir,
                           section.batch_delay_s)
