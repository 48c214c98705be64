"""PY3 / PY4 / PY5 (issue 24): onceflow's Python package on NATS JetStream, Apache Pulsar and
Kinesis against each platform's own Python client, on the same server, in the same run. Prints
one `RATIO <id> <what> <value> target <t> PASS|MISS` line per figure (onceflow / other; > 1
means onceflow is better), the median of `--rounds` rounds whose clients alternate in order.

    python python/bench/py_platforms.py [--only py3,py4,py5] [--messages N] [--rounds R]

Reads ONCEFLOW_NATS_URL, ONCEFLOW_PULSAR_URL (+ ONCEFLOW_PULSAR_ADMIN_URL for onceflow's admin
API) and ONCEFLOW_KINESIS_URL (+ ONCEFLOW_KINESIS_ENDPOINT for boto3), as `tests/brokers/up.sh` writes them; a platform without its variable is skipped
with a line saying so. Needs a release build of the wheel and nats-py, pulsar-client, boto3.
Run without OpenTelemetry installed (it would add a span per send).

Every message is 100 B (1 KiB on Kinesis). What each side does:

- **PY3 JetStream** (target >= 2x nats-py):
  - produce: onceflow `send_batch` of 1 000 records, 4 batches in flight (each record's
    publish acknowledged by the stream) against nats-py `js.publish_async` (nats-py >= 2.10
    sends without waiting and returns a future of the ack), at most 5 000 futures in flight,
    gathered; both wait for every ack.
  - idempotent consume: onceflow `IdempotentConsumer` (batch handler, memory store, key =
    the message's coordinates, acks through the engine's commits) against nats-py
    `pull_subscribe` + `fetch(1000)` + `ack()` per message + a Python `set` of
    (subject, stream sequence) to skip repeats, the same guarantee in-process.
- **PY4 Pulsar** (target >= 1x pulsar-client):
  - produce: onceflow `send_batch` (1 000, 4 in flight) against pulsar-client's
    `send_async` with its default batching, every callback counted, then `flush`.
  - idempotent consume: onceflow `IdempotentConsumer` as above against pulsar-client
    `receive` + `acknowledge` per message + a `set` of message ids.
- **PY5 Kinesis** (target >= 1.5x boto3, judged on CPU time per record of this process from
  `getrusage`, since the emulator bounds the rate):
  - produce: onceflow `send_batch` (the producer packs PutRecords calls of up to 500) against
    boto3 `put_records` with 500 entries per call, one call at a time.
  - idempotent consume: onceflow `IdempotentConsumer` as above against boto3
    `get_shard_iterator(TRIM_HORIZON)` + `get_records` per shard + a `set` of sequence numbers.
  The ratio is boto3's CPU per record over onceflow's (> 1: onceflow spends less).

Rates count from the first message received (consumers) or the first call (producers) to the
last ack / delivery. Each round uses fresh topics / streams for every client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
import uuid
from typing import Callable, Dict, List, Tuple
from urllib.parse import parse_qs, urlparse

import onceflow

PAYLOAD = b"x" * 100
KINESIS_PAYLOAD = b"x" * 1024


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def new_topic(client, partitions: int = 1) -> str:
    name = uid("pyb")
    admin = await client.admin()
    await admin.create_topic(name, partitions)
    for _ in range(100):
        try:
            await admin.describe_topic(name)
            return name
        except onceflow.NotFoundError:
            await asyncio.sleep(0.1)
    return name


class Timed:
    """Wall seconds and process CPU seconds of a measured part."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self) -> "Timed":
        self._w, self._c = time.perf_counter(), cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._w
        self.cpu = cpu() - self._c


# ---- onceflow, every platform --------------------------------------------------------------


async def of_produce(client, topic: str, n: int, payload: bytes, chunk: int = 1000) -> Timed:
    p = await client.producer()
    await p.send(topic, payload)  # warm: connected, the topic's metadata read
    records = [(topic, payload)] * chunk
    pending: List[asyncio.Future] = []
    with Timed() as t:
        sent = 0
        while sent < n:
            k = min(chunk, n - sent)
            pending.append(asyncio.ensure_future(p.send_batch(records[:k])))
            sent += k
            if len(pending) >= 4:
                for d in await pending.pop(0):
                    assert not isinstance(d, BaseException), d
        for f in pending:
            for d in await f:
                assert not isinstance(d, BaseException), d
    await p.close()
    return t


async def of_consume_idempotent(client, topic: str, n: int) -> Timed:
    """`n` messages (after the warm-up one) through the idempotent consumer; timed from the
    first batch to the one that reaches `n`."""
    c = await client.consumer(uid("g"), [topic], start="earliest")
    seen = 0
    marks: Dict[str, float] = {}

    async def handle(messages):
        nonlocal seen
        if "w" not in marks:
            marks["w"], marks["c"] = time.perf_counter(), cpu()
        for _ in messages.payloads():
            pass
        seen += len(messages)
        if seen >= n and "w1" not in marks:
            marks["w1"], marks["c1"] = time.perf_counter(), cpu()
            engine.stop()

    engine = onceflow.IdempotentConsumer(
        c, handle, "memory://?capacity=2000000", batch=True, batch_size=1000, key="coordinates"
    )
    await engine.run()
    await c.close()
    t = Timed()
    t.wall, t.cpu = marks["w1"] - marks["w"], marks["c1"] - marks["c"]
    return t


# ---- PY3: NATS JetStream vs nats-py -----------------------------------------------------------


async def nats_connect(url: str):
    import nats

    return await nats.connect(url.split("?", 1)[0])


async def natspy_produce(url: str, subject: str, n: int, window: int = 5000) -> Timed:
    nc = await nats_connect(url)
    js = nc.jetstream(publish_async_max_pending=window)
    await js.publish(subject, PAYLOAD)
    with Timed() as t:
        futs = []
        for _ in range(n):
            futs.append(await js.publish_async(subject, PAYLOAD))
            if len(futs) >= window:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    await nc.close()
    return t


async def natspy_consume_idempotent(url: str, stream: str, subject: str, n: int) -> Timed:
    nc = await nats_connect(url)
    js = nc.jetstream()
    sub = await js.pull_subscribe(subject, durable=uid("d"), stream=stream)
    done = set()
    seen = 0
    t = Timed()
    w = c = None
    while seen < n:
        try:
            msgs = await sub.fetch(1000, timeout=1)
        except Exception:  # nats.errors.TimeoutError: nothing yet
            continue
        if w is None:
            w, c = time.perf_counter(), cpu()
        for m in msgs:
            key = (m.subject, m.metadata.sequence.stream)
            if key not in done:
                m.data
                done.add(key)
            await m.ack()
            seen += 1
    t.wall, t.cpu = time.perf_counter() - w, cpu() - c
    await nc.close()
    return t


# ---- PY4: Pulsar vs pulsar-client -------------------------------------------------------------


def pulsar_service(url: str) -> str:
    return url.split("?", 1)[0]


def pulsar_topic(topic: str) -> str:
    return f"persistent://public/default/{topic}"


def pulsarpy_produce(url: str, topic: str, n: int) -> Timed:
    import pulsar

    client = pulsar.Client(pulsar_service(url), logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    # Blocks when its pending queue (1 000 by default) is full, instead of failing the send.
    producer = client.create_producer(pulsar_topic(topic), block_if_queue_full=True)
    producer.send(PAYLOAD)
    acked = [0, 0]

    def on_sent(res, _msg_id):
        acked[res != pulsar.Result.Ok] += 1

    with Timed() as t:
        for _ in range(n):
            producer.send_async(PAYLOAD, on_sent)
        producer.flush()
        while sum(acked) < n:
            time.sleep(0.001)
    assert acked == [n, 0], acked
    producer.close()
    client.close()
    return t


def pulsarpy_consume_idempotent(url: str, topic: str, n: int) -> Timed:
    import pulsar

    client = pulsar.Client(pulsar_service(url), logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    consumer = client.subscribe(
        pulsar_topic(topic), uid("s"), initial_position=pulsar.InitialPosition.Earliest
    )
    done = set()
    seen = 0
    t = Timed()
    w = c = None
    while seen < n:
        m = consumer.receive()
        if w is None:
            w, c = time.perf_counter(), cpu()
        key = str(m.message_id())
        if key not in done:
            m.data()
            done.add(key)
        consumer.acknowledge(m)
        seen += 1
    t.wall, t.cpu = time.perf_counter() - w, cpu() - c
    consumer.close()
    client.close()
    return t


# ---- PY5: Kinesis vs boto3 --------------------------------------------------------------------


def kinesis_client():
    import boto3

    url = os.environ["ONCEFLOW_KINESIS_URL"]
    q = parse_qs(urlparse(url).query)
    endpoint = os.environ.get("ONCEFLOW_KINESIS_ENDPOINT") or q.get("endpoint", [None])[0]
    region = q.get("region", ["us-east-1"])[0]
    # Dummy credentials: the local server checks that requests are signed, not by whom.
    return boto3.client(
        "kinesis", endpoint_url=endpoint, region_name=region,
        aws_access_key_id="onceflow-bench", aws_secret_access_key="onceflow-bench",
    )


def boto3_produce(stream: str, n: int) -> Timed:
    kc = kinesis_client()
    kc.put_records(StreamName=stream, Records=[{"Data": KINESIS_PAYLOAD, "PartitionKey": "warm"}])
    with Timed() as t:
        sent = 0
        while sent < n:
            k = min(500, n - sent)
            r = kc.put_records(
                StreamName=stream,
                Records=[{"Data": KINESIS_PAYLOAD, "PartitionKey": f"k{sent + i}"} for i in range(k)],
            )
            assert r["FailedRecordCount"] == 0, r["FailedRecordCount"]
            sent += k
    return t


def boto3_consume_idempotent(stream: str, n: int) -> Timed:
    kc = kinesis_client()
    shards = [s["ShardId"] for s in kc.list_shards(StreamName=stream)["Shards"]]
    its = {
        s: kc.get_shard_iterator(StreamName=stream, ShardId=s, ShardIteratorType="TRIM_HORIZON")["ShardIterator"]
        for s in shards
    }
    done = set()
    seen = 0
    t = Timed()
    w = c = None
    while seen < n:
        for s, it in list(its.items()):
            r = kc.get_records(ShardIterator=it, Limit=10000)
            its[s] = r["NextShardIterator"]
            if r["Records"] and w is None:
                w, c = time.perf_counter(), cpu()
            for rec in r["Records"]:
                key = (s, rec["SequenceNumber"])
                if key not in done:
                    rec["Data"]
                    done.add(key)
                seen += 1
    t.wall, t.cpu = time.perf_counter() - w, cpu() - c
    return t


# ---- rounds and verdicts ----------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "PASS" if value >= target else "MISS"


def report(bench: str, what: str, ours: List[Timed], theirs: List[Timed], n: int, target: float, by_cpu: bool) -> None:
    """Per round: onceflow's rate over the other's (or the other's CPU per record over ours);
    prints every round and the median as the RATIO line."""
    ratios = []
    for o, t in zip(ours, theirs):
        ratios.append((t.cpu / o.cpu) if by_cpu else (t.wall / o.wall))
    for i, (o, t, r) in enumerate(zip(ours, theirs, ratios)):
        print(
            f"[bench] {bench} {what} round {i + 1}: onceflow {n / o.wall:,.0f}/s {o.cpu / n * 1e6:.1f} us CPU/record; "
            f"other {n / t.wall:,.0f}/s {t.cpu / n * 1e6:.1f} us CPU/record; ratio {r:.3f}"
        )
    m = statistics.median(ratios)
    print(f"RATIO {bench} {what} {m:.3f} target >={target} {verdict(m, target)}", flush=True)


async def py3(n: int, rounds: int) -> None:
    url = os.environ.get("ONCEFLOW_NATS_URL")
    if not url:
        print("[bench] PY3 skipped: ONCEFLOW_NATS_URL is not set (tests/brokers/up.sh nats)")
        return
    client = await onceflow.connect(url)
    prod_of, prod_raw, cons_of, cons_raw = [], [], [], []
    for r in range(rounds):
        a, b = await new_topic(client), await new_topic(client)
        if r % 2 == 0:
            prod_of.append(await of_produce(client, a, n, PAYLOAD))
            prod_raw.append(await natspy_produce(url, b, n))
        else:
            prod_raw.append(await natspy_produce(url, b, n))
            prod_of.append(await of_produce(client, a, n, PAYLOAD))
        # Each side reads the topic the other wrote (n + 1 messages: the warm-up too).
        if r % 2 == 0:
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
            cons_raw.append(await natspy_consume_idempotent(url, a, a, n + 1))
        else:
            cons_raw.append(await natspy_consume_idempotent(url, a, a, n + 1))
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
    report("PY3", "jetstream-produce-vs-nats-py", prod_of, prod_raw, n, 2, False)
    report("PY3", "jetstream-idempotent-consume-vs-nats-py", cons_of, cons_raw, n, 2, False)


async def py4(n: int, rounds: int) -> None:
    url = os.environ.get("ONCEFLOW_PULSAR_URL")
    if not url:
        print("[bench] PY4 skipped: ONCEFLOW_PULSAR_URL is not set (tests/brokers/up.sh pulsar)")
        return
    admin = os.environ.get("ONCEFLOW_PULSAR_ADMIN_URL")
    of_url = url if not admin or "admin=" in url else f"{url}{'&' if '?' in url else '?'}admin={admin}"
    client = await onceflow.connect(of_url)
    prod_of, prod_raw, cons_of, cons_raw = [], [], [], []
    for r in range(rounds):
        a, b = await new_topic(client), await new_topic(client)
        raw = lambda: asyncio.to_thread(pulsarpy_produce, url, b, n)  # noqa: E731
        if r % 2 == 0:
            prod_of.append(await of_produce(client, a, n, PAYLOAD))
            prod_raw.append(await raw())
        else:
            prod_raw.append(await raw())
            prod_of.append(await of_produce(client, a, n, PAYLOAD))
        raw_c = lambda: asyncio.to_thread(pulsarpy_consume_idempotent, url, a, n + 1)  # noqa: E731
        if r % 2 == 0:
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
            cons_raw.append(await raw_c())
        else:
            cons_raw.append(await raw_c())
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
    report("PY4", "pulsar-produce-vs-pulsar-client", prod_of, prod_raw, n, 1, False)
    report("PY4", "pulsar-idempotent-consume-vs-pulsar-client", cons_of, cons_raw, n, 1, False)


async def py5(n: int, rounds: int) -> None:
    url = os.environ.get("ONCEFLOW_KINESIS_URL")
    if not url:
        print("[bench] PY5 skipped: ONCEFLOW_KINESIS_URL is not set (tests/brokers/up.sh kinesis)")
        return
    client = await onceflow.connect(url)
    prod_of, prod_raw, cons_of, cons_raw = [], [], [], []
    for r in range(rounds):
        a, b = await new_topic(client, 2), await new_topic(client, 2)
        raw = lambda: asyncio.to_thread(boto3_produce, b, n)  # noqa: E731
        if r % 2 == 0:
            prod_of.append(await of_produce(client, a, n, KINESIS_PAYLOAD, chunk=500))
            prod_raw.append(await raw())
        else:
            prod_raw.append(await raw())
            prod_of.append(await of_produce(client, a, n, KINESIS_PAYLOAD, chunk=500))
        raw_c = lambda: asyncio.to_thread(boto3_consume_idempotent, a, n + 1)  # noqa: E731
        if r % 2 == 0:
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
            cons_raw.append(await raw_c())
        else:
            cons_raw.append(await raw_c())
            cons_of.append(await of_consume_idempotent(client, b, n + 1))
    report("PY5", "kinesis-produce-cpu-per-record-vs-boto3", prod_of, prod_raw, n, 1.5, True)
    report("PY5", "kinesis-idempotent-consume-cpu-per-record-vs-boto3", cons_of, cons_raw, n, 1.5, True)
    # Rates for information (the emulator bounds them).
    for what, o, t in (("produce", prod_of, prod_raw), ("consume", cons_of, cons_raw)):
        m = statistics.median(x.wall / y.wall for x, y in zip(t, o))
        print(f"[bench] PY5 kinesis-{what}-rate-vs-boto3 (info) {m:.3f}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="py3,py4,py5")
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--kinesis-messages", type=int, default=5_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(
        f"[bench] onceflow {getattr(onceflow, '__version__', '?')}, python {sys.version.split()[0]}, "
        f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}",
        flush=True,
    )
    only = set(a.only.split(","))
    if "py3" in only:
        await py3(a.messages, a.rounds)
    if "py4" in only:
        await py4(a.messages, a.rounds)
    if "py5" in only:
        await py5(a.kinesis_messages, a.rounds)
    print(f"[bench] load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())
