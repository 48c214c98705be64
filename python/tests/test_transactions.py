"""Transactions: `async with producer.transaction() as tx` commits or aborts, and commits the
consumer's positions with the outputs (memory and Kafka; JetStream has no transactions)."""

from __future__ import annotations

import pytest

import onceflow

from conftest import drain, unique


@pytest.fixture
def tx_platform(platform):
    if platform.name == "nats":
        pytest.skip("JetStream has no transactions (test_jetstream_has_no_transactions checks the refusal)")
    return platform


async def test_committed_transaction_is_visible_aborted_is_not(tx_platform):
    p = tx_platform
    topic = await p.topic()
    producer = await p.client.producer(transactional_id=unique("py-tx"))
    assert producer.guarantee == "exactly-once"

    async with producer.transaction() as tx:
        await tx.send(topic, b"committed-1")
        await tx.send_batch([onceflow.Record(topic, b"committed-2")])

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with producer.transaction() as tx:
            await tx.send(topic, b"aborted")
            raise Boom()

    async with producer.transaction() as tx:
        await tx.send(topic, b"committed-3")

    consumer = await p.consumer(topic)  # read_committed by default
    got = await drain(consumer, 3)
    assert [m.payload for m in got] == [b"committed-1", b"committed-2", b"committed-3"]
    assert not await consumer.poll(10, 1.0)
    await consumer.close()
    await producer.close()


async def test_consume_transform_produce_commits_positions_in_the_transaction(tx_platform):
    p = tx_platform
    source, sink = await p.topic(), await p.topic()
    plain = await p.client.producer()
    await plain.send_batch([onceflow.Record(source, f"in{i}".encode()) for i in range(4)])

    group = unique("py-group")
    consumer = await p.consumer(source, group)
    producer = await p.client.producer(transactional_id=unique("py-tx"))
    inputs = await drain(consumer, 4)
    async with producer.transaction() as tx:
        await tx.send_batch([onceflow.Record(sink, m.payload.upper()) for m in inputs])
        await tx.commit_offsets(consumer)
    await consumer.close()

    reader = await p.consumer(sink)
    out = await drain(reader, 4)
    assert sorted(m.payload for m in out) == [b"IN0", b"IN1", b"IN2", b"IN3"]
    # the group resumes after the inputs the transaction committed
    again = await p.consumer(source, group)
    assert not await again.poll(10, 1.5)
    await again.close()
    await reader.close()


async def test_transaction_without_transactional_id_is_a_config_error(memory):
    producer = await memory.client.producer()
    with pytest.raises(onceflow.ConfigError) as e:
        async with producer.transaction():
            pass
    # In the user's words: no Rust type (it said "set ProducerConfig::transactional_id").
    assert "transactional id" in str(e.value) and "ProducerConfig" not in str(e.value), e.value


async def test_jetstream_has_no_transactions(platform):
    if platform.name != "nats":
        pytest.skip("checks the JetStream refusal only")
    producer = await platform.client.producer(transactional_id=unique("py-tx"))
    with pytest.raises(onceflow.UnsupportedError):
        async with producer.transaction():
            pass


async def test_commit_offsets_names_a_consumer_that_is_not_one(memory):
    producer = await memory.client.producer(transactional_id=unique("py-tx"))
    async with producer.transaction() as tx:
        with pytest.raises(TypeError, match=r"commit_offsets\(consumer=...\).*got str 'orders'"):
            await tx.commit_offsets("orders")
        await tx.abort()


def test_sync_commit_offsets_names_a_consumer_that_is_not_one():
    import onceflow.sync

    producer = onceflow.sync.connect("memory://").producer(transactional_id=unique("py-tx"))
    with producer.transaction() as tx:
        with pytest.raises(TypeError, match=r"onceflow\.sync\.Consumer.*got str 'orders'"):
            tx.commit_offsets("orders")
        tx.abort()


async def test_commit_offsets_names_a_partition_of_the_wrong_type(memory):
    """A partition 1.5 or 'x' (or a position that is not a string) raises a TypeError naming
    the tuple; it was a bare "'float' object cannot be interpreted as an integer"."""
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    producer = await memory.client.producer(transactional_id=unique("py-tx"))
    async with producer.transaction() as tx:
        for bad in [(topic, 1.5, "offset:0"), (topic, "x", "offset:0"), (topic, True, "offset:0"), (topic, 0, 42)]:
            with pytest.raises(TypeError, match=r"expected \(topic: str, partition: int, position: str\)") as e:
                await tx.commit_offsets(consumer, [bad])
            assert repr(bad[1]) in str(e.value) or repr(bad[2]) in str(e.value), e.value
        await tx.abort()
