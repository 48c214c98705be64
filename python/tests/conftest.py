"""Fixtures: a platform per test (memory, and the real brokers named by ONCEFLOW_KAFKA_URL /
ONCEFLOW_NATS_URL), fresh topic and group names per test, helpers to wait for messages.

Without a broker's variable its cases are skipped, saying why; with ONCEFLOW_REQUIRE_BROKERS=1
(set by tests/run-all.sh) a missing broker fails instead.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional

import pytest

import onceflow

BROKERS = {
    "memory": None,
    "kafka": "ONCEFLOW_KAFKA_URL",
    "nats": "ONCEFLOW_NATS_URL",
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class Platform:
    name: str
    url: str
    client: onceflow.Client

    async def topic(self, partitions: int = 1) -> str:
        """A new topic, created through the admin API and waited for."""
        name = unique("py-topic")
        admin = await self.client.admin()
        await admin.create_topic(name, partitions)
        deadline = time.monotonic() + 30
        while True:
            try:
                d = await admin.describe_topic(name)
                if d["partitions"] == partitions:
                    return name
            except onceflow.NotFoundError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {name} never appeared")
            await asyncio.sleep(0.1)

    async def consumer(self, topic: str, group: Optional[str] = None, **kw) -> onceflow.Consumer:
        kw.setdefault("start", "committed")
        kw.setdefault("poll_timeout", 0.5)
        return await self.client.consumer(group or unique("py-group"), [topic], **kw)


def _url(name: str) -> Optional[str]:
    var = BROKERS[name]
    if var is None:
        return f"memory://{unique('py')}"
    url = os.environ.get(var)
    if not url:
        msg = f"{var} is not set: no {name} broker (tests/brokers/up.sh {name} starts one)"
        if os.environ.get("ONCEFLOW_REQUIRE_BROKERS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return url


@pytest.fixture(params=list(BROKERS))
async def platform(request) -> Platform:
    url = _url(request.param)
    return Platform(request.param, url, await onceflow.connect(url))


@pytest.fixture
async def memory() -> Platform:
    url = _url("memory")
    return Platform("memory", url, await onceflow.connect(url))


@pytest.fixture
async def kafka() -> Platform:
    url = _url("kafka")
    return Platform("kafka", url, await onceflow.connect(url))


TRACE_HEADERS = {"traceparent", "tracestate", "baggage"}


def user_headers(message: onceflow.Message):
    """A message's headers without the trace context onceflow may have added."""
    return [(k, v) for k, v in message.headers if k not in TRACE_HEADERS]


async def drain(consumer: onceflow.Consumer, count: int, timeout: float = 30.0) -> List[onceflow.Message]:
    """Polls until `count` messages arrived (or fails after `timeout` seconds)."""
    got: List[onceflow.Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(got)} of {count} messages in {timeout}s")
        got.extend(await consumer.poll(max(1, count - len(got)), 0.5))
    return got


async def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
