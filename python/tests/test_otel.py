"""Trace continuity: the producer's span context rides in the headers, and the handler runs
inside it (its span a child of the producer's), checked with the OpenTelemetry SDK's in-memory
exporter. Without a current span, headers pass through untouched."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import onceflow  # noqa: E402

from conftest import drain, wait_for  # noqa: E402

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
trace.set_tracer_provider(_PROVIDER)


@pytest.fixture
def spans():
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


async def test_handler_span_is_a_child_of_the_producer_span(platform, spans):
    topic = await platform.topic()
    producer = await platform.client.producer()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("checkout") as root:
        await producer.send(topic, b"order", idempotency_key="o-1")
    trace_id = root.get_span_context().trace_id

    seen = {}

    @onceflow.idempotent(await platform.consumer(topic), store="memory://", poll_timeout=0.1)
    async def handle(message):
        with tracer.start_as_current_span("charge") as span:
            seen["charge"] = span.get_span_context()

    task = asyncio.create_task(handle.run())
    try:
        await wait_for(lambda: "charge" in seen, 30, "the handler")
    finally:
        handle.stop()
    await asyncio.wait_for(task, 30)

    by_name = {s.name: s for s in spans.get_finished_spans()}
    send, process, charge = by_name[f"send {topic}"], by_name[f"process {topic}"], by_name["charge"]
    assert send.kind == trace.SpanKind.PRODUCER and process.kind == trace.SpanKind.CONSUMER
    assert {send.context.trace_id, process.context.trace_id, charge.context.trace_id} == {trace_id}
    assert send.parent.span_id == root.get_span_context().span_id
    assert process.parent.span_id == send.context.span_id
    assert charge.parent.span_id == process.context.span_id
    assert process.attributes["messaging.destination.name"] == topic


async def test_batch_send_carries_one_context_and_consumers_can_extract_it(memory, spans):
    topic = await memory.topic()
    producer = await memory.client.producer()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("import") as root:
        await producer.send_batch([onceflow.Record(topic, b"a"), onceflow.Record(topic, b"b", headers=[("x", b"1")])])
    got = await drain(await memory.consumer(topic), 2)
    for m in got:
        ctx = onceflow.context_of(m)
        assert trace.get_current_span(ctx).get_span_context().trace_id == root.get_span_context().trace_id
        assert sum(1 for n, _ in m.headers if n == "traceparent") == 1
    assert got[1].headers_dict["x"] == b"1"


def test_without_opentelemetry_headers_pass_through_untouched(tmp_path):
    # A fresh interpreter where `import opentelemetry` fails, as when it is not installed.
    code = """
import sys, asyncio
sys.modules["opentelemetry"] = None
import onceflow
assert not onceflow._otel.ENABLED
async def main():
    client = await onceflow.connect("memory://no-otel")
    producer = await client.producer()
    await producer.send("t", b"plain", headers=[("h", b"v"), ("n", None)])
    await producer.send_batch([onceflow.Record("t", b"b", headers=[("h", b"w")])])
    consumer = await client.consumer("g", ["t"], start="earliest")
    got = await consumer.poll(10, 5.0)
    print([m.headers for m in got])
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[('h', b'v'), ('n', None)], [('h', b'w')]]"
