"""The transactional inbox from Python: the handler's SQL, the idempotency key and the position
commit in one database transaction, on the real PostgreSQL (ONCEFLOW_POSTGRES_URL) and on the
embedded (SQLite) store, over the memory backend and the real Kafka and JetStream brokers."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import time
from typing import Any, Dict, List

import pytest

import onceflow
from onceflow import sync as onceflow_sync

from conftest import Platform, _url, unique


@pytest.fixture(params=["memory", "kafka", "nats"])
async def platform(request) -> Platform:
    url = _url(request.param)
    return Platform(request.param, url, await onceflow.connect(url))


class Db:
    """A store for one test, with its own table ``name (key TEXT, payload TEXT)``, read from
    outside the inbox (psql / sqlite3) to check what was committed."""

    def __init__(self, kind: str, tmp_path):
        self.kind = kind
        self.table = unique("py_inbox").replace("-", "_")
        if kind == "postgres":
            url = os.environ.get("ONCEFLOW_POSTGRES_URL")
            if not url:
                msg = "ONCEFLOW_POSTGRES_URL is not set: no PostgreSQL (tests/brokers/up.sh postgres starts one)"
                if os.environ.get("ONCEFLOW_REQUIRE_BROKERS") == "1":
                    pytest.fail(msg)
                pytest.skip(msg)
            self.url = url
        else:
            self.path = str(tmp_path / "inbox.db")
            self.url = self.path
        self.sql(f"CREATE TABLE {self.table} (key TEXT NOT NULL, payload TEXT NOT NULL)")

    def ph(self, i: int) -> str:
        """Placeholder ``i`` (1-based) in this store's style."""
        return f"${i}" if self.kind == "postgres" else "?"

    def insert(self) -> str:
        return f"INSERT INTO {self.table} (key, payload) VALUES ({self.ph(1)}, {self.ph(2)})"

    def sql(self, statement: str) -> List[tuple]:
        if self.kind == "postgres":
            out = subprocess.run(
                ["psql", self.url, "-v", "ON_ERROR_STOP=1", "-qtAF", "\t", "-c", statement],
                capture_output=True, text=True, timeout=30,
            )
            assert out.returncode == 0, f"psql failed: {out.stderr.strip()}"
            return [tuple(line.split("\t")) for line in out.stdout.splitlines() if line]
        with sqlite3.connect(self.path, timeout=10) as c:
            return [tuple(str(v) for v in r) for r in c.execute(statement).fetchall()]

    def rows(self) -> List[tuple]:
        return sorted(self.sql(f"SELECT key, payload FROM {self.table}"))

    def drop(self) -> None:
        if self.kind == "postgres":
            self.sql(f"DROP TABLE IF EXISTS {self.table}")


@pytest.fixture(params=["postgres", "embedded"])
def db(request, tmp_path):
    d = Db(request.param, tmp_path)
    yield d
    d.drop()


async def send(platform: Platform, topic: str, items) -> None:
    producer = await platform.client.producer()
    for key, payload in items:
        await producer.send(topic, payload.encode(), idempotency_key=key)
    await producer.flush()
    await producer.close()


async def step_until(inbox: onceflow.Inbox, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"inbox did not get there in {timeout}s: {inbox.summary()}")
        await inbox.step()


def inserting(db: Db, calls: Dict[str, int]):
    async def handle(message: onceflow.Message, tx: onceflow.InboxTransaction) -> None:
        key = message.header("idempotency-key").decode()
        calls[key] = calls.get(key, 0) + 1
        assert await tx.execute(db.insert(), [key, message.payload.decode()]) == 1

    return handle


async def test_one_row_per_message_and_a_redelivered_message_writes_none(platform, db):
    topic = await platform.topic()
    # The business key rides in its own header (the inbox's `key` setting), so the repeat of k1
    # reaches the consumer on every platform (JetStream's producer dedup drops a repeated
    # idempotency-key before it is stored).
    producer = await platform.client.producer()
    for key, payload in [("k0", "a"), ("k1", "b"), ("k2", "c"), ("k1", "b")]:
        await producer.send(topic, payload.encode(), headers=[("order-id", key.encode())])
    await producer.flush()
    await producer.close()
    calls: Dict[str, int] = {}

    async def handle(message, tx):
        key = message.header("order-id").decode()
        calls[key] = calls.get(key, 0) + 1
        assert await tx.execute(db.insert(), [key, message.payload.decode()]) == 1

    consumer = await platform.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"), key="header:order-id")
    await step_until(inbox, lambda: sum(inbox.summary().values()) >= 4)
    assert inbox.store == db.kind
    assert inbox.summary() == {"handled": 3, "duplicates": 1, "behind_position": 0}
    assert calls == {"k0": 1, "k1": 1, "k2": 1}
    assert db.rows() == [("k0", "a"), ("k1", "b"), ("k2", "c")]
    await consumer.close()


async def test_query_sees_the_transactions_rows_as_tuples_and_dicts(platform, db):
    topic = await platform.topic()
    await send(platform, topic, [("q0", "x"), ("q1", "y")])
    seen: List[Any] = []

    async def handle(message, tx):
        key = message.header("idempotency-key").decode()
        await tx.execute(db.insert(), [key, message.payload.decode()])
        rows = await tx.query(f"SELECT key, payload FROM {db.table} ORDER BY key")
        dicts = await tx.query(
            f"SELECT count(*) AS n, CAST({db.ph(1)} AS INTEGER) AS echoed FROM {db.table}", [7], as_dicts=True
        )
        seen.append((rows, dicts))

    consumer = await platform.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"))
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 2)
    assert seen[0] == ([("q0", "x")], [{"n": 1, "echoed": 7}])
    assert seen[1] == ([("q0", "x"), ("q1", "y")], [{"n": 2, "echoed": 7}])
    await consumer.close()


async def test_a_handler_that_raises_writes_nothing_and_is_retried(platform, db):
    topic = await platform.topic()
    await send(platform, topic, [("r0", "a"), ("r1", "b")])
    calls: Dict[str, int] = {}

    async def handle(message, tx):
        key = message.header("idempotency-key").decode()
        calls[key] = calls.get(key, 0) + 1
        await tx.execute(db.insert(), [key, f"attempt {calls[key]}"])
        if key == "r1" and calls[key] == 1:
            raise RuntimeError("first attempt fails after its insert")

    consumer = await platform.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"), backoff=0.01)
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 2)
    assert calls == {"r0": 1, "r1": 2}
    assert db.rows() == [("r0", "attempt 1"), ("r1", "attempt 2")]
    await consumer.close()


async def test_a_sql_error_fails_the_message_even_when_the_handler_catches_it(platform, db):
    topic = await platform.topic()
    await send(platform, topic, [("s0", "a")])
    errors: List[BaseException] = []
    calls: List[int] = []

    async def handle(message, tx):
        calls.append(1)
        await tx.execute(db.insert(), ["s0", f"attempt {len(calls)}"])
        if len(calls) == 1:
            try:
                await tx.execute("INSERT INTO no_such_table_at_all VALUES (1)")
            except onceflow.OnceflowError as e:
                errors.append(e)  # swallowed: the transaction still rolls back

    consumer = await platform.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"), backoff=0.01)
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 1)
    assert len(calls) == 2
    assert isinstance(errors[0], onceflow.DedupStoreError)
    assert "no_such_table_at_all" in str(errors[0])
    assert db.rows() == [("s0", "attempt 2")]
    await consumer.close()


async def test_a_message_failing_every_attempt_stops_the_inbox_with_nothing_committed(platform, db):
    topic = await platform.topic()
    await send(platform, topic, [("f0", "a")])

    async def handle(message, tx):
        await tx.execute(db.insert(), ["f0", "a"])
        raise ValueError("always")

    consumer = await platform.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"), max_attempts=2, backoff=0.01)
    with pytest.raises(onceflow.HandlerError, match="always") as e:
        await step_until(inbox, lambda: False)
    assert isinstance(e.value.__cause__, ValueError)
    assert db.rows() == []
    assert await inbox.stored_positions() == []
    await consumer.close()


async def test_stored_positions_and_a_fresh_group_resumes_from_them(platform, db):
    topic = await platform.topic()
    await send(platform, topic, [("p0", "a"), ("p1", "b"), ("p2", "c")])
    namespace = unique("ns")
    calls: Dict[str, int] = {}
    first = await platform.consumer(topic, start="earliest")
    last: List[str] = []

    async def handle(message, tx):
        last.append(message.position)
        await inserting(db, calls)(message, tx)

    inbox = onceflow.Inbox(first, handle, db.url, namespace=namespace)
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 3)
    assert await inbox.stored_positions() == [onceflow.StoredPosition(topic, 0, last[-1])]
    await first.close()

    await send(platform, topic, [("p3", "d"), ("p4", "e")])
    # A new group reading from the earliest message: the inbox seeks past the stored position.
    fresh = await platform.consumer(topic, group=unique("py-fresh"), start="earliest")
    resumed = onceflow.Inbox(fresh, handle, db.url, namespace=namespace)
    await step_until(resumed, lambda: resumed.summary()["handled"] >= 2)
    for _ in range(3):
        await resumed.step()
    assert resumed.summary()["handled"] == 2
    assert resumed.summary()["duplicates"] == 0
    assert calls == {f"p{i}": 1 for i in range(5)}
    assert [r[0] for r in db.rows()] == [f"p{i}" for i in range(5)]
    assert len(last) == 5
    assert await resumed.stored_positions() == [onceflow.StoredPosition(topic, 0, last[-1])]
    await fresh.close()


async def test_a_new_group_with_the_default_namespace_handles_nothing_twice(kafka, db):
    # The inbox's keys and positions belong to its namespace ("default" unless set), not to
    # the consumer group: a second group reading the topic from the earliest offset on the same
    # database resumes after the stored position and skips the keys already done (#24). Keys
    # are unique per run, since the default namespace is shared by every run on the database.
    topic = await kafka.topic()
    run = unique("ng")
    first_keys = [f"{run}-{i}" for i in range(30)]
    await send(kafka, topic, [(k, "a") for k in first_keys])
    calls: Dict[str, int] = {}
    handle = inserting(db, calls)
    first = await kafka.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(first, handle, db.url)
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 30)
    assert inbox.namespace == "default"
    await first.close()

    # Two new keys and a repeat of the first one, after the stored position.
    await send(kafka, topic, [(f"{run}-new0", "b"), (f"{run}-new1", "b"), (first_keys[0], "a")])
    second = await kafka.consumer(topic, group=unique("py-second"), start="earliest")
    again = onceflow.Inbox(second, handle, db.url)
    await step_until(again, lambda: again.summary()["handled"] + again.summary()["duplicates"] >= 3)
    assert again.namespace == "default"
    assert again.summary()["handled"] == 2, again.summary()
    assert again.summary()["duplicates"] == 1, again.summary()
    assert all(n == 1 for n in calls.values()), calls
    assert len([r for r in db.rows() if r[0].startswith(run)]) == 32
    await second.close()


async def test_the_transaction_is_closed_after_the_handler_and_params_are_typed(memory, db):
    topic = await memory.topic()
    await send(memory, topic, [("c0", "a")])
    kept: List[Any] = []
    type_errors: List[str] = []

    async def handle(message, tx):
        kept.append(tx)
        assert tx.open and tx.store == db.kind
        with pytest.raises(TypeError) as e:
            await tx.execute(db.insert(), ["c0", ["not", "a", "value"]])
        type_errors.append(str(e.value))
        with pytest.raises(TypeError, match="list or tuple"):
            await tx.execute(db.insert(), "c0")
        await tx.execute(db.insert(), ("c0", "a"))

    consumer = await memory.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"))
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 1)
    assert type_errors == ["params[1]: expected str, int, float, bytes, bool or None, got list"]
    assert not kept[0].open
    with pytest.raises(onceflow.ClosedError, match="only while the handler runs"):
        await kept[0].execute(db.insert(), ["late", "write"])
    assert db.rows() == [("c0", "a")]
    await consumer.close()


async def test_values_round_trip(memory, db):
    topic = await memory.topic()
    await send(memory, topic, [("v0", "a")])
    got: List[Any] = []

    async def handle(message, tx):
        if db.kind == "postgres":
            sql = "SELECT $1::bigint, $2::float8, $3::text, $4::bytea, $5::bool, $6::text"
        else:
            sql = "SELECT ?, ?, ?, ?, ?, ?"
        got.extend(await tx.query(sql, [2**40, 1.5, "é", b"\x00\xff", True, None]))

    consumer = await memory.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"))
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 1)
    # SQLite has no boolean type: True is stored and read back as 1.
    assert got == [(2**40, 1.5, "é", b"\x00\xff", True if db.kind == "postgres" else 1, None)]
    await consumer.close()


async def test_a_store_without_an_inbox_is_a_config_error(memory):
    topic = await memory.topic()
    consumer = await memory.consumer(topic)
    for url in ("memory://", "redis://user:secret@127.0.0.1:1"):
        inbox = onceflow.Inbox(consumer, lambda m, tx: None, url)
        with pytest.raises(onceflow.ConfigError, match="PostgreSQL or the embedded store") as e:
            await inbox.step()
        assert "secret" not in str(e.value)
    with pytest.raises(TypeError, match="handler: expected a callable"):
        onceflow.Inbox(consumer, None, "x.db")
    with pytest.raises(TypeError, match="store: expected a postgres:// URL"):
        onceflow.Inbox(consumer, lambda m, tx: None, 42)
    with pytest.raises(onceflow.ConfigError, match="backof"):
        await onceflow.Inbox(consumer, lambda m, tx: None, "x.db", backof=1).step()
    with pytest.raises(TypeError, match="max_attempts"):
        await onceflow.Inbox(consumer, lambda m, tx: None, "x.db", max_attempts="3").step()
    await consumer.close()


def test_sync_inbox(db):
    client = onceflow_sync.connect(f"memory://{unique('py-sync')}")
    topic = unique("py-topic")
    producer = client.producer()
    for key in ("y0", "y1", "y0"):
        producer.send(topic, key.encode(), idempotency_key=key)
    producer.close()
    consumer = client.consumer(unique("py-group"), [topic], start="earliest", poll_timeout=0.2)
    counts: List[int] = []

    def handle(message, tx: onceflow_sync.InboxTransaction) -> None:
        key = message.header("idempotency-key").decode()
        assert tx.execute(db.insert(), [key, message.payload.decode()]) == 1
        counts.append(tx.query(f"SELECT count(*) FROM {db.table}", as_dicts=False)[0][0])
        if len(counts) == 2:
            inbox.stop()

    inbox = onceflow_sync.Inbox(consumer, handle, db.url, namespace=unique("ns"))
    summary = inbox.run()
    assert summary["handled"] == 2
    assert counts == [1, 2]
    assert db.rows() == [("y0", "y0"), ("y1", "y1")]
    consumer.close()


async def test_run_until_stop_returns_the_summary(memory, db):
    topic = await memory.topic()
    await send(memory, topic, [("u0", "a"), ("u1", "b"), ("u0", "a")])
    calls: Dict[str, int] = {}
    handle = inserting(db, calls)

    async def stop_after_two(message, tx):
        await handle(message, tx)
        if len(calls) == 2:
            inbox.stop()

    consumer = await memory.consumer(topic, start="earliest")
    namespace = unique("ns")
    inbox = onceflow.Inbox(
        consumer, stop_after_two, f"embedded://{db.path}" if db.kind == "embedded" else db.url, namespace=namespace
    )
    summary = await asyncio.wait_for(inbox.run(), 30)
    # The batch in hand is handled to its end: the repeat of u0 is skipped as a duplicate.
    assert summary == {"handled": 2, "duplicates": 1, "behind_position": 0}
    assert inbox.summary() == summary
    assert inbox.namespace == namespace
    with pytest.raises(onceflow.ClosedError, match="already ran"):
        await inbox.step()
    assert db.rows() == [("u0", "a"), ("u1", "b")]
    # The positions are still readable after run() returned: the last of the three committed.
    assert await inbox.stored_positions() == [onceflow.StoredPosition(topic, 0, "offset:2")]
    await consumer.close()


async def test_a_param_postgres_cannot_take_names_its_index_and_types(memory, db):
    if db.kind != "postgres":
        pytest.skip("SQLite takes any value in any column (type affinity): nothing to refuse")
    topic = await memory.topic()
    await send(memory, topic, [("m0", "a")])
    errors: List[BaseException] = []
    attempts = [["m0", "seven"], ["m0", 2**40], ["m0", 7]]

    async def handle(message, tx):
        params = attempts[len(errors)]
        try:
            await tx.execute(f"INSERT INTO {db.table} (key, payload) SELECT {db.ph(1)}, CAST({db.ph(2)}::int4 AS text)", params)
        except onceflow.SerializationError as e:
            errors.append(e)
            raise

    consumer = await memory.consumer(topic, start="earliest")
    inbox = onceflow.Inbox(consumer, handle, db.url, namespace=unique("ns"), backoff=0.01)
    await step_until(inbox, lambda: inbox.summary()["handled"] >= 1)
    assert [str(e) for e in errors] == [
        "ONCEFLOW_SERIALIZATION: params[1] ($2): cannot send a value of kind text as PostgreSQL type int4: "
        "send a value of that type, or convert in SQL (CAST($2 AS text)::int4)",
        "ONCEFLOW_SERIALIZATION: params[1] ($2): 1099511627776 is out of range for PostgreSQL type int4",
    ]
    assert db.rows() == [("m0", "7")]
    await consumer.close()
