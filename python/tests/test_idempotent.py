"""The idempotent consumer from Python: the handler (a coroutine or a plain function) runs once
per idempotency key, with each dedup store; a handler that raises is retried, never lost."""

from __future__ import annotations

import asyncio

import pytest

import onceflow

from conftest import unique, wait_for


@pytest.fixture(params=["memory://", "embedded"])
def store_url(request, tmp_path):
    if request.param == "embedded":
        return str(tmp_path / "dedup.db")
    return request.param


async def _run_until(engine, predicate, timeout=30.0):
    task = asyncio.create_task(engine.run())
    try:
        await wait_for(lambda: predicate() or task.done(), timeout, "the handler")
    finally:
        engine.stop()
    return await asyncio.wait_for(task, 30)


async def test_duplicates_are_skipped_with_each_store(platform, store_url):
    topic = await platform.topic()
    producer = await platform.client.producer()
    written = 0
    for key in ["a", "b", "a", "c", "b"]:
        d = await producer.send(topic, f"order {key}".encode(), idempotency_key=f"order-{key}")
        written += not d.duplicate  # JetStream drops repeated message ids at publish
    skipped = written - 3

    consumer = await platform.consumer(topic)
    handled = []

    @onceflow.idempotent(consumer, store=store_url, poll_timeout=0.1)
    async def handle(message: onceflow.Message) -> None:
        handled.append(message.header("idempotency-key"))

    summary = await _run_until(
        handle, lambda: handle.metrics().get("duplicates_skipped", 0) >= skipped and len(handled) >= 3
    )
    assert sorted(handled) == [b"order-a", b"order-b", b"order-c"]
    assert summary["metrics"]["duplicates_skipped"] == skipped
    assert summary["guarantee"] == "effectively-once"


async def test_embedded_store_remembers_across_consumers(memory, tmp_path):
    topic = await memory.topic()
    path = str(tmp_path / "keys.db")
    producer = await memory.client.producer()
    await producer.send(topic, b"once", idempotency_key="k1")
    handled = []

    def handler(m):  # a plain function works too
        handled.append(m.payload)

    first = onceflow.IdempotentConsumer(await memory.consumer(topic), handler, path, namespace="billing", poll_timeout=0.1)
    await _run_until(first, lambda: len(handled) == 1)

    # another group reads the same message again: the store says it is done
    second = onceflow.IdempotentConsumer(await memory.consumer(topic), handler, path, namespace="billing", poll_timeout=0.1)
    await _run_until(second, lambda: second.metrics().get("duplicates_skipped", 0) == 1)
    assert handled == [b"once"]


async def test_a_handler_that_raises_is_retried_and_not_lost(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send(topic, b"flaky", idempotency_key="flaky-1")
    await producer.send(topic, b"fine", idempotency_key="fine-1")
    attempts = {"flaky": 0}
    done = []

    async def handle(m):
        if m.payload == b"flaky":
            attempts["flaky"] += 1
            if attempts["flaky"] < 3:
                raise RuntimeError("downstream unavailable")
        done.append(m.payload)

    engine = onceflow.IdempotentConsumer(
        await platform.consumer(topic), handle, "memory://", min_backoff=0.01, max_backoff=0.05, poll_timeout=0.1
    )
    summary = await _run_until(engine, lambda: len(done) == 2)
    assert done == [b"flaky", b"fine"]
    assert attempts["flaky"] == 3
    assert summary["metrics"]["handler_errors"] == 2


async def test_exhausted_retries_redeliver_then_succeed(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"x", idempotency_key="x-1")
    calls = []

    async def handle(m):
        calls.append(m.delivery_count)
        if len(calls) <= 2:
            raise ValueError("not yet")

    engine = onceflow.IdempotentConsumer(
        await memory.consumer(topic),
        handle,
        "memory://",
        max_attempts=1,
        redelivery_delay=0.05,
        poll_timeout=0.05,
    )
    summary = await _run_until(engine, lambda: len(calls) == 3)
    assert summary["metrics"]["processed"] == 1
    assert summary["metrics"]["redelivery_requests"] >= 2


async def test_on_failure_stop_raises_handler_error_with_the_python_cause(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"bad")

    async def handle(m):
        raise KeyError("missing customer")

    engine = onceflow.IdempotentConsumer(
        await memory.consumer(topic), handle, None, max_attempts=1, on_failure="stop", poll_timeout=0.05
    )
    with pytest.raises(onceflow.HandlerError) as e:
        await asyncio.wait_for(engine.run(), 30)
    err = e.value
    assert err.kind == "handler" and err.code == "ONCEFLOW_HANDLER"
    cause = err.__cause__
    assert isinstance(cause, KeyError) and cause.args == ("missing customer",)


async def _run_pipeline(platform, source, sink, transform, n=3):
    """Runs a Pipeline from ``source`` to ``sink`` (memory dedup store) until ``n`` outputs are
    read; returns the pipeline, the outputs and its run summary."""
    out_producer = await platform.client.producer(transactional_id=unique("py-tx"))
    pipeline = onceflow.Pipeline(await platform.consumer(source), out_producer, transform, "memory://", poll_timeout=0.1)
    task = asyncio.create_task(pipeline.run())
    reader = await platform.consumer(sink)
    got = []
    try:
        while len(got) < n:
            got.extend(await reader.poll(10, 0.5))
            assert not task.done(), task
    finally:
        pipeline.stop()
    return pipeline, got, await asyncio.wait_for(task, 30)


async def test_pipeline_transforms_into_the_output_topic(platform):
    source, sink = await platform.topic(), await platform.topic()
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(source, f"in{i}".encode(), idempotency_key=f"in-{i}") for i in range(3)])

    async def transform(m):
        return [onceflow.Record(sink, m.payload.upper())]

    pipeline, got, summary = await _run_pipeline(platform, source, sink, transform)
    assert sorted(m.payload for m in got) == [b"IN0", b"IN1", b"IN2"]
    assert summary["guarantee"] in ("exactly-once", "effectively-once", "at-least-once")
    assert isinstance(await pipeline.mechanism(), str)


async def test_a_transform_may_return_one_record(memory):
    """A transform returning one Record (not a list) writes it: it was taken as a sequence of
    its fields and failed every input, retried for ever (break-it #27)."""
    source, sink = await memory.topic(), await memory.topic()
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(source, f"in{i}".encode(), idempotency_key=f"in-{i}") for i in range(3)])
    _, got, _ = await _run_pipeline(memory, source, sink, lambda m: onceflow.Record(sink, m.payload.upper()))
    assert sorted(m.payload for m in got) == [b"IN0", b"IN1", b"IN2"]


def test_records_of_another_type_are_named():
    with pytest.raises(TypeError, match=r"expected a list of Records .* got an item str 'oops'"):
        onceflow._as_records(["oops"])


async def test_batch_handler_runs_once_per_key_with_each_store(platform, store_url):
    topic = await platform.topic()
    producer = await platform.client.producer()
    keys = ["a", "b", "a", "c", "b", "d"]
    results = await producer.send_batch_results(
        [onceflow.Record(topic, f"order {k}".encode(), idempotency_key=f"order-{k}") for k in keys]
    )
    written = sum(not r.duplicate for r in results)
    skipped = written - 4
    batches = []

    @onceflow.idempotent(await platform.consumer(topic), store=store_url, batch=True, poll_timeout=0.1)
    async def handle(messages):
        batches.append([m.header("idempotency-key") for m in messages])

    summary = await _run_until(
        handle, lambda: sum(map(len, batches)) >= 4 and handle.metrics().get("duplicates_skipped", 0) >= skipped
    )
    handled = [k for b in batches for k in b]
    assert sorted(handled) == [b"order-a", b"order-b", b"order-c", b"order-d"]
    assert len(batches) < len(handled), "one call per batch, not per message"
    assert summary["metrics"]["processed"] == 4
    assert summary["metrics"]["duplicates_skipped"] == skipped


async def test_a_batch_handler_that_raises_is_retried_and_not_lost(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), idempotency_key=f"m-{i}") for i in range(5)])
    calls = []
    done = []

    async def handle(messages):
        calls.append(len(messages))
        if len(calls) < 3:
            raise RuntimeError("downstream unavailable")
        done.extend(m.payload for m in messages)

    engine = onceflow.IdempotentConsumer(
        await platform.consumer(topic),
        handle,
        "memory://",
        batch=True,
        min_backoff=0.01,
        max_backoff=0.05,
        poll_timeout=0.1,
    )
    summary = await _run_until(engine, lambda: len(done) == 5)
    assert done == [f"m{i}".encode() for i in range(5)]
    assert summary["metrics"]["handler_errors"] == 2
    assert summary["metrics"]["processed"] == 5


async def test_a_batch_that_exhausts_its_retries_is_redelivered_whole(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), idempotency_key=f"m-{i}") for i in range(3)])
    calls = []

    def handle(messages):  # a plain function works too
        calls.append([m.payload for m in messages])
        if len(calls) <= 2:
            raise ValueError("not yet")
        return [m.payload.upper() for m in messages]

    engine = onceflow.IdempotentConsumer(
        await memory.consumer(topic),
        handle,
        "memory://",
        batch=True,
        max_attempts=1,
        redelivery_delay=0.05,
        poll_timeout=0.05,
    )
    summary = await _run_until(engine, lambda: summary_done(engine))
    handled = [p for c in calls[2:] for p in c]
    assert sorted(handled) == [b"m0", b"m1", b"m2"], calls
    assert summary["metrics"]["processed"] == 3
    assert summary["metrics"]["redelivery_requests"] >= 2


def summary_done(engine):
    return engine.metrics().get("processed", 0) == 3


async def test_a_batch_handler_must_return_one_result_per_message(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), idempotency_key=f"m-{i}") for i in range(2)])

    async def handle(messages):
        return [b"only one"]

    engine = onceflow.IdempotentConsumer(
        await memory.consumer(topic), handle, "memory://", batch=True, on_failure="stop", poll_timeout=0.05
    )
    with pytest.raises(onceflow.HandlerError, match="2 messages"):
        await asyncio.wait_for(engine.run(), 30)
