"""Errors: one class per error kind under OnceflowError, with kind, code and retriable."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

import onceflow
from onceflow import _native


def test_one_class_per_kind():
    kinds = _native.error_kinds()
    assert len(kinds) == 14
    classes = set()
    for kind, code, cls_name in kinds:
        cls = getattr(onceflow, cls_name)
        assert issubclass(cls, onceflow.OnceflowError)
        assert cls is not onceflow.OnceflowError
        assert cls.kind == kind and cls.code == code
        assert cls.__module__ == "onceflow"
        assert onceflow.error_class(code) is cls
        classes.add(cls)
    assert len(classes) == len(kinds)
    assert {"ConfigError", "AuthError", "FencedError", "TimeoutError", "DedupStoreError"} <= {
        c for _, _, c in kinds
    }


async def test_unknown_scheme_is_a_config_error():
    with pytest.raises(onceflow.ConfigError) as e:
        await onceflow.connect("carrier-pigeon://coop")
    err = e.value
    assert err.kind == "config" and err.code == "ONCEFLOW_CONFIG" and err.retriable is False
    assert "carrier-pigeon" in str(err) and "memory://" in err.message


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path: echoed paths are cut past 80 characters, and
    pytest's own tmp_path can be longer than that."""
    d = Path(tempfile.mkdtemp(prefix="of-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_dedup_store_path_in_a_missing_directory_is_a_config_error(short_tmp):
    missing = short_tmp / "no" / "such" / "dir" / "keys.db"
    with pytest.raises(onceflow.ConfigError) as e:
        await onceflow.dedup_store(str(missing))
    assert e.value.kind == "config"
    assert str(missing) in str(e.value) and "does not exist" in str(e.value)
    assert not (short_tmp / "no").exists()


async def test_bad_dedup_store_file_chains_the_native_cause(short_tmp):
    not_a_db = short_tmp / "notes.txt"
    not_a_db.write_text("not an SQLite database, but long enough to have a header.\n" * 4)
    with pytest.raises(onceflow.DedupStoreError) as e:
        await onceflow.dedup_store(str(not_a_db))
    assert e.value.kind == "dedup_store"
    assert str(not_a_db) in str(e.value)
    assert e.value.__cause__ is not None


async def test_bad_start_and_engine_settings_are_config_errors(memory):
    topic = await memory.topic()
    with pytest.raises(onceflow.ConfigError, match="yesterday"):
        await memory.client.consumer("g", [topic], start="yesterday")
    consumer = await memory.consumer(topic)
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, max_attempts=0)
    with pytest.raises(onceflow.ConfigError, match="max_attempts"):
        await engine.run()
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, no_such_setting=1)
    with pytest.raises(onceflow.ConfigError, match="no_such_setting"):
        await engine.run()


async def test_engine_settings_follow_one_table_of_names_types_and_ranges(memory):
    """The settings table the Node binding uses too: wrong types are TypeErrors, bad values
    ConfigErrors naming the setting, None keeps the default."""
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    producer = await memory.client.producer()
    for config, error, text in [
        ({"tracing": 1}, TypeError, "tracing: expected bool, got int"),
        ({"lease": "30"}, TypeError, r"lease: expected int, float or datetime.timedelta \(seconds\), got str"),
        ({"batch_size": 2.5}, onceflow.ConfigError, "batch_size 2.5: expected a whole number from 1"),
        ({"commit_every": -1}, onceflow.ConfigError, "commit_every -1: expected a whole number"),
        ({"lease": 0.05}, onceflow.ConfigError, "lease 0.05: too short, expected at least 0.1 seconds"),
        ({"on_failure": "retry"}, onceflow.ConfigError, "on_failure: failure policy 'retry'"),
        ({"leaseMs": 100}, onceflow.ConfigError, "unknown setting 'leaseMs': expected one of key, namespace"),
    ]:
        engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, **config)
        with pytest.raises(error, match=text):
            await engine.run()
    pipeline = onceflow.Pipeline(consumer, producer, lambda m: [], max_transaction_inputs=0)
    with pytest.raises(onceflow.ConfigError, match="max_transaction_inputs 0: expected a whole number from 1"):
        await pipeline.run()
    pipeline = onceflow.Pipeline(consumer, producer, lambda m: [], mode="exactly")
    with pytest.raises(onceflow.ConfigError, match="mode: pipeline mode 'exactly'"):
        await pipeline.run()
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, lease=None, namespace=None)
    assert await engine.step() == 0


async def test_durations_take_seconds_or_a_timedelta_and_schemes_are_top_level(memory):
    import datetime

    assert "memory://" in onceflow.supported_schemes()
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    assert len(await consumer.poll(timeout=datetime.timedelta(milliseconds=20))) == 0
    with pytest.raises(TypeError, match=r"expected int, float or datetime.timedelta \(seconds\), got str"):
        await consumer.poll(timeout="1")
    with pytest.raises(onceflow.ConfigError, match="timeout -1: expected a number of seconds"):
        await consumer.poll(timeout=datetime.timedelta(seconds=-1))
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, lease=datetime.timedelta(milliseconds=50))
    with pytest.raises(onceflow.ConfigError, match="lease 0.05: too short"):
        await engine.run()
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, None, poll_timeout=datetime.timedelta(milliseconds=10))
    assert await engine.step() == 0


async def test_empty_topic_is_refused_before_sending(memory):
    producer = await memory.client.producer()
    with pytest.raises(onceflow.ConfigError, match="topic"):
        await producer.send("", b"x")


async def test_bad_send_arguments_name_the_argument_and_the_value(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    with pytest.raises(TypeError, match="topic"):
        await producer.send(42, b"x")
    with pytest.raises(onceflow.ConfigError, match=r"partition 1099511627776: expected an int from 0 to 2147483647"):
        await producer.send(topic, b"x", partition=2**40)
    with pytest.raises(onceflow.ConfigError, match=r"partition -1: expected"):
        producer.send_nowait(topic, b"x", partition=-1)
    with pytest.raises(onceflow.ConfigError, match=r"timestamp 1180591620717411303424"):
        await producer.send(topic, b"x", timestamp=2**70)
    with pytest.raises(TypeError, match=r"partition: expected int or None, got str"):
        await producer.send(topic, b"x", partition="0")
    with pytest.raises(onceflow.ConfigError, match="partition 4294967296"):
        await producer.send_batch([(topic, b"x", None, None, 2**32)])
    with pytest.raises(TypeError, match="record topic: expected str, got int"):
        await producer.send_batch([(7, b"x")])
    # A huge bad topic name is quoted cut, with its length, not echoed whole.
    with pytest.raises(onceflow.ConfigError) as e:
        await producer.send("/" * 100_000, b"x")
    assert "(100000 characters)" in str(e.value) and len(str(e.value)) < 400
    # Nothing bad was sent; a good record still goes through.
    delivery = await producer.send(topic, b"ok", partition=0)
    assert delivery.partition == 0
    await producer.close()


def test_send_outside_a_running_loop_says_what_to_use_instead():
    async def make():
        client = await onceflow.connect("memory://outside-loop")
        return await client.producer()

    producer = asyncio.run(make())
    with pytest.raises(RuntimeError, match="from onceflow import sync") as e:
        producer.send("t", b"x")
    assert "no running event loop" in str(e.value.__cause__)


async def test_zero_max_and_out_of_range_timeouts_are_refused(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"x")
    consumer = await memory.consumer(topic)
    with pytest.raises(onceflow.ConfigError):
        await consumer.poll(max=0)
    with pytest.raises(onceflow.ConfigError, match=r"max -1: expected an int from 1 to"):
        await consumer.poll(max=-1)
    with pytest.raises(TypeError, match=r"max: expected int or None, got str"):
        await consumer.poll(max="10")
    with pytest.raises(onceflow.ConfigError, match=r"position \('t', 0\): expected \(topic, partition, position\)"):
        await consumer.commit([("t", 0)])
    with pytest.raises(TypeError, match=r"expected a Message or a \(topic, partition, position\) tuple, got int"):
        await consumer.commit([42])
    with pytest.raises(onceflow.ConfigError, match=r"timeout 1e308: expected a number of seconds from 0 to"):
        await producer.flush(timeout=1e308)
    with pytest.raises(onceflow.ConfigError, match=r"timestamp -1: expected an int from 0 to"):
        await producer.send(topic, b"x", timestamp=-1)
    await producer.close()


async def test_a_store_of_the_wrong_type_is_refused_when_the_engine_is_made(memory, tmp_path):
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    with pytest.raises(TypeError, match=r"store: expected None, a DedupStore, or a dedup store URL or path .* got int"):

        @onceflow.idempotent(consumer, store=42)
        async def handle(message):
            pass

    # A path object is a path: accepted at construction, opened by run().
    engine = onceflow.IdempotentConsumer(consumer, lambda m: None, tmp_path / "dedup.db")
    assert engine._store == str(tmp_path / "dedup.db")
