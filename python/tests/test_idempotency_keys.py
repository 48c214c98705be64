"""Idempotency keys from Python (#31): keyless messages are counted and write no dedup record,
``require_key=True`` dead-letters them naming the header, a conflicting payload does not stop
the consumer, and ``requeue=n`` runs a processed job once more (on the real JetStream too)."""

from __future__ import annotations

import asyncio

import pytest

import onceflow

from conftest import Platform, _url, drain, wait_for


@pytest.fixture
async def nats() -> Platform:
    url = _url("nats")
    return Platform("nats", url, await onceflow.connect(url))


async def _run_until(engine, predicate, timeout=30.0):
    task = asyncio.create_task(engine.run())
    try:
        await wait_for(lambda: predicate() or task.done(), timeout, "the engine")
    finally:
        engine.stop()
    return await asyncio.wait_for(task, 30)


async def test_keyless_messages_run_and_are_counted(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send(topic, b"no key")
    await producer.send(topic, b"keyed", idempotency_key="k1")
    handled = []
    engine = onceflow.IdempotentConsumer(
        await platform.consumer(topic), lambda m: handled.append(m.payload), "memory://", poll_timeout=0.1
    )
    summary = await _run_until(engine, lambda: len(handled) == 2)
    assert handled == [b"no key", b"keyed"]
    assert summary["metrics"]["keyless"] == 1


async def test_require_key_dead_letters_a_keyless_message_naming_the_header(platform):
    topic = await platform.topic()
    dlq = await platform.topic()
    producer = await platform.client.producer()
    await producer.send(topic, b"no key")
    await producer.send(topic, b"keyed", idempotency_key="k1")
    handled = []
    engine = onceflow.IdempotentConsumer(
        await platform.consumer(topic),
        lambda m: handled.append(m.payload),
        "memory://",
        dead_letter_producer=producer,
        on_failure=f"dead-letter:{dlq}",
        require_key=True,
        poll_timeout=0.1,
    )
    summary = await _run_until(engine, lambda: engine.metrics().get("dead_lettered") == 1 and handled)
    assert handled == [b"keyed"]
    assert summary["metrics"]["keyless"] == 0
    [dead] = await drain(await platform.consumer(dlq, start="earliest"), 1)
    assert dead.payload == b"no key"
    assert b"header 'idempotency-key'" in dead.header("onceflow-error")
    assert dead.header("onceflow-error-kind") == b"ONCEFLOW_CONFIG"


async def test_require_key_must_be_a_bool(memory):
    topic = await memory.topic()
    engine = onceflow.IdempotentConsumer(await memory.consumer(topic), lambda m: None, "memory://", require_key="yes")
    with pytest.raises(TypeError, match="require_key"):
        await engine.step()


async def test_a_conflicting_payload_does_not_stop_the_consumer(platform):
    if platform.name == "nats":
        pytest.skip("JetStream drops the second publish of a key itself (Nats-Msg-Id): no conflict reaches the consumer")
    memory = platform
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"first", idempotency_key="k")
    await producer.send(topic, b"second", idempotency_key="k")
    handled = []
    engine = onceflow.IdempotentConsumer(
        await memory.consumer(topic),
        lambda m: handled.append(m.payload),
        "memory://",
        poll_timeout=0.1,
        redelivery_delay=0.01,
    )
    # Before #31 run() raised ConflictError here; now the conflict is redelivered (on_failure).
    summary = await _run_until(engine, lambda: engine.metrics().get("redelivery_requests", 0) >= 2)
    assert handled == [b"first"]
    assert summary["metrics"]["redelivery_requests"] >= 2


async def test_requeue_runs_a_processed_job_once_more_on_jetstream(nats):
    topic = await nats.topic()
    producer = await nats.client.producer()
    first = await producer.send(topic, b"job", idempotency_key="job-1")
    handled = []
    engine = onceflow.IdempotentConsumer(
        await nats.consumer(topic),
        lambda m: handled.append((m.payload, m.header("onceflow-key-generation"))),
        "memory://",
        poll_timeout=0.1,
    )
    task = asyncio.create_task(engine.run())
    try:
        await wait_for(lambda: len(handled) == 1 or task.done(), 30, "the first run")
        again = await producer.send(topic, b"job", idempotency_key="job-1")
        requeued = await producer.send(topic, b"job", idempotency_key="job-1", requeue=1)
        repeat = await producer.send(topic, b"job", idempotency_key="job-1", requeue=1)
        await wait_for(lambda: len(handled) == 2 or task.done(), 30, "the requeued run")
        await asyncio.sleep(1.0)  # nothing else arrives
    finally:
        engine.stop()
    await asyncio.wait_for(task, 30)
    assert not first.duplicate
    assert again.duplicate, "a plain re-send is dropped by the duplicate window"
    assert not requeued.duplicate, "generation 1 is a new message id"
    assert repeat.duplicate, "generation 1 twice is a duplicate"
    assert handled == [(b"job", None), (b"job", b"1")]


async def test_requeue_needs_an_idempotency_key_and_a_generation_in_range(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    with pytest.raises(onceflow.ConfigError, match="requeue"):
        await producer.send(topic, b"job", idempotency_key="job-1", requeue=-1)
    with pytest.raises(onceflow.ConfigError, match="no idempotency key"):
        await producer.send(topic, b"job", requeue=1)
    batch = await producer.send_batch([onceflow.Record(topic, b"job", idempotency_key="job-1", requeue=2)])
    assert len(batch) == 1
