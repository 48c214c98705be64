"""`MessageBatch` (what `poll` returns and a batch handler gets) and `Producer.send_nowait`."""

from __future__ import annotations

import pytest

import onceflow

from conftest import drain, unique


async def test_a_polled_batch_is_a_sequence_with_columns(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    ds = await producer.send_batch(
        [onceflow.Record(topic, f"m{i}".encode(), key=(b"k" if i % 2 else None)) for i in range(6)]
    )
    consumer = await platform.consumer(topic, start="earliest")
    batch = await consumer.poll(6, 5.0)
    while len(batch) == 0:
        batch = await consumer.poll(6, 5.0)
    assert isinstance(batch, onceflow.MessageBatch)
    n = len(batch)
    assert n >= 1 and bool(batch)
    assert batch.payloads() == [f"m{i}".encode() for i in range(n)]
    assert batch.keys() == [(b"k" if i % 2 else None) for i in range(n)]
    assert batch.positions() == [d.position for d in ds[:n]]
    assert batch.topics() == [topic] * n and batch.partitions() == [0] * n
    assert all(isinstance(t, int) and t > 0 for t in batch.timestamps())
    # Message views: indexing (negative too), slicing, iteration agree with the columns.
    assert batch[0].payload == b"m0" and batch[-1].payload == f"m{n - 1}".encode()
    assert [m.payload for m in batch] == batch.payloads()
    assert [m.position for m in batch[1:]] == batch.positions()[1:]
    assert [m.payload for m in batch[::-1]] == batch.payloads()[::-1]
    with pytest.raises(IndexError):
        batch[n]
    with pytest.raises(IndexError):
        batch[-n - 1]
    # last_positions: what commit takes, per partition, limited to the first `count` too.
    assert batch.last_positions() == [(topic, 0, batch.positions()[-1])]
    assert batch.last_positions(1) == [(topic, 0, batch.positions()[0])]
    assert batch.last_positions(0) == []
    await consumer.close()
    await producer.close()


async def test_an_empty_poll_is_an_empty_batch(memory):
    consumer = await memory.consumer(await memory.topic())
    batch = await consumer.poll(10, 0.05)
    assert isinstance(batch, onceflow.MessageBatch)
    assert len(batch) == 0 and not batch and list(batch) == [] and batch.payloads() == []
    assert batch.last_positions() == []


async def test_last_positions_keeps_the_last_of_each_partition(memory):
    topic = await memory.topic(partitions=2)
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), partition=i % 2) for i in range(8)])
    consumer = await memory.consumer(topic, start="earliest")
    seen = 0
    partitions = set()
    while seen < 8:
        batch = await consumer.poll(8, 1.0)
        expected = {}
        for m in batch:
            expected[(m.topic, m.partition)] = m.position
        assert batch.last_positions() == [(t, p, pos) for (t, p), pos in expected.items()]
        partitions.update(p for _, p, _ in batch.last_positions())
        seen += len(batch)
    assert partitions == {0, 1}


async def test_commit_of_a_batch_commits_its_last_positions(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode()) for i in range(4)])
    group = unique("py-group")
    first = await platform.consumer(topic, group, start="earliest")
    batch = await first.poll(2, 5.0)
    while len(batch) == 0:
        batch = await first.poll(2, 5.0)
    assert 1 <= len(batch) <= 2
    await first.commit(batch)
    await first.close()
    second = await platform.consumer(topic, group)
    rest = await drain(second, 4 - len(batch))
    assert rest[0].payload == f"m{len(batch)}".encode()
    await second.close()


async def test_an_iterator_left_mid_batch_is_continued_not_skipped(memory):
    """A second ``async for`` (or ``batches()``) after a ``break`` mid-batch hands out the rest
    of that batch first: the messages already fetched are neither skipped nor committed
    unseen."""
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode()) for i in range(6)])
    group = unique("py-group")
    consumer = await memory.consumer(topic, group, start="earliest")
    consumer.batch_size = 6
    seen = []
    async for m in consumer:
        seen.append(m.payload)
        if len(seen) == 2:
            break
    await consumer.commit()
    async for m in consumer:
        seen.append(m.payload)
        if len(seen) == 3:
            break
    async for batch in consumer.batches():
        assert isinstance(batch, onceflow.MessageBatch)
        seen.extend(batch.payloads())
        break
    assert seen == [f"m{i}".encode() for i in range(6)]
    # The commit after the first loop took m1 only; a new member of the group starts at m2.
    await consumer.close()
    again = await memory.consumer(topic, group)
    assert [m.payload for m in await drain(again, 4)] == [f"m{i}".encode() for i in range(2, 6)]
    await again.close()


async def test_send_nowait_delivers_in_order_and_flush_waits(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    for i in range(500):
        assert producer.send_nowait(topic, f"m{i}".encode(), key=b"k") is None
    await producer.flush(30)
    got = await drain(await platform.consumer(topic, start="earliest"), 500)
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(500)]
    assert all(m.key == b"k" for m in got)
    await producer.close()


async def test_send_nowait_failures_raise_at_flush(memory):
    producer = await memory.client.producer()
    topic = await memory.topic()
    producer.send_nowait(topic, b"ok")
    producer.send_nowait("", b"no topic")
    with pytest.raises(onceflow.SendError) as e:
        await producer.flush(10)
    assert len(e.value.results) == 1
    assert isinstance(e.value.results[0], onceflow.ConfigError)
    assert isinstance(e.value.__cause__, onceflow.ConfigError)
    # Reported once: the next flush has nothing to raise.
    await producer.flush(10)
    got = await drain(await memory.consumer(topic, start="earliest"), 1)
    assert [m.payload for m in got] == [b"ok"]


async def test_send_nowait_rejects_bad_arguments_at_the_call(memory):
    producer = await memory.client.producer()
    with pytest.raises(TypeError):
        producer.send_nowait(await memory.topic(), 42)
    await producer.flush(5)


async def test_close_waits_for_send_nowait(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    for i in range(100):
        producer.send_nowait(topic, f"m{i}".encode())
    await producer.close()
    got = await drain(await memory.consumer(topic, start="earliest"), 100)
    assert len(got) == 100


async def test_a_batch_handler_gets_a_message_batch(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send_batch([onceflow.Record(topic, f"m{i}".encode(), idempotency_key=f"m-{i}") for i in range(5)])
    seen = []

    async def handle(messages):
        assert isinstance(messages, onceflow.MessageBatch)
        assert [m.payload for m in messages] == messages.payloads()
        seen.extend(messages.payloads())
        if len(seen) >= 5:
            engine.stop()

    engine = onceflow.IdempotentConsumer(await memory.consumer(topic, start="earliest"), handle, "memory://", batch=True, poll_timeout=0.05)
    await engine.run()
    assert seen == [f"m{i}".encode() for i in range(5)]


async def test_batch_send_results_are_a_sequence_made_on_read(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    results = await producer.send_batch_results(
        [onceflow.Record(topic, b"a"), onceflow.Record("", b"no topic"), onceflow.Record(topic, b"b")]
    )
    assert isinstance(results, onceflow.Deliveries)
    assert len(results) == 3 and results.failed() == 1
    assert isinstance(results[0], onceflow.Delivery) and isinstance(results[-1], onceflow.Delivery)
    assert isinstance(results[1], onceflow.ConfigError)
    assert isinstance(results.first_error(), onceflow.ConfigError)
    assert [type(r) for r in results] == [type(r) for r in results[:]] == [type(r) for r in results[::-1]][::-1]
    assert results[0].topic == topic and results[0].position != results[2].position
    with pytest.raises(IndexError):
        results[3]
    ok = await producer.send_batch([onceflow.Record(topic, b"c")])
    assert ok.failed() == 0 and ok.first_error() is None and ok[0].topic == topic
