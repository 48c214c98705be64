"""The Python interpreter of the cross-language scenario suite (tests/scenarios/scenarios.json,
issue #24): every (scenario, platform) cell of the spec runs against the real broker named by
the spec's environment variable, one pytest case per cell, and prints
``SCENARIO <name> python <platform> PASS|FAIL`` (also written to
``$CARGO_TARGET_DIR/scenarios/python.txt`` for tests/scenarios/check.py).

The cells run concurrently (a few at a time) in one event loop, before the first case asks for
its result, so the suite costs about as long as its slowest cells. python/run-tests.sh runs it
twice: with OpenTelemetry installed (language ``python``) and without (``python-no-otel``,
where ``send`` takes its fast path); the second leaves out the scenarios whose spec ``needs``
OpenTelemetry (the trace scenario), and check.py expects exactly that."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pathlib
import tempfile
import time
import traceback
import uuid
from typing import Any, Dict, List, Optional, Tuple

import pytest

import onceflow

try:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    OTEL = True
except ImportError:
    OTEL = False

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = json.loads((ROOT / "tests" / "scenarios" / "scenarios.json").read_text())
# Without OpenTelemetry `send` takes its fast path (no span, no trace headers): a language of
# its own in the table, without the scenarios that need OpenTelemetry (spec: "needs").
LANGUAGE = "python" if OTEL else "python-no-otel"
TRACE_HEADERS = {"traceparent", "tracestate", "baggage"}
CELL_TIMEOUT = 120.0
WAIT = 60.0
PARALLEL = 12

if OTEL:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    TRACER = trace.get_tracer("onceflow-scenarios")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def cells() -> List[Tuple[str, dict, Optional[str], str]]:
    """(cell name, scenario, store or None, platform) for every cell of the spec."""
    out = []
    for s in SPEC["scenarios"]:
        if not OTEL and "opentelemetry" in s.get("needs", {}):
            continue
        for store in s.get("stores", [None]):
            name = s["name"] if store is None else f"{s['name']}[{store}]"
            for p in SPEC["platforms"]:
                out.append((name, s, store, p))
    return out


class MissingEnv(Exception):
    pass


def env_url(var: str) -> str:
    url = os.environ.get(var)
    if not url:
        raise MissingEnv(f"{var} is not set (tests/brokers/up.sh starts the broker)")
    return url


def platform_url(name: str) -> str:
    p = SPEC["platforms"][name]
    if "url" in p:
        return p["url"] + unique("py-scn")
    url = env_url(p["env"])
    extra = []
    if "query" in p:
        extra.append(p["query"])
    if "admin_env" in p and os.environ.get(p["admin_env"]) and "admin=" not in url:
        extra.append(f"admin={os.environ[p['admin_env']]}")
    if extra:
        url += ("&" if "?" in url else "?") + "&".join(extra)
    return url


def store_url(name: str, tmp: str) -> str:
    s = SPEC["stores"][name]
    if "url" in s:
        return s["url"]
    if s.get("file"):
        return os.path.join(tmp, f"{unique('dedup')}.db")
    return env_url(s["env"])


def value(v: Optional[str]) -> Optional[bytes]:
    """A spec value: ``hex:…`` or ``text:…``, or null."""
    if v is None:
        return None
    kind, _, rest = v.partition(":")
    if kind == "hex":
        return bytes.fromhex(rest)
    if kind == "text":
        return rest.encode()
    raise ValueError(f"spec value {v!r}: expected hex:… or text:…")


def subst(s: str, vars: Dict[str, Any]) -> str:
    for k, v in vars.items():
        s = s.replace(f"${k}", str(v))
    return s


def config_kwargs(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Spec engine settings (``*_ms`` in milliseconds) as the Python keyword arguments."""
    out: Dict[str, Any] = {"poll_timeout": 0.05}
    for k, v in cfg.items():
        if k.endswith("_ms"):
            out[k[: -len("_ms")]] = v / 1000.0
        else:
            out[k] = v
    return out


async def read(consumer: onceflow.Consumer, want: int, quiet_ms: int) -> List[onceflow.Message]:
    """Polls until ``want`` messages arrived (or the wait ran out), then ``quiet_ms`` more."""
    got: List[onceflow.Message] = []
    deadline = time.monotonic() + WAIT
    while len(got) < want and time.monotonic() < deadline:
        got.extend(await consumer.poll(want - len(got), 0.2))
    quiet = time.monotonic() + quiet_ms / 1000.0
    while time.monotonic() < quiet:
        got.extend(await consumer.poll(10, 0.2))
    return got


def check_payloads(got: List[onceflow.Message], expected: List[str], what: str) -> None:
    """The payloads of ``got`` are those of the spec, as a multiset."""
    actual_p = sorted(m.payload for m in got)
    expected_p = sorted(value(p) for p in expected)
    assert actual_p == expected_p, f"payloads {what}: {actual_p}, expected {expected_p}"


async def wait_until(pred, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


class Cell:
    def __init__(self, scenario: dict, store: Optional[str], platform: str, client: onceflow.Client, tmp: str):
        self.scenario = scenario
        self.store = store
        self.platform = platform
        self.client = client
        self.tmp = tmp
        self.topics: Dict[str, str] = {}
        self.vars: Dict[str, Any] = {}

    def store_of(self, step: dict) -> str:
        name = step["store"]
        if name == "$store":
            name = self.store
        return store_url(name, self.tmp)

    async def run(self) -> None:
        for i, step in enumerate(self.scenario["steps"]):
            # A platform's documented difference replaces fields of the step ("why" says why).
            override = step.get("overrides", {}).get(self.platform, {})
            step = {**step, **{k: v for k, v in override.items() if k != "why"}}
            op = step["op"]
            unsupported = step.get("unsupported", {}).get(self.platform)
            try:
                await getattr(self, f"op_{op}")(step)
            except onceflow.OnceflowError as e:
                if unsupported and e.kind == unsupported["kind"]:
                    return  # documented: the rest of the scenario cannot run here
                raise AssertionError(f"step {i} ({op}): {type(e).__name__}: {e}") from e
            if unsupported:
                raise AssertionError(
                    f"step {i} ({op}) succeeded on {self.platform}, where the spec documents a "
                    f"{unsupported['kind']} error: {unsupported['reason']}"
                )

    async def op_topic(self, step: dict) -> None:
        name = unique("py-scn")
        admin = await self.client.admin()
        await admin.create_topic(name, step.get("partitions", 1))
        self.topics[step["as"]] = name

    async def op_produce(self, step: dict) -> None:
        producer = await self.client.producer()
        topic = self.topics[step["topic"]]

        deliveries = []

        async def send_all() -> None:
            for r in step["records"]:
                headers = [(n, value(v)) for n, v in r.get("headers", [])]
                d = await producer.send(
                    topic,
                    value(r["payload"]),
                    key=value(r.get("key")),
                    headers=headers or None,
                    idempotency_key=r.get("idempotency_key"),
                )
                deliveries.append(d)

        if "traceparent" in step:
            parent = TraceContextTextMapPropagator().extract({"traceparent": step["traceparent"]})
            with TRACER.start_as_current_span("scenario produce", context=parent):
                await send_all()
        else:
            await send_all()
        await producer.flush()
        await producer.close()
        if "expect_attempts" in step:
            attempts = [d.attempts for d in deliveries]
            assert attempts == step["expect_attempts"], f"Delivery.attempts {attempts}, expected {step['expect_attempts']}"
        if "expect_duplicate" in step:
            flags = [d.duplicate for d in deliveries]
            assert flags == step["expect_duplicate"], f"Delivery.duplicate {flags}, expected {step['expect_duplicate']}"

    async def op_transaction(self, step: dict) -> None:
        producer = await self.client.producer(transactional_id=unique("py-scn-tx"))
        topic = self.topics[step["topic"]]
        try:
            for records, end in ((step["commit"], "commit"), (step["abort"], "abort")):
                tx = await producer.begin()
                for r in records:
                    await tx.send(topic, value(r["payload"]), key=value(r.get("key")))
                await (tx.commit() if end == "commit" else tx.abort())
        finally:
            await producer.close()

    async def op_atomic_batch(self, step: dict) -> None:
        producer = await self.client.producer()
        topic = self.topics[step["topic"]]
        try:
            # Rust's Producer::send_atomic; the name the Python API would give it, next to
            # send_batch. Until the binding has it, every cell of this scenario fails here.
            send_atomic = getattr(producer, "send_atomic", None)
            assert send_atomic is not None, (
                "the Python binding has no Producer.send_atomic (Rust: Producer::send_atomic, "
                "JetStream atomic batches; issue #24 asks for them in Python)"
            )
            records = [onceflow.Record(topic, value(r["payload"])) for r in step["records"]]
            deliveries = await send_atomic(records)
            assert len(deliveries) == len(records), f"{len(deliveries)} deliveries for {len(records)} records"
        finally:
            await producer.close()

    async def op_inbox(self, step: dict) -> None:
        consumer = await self.client.consumer(unique("py-scn-g"), [self.topics[step["topic"]]], start="earliest")
        table = unique("scn_inbox").replace("-", "_")
        sql = {k: (v if isinstance(v, str) else v[self.store]).replace("{table}", table) for k, v in step["sql"].items()}
        key_header = step.get("key_header", "idempotency-key")
        calls: Dict[str, int] = collections.Counter()
        rows_seen: List[int] = []

        async def handler(m: onceflow.Message, tx) -> None:
            k = (m.header(key_header) or b"").decode()
            await tx.execute(sql["create"])
            rows = (await tx.query(sql["count"]))[0][0]
            await tx.execute(sql["insert"], [k, m.payload.decode()])
            calls[k] += 1
            rows_seen.append(rows)

        # Each cell its own namespace: keys are the inbox's per namespace, not per group, and
        # the PostgreSQL database is shared by every cell and run.
        config: Dict[str, Any] = {"poll_timeout": 0.05, "namespace": unique("scn-ns")}
        if "key_header" in step:
            config["key"] = f"header:{key_header}"
        inbox = onceflow.Inbox(consumer, handler, store_url(self.store, self.tmp), **config)
        want = step["expect_summary"]
        deadline = time.monotonic() + WAIT
        while True:
            await inbox.step()
            summary = inbox.summary()
            if all(summary[k] >= v for k, v in want.items()) or time.monotonic() > deadline:
                break
        await consumer.close()
        for k, v in want.items():
            assert summary[k] == v, f"inbox summary {k} = {summary[k]}, expected {v} ({summary})"
        assert dict(calls) == step["expect_calls"], f"handler calls {dict(calls)}, expected {step['expect_calls']}"
        assert rows_seen == step["expect_rows_seen"], f"rows seen by each call {rows_seen}, expected {step['expect_rows_seen']}"

    async def op_sleep(self, step: dict) -> None:
        await asyncio.sleep(step["ms"] / 1000.0)

    async def op_mark_time(self, step: dict) -> None:
        self.vars[step["as"]] = int(time.time() * 1000)

    async def op_consume(self, step: dict) -> None:
        start = subst(step.get("start", "earliest"), self.vars)
        consumer = await self.client.consumer(unique("py-scn-g"), [self.topics[step["topic"]]], start=start)
        want = len(step["expect"]) if "expect" in step else len(step["expect_payloads"])
        # Without a seek to follow, `quiet_ms` more after the last expected record: nothing more.
        got = await read(consumer, want, 0 if "seek" in step else step.get("quiet_ms", 0))
        if "expect" in step:
            actual = [
                (m.key, m.payload, [(n, v) for n, v in m.headers if n.lower() not in TRACE_HEADERS]) for m in got
            ]
            expected = [
                (value(r.get("key")), value(r["payload"]), [(n, value(v)) for n, v in r.get("headers", [])])
                for r in step["expect"]
            ]
            assert actual == expected, f"records read back:\n  {actual}\nexpected:\n  {expected}"
        else:
            check_payloads(got, step["expect_payloads"], "read")
        if "seek" in step:
            to = subst(step["seek"], self.vars)
            assignment = consumer.assignment()
            assert assignment, "no partition assigned after reading"
            for topic, partition in assignment:
                await consumer.seek(topic, partition, to)
            again = await read(consumer, len(step["expect_after_seek"]), step.get("quiet_ms", 0))
            check_payloads(again, step["expect_after_seek"], f"read after seek to {to}")
        await consumer.close()

    async def op_idempotent(self, step: dict) -> None:
        consumer = await self.client.consumer(unique("py-scn-g"), [self.topics[step["topic"]]], start="earliest")
        calls: Dict[str, int] = collections.Counter()
        delivery_counts: Dict[str, List[int]] = collections.defaultdict(list)
        fail_first = set(step.get("fail_first", []))
        seen_traces: List[Tuple[str, Optional[bytes]]] = []
        key_header = step.get("key_header", "idempotency-key")
        config = config_kwargs(step.get("config", {}))
        if "key_header" in step:
            config["key"] = f"header:{key_header}"

        async def handler(m: onceflow.Message) -> None:
            k = (m.header(key_header) or b"").decode()
            calls[k] += 1
            delivery_counts[k].append(m.delivery_count)
            if "expect_trace" in step:
                ctx = trace.get_current_span().get_span_context()
                seen_traces.append((format(ctx.trace_id, "032x"), m.header("traceparent")))
            if k in fail_first and calls[k] == 1:
                raise RuntimeError(f"scenario: the first delivery of {k} fails")

        engine = onceflow.IdempotentConsumer(consumer, handler, self.store_of(step), **config)
        run = asyncio.ensure_future(engine.run())
        expect_calls = step["expect_calls"]
        expect_metrics = step["expect_metrics"]

        def done() -> bool:
            if run.done():
                return True
            m = engine.metrics()
            return dict(calls) == expect_calls and all(m.get(k, 0) >= v for k, v in expect_metrics.items())

        try:
            await wait_until(done, f"handler calls {expect_calls} and metrics {expect_metrics}")
        finally:
            engine.stop()
            summary = await run
        assert dict(calls) == expect_calls, f"handler calls {dict(calls)}, expected {expect_calls}"
        metrics = summary["metrics"]
        for k, v in expect_metrics.items():
            assert metrics[k] == v, f"metrics[{k!r}] = {metrics[k]}, expected {v} (all: {metrics})"
        for k, want_counts in step.get("expect_delivery_counts", {}).items():
            assert delivery_counts[k] == want_counts, (
                f"delivery_count of {k} per handler call {delivery_counts[k]}, expected {want_counts}"
            )
        if "expect_trace" in step:
            want = step["expect_trace"]
            assert seen_traces, "the handler never ran"
            for trace_id, tp in seen_traces:
                assert trace_id == want["trace_id"], f"handler ran in trace {trace_id}, expected {want['trace_id']}"
                assert tp is not None, "the message carries no traceparent"
                parts = tp.decode().split("-")
                assert parts[1] == want["trace_id"], f"traceparent {tp!r}: another trace"
                assert parts[2] != want["not_span_id"], f"traceparent {tp!r} names the given span, not the producer's"

    async def op_pipeline(self, step: dict) -> None:
        tx = self.platform in step.get("transactional_producer", [])
        producer = await self.client.producer(transactional_id=unique("py-scn-tx") if tx else None)
        consumer = await self.client.consumer(unique("py-scn-g"), [self.topics[step["in"]]], start="earliest")
        out = self.topics[step["out"]]
        suffix = value(step["suffix"])

        def transform(m: onceflow.Message):
            return [onceflow.Record(out, m.payload + suffix)]

        pipeline = onceflow.Pipeline(consumer, producer, transform, self.store_of(step), poll_timeout=0.05)
        run = asyncio.ensure_future(pipeline.run())
        want = step["expect_processed"]
        try:
            await wait_until(
                lambda: run.done() or pipeline.metrics().get("processed", 0) >= want, f"{want} inputs processed"
            )
        finally:
            pipeline.stop()
            summary = await run
        await producer.close()
        assert summary["metrics"]["processed"] == want, f"processed {summary['metrics']}"
        expected = step["expect_guarantee"][self.platform]
        assert pipeline.guarantee == expected, f"Pipeline.guarantee {pipeline.guarantee!r}, expected {expected!r}"
        assert summary["guarantee"] == expected, f"run() guarantee {summary['guarantee']!r}, expected {expected!r}"

    async def op_lag(self, step: dict) -> None:
        consumer = await self.client.consumer(unique("py-scn-g"), [self.topics[step["topic"]]], start="earliest")
        taken: List[onceflow.Message] = []
        deadline = time.monotonic() + WAIT
        while len(taken) < step["read"]:
            assert time.monotonic() < deadline, f"read {len(taken)} of {step['read']}"
            taken.extend(await consumer.poll(step["read"] - len(taken), 0.2))
        await consumer.commit(taken)
        lags: List[Any] = []
        want = step["expect_messages"]
        deadline = time.monotonic() + WAIT
        previous = None
        while True:
            # The same figure twice in a row, 300 ms apart: not one seen while a commit lands.
            lags = await consumer.lag()
            total = sum(l.messages for l in lags)
            if total == want and previous == want:
                break
            previous = total
            assert time.monotonic() < deadline, f"lag {total} messages ({lags}), expected {want}"
            await asyncio.sleep(0.3)
        assignment = consumer.assignment()
        committed = await consumer.committed(assignment)
        assert len(committed) == len(assignment) and all(c.next is not None for c in committed), (
            f"committed({assignment}) = {committed}: a next position for every partition expected"
        )
        await consumer.close()
        if "expect_resume" in step:
            member = await self.client.consumer(consumer.group, [self.topics[step["topic"]]], start="committed")
            first = await read(member, 1, 0)
            await member.close()
            assert first and first[0].payload == value(step["expect_resume"]), (
                f"a new member of the group read {[m.payload for m in first]} first, expected {step['expect_resume']}"
            )


async def run_cell(name: str, scenario: dict, store: Optional[str], platform: str, tmp: str) -> Tuple[str, str]:
    """("PASS", "") or ("FAIL", why) or ("SKIP", why) (a missing broker without
    ONCEFLOW_REQUIRE_BROKERS=1)."""
    try:
        url = platform_url(platform)
        if store is not None:
            store_url(store, tmp)
        client = await onceflow.connect(url)
        await asyncio.wait_for(Cell(scenario, store, platform, client, tmp).run(), CELL_TIMEOUT)
        return "PASS", ""
    except MissingEnv as e:
        if os.environ.get("ONCEFLOW_REQUIRE_BROKERS") == "1":
            return "FAIL", f"{e} and ONCEFLOW_REQUIRE_BROKERS=1"
        return "SKIP", str(e)
    except asyncio.TimeoutError:
        return "FAIL", f"the cell took longer than {CELL_TIMEOUT}s"
    except Exception:  # noqa: BLE001 - every failure is the cell's result
        return "FAIL", traceback.format_exc()


async def run_all() -> Dict[Tuple[str, str], Tuple[str, str]]:
    tmp = tempfile.mkdtemp(prefix="onceflow-scenarios-")
    gate = asyncio.Semaphore(PARALLEL)
    results: Dict[Tuple[str, str], Tuple[str, str]] = {}
    out_dir = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "scenarios"
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []

    async def one(name, scenario, store, platform):
        async with gate:
            t0 = time.monotonic()
            status, why = await run_cell(name, scenario, store, platform, tmp)
        results[(name, platform)] = (status, why)
        if status != "SKIP":
            line = f"SCENARIO {name} {LANGUAGE} {platform} {status}"
            print(f"{line} ({time.monotonic() - t0:.1f}s)", flush=True)
            lines.append(line)

    await asyncio.gather(*(one(*c) for c in cells()))
    (out_dir / f"{LANGUAGE}.txt").write_text("".join(f"{l}\n" for l in sorted(lines)))
    return results


@pytest.fixture(scope="module")
def scenario_results():
    # Its own event loop: every cell runs concurrently in it, before any case reads a result.
    return asyncio.run(run_all())


@pytest.mark.parametrize("name,platform", [(c[0], c[3]) for c in cells()])
def test_scenario(scenario_results, name, platform):
    status, why = scenario_results[(name, platform)]
    if status == "SKIP":
        pytest.skip(why)
    assert status == "PASS", f"SCENARIO {name} {LANGUAGE} {platform} FAIL:\n{why}"
