"""Raw client options (``options=``): values may be str, bool or numbers, as users write
them; another type is a TypeError naming the key and the type, never the value."""

from __future__ import annotations

import math

import pytest

import onceflow

from conftest import _url, drain, unique


async def test_bool_and_number_options_reach_the_adapter(memory):
    url = f"memory://{unique('opts')}"
    # auto_create=False as a bool: producing to a missing topic is then NotFound.
    client = await onceflow.connect(url, options={"auto_create": False, "partitions": 3})
    admin = await client.admin()
    # Booleans and numbers pass the conversion and reach the platform, which names them:
    # memory:// reads no producer or consumer options, so it refuses them (#31).
    with pytest.raises(onceflow.ConfigError, match="unknown memory:// producer options 'enable.idempotence', 'linger.ms', 'ratio'"):
        await client.producer(options={"linger.ms": 5, "enable.idempotence": True, "ratio": 0.5})
    producer = await client.producer()
    with pytest.raises(onceflow.NotFoundError):
        await producer.send(unique("missing"), b"x")
    topic = unique("t")
    await admin.create_topic(topic, 2, options={"cleanup.policy": "delete", "segment.ms": 1000, "x": False})
    await producer.send(topic, b"m")
    with pytest.raises(onceflow.ConfigError, match="unknown memory:// consumer options 'check.crcs', 'fetch.min.bytes'"):
        await client.consumer(unique("g"), [topic], start="earliest", options={"fetch.min.bytes": 1, "check.crcs": True})
    consumer = await client.consumer(unique("g"), [topic], start="earliest")
    [m] = await drain(consumer, 1)
    assert m.payload == b"m"
    await consumer.close()


@pytest.mark.parametrize(
    "value, type_name",
    [([1], "list"), ({"a": 1}, "dict"), (None, "NoneType"), (b"false", "bytes")],
)
async def test_other_option_types_are_type_errors_naming_key_and_type(memory, value, type_name):
    expected = f"option 'tls_hostname_verification': expected str, bool, int or float, got {type_name}"
    with pytest.raises(TypeError) as e:
        await onceflow.connect(f"memory://{unique('opts')}", options={"tls_hostname_verification": value})
    assert str(e.value) == expected
    with pytest.raises(TypeError) as e:
        await memory.client.producer(options={"a": "1", "tls_hostname_verification": value})
    assert str(e.value) == expected
    with pytest.raises(TypeError) as e:
        await memory.client.consumer(unique("g"), [unique("t")], options={"tls_hostname_verification": value})
    assert str(e.value) == expected
    admin = await memory.client.admin()
    with pytest.raises(TypeError) as e:
        await admin.create_topic(unique("t"), options={"tls_hostname_verification": value})
    assert str(e.value) == expected


async def test_option_errors_never_show_the_value(memory):
    secret = "hunter2-s3cret"
    with pytest.raises(TypeError) as e:
        await memory.client.producer(options={"sasl.password": [secret]})
    assert "sasl.password" in str(e.value) and secret not in str(e.value)
    with pytest.raises(onceflow.ConfigError) as e:
        await memory.client.producer(options={"linger.ms": math.nan})
    assert str(e.value).endswith("option 'linger.ms': expected a finite number, got nan or inf"), str(e.value)
    with pytest.raises(TypeError, match="keys must be str, got int"):
        await memory.client.producer(options={1: "x"})
    with pytest.raises(TypeError, match="options: expected a mapping"):
        await memory.client.producer(options=[("a", "b")])


async def test_memory_refuses_producer_and_consumer_options_by_name(memory):
    # An option memory:// does not read was ignored as if applied (ack_wait_ms on a consumer,
    # a producer setting of another platform): it is a ConfigError naming it, never its value.
    topic = await memory.topic()
    with pytest.raises(onceflow.ConfigError) as e:
        await memory.client.consumer(unique("g"), [topic], options={"ack_wait_ms": 100})
    assert "unknown memory:// consumer option 'ack_wait_ms'" in str(e.value), str(e.value)
    assert "partitions, auto_create, max_record_bytes" in str(e.value)
    with pytest.raises(onceflow.ConfigError) as e:
        await memory.client.producer(options={"linger.ms": 5, "sasl.password": "hunter2-s3cret"})
    assert "unknown memory:// producer options 'linger.ms', 'sasl.password'" in str(e.value), str(e.value)
    assert "hunter2" not in str(e.value)
    from onceflow import sync

    client = sync.connect(f"memory://{unique('opts')}")
    with pytest.raises(onceflow.ConfigError, match="unknown memory:// producer option 'acks'"):
        client.producer(options={"acks": "all"})
    # Without options both open as before.
    producer = await memory.client.producer()
    await producer.send(topic, b"x")
    consumer = await memory.client.consumer(unique("g"), [topic], start="earliest")
    [m] = await drain(consumer, 1)
    assert m.payload == b"x"
    await consumer.close()


def test_sync_connect_takes_options():
    from onceflow import sync

    client = sync.connect(f"memory://{unique('opts')}", options={"auto_create": False})
    producer = client.producer()
    with pytest.raises(onceflow.NotFoundError):
        producer.send(unique("missing"), b"x")
    producer.close()


async def test_kafka_producer_takes_boolean_and_number_properties(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer(options={"enable.idempotence": True, "linger.ms": 5})
    await producer.send(topic, b"idempotent")
    consumer = await kafka.consumer(topic, start="earliest", options={"check.crcs": True, "fetch.wait.max.ms": 100})
    [m] = await drain(consumer, 1)
    assert m.payload == b"idempotent"
    await consumer.close()
    await producer.close()


async def test_nats_connect_takes_a_boolean_option():
    client = await onceflow.connect(_url("nats"), options={"tls_first": False})
    assert client.platform == "jetstream"
