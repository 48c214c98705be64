"""Produce and consume through the Python API, on memory and on the real brokers."""

from __future__ import annotations

import asyncio

import pytest

import onceflow

from conftest import drain, unique, user_headers


async def test_send_and_consume_round_trip(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    d = await producer.send(
        topic,
        b"\x00payload\xff",
        key=b"customer-7",
        headers=[("a", b"1"), ("a", b"2"), ("empty", b""), ("null", None)],
        idempotency_key="order-1",
    )
    assert isinstance(d, onceflow.Delivery)
    assert d.topic == topic and d.partition == 0 and isinstance(d.position, str)

    consumer = await platform.consumer(topic)
    [m] = await drain(consumer, 1)
    assert isinstance(m, onceflow.Message)
    assert (m.topic, m.partition, m.position) == (topic, 0, d.position)
    assert m.payload == b"\x00payload\xff" and isinstance(m.payload, bytes)
    assert m.key == b"customer-7"
    assert user_headers(m)[:4] == [("a", b"1"), ("a", b"2"), ("empty", b""), ("null", None)]
    assert m.headers_dict["a"] == b"1"  # first value of a repeated name
    assert m.header("idempotency-key") == b"order-1"
    assert m.header("missing") is None
    assert isinstance(m.timestamp, int) and m.timestamp > 0
    await consumer.close()
    await producer.close()


async def test_a_delivery_says_how_many_attempts_its_send_took(platform):
    """A send the platform acknowledges at once took one attempt: ``Delivery.attempts`` is the
    int 1 from ``send``, ``send_batch`` and ``send_batch_results`` alike (resends, which only
    JetStream and Kinesis make themselves, are tested in Rust behind fault proxies)."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    d = await producer.send(topic, b"once")
    assert type(d.attempts) is int and d.attempts == 1
    assert "attempts=1" in repr(d)
    batch = await producer.send_batch([onceflow.Record(topic, b"a"), (topic, b"b")])
    assert [b.attempts for b in batch] == [1, 1]
    [r] = await producer.send_batch_results([onceflow.Record(topic, b"c")])
    assert r.attempts == 1
    await producer.close()


async def test_send_batch_and_async_iteration_in_order(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    records = [onceflow.Record(topic, f"m{i}".encode(), key=b"k") for i in range(50)]
    deliveries = await producer.send_batch(records)
    assert len(deliveries) == 50
    assert all(isinstance(d, onceflow.Delivery) for d in deliveries)
    # tuples work too
    await producer.send_batch([(topic, b"tuple", None, {"h": "v"})])

    consumer = await platform.consumer(topic, batch_size=16)
    got = []
    async for m in consumer:
        got.append(m)
        if len(got) == 51:
            break
    assert [m.payload for m in got[:50]] == [f"m{i}".encode() for i in range(50)]
    assert got[50].headers_dict["h"] == b"v"
    await consumer.close()


async def test_send_batch_reports_the_failing_record(memory):
    producer = await memory.client.producer()
    topic = await memory.topic()
    with pytest.raises(onceflow.SendError) as e:
        await producer.send_batch([onceflow.Record(topic, b"ok"), onceflow.Record("", b"no topic")])
    results = e.value.results
    assert isinstance(results[0], onceflow.Delivery)
    assert isinstance(results[1], onceflow.ConfigError)
    assert isinstance(e.value.__cause__, onceflow.ConfigError)


async def test_commit_then_a_new_member_resumes_after_it(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode()) for i in range(6)])
    group = unique("py-group")
    first = await platform.consumer(topic, group)
    got = await drain(first, 3)
    got = got[:3]
    await first.commit(got[-1])
    await first.close()

    second = await platform.consumer(topic, group)
    rest = await drain(second, 3)
    assert rest[0].payload == b"m3"
    await second.close()


async def test_seek_replays_and_lag_counts(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    ds = await producer.send_batch([onceflow.Record(topic, f"m{i}".encode()) for i in range(5)])
    consumer = await memory.consumer(topic)
    await drain(consumer, 5)
    await consumer.seek(topic, 0, ds[2].position)
    again = await drain(consumer, 3)
    assert [m.payload for m in again] == [b"m2", b"m3", b"m4"]
    await consumer.commit()
    lag = await consumer.lag()
    assert [(lag_.topic, lag_.partition, lag_.messages) for lag_ in lag] == [(topic, 0, 0)]
    assert consumer.assignment() == [(topic, 0)]


async def test_rewind_uncommitted_gives_out_again_what_was_not_committed(platform):
    # What a transactional loop does after an abort: everything after the committed position
    # comes again, in order (Pulsar: the broker's redelivery, elsewhere a seek).
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode()) for i in range(6)])
    consumer = await platform.consumer(topic)
    got = await drain(consumer, 6)
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(6)]
    await consumer.commit(got[1])
    left = await consumer.rewind_uncommitted([(topic, got[0].partition)])
    assert left == []
    again = await drain(consumer, 4)
    assert [m.payload for m in again] == [b"m2", b"m3", b"m4", b"m5"]
    await consumer.close()


async def test_rewind_uncommitted_refuses_what_this_consumer_does_not_read(platform):
    # Each of these used to come back as a partition "with nothing committed" (issue #27).
    topic = await platform.topic(2)
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), key=f"k{i}".encode()) for i in range(4)])
    consumer = await platform.consumer(topic)
    got = await drain(consumer, 4)
    # commit and a transaction's commit_offsets refuse the same names the same way.
    with pytest.raises(onceflow.ConfigError, match="commit: partition -1"):
        await consumer.commit([(topic, -1, got[0].position)])
    with pytest.raises(onceflow.ConfigError, match="commit: topic 'nope-topic'"):
        await consumer.commit([("nope-topic", 0, got[0].position)])
    if platform.client.capabilities()["transactions"]:
        tx_producer = await platform.client.producer(transactional_id=f"tx-{topic}")
        tx = await tx_producer.begin()
        with pytest.raises(onceflow.ConfigError, match="commit_offsets: partition -1"):
            await tx.commit_offsets(consumer, [(topic, -1, got[0].position)])
        await tx.abort()
        await tx_producer.close()
    with pytest.raises(onceflow.FencedError, match=rf"{topic}\[7\]"):
        await consumer.rewind_uncommitted([(topic, 7)])
    with pytest.raises(onceflow.ConfigError, match="partition -1"):
        await consumer.rewind_uncommitted([(topic, -1)])
    with pytest.raises(onceflow.ConfigError, match="nope-topic"):
        await consumer.rewind_uncommitted([("nope-topic", 0)])
    with pytest.raises(onceflow.ConfigError, match="empty topic name"):
        await consumer.rewind_uncommitted([("", 0)])
    for bad, named in [
        (5, "partitions"),
        ("orders", "partitions"),
        ((topic, 0), "partitions"),
        ([(topic, 1.5)], r"partitions\[0\]: partition 1\.5"),
        ([(topic, "0")], r"partitions\[0\]: partition '0'"),
        ([(0, topic)], r"partitions\[0\]: topic 0"),
        ([topic], r"partitions\[0\]"),
    ]:
        with pytest.raises(TypeError, match=named):
            await consumer.rewind_uncommitted(bad)
    with pytest.raises(onceflow.ConfigError, match="partitions\\[0\\]: partition 4294967296"):
        await consumer.rewind_uncommitted([(topic, 2**32)])
    assert await consumer.rewind_uncommitted(consumer.assignment()) is not None
    await consumer.close()
    with pytest.raises(onceflow.ClosedError):
        await consumer.rewind_uncommitted([])
    with pytest.raises(onceflow.ClosedError):
        await consumer.rewind_uncommitted([(topic, 0)])
    await producer.close()


def test_sync_rewind_uncommitted_names_a_bad_argument():
    from onceflow import sync

    client = sync.connect(f"memory://{unique('sync')}")
    topic = unique("py-topic")
    producer = client.producer()
    producer.send(topic, b"x")
    consumer = client.consumer(unique("py-group"), [topic], start="earliest")
    with pytest.raises(TypeError, match="partitions"):
        consumer.rewind_uncommitted(None)
    consumer.close()
    producer.close()


async def test_str_payloads_and_dict_headers_are_accepted(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, "héllo", key="k", headers={"x": "y"})
    consumer = await memory.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.payload == "héllo".encode() and m.key == b"k" and user_headers(m) == [("x", b"y")]


async def test_header_gives_the_first_value_and_header_all_every_one(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send(topic, b"x", headers=[("h", None), ("h", b"1"), ("other", b"o"), ("h", b"2")])
    consumer = await platform.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.header("h") is None  # the first value is null
    assert m.header_all("h") == [None, b"1", b"2"]
    assert m.header_all("missing") == [] and m.header("missing") is None
    assert m.header("other") == b"o"


async def test_bad_arguments_are_type_errors(memory):
    producer = await memory.client.producer()
    with pytest.raises(TypeError):
        await producer.send("t", 42)
    with pytest.raises(TypeError):
        await producer.send("t", b"x", headers=42)


async def test_many_sends_in_flight_without_a_task_each(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    # send() starts the send at the call and returns a future: no task per record.
    futures = [producer.send(topic, f"m{i}".encode()) for i in range(300)]
    assert all(asyncio.isfuture(f) for f in futures)  # a SendFuture, asyncio-compatible
    deliveries = await asyncio.gather(*futures)
    assert all(d.topic == topic for d in deliveries)
    assert len({d.position for d in deliveries}) == 300
    got = await drain(await platform.consumer(topic, start="earliest"), 300)
    assert sorted(m.payload for m in got) == sorted(f"m{i}".encode() for i in range(300))


async def test_invalid_send_raises_at_the_call(memory):
    producer = await memory.client.producer()
    with pytest.raises(TypeError):
        producer.send(await memory.topic(), 42)


async def test_a_cancelled_poll_leaves_the_consumer_and_loop_working(memory):
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    pending = asyncio.ensure_future(consumer.poll(10, 5.0))
    await asyncio.sleep(0.05)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    producer = await memory.client.producer()
    await producer.send(topic, b"after")
    got = await drain(consumer, 1)
    assert [m.payload for m in got] == [b"after"]


async def test_a_closed_producer_refuses_sends(platform):
    """After close(), send and send_batch raise ClosedError on every platform (Kafka and
    JetStream went on sending before)."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send(topic, b"before")
    await producer.close()
    with pytest.raises(onceflow.ClosedError):
        await producer.send(topic, b"after")
    with pytest.raises(onceflow.SendError) as e:
        await producer.send_batch([onceflow.Record(topic, b"a"), onceflow.Record(topic, b"b")])
    results = e.value.results
    assert len(results) == 2 and all(isinstance(r, onceflow.ClosedError) for r in results), results
