"""JetStream from Python (#31), on the real nats-server (ONCEFLOW_NATS_URL): the durability
report of ``describe_topic``, ``require_durable``, and the consumer options: a handler longer
than ``ack_wait_ms`` is not redelivered (the in-progress keepalive), ``reset=True`` restarts an
existing durable at an explicit start, ``idle_heartbeat_ms`` / ``pull_expires_ms`` are taken,
durations in milliseconds take a ``timedelta``, and wrong types or unknown keys raise naming
the option."""

from __future__ import annotations

import asyncio
import datetime
import re
import time

import pytest

import onceflow

from conftest import Platform, _url, drain, unique


@pytest.fixture
async def nats() -> Platform:
    url = _url("nats")
    return Platform("nats", url, await onceflow.connect(url))


async def _nothing_within(consumer: onceflow.Consumer, seconds: float) -> list:
    got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got.extend(await consumer.poll(10, 0.2))
    return got


async def test_describe_topic_reports_the_durability_of_file_and_memory_streams(nats):
    admin = await nats.client.admin()
    file, memory = unique("py-topic"), unique("py-topic")
    await admin.create_topic(file, 1)
    await admin.create_topic(memory, 1, options={"storage": "memory"})
    try:
        f = await admin.describe_topic(file)
        assert f["name"] == file and f["partitions"] == 1
        assert f["storage"] == "file" and f["replicas"] == 1
        # An ordinary user cannot read the server's sync_interval: "unknown", durable_on_ack None.
        assert f["sync"] == "unknown" or f["sync"] == "always" or re.fullmatch(r"\d+ ms", f["sync"]), f["sync"]
        assert f["durable_on_ack"] is {"always": True, "unknown": None}.get(f["sync"], False)
        assert f["options"]["sync"] == f["sync"], "the raw options carry the same report"
        assert isinstance(f["options"], dict) and f["options"]["storage"] == "file"
        m = await admin.describe_topic(memory)
        assert m["storage"] == "memory"
        assert m["durable_on_ack"] is False, "a memory stream loses acknowledged writes on a restart"
        assert set(m) == set(onceflow.TopicDescription.__annotations__)
        with pytest.raises(onceflow.NotFoundError):
            await admin.describe_topic(unique("py-missing"))
    finally:
        await admin.delete_topic(file)
        await admin.delete_topic(memory)


async def test_describe_topic_has_no_durability_fields_where_the_platform_reports_none(memory):
    topic = await memory.topic()
    d = await (await memory.client.admin()).describe_topic(topic)
    assert set(d) == set(onceflow.TopicDescription.__annotations__)
    assert (d["storage"], d["replicas"], d["sync"], d["durable_on_ack"]) == (None, None, None, None)


async def test_require_durable_is_a_connection_option_and_only_warns(nats):
    client = await onceflow.connect(nats.url, {"require_durable": True})
    admin = await client.admin()
    topic = unique("py-topic")
    await admin.create_topic(topic, 1, options={"storage": "memory"})
    try:
        producer = await client.producer()
        await producer.send(topic, b"kept in memory")  # a warning in the log, not an error
        assert (await admin.describe_topic(topic))["durable_on_ack"] is False
        (m,) = await drain(await client.consumer(unique("py-group"), [topic], start="earliest"), 1)
        assert m.payload == b"kept in memory"
    finally:
        await admin.delete_topic(topic)
    with pytest.raises(onceflow.ConfigError, match="require_durable"):
        await onceflow.connect(nats.url, {"require_durable": "maybe"})
    with pytest.raises(TypeError, match=r"option 'require_durable': expected str, bool, int or float, got list"):
        await onceflow.connect(nats.url, {"require_durable": [True]})


async def test_a_handler_longer_than_ack_wait_is_not_redelivered(nats):
    topic = await nats.topic()
    producer = await nats.client.producer()
    await producer.send(topic, b"slow job", idempotency_key="slow-1")
    calls = []

    async def slow(message: onceflow.Message) -> None:
        calls.append(message.delivery_count)
        await asyncio.sleep(3.5)  # three and a half ack waits

    consumer = await nats.consumer(
        topic, start="earliest", options={"ack_wait_ms": datetime.timedelta(seconds=1), "max_deliver": 3}
    )
    # No dedup store: a redelivery would run the handler again.
    engine = onceflow.IdempotentConsumer(consumer, slow, None, poll_timeout=0.05)
    task = asyncio.create_task(engine.run())
    try:
        deadline = time.monotonic() + 20
        while engine.metrics().get("processed") != 1 and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.5)  # a redelivery would arrive within two ack waits
    finally:
        engine.stop()
    summary = await asyncio.wait_for(task, 30)
    assert calls == [1], "one call, on the first delivery"
    assert summary["metrics"]["consumed"] == 1, "the message was delivered once"
    assert summary["metrics"]["processed"] == 1


async def test_reset_restarts_an_existing_durable_at_an_explicit_start(nats):
    topic = await nats.topic()
    producer = await nats.client.producer()
    for v in (b"a", b"b", b"c"):
        await producer.send(topic, v)
    group = unique("py-group")
    first = await nats.consumer(topic, group, start="earliest")
    assert len(await drain(first, 3)) == 3
    await first.commit()
    await first.close()

    resumed = await nats.consumer(topic, group, start="earliest")
    assert await _nothing_within(resumed, 2.0) == [], "an existing durable resumes at its ack floor"
    await resumed.close()

    reset = await nats.consumer(topic, group, start="earliest", options={"reset": True})
    assert [m.payload for m in await drain(reset, 3)] == [b"a", b"b", b"c"], "reset starts over at earliest"
    await reset.close()


async def test_idle_heartbeat_and_pull_expires_are_taken_and_bad_values_refused(nats):
    topic = await nats.topic()
    await (await nats.client.producer()).send(topic, b"x")
    c = await nats.consumer(
        topic,
        start="earliest",
        options={"idle_heartbeat_ms": 100, "pull_expires_ms": datetime.timedelta(seconds=1), "ack_wait_ms": 5000},
    )
    (m,) = await drain(c, 1)
    assert m.payload == b"x"
    await c.close()

    async def open_with(options):
        return await nats.consumer(topic, options=options)

    with pytest.raises(TypeError, match=r"option 'ack_wait_ms': expected str, bool, int or float, got dict"):
        await open_with({"ack_wait_ms": {}})
    with pytest.raises(onceflow.ConfigError, match=r"idle_heartbeat_ms=5.*at least 10 ms"):
        await open_with({"idle_heartbeat_ms": 5})
    with pytest.raises(onceflow.ConfigError, match="pull_expires_ms"):
        await open_with({"pull_expires_ms": "soon"})
    with pytest.raises(onceflow.ConfigError, match="'reset=maybe': expected true or false"):
        await open_with({"reset": "maybe"})
    with pytest.raises(onceflow.ConfigError, match=r"'ackWaitMs'.*ack_wait_ms"):
        await open_with({"ackWaitMs": 1000})
    with pytest.raises(onceflow.ConfigError, match=r"option 'ack_wait_ms': expected a datetime.timedelta of whole milliseconds"):
        await open_with({"ack_wait_ms": datetime.timedelta(microseconds=1500)})
    with pytest.raises(onceflow.ConfigError, match="option 'ack_wait_ms'"):
        await open_with({"ack_wait_ms": datetime.timedelta(seconds=-1)})
    with pytest.raises(TypeError, match="option 'reset': expected str, bool, int or float, got timedelta"):
        await open_with({"reset": datetime.timedelta(seconds=1)})
