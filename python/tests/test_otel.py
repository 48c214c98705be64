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

from conftest import drain, unique, wait_for  # noqa: E402

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
    # The attributes come from the core's span plans (onceflow::trace::plan), as the Rust
    # engine's and Node's do: the same keys in every language.
    assert set(send.attributes) == SEND_ATTRIBUTES
    assert set(process.attributes) == PROCESS_ATTRIBUTES
    assert send.attributes["messaging.message.body.size"] == len(b"order")
    assert process.attributes["messaging.message.body.size"] == len(b"order")
    assert process.attributes["messaging.consumer.group.name"]


SEND_ATTRIBUTES = {
    "messaging.system",
    "messaging.operation.type",
    "messaging.operation.name",
    "messaging.destination.name",
    "messaging.message.body.size",
    "messaging.destination.partition.id",
    "messaging.message.id",
}
PROCESS_ATTRIBUTES = {
    "messaging.system",
    "messaging.operation.type",
    "messaging.operation.name",
    "messaging.destination.name",
    "messaging.destination.partition.id",
    "messaging.consumer.group.name",
    "messaging.message.id",
    "messaging.message.body.size",
}


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


async def test_context_of_reads_trace_headers_in_any_casing(memory, spans):
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    topic = await memory.topic()
    producer = await memory.client.producer()
    # No current span: the send span continues the record's own `TraceParent` context.
    await producer.send(topic, b"traced", headers=[("TraceParent", tp)])
    await producer.send(topic, b"plain")
    traced, plain = await drain(await memory.consumer(topic), 2)
    trace_of = lambda m: trace.get_current_span(onceflow.context_of(m)).get_span_context().trace_id  # noqa: E731
    assert trace_of(traced) == int(tp.split("-")[1], 16)
    # Without headers of its own, the record got its send span's new trace.
    assert trace_of(plain) == int(plain.headers_dict["traceparent"].decode().split("-")[1], 16)
    assert trace_of(plain) != trace_of(traced)


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


def _parse_tp(value: bytes):
    version, trace_id, span_id, flags = value.decode().split("-")
    return int(trace_id, 16), int(span_id, 16)


def _any_case(message, name: str):
    return [v for n, v in message.headers if n.lower() == name]


async def test_pipeline_outputs_are_children_of_the_python_process_span(platform, spans):
    # Issue #30, point 7: in every mode (Kafka: transactions; JetStream, memory: message ids)
    # each output is sent as a child of the transform's `process` span, also when the
    # transform copies the input's headers (its traceparent) onto the output.
    source, sink = await platform.topic(), await platform.topic()
    producer = await platform.client.producer()
    tracer = trace.get_tracer("test")
    for i in range(4):
        with tracer.start_as_current_span(f"upstream {i}"):
            await producer.send(source, f"in{i}".encode(), idempotency_key=f"in-{i}")

    def transform(m):
        copy = int(m.payload[-1:]) % 2 == 1
        headers = [(n, v) for n, v in m.headers if n != "idempotency-key"] if copy else None
        return [onceflow.Record(sink, m.payload.upper(), headers=headers)]

    out_producer = await platform.client.producer(transactional_id=unique("py-tx"))
    pipeline = onceflow.Pipeline(await platform.consumer(source), out_producer, transform, "memory://", poll_timeout=0.1)
    task = asyncio.create_task(pipeline.run())
    try:
        got = await drain(await platform.consumer(sink), 4)
    finally:
        pipeline.stop()
    await asyncio.wait_for(task, 30)

    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    sends = {s.context.span_id: s for s in finished if s.name == f"send {source}"}
    assert len(sends) == 4
    for m in got:
        tps = _any_case(m, "traceparent")
        assert len(tps) == 1, (m.payload, m.headers)
        trace_id, parent_id = _parse_tp(tps[0])
        process = by_id.get(parent_id)
        assert process is not None, f"{m.payload}: its traceparent names no exported span"
        assert process.name == f"process {source}" and process.kind == trace.SpanKind.CONSUMER
        assert process.context.trace_id == trace_id
        assert process.parent.span_id in sends, f"{m.payload}: the process span is a child of the input's send span"


TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TS = "congo=t61rcWkgMzE"


async def test_trace_headers_are_replaced_whatever_their_case(platform, spans):
    # Issue #30, point 8: `Traceparent` / `Tracestate` as older clients write them. Without a
    # current span the record's own trace is continued with its trace state; inside a span the
    # span's trace wins and the record's trace state (another trace's) is dropped.
    topic = await platform.topic()
    producer = await platform.client.producer()
    headers = [("Traceparent", TP.encode()), ("Tracestate", TS.encode()), ("x", b"y")]
    await producer.send(topic, b"m0", headers=headers)
    await producer.send_batch([onceflow.Record(topic, b"m1", headers=headers), onceflow.Record(topic, b"m2", headers=headers)])
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        await producer.send(topic, b"m3", headers=headers)
        await producer.send_batch([onceflow.Record(topic, b"m4", headers=headers)])
    got = sorted(await drain(await platform.consumer(topic), 5), key=lambda m: m.payload)
    for i, m in enumerate(got):
        tps, tss = _any_case(m, "traceparent"), _any_case(m, "tracestate")
        assert len(tps) == 1 and [n for n, _ in m.headers if n.lower() == "traceparent"] == ["traceparent"], m.headers
        assert ("x", b"y") in m.headers
        trace_id, _ = _parse_tp(tps[0])
        if i < 3:
            assert trace_id == int(TP.split("-")[1], 16), f"m{i}: the record's trace continues"
            assert tss == [TS.encode()], f"m{i}: its tracestate kept: {m.headers}"
        else:
            assert trace_id == caller.get_span_context().trace_id, f"m{i}: the caller's trace wins"
            assert tss == [], f"m{i}: the record's tracestate is dropped: {m.headers}"


async def test_malformed_traceparents_are_counted_in_engine_metrics(kafka):
    # Issue #30, point 9. Written by confluent-kafka: onceflow's own producers never store a
    # malformed traceparent (they replace it).
    ck = pytest.importorskip("confluent_kafka")
    topic = await kafka.topic()
    p = ck.Producer({"bootstrap.servers": kafka.url.split("://", 1)[1].split("?", 1)[0]})
    p.produce(topic, value=b"bad", headers=[("traceparent", b"00-not-a-trace-01"), ("idempotency-key", b"bad")])
    p.produce(topic, value=b"good", headers=[("Traceparent", TP.encode()), ("idempotency-key", b"good")])
    assert await asyncio.to_thread(p.flush, 30) == 0
    seen = []

    @onceflow.idempotent(await kafka.consumer(topic), store="memory://", poll_timeout=0.1)
    async def handle(message):
        seen.append(message.payload)

    task = asyncio.create_task(handle.run())
    try:
        await wait_for(lambda: len(seen) == 2, 30, "both messages")
    finally:
        handle.stop()
    summary = await asyncio.wait_for(task, 30)
    assert summary["metrics"]["malformed_traceparents"] == 1
    assert handle.metrics()["malformed_traceparents"] == 1


async def test_inbox_handler_runs_in_a_process_span_per_attempt(platform, spans, tmp_path):
    # The transactional inbox's handler runs in the message's trace context, inside a process
    # span per attempt (the core's plan, as the idempotent consumer's): a failed attempt's span
    # is marked failed, the retry gets a new one, and a repeated key (a duplicate) starts none.
    topic = await platform.topic()
    producer = await platform.client.producer()
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("checkout") as root:
        # The repeat rides in its own header: JetStream drops a repeated idempotency key.
        for _ in range(2):
            await producer.send(topic, b"order", headers=[("order-id", b"o1")])
    await producer.close()
    trace_id = root.get_span_context().trace_id
    consumer = await platform.consumer(topic, start="earliest")
    active = []

    async def handle(message, tx):
        active.append(trace.get_current_span().get_span_context().span_id)
        await tx.query("SELECT 1")
        if len(active) == 1:
            raise RuntimeError("first attempt fails")

    inbox = onceflow.Inbox(
        consumer, handle, str(tmp_path / "inbox.db"), namespace=unique("ns"), key="header:order-id", backoff=0.01
    )
    deadline = asyncio.get_running_loop().time() + 30
    while inbox.summary()["handled"] + inbox.summary()["duplicates"] < 2:
        assert asyncio.get_running_loop().time() < deadline, inbox.summary()
        await inbox.step()
    assert inbox.summary() == {"handled": 1, "duplicates": 1, "behind_position": 0}
    await consumer.close()

    finished = spans.get_finished_spans()
    sends = [s for s in finished if s.name == f"send {topic}"]
    procs = [s for s in finished if s.name == f"process {topic}"]
    assert len(sends) == 2
    assert len(procs) == 2, [s.name for s in finished]  # two attempts, none for the duplicate
    for proc in procs:
        assert proc.kind == trace.SpanKind.CONSUMER
        assert proc.context.trace_id == trace_id
        assert proc.parent.span_id in {s.context.span_id for s in sends}
        assert set(proc.attributes) == PROCESS_ATTRIBUTES
        assert proc.attributes["messaging.consumer.group.name"] == consumer.group
    assert procs[0].parent.span_id == procs[1].parent.span_id
    assert procs[0].status.status_code == trace.StatusCode.ERROR
    assert procs[1].status.status_code != trace.StatusCode.ERROR
    assert active == [p.context.span_id for p in procs]
