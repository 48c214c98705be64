"""PY1 / PY2 (issue 8): onceflow's Python API against confluent-kafka-python and aiokafka on
the same Kafka broker, in the same run. Prints one `RATIO` line per comparison
(onceflow rate / other rate; > 1 means onceflow is faster).

    ONCEFLOW_KAFKA_URL=kafka://127.0.0.1:19092 python python/bench/py_bench.py [--messages N]

Needs a release build of the wheel (`pip install ./python`), confluent-kafka and aiokafka.
Without OpenTelemetry installed (it would add a span per send).

Same producer settings on every client: idempotence on, acks=all, linger.ms=5 (librdkafka's
default, set explicitly on all three). Every side counts delivered records: onceflow's
awaitables (`send`: a native `SendFuture` each, counted by a done-callback as confluent-kafka's
`on_delivery`, at most 100 000 in flight as librdkafka's queue allows confluent-kafka, the loop
given a turn every 1 000 sends as confluent-kafka's loop polls; an info line keeps at most
5 000 in flight; another awaits them with `asyncio.gather`) resolve on the delivery report (`send_nowait`: `flush` waits for every report and
raises on any failure), confluent-kafka's loop polls delivery reports (an `on_delivery`
callback counts them, checked after `flush`), aiokafka's send futures are awaited. PY2's
idempotent consumer uses the batch handler (`batch=True`: one Python call, one dedup claim and
one completion per batch) with the memory store keyed by coordinates. PY2 reads every
message's value on both sides: onceflow through `MessageBatch.payloads()` (one `bytes` per
message), confluent-kafka through `Message.value()` of each message `consume` returns.

Each client reads at its defaults, except that onceflow's Kafka consumer sets librdkafka's
`fetch.queue.backoff.ms` to 10 ms (librdkafka's default is 1 s). An extra PY2 line (no target)
gives confluent-kafka the same value, so the clients' code is compared alone too.
`--only py2` pre-fills the topic (untimed) and runs PY2 only; `--only py1` runs PY1 only.

PY1 runs `--rounds` rounds (5), the clients in an order rotated every round, each on a fresh
topic; every PY1 `RATIO` is the median of the per-round ratios (both rates from the same round),
and the per-round figures are printed with it.

PY1 times the steady state: every producer delivers one record to a warm-up topic before its
clock starts (connected, ProducerID acquired), as aiokafka's `start()` does on its own. The
time from creating a producer to that first delivery is printed as an info line: librdkafka's
idempotent producer waits for a 500 ms timer to ask for its ProducerID unless something
triggers it sooner (onceflow does; confluent-kafka does not)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

import onceflow

PAYLOAD = b"x" * 100
LINGER_MS = 5
ONCEFLOW_PRODUCER = {"linger.ms": str(LINGER_MS), "acks": "all"}


def bootstrap(url: str) -> str:
    return url.split("://", 1)[1].split("?", 1)[0]


# Topics made by `new_topic` and not deleted yet.
CREATED: list[str] = []


async def new_topic(client, partitions=1) -> str:
    name = f"pybench-{uuid.uuid4().hex[:10]}"
    admin = await client.admin()
    await admin.create_topic(name, partitions)
    CREATED.append(name)
    for _ in range(100):
        try:
            await admin.describe_topic(name)
            return name
        except onceflow.NotFoundError:
            await asyncio.sleep(0.1)
    return name


WARM_TOPIC = None
# Milliseconds from creating a producer to its first delivery, per client (the warm-ups).
FIRST_DELIVERY: dict[str, list[float]] = {}


async def of_producer(client):
    """A onceflow producer that has delivered one record to the warm-up topic."""
    t = time.perf_counter()
    p = await client.producer(idempotent=True, options=ONCEFLOW_PRODUCER)
    await p.send(WARM_TOPIC, PAYLOAD)
    FIRST_DELIVERY.setdefault("onceflow", []).append((time.perf_counter() - t) * 1000)
    return p


def rate(n, secs):
    return n / secs if secs > 0 else float("inf")


async def of_send_batch(client, n, chunk=10_000):
    topic = await new_topic(client)
    p = await of_producer(client)
    records = [(topic, PAYLOAD)] * chunk
    t = time.perf_counter()
    sent = 0
    pending = []
    while sent < n:
        k = min(chunk, n - sent)
        pending.append(asyncio.ensure_future(p.send_batch(records[:k])))
        sent += k
        if len(pending) >= 4:
            await pending.pop(0)
    for f in pending:
        await f
    secs = time.perf_counter() - t
    await p.close()
    return topic, rate(n, secs)


# confluent-kafka's `produce` raises BufferError once librdkafka's local queue holds
# `queue.buffering.max.messages` records (100 000 by default): the most records its loop has in
# flight. The single-`send` loop gets the same bound.
CK_QUEUE_MESSAGES = 100_000


async def of_send(client, n, window=CK_QUEUE_MESSAGES, yield_every=1000):
    """At most `window` sends in flight; a done-callback per send counts its delivery (as
    confluent-kafka's `on_delivery` does), instead of `asyncio.wait` over the whole window,
    which adds and removes a callback on every pending future per call. Every `yield_every`
    sends the loop gets a turn to resolve what was delivered, as confluent-kafka's loop calls
    `poll(0)` every 1 000 records."""
    topic = await new_topic(client)
    p = await of_producer(client)
    delivered = [0, 0]
    inflight = 0
    room = asyncio.Event()

    def on_done(f):
        nonlocal inflight
        inflight -= 1
        delivered[f.cancelled() or f.exception() is not None] += 1
        if inflight < window:
            room.set()

    t = time.perf_counter()
    for i in range(n):
        if inflight >= window:
            room.clear()
            await room.wait()
        elif i % yield_every == 0:
            await asyncio.sleep(0)
        p.send(topic, PAYLOAD).add_done_callback(on_done)
        inflight += 1
    while inflight:
        room.clear()
        await room.wait()
    secs = time.perf_counter() - t
    await p.close()
    assert delivered == [n, 0], f"onceflow send delivered {delivered}"
    return rate(n, secs)


async def of_send_gather(client, n, window=5_000):
    """Single `send`s awaited the common way: `asyncio.gather` over `window` of them at a time
    (each `SendFuture` is taken as a future by gather: no task per record)."""
    topic = await new_topic(client)
    p = await of_producer(client)
    t = time.perf_counter()
    sent = 0
    while sent < n:
        k = min(window, n - sent)
        deliveries = await asyncio.gather(*[p.send(topic, PAYLOAD) for _ in range(k)])
        assert len(deliveries) == k
        sent += k
    secs = time.perf_counter() - t
    await p.close()
    return rate(n, secs)


async def of_send_nowait(client, n):
    """Single records without an awaitable each: `send_nowait` per record, then `flush`,
    which waits for every delivery report and raises if any record failed."""
    topic = await new_topic(client)
    p = await of_producer(client)
    t = time.perf_counter()
    for _ in range(n):
        p.send_nowait(topic, PAYLOAD)
    await p.flush(60)
    secs = time.perf_counter() - t
    await p.close()
    return rate(n, secs)


def ck_produce(url, topic, n):
    import confluent_kafka as ck

    t = time.perf_counter()
    p = ck.Producer(
        {"bootstrap.servers": bootstrap(url), "enable.idempotence": True, "acks": "all", "linger.ms": LINGER_MS}
    )
    p.produce(WARM_TOPIC, PAYLOAD)
    assert p.flush(60) == 0, "confluent-kafka warm-up record not delivered"
    FIRST_DELIVERY.setdefault("confluent-kafka", []).append((time.perf_counter() - t) * 1000)
    delivered = [0, 0]

    def on_delivery(err, msg):
        delivered[err is not None] += 1

    t = time.perf_counter()
    for i in range(n):
        while True:
            try:
                p.produce(topic, PAYLOAD, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    left = p.flush(60)
    secs = time.perf_counter() - t
    assert left == 0 and delivered == [n, 0], f"confluent-kafka delivered {delivered}, {left} left"
    return rate(n, secs)


async def aiokafka_produce(url, topic, n, window=5_000):
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap(url), enable_idempotence=True, acks="all", linger_ms=LINGER_MS)
    await p.start()
    t = time.perf_counter()
    futs = []
    for _ in range(n):
        futs.append(await p.send(topic, PAYLOAD))
        if len(futs) >= window:
            await asyncio.gather(*futs)
            futs = []
    await asyncio.gather(*futs)
    secs = time.perf_counter() - t
    await p.stop()
    return rate(n, secs)


async def of_consume(client, topic, n):
    c = await client.consumer(f"g-{uuid.uuid4().hex[:8]}", [topic], start="earliest", batch_size=1000)
    got = 0
    t = None
    while got < n:
        batch = await c.poll(1000, 1.0)
        if batch and t is None:
            t = time.perf_counter()
        for _ in batch.payloads():
            pass
        got += len(batch)
    secs = time.perf_counter() - t
    await c.close()
    return rate(n, secs)


async def of_consume_dedup(client, topic, n):
    c = await client.consumer(f"g-{uuid.uuid4().hex[:8]}", [topic], start="earliest")
    seen = 0
    t = [None, None]

    async def handle(messages):
        nonlocal seen
        if t[0] is None:
            t[0] = time.perf_counter()
        for _ in messages.payloads():
            pass
        seen += len(messages)
        if seen >= n and t[1] is None:
            t[1] = time.perf_counter()
            engine.stop()

    engine = onceflow.IdempotentConsumer(
        c, handle, "memory://?capacity=2000000", batch=True, batch_size=1000, key="coordinates"
    )
    summary = await engine.run()
    assert summary["metrics"]["processed"] >= n, summary
    return rate(n, t[1] - t[0])


# onceflow's Kafka consumer sets librdkafka's `fetch.queue.backoff.ms` to 10 (librdkafka's default
# is 1000, which stalls a consumer that drains the 100 000 prefetched messages within a second);
# the extra PY2 line gives confluent-kafka the same value, to compare the clients' code alone.
ONCEFLOW_FETCH_DEFAULTS = {"fetch.queue.backoff.ms": 10}


def ck_consume(url, topic, n, extra=None):
    import confluent_kafka as ck

    c = ck.Consumer(
        {
            "bootstrap.servers": bootstrap(url),
            "group.id": f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **(extra or {}),
        }
    )
    c.subscribe([topic])
    got = 0
    t = None
    while got < n:
        msgs = c.consume(num_messages=1000, timeout=1.0)
        if msgs and t is None:
            t = time.perf_counter()
        for m in msgs:
            if m.error() is None:
                m.value()
                got += 1
    secs = time.perf_counter() - t
    c.close()
    return rate(n, secs)


async def py1_rounds(client, url, n, rounds):
    """`rounds` rounds of PY1's clients, each on fresh topics, in an order rotated every round
    (so no client is always first after the broker's quiet spell); the rates per client, round
    by round, and the topic of the last `send_batch` round (PY2 reads it)."""
    topic = None

    async def confluent():
        return await asyncio.to_thread(ck_produce, url, await new_topic(client), n)

    async def batch():
        nonlocal topic
        topic, figure = await of_send_batch(client, n)
        return figure

    runs = [
        ("confluent-kafka", confluent),
        ("send_batch", batch),
        ("send", lambda: of_send(client, n)),
        ("send_nowait", lambda: of_send_nowait(client, n)),
        ("send-window-5000", lambda: of_send(client, n, window=5_000)),
    ]
    figures = {who: [] for who, _ in runs}
    admin = await client.admin()
    for r in range(rounds):
        for who, run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            figures[who].append(await run())
        # A round writes ~5M records: the broker keeps only what is read later, or its growing
        # log slows the rounds after (send_batch 2.0-2.4M/s on a new broker, 1.6M/s by 8 GB).
        for t in [t for t in CREATED if t not in (WARM_TOPIC, topic)]:
            await admin.delete_topic(t)
            CREATED.remove(t)
    return topic, figures


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--single-messages", type=int, default=200_000, help="for aiokafka and the gathered sends")
    ap.add_argument("--rounds", type=int, default=5, help="PY1 rounds (a median of per-round ratios is printed)")
    ap.add_argument(
        "--only",
        choices=["py1", "py2"],
        help="run only PY1 (produce) or only PY2 (consume: pre-fills the topic with send_batch, untimed)",
    )
    a = ap.parse_args()
    url = os.environ["ONCEFLOW_KAFKA_URL"]
    n, s = a.messages, a.single_messages
    client = await onceflow.connect(url)
    global WARM_TOPIC
    WARM_TOPIC = await new_topic(client)
    import confluent_kafka
    import aiokafka

    import platform

    print(
        f"versions: onceflow {onceflow.__version__}, confluent-kafka {confluent_kafka.__version__} "
        f"(librdkafka {confluent_kafka.libversion()[0]}), aiokafka {aiokafka.__version__}, "
        f"{platform.python_implementation()} {platform.python_version()}; "
        f"OpenTelemetry {'installed' if onceflow._otel.ENABLED else 'not installed'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if a.only == "py2":
        topic, _ = await of_send_batch(client, n)
        await py2(client, url, topic, n)
        return
    topic, figures = await py1_rounds(client, url, n, a.rounds)
    of_gather = await of_send_gather(client, s)
    aio_rate = await aiokafka_produce(url, await new_topic(client), s)
    ck_rate = statistics.median(figures["confluent-kafka"])

    def median_ratio(who):
        return statistics.median(x / c for x, c in zip(figures[who], figures["confluent-kafka"]))

    for who, rates in figures.items():
        print(f"PY1 produce {n} x 100 B: {who} {', '.join(f'{r:,.0f}' for r in rates)}/s (per round)")
    for who, target in [
        ("send_batch", "target >= 2"),
        ("send", "target >= 1"),
        ("send_nowait", "target >= 1, single-record path"),
        ("send-window-5000", "no target: at most 5 000 sends in flight instead of librdkafka's 100 000"),
    ]:
        per_round = [x / c for x, c in zip(figures[who], figures["confluent-kafka"])]
        print(
            f"RATIO PY1 {who}/confluent-kafka {median_ratio(who):.2f} ({target}; median of "
            f"{len(per_round)} rounds: {', '.join(f'{r:.2f}' for r in per_round)})"
        )
    print(f"PY1 produce {s} x 100 B: onceflow send + asyncio.gather of 5000 at a time {of_gather:,.0f}/s, aiokafka {aio_rate:,.0f}/s")
    print(f"RATIO PY1 send-gather/confluent-kafka {of_gather / ck_rate:.2f} (no target: the same sends awaited with gather; against the median confluent-kafka round)")
    print(f"RATIO PY1 send_batch/aiokafka {statistics.median(figures['send_batch']) / aio_rate:.2f} (target >= 3; median send_batch round)")
    for who, ms in FIRST_DELIVERY.items():
        print(f"PY1 first delivery of a new idempotent producer, {who}: {', '.join(f'{m:.0f}' for m in ms)} ms (info)")
    if a.only != "py1":
        await py2(client, url, topic, n)


async def py2(client, url, topic, n):
    of_c = await of_consume(client, topic, n)
    ck_c = await asyncio.to_thread(ck_consume, url, topic, n)
    of_d = await of_consume_dedup(client, topic, n)
    ck_same = await asyncio.to_thread(ck_consume, url, topic, n, ONCEFLOW_FETCH_DEFAULTS)
    print(f"PY2 consume {n}: onceflow poll batches {of_c:,.0f}/s, with memory dedup store {of_d:,.0f}/s, confluent-kafka consume(1000) {ck_c:,.0f}/s")
    print(f"RATIO PY2 consume/confluent-kafka {of_c / ck_c:.2f} (target >= 1.5)")
    print(f"RATIO PY2 idempotent+memory store/confluent-kafka {of_d / ck_c:.2f} (target >= 1.2)")
    print(f"PY2 consume {n}: confluent-kafka consume(1000) with onceflow's fetch settings {ONCEFLOW_FETCH_DEFAULTS} {ck_same:,.0f}/s")
    print(f"RATIO PY2 consume/confluent-kafka-same-fetch-settings {of_c / ck_same:.2f} (no target: the clients' code alone)")
    print(f"RATIO PY2 idempotent+memory store/confluent-kafka-same-fetch-settings {of_d / ck_same:.2f} (no target)")


if __name__ == "__main__":
    asyncio.run(main())
