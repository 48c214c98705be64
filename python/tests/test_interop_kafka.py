"""Interop with confluent-kafka (librdkafka's Python client) on the same Kafka broker: their
records, headers and trace context reach our consumer intact, and ours reach them."""

from __future__ import annotations

import asyncio

import pytest

import onceflow

from conftest import drain, unique

ck = pytest.importorskip("confluent_kafka")

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _bootstrap(url: str) -> str:
    return url.split("://", 1)[1].split("?", 1)[0]


async def test_confluent_kafka_producer_to_onceflow_consumer(kafka):
    topic = await kafka.topic()
    p = ck.Producer({"bootstrap.servers": _bootstrap(kafka.url)})
    p.produce(topic, value=b"from-ck", key=b"k1", headers=[("traceparent", TRACEPARENT), ("n", None), ("idempotency-key", b"ck-1")])
    assert await asyncio.to_thread(p.flush, 30) == 0

    consumer = await kafka.consumer(topic)
    [m] = await drain(consumer, 1)
    assert (m.payload, m.key) == (b"from-ck", b"k1")
    assert ("traceparent", TRACEPARENT) in m.headers and ("n", None) in m.headers
    ctx_span = None
    ctx = onceflow.context_of(m)
    if ctx is not None:
        from opentelemetry import trace

        ctx_span = trace.get_current_span(ctx).get_span_context()
        assert format(ctx_span.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    await consumer.close()


async def test_onceflow_producer_to_confluent_kafka_consumer(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer()
    await producer.send(topic, b"from-onceflow", key=b"k2", headers=[("h", b"v")], idempotency_key="of-1")

    c = ck.Consumer(
        {
            "bootstrap.servers": _bootstrap(kafka.url),
            "group.id": unique("py-ck"),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    try:
        msg = None
        for _ in range(60):
            msg = await asyncio.to_thread(c.poll, 0.5)
            if msg is not None and msg.error() is None:
                break
        assert msg is not None and msg.error() is None, msg and msg.error()
        assert (msg.value(), msg.key()) == (b"from-onceflow", b"k2")
        headers = dict(msg.headers())
        assert headers["h"] == b"v" and headers["idempotency-key"] == b"of-1"
    finally:
        await asyncio.to_thread(c.close)


async def test_transactional_writes_are_hidden_from_read_committed_confluent_consumer_until_commit(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer(transactional_id=unique("py-tx"))
    tx = await producer.begin()
    await tx.send(topic, b"in-tx")

    c = ck.Consumer(
        {
            "bootstrap.servers": _bootstrap(kafka.url),
            "group.id": unique("py-ck"),
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    c.subscribe([topic])
    try:
        msg = await asyncio.to_thread(c.poll, 3.0)
        assert msg is None or msg.error() is not None
        await tx.commit()
        for _ in range(60):
            msg = await asyncio.to_thread(c.poll, 0.5)
            if msg is not None and msg.error() is None:
                break
        assert msg.value() == b"in-tx"
    finally:
        await asyncio.to_thread(c.close)
