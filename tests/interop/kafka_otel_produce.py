"""Produces N messages with confluent-kafka, instrumented by
opentelemetry-instrumentation-confluent-kafka, inside one parent span.

Usage: kafka_otel_produce.py BOOTSTRAP TOPIC N

Each message gets its own `{topic} send` producer span (a child of the parent span) whose
context the instrumentation injects as a `traceparent` header. Prints one JSON object:
{"trace_id": hex, "parent_span_id": hex, "producer_spans": [{"span_id", "parent", "name"}...]}.
"""

import json
import sys

from confluent_kafka import Producer
from opentelemetry import trace
from opentelemetry.instrumentation.confluent_kafka import ConfluentKafkaInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def main() -> None:
    bootstrap, topic, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("onceflow-interop")
    producer = ConfluentKafkaInstrumentor().instrument_producer(
        Producer({"bootstrap.servers": bootstrap}), tracer_provider=provider
    )
    with tracer.start_as_current_span("interop-python-producer") as parent:
        for i in range(n):
            producer.produce(topic, key=f"k{i}".encode(), value=f"py-{i}".encode())
        if producer.flush(30) != 0:
            sys.exit("messages left undelivered after 30 s")
        ctx = parent.get_span_context()
    spans = [
        {
            "name": s.name,
            "span_id": format(s.context.span_id, "016x"),
            "trace_id": format(s.context.trace_id, "032x"),
            "parent": format(s.parent.span_id, "016x") if s.parent else None,
        }
        for s in exporter.get_finished_spans()
        if s.kind == trace.SpanKind.PRODUCER
    ]
    print(
        json.dumps(
            {
                "trace_id": format(ctx.trace_id, "032x"),
                "parent_span_id": format(ctx.span_id, "016x"),
                "producer_spans": spans,
            }
        )
    )


if __name__ == "__main__":
    main()
