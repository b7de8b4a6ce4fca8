"""Tracing for the demo: spans to the console, or OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


def tracer_provider(mode: str, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError as exc:
            raise SystemExit(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is missing: "
                "pip install 'umt-tasks[otlp]'"
            ) from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif mode == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider
