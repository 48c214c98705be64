"""Commit conventions (#31): ``committed()`` returns ``Committed(topic, partition, next)``, the
next position to read, while ``commit()`` takes the last processed message; ``commit()``
refuses a ``Committed`` with a ``ConfigError``, so passing one for the other cannot silently
skip a message. On every platform configured (memory always; Kafka and NATS when set)."""

from __future__ import annotations

import pytest

import onceflow
from onceflow import sync

from conftest import drain, unique


async def test_committed_is_the_next_position_and_commit_refuses_it(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    for v in (b"m0", b"m1", b"m2"):
        await producer.send(topic, v)
    group = f"{topic}-g"
    consumer = await platform.consumer(topic, group, start="earliest")
    got = await drain(consumer, 3)
    assert [m.payload for m in got] == [b"m0", b"m1", b"m2"]
    assert await consumer.committed([(topic, 0)]) == [onceflow.Committed(topic, 0, None)]

    await consumer.commit(got[1])  # processed m0 and m1
    committed = await consumer.committed([(topic, 0)])
    assert committed == [onceflow.Committed(topic, 0, got[2].position)], "next is m2, the first not processed"
    c = committed[0]
    assert isinstance(c, onceflow.Committed) and isinstance(c, tuple)
    assert (c.topic, c.partition, c.next) == (topic, 0, got[2].position)
    t, p, nxt = c  # unpacking still works
    assert (t, p, nxt) == (topic, 0, got[2].position)

    for wrong in (committed, c, [got[2], c]):
        with pytest.raises(onceflow.ConfigError) as e:
            await consumer.commit(wrong)
        assert e.value.kind == "config"
        assert "a Committed is the next position to read, from committed()" in str(e.value)
        assert "last processed" in str(e.value)
    # The refusals committed nothing: the group still resumes at m2.
    assert await consumer.committed([(topic, 0)]) == committed
    await consumer.close()

    again = await platform.consumer(topic, group)  # start: committed
    (first,) = await drain(again, 1)
    assert first.payload == b"m2" and first.position == c.next
    await again.close()


async def test_a_transaction_refuses_a_committed_too(memory):
    topic = await memory.topic()
    await (await memory.client.producer()).send(topic, b"m0")
    producer = await memory.client.producer(transactional_id=f"{topic}-tx")
    consumer = await memory.consumer(topic, start="earliest")
    (m,) = await drain(consumer, 1)
    await consumer.commit(m)
    committed = await consumer.committed([(topic, 0)])
    with pytest.raises(onceflow.ConfigError, match=r"committed\(\)"):
        async with producer.transaction() as tx:
            await tx.commit_offsets(consumer, committed)


def test_sync_consumer_has_committed_and_refuses_it_in_commit():
    client = sync.connect(f"memory://{unique('sync')}")
    producer = client.producer()
    producer.send("orders", b"m0")
    producer.send("orders", b"m1")
    consumer = client.consumer(unique("g"), ["orders"], start="earliest", poll_timeout=0.2)
    got = []
    for m in consumer:
        got.append(m)
        if len(got) == 2:
            break
    consumer.commit(got[0])
    (c,) = consumer.committed([("orders", 0)])
    assert c == onceflow.Committed("orders", 0, got[1].position)
    with pytest.raises(onceflow.ConfigError, match="next position to read"):
        consumer.commit([c])
    consumer.close()
