"""Errors: one class per error kind under OnceflowError, with kind, code and retriable."""

from __future__ import annotations

import pytest

import onceflow
from onceflow import _native


def test_one_class_per_kind():
    kinds = _native.error_kinds()
    assert len(kinds) == 13
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
    assert {"ConfigError", "FencedError", "TimeoutError", "DedupStoreError"} <= {c for _, _, c in kinds}


async def test_unknown_scheme_is_a_config_error():
    with pytest.raises(onceflow.ConfigError) as e:
        await onceflow.connect("carrier-pigeon://coop")
    err = e.value
    assert err.kind == "config" and err.code == "ONCEFLOW_CONFIG" and err.retriable is False
    assert "carrier-pigeon" in str(err) and "memory://" in err.message


async def test_bad_dedup_store_path_chains_the_native_cause(tmp_path):
    with pytest.raises(onceflow.OnceflowError) as e:
        await onceflow.dedup_store(str(tmp_path / "no" / "such" / "dir" / "keys.db"))
    assert e.value.kind == "dedup_store"
    assert str(tmp_path) in str(e.value)


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


async def test_empty_topic_is_refused_before_sending(memory):
    producer = await memory.client.producer()
    with pytest.raises(onceflow.ConfigError, match="topic"):
        await producer.send("", b"x")
