"""`Producer.send` returns a native `SendFuture`: asyncio's Future protocol without an
`asyncio.Future` or a task per record. `await`, `asyncio.gather`, `asyncio.wait`,
`asyncio.wait_for`, done-callbacks, errors and cancellation, on memory and on the real
brokers."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import sys
import time

import pytest

import onceflow
from onceflow import _native

from conftest import drain

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SendFuture is the Unix send path")


async def test_await_resolves_to_the_delivery(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    fut = producer.send(topic, b"one")
    assert isinstance(fut, _native.SendFuture)
    assert asyncio.isfuture(fut)
    assert fut.get_loop() is asyncio.get_running_loop()
    d = await fut
    assert isinstance(d, onceflow.Delivery) and d.topic == topic
    assert fut.done() and not fut.cancelled()
    assert fut.result() is d or fut.result() == d
    assert fut.exception() is None
    # awaiting a finished future again gives the same result at once
    d2 = await fut
    assert (d2.topic, d2.partition, d2.position) == (d.topic, d.partition, d.position)
    consumer = await platform.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.payload == b"one" and m.position == d.position
    await consumer.close()
    await producer.close()


async def test_gather_and_wait_take_it_as_a_future(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    futs = [producer.send(topic, f"g{i}".encode()) for i in range(200)]
    deliveries = await asyncio.gather(*futs)
    assert len(deliveries) == 200 and all(isinstance(d, onceflow.Delivery) for d in deliveries)
    assert len({d.position for d in deliveries}) == 200
    # asyncio.wait, and gather(return_exceptions=True)
    more = [producer.send(topic, b"w") for _ in range(20)]
    done, pending = await asyncio.wait(more, timeout=30)
    assert len(done) == 20 and not pending
    assert all(f.exception() is None for f in done)
    got = await asyncio.gather(producer.send(topic, b"x"), producer.send("", b"bad"), return_exceptions=True)
    assert isinstance(got[0], onceflow.Delivery) and isinstance(got[1], onceflow.ConfigError)
    consumer = await platform.consumer(topic)
    msgs = await drain(consumer, 221)
    assert sorted(m.payload for m in msgs[:200]) == sorted(f"g{i}".encode() for i in range(200))
    await consumer.close()
    await producer.close()


async def test_wait_for_and_ensure_future(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    d = await asyncio.wait_for(producer.send(topic, b"in time"), timeout=30)
    assert isinstance(d, onceflow.Delivery)
    fut = producer.send(topic, b"ensured")
    assert asyncio.ensure_future(fut) is fut
    assert isinstance(await fut, onceflow.Delivery)
    # a task awaiting it
    task = asyncio.create_task(_await(producer.send(topic, b"task")))
    assert isinstance(await task, onceflow.Delivery)
    await producer.close()


async def _await(fut):
    return await fut


async def test_wait_for_timeout_cancels_the_future_but_not_the_send(kafka):
    """A send whose acknowledgement takes longer than the timeout: `wait_for` raises
    `TimeoutError` and cancels the future; the record is still delivered."""
    topic = await kafka.topic()
    # linger.ms keeps the record in librdkafka's queue for 2 s before it is sent
    producer = await kafka.client.producer(options={"linger.ms": "2000"})
    fut = producer.send(topic, b"late")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(fut, timeout=0.05)
    assert fut.cancelled() and fut.done()
    with pytest.raises(asyncio.CancelledError):
        fut.result()
    await producer.flush(30)
    consumer = await kafka.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.payload == b"late"
    await consumer.close()
    await producer.close()


async def test_cancelling_the_awaiting_task_cancels_only_the_result(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer(options={"linger.ms": "1000"})
    fut = producer.send(topic, b"kept")
    task = asyncio.create_task(_await(fut))
    await asyncio.sleep(0.05)
    assert not fut.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()
    assert fut.cancel() is False  # already done
    await producer.flush(30)
    consumer = await kafka.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.payload == b"kept"
    await consumer.close()
    await producer.close()


async def test_done_callbacks(platform):
    topic = await platform.topic()
    producer = await platform.client.producer()
    var = contextvars.ContextVar("var", default="unset")
    seen = []
    finished = asyncio.Event()

    def cb(f):
        seen.append((f.result().topic, var.get()))
        if len(seen) == 2:
            finished.set()

    def never(f):
        seen.append("removed callback ran")

    var.set("at-add")
    fut = producer.send(topic, b"cb")
    fut.add_done_callback(cb)
    if not fut.done():  # memory:// acknowledges at the call: its callbacks are scheduled at once
        fut.add_done_callback(never)
        fut.add_done_callback(never)
        assert fut.remove_done_callback(never) == 2
    ctx = contextvars.copy_context()
    ctx.run(var.set, "explicit")
    fut.add_done_callback(cb, context=ctx)
    var.set("later")
    await asyncio.wait_for(finished.wait(), 30)
    assert seen == [(topic, "at-add"), (topic, "explicit")]
    # added after it is done: scheduled on the loop, not called inline
    late = []
    fut.add_done_callback(late.append)
    assert late == []
    await asyncio.sleep(0)
    assert late == [fut]
    await producer.close()


async def test_callbacks_added_where_no_variable_is_set_each_start_from_none(platform):
    """Done-callbacks registered where no context variable is set run where none is set,
    and what one of them sets is seen neither by the next nor by the task."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    var = contextvars.ContextVar("var", default="unset")
    seen = []

    def setter(f):
        seen.append(var.get())
        var.set("set by a callback")

    async def body():
        assert len(contextvars.copy_context()) == 0
        futs = [producer.send(topic, b"x") for _ in range(3)]
        for f in futs:
            f.add_done_callback(setter)
            f.add_done_callback(setter)
        await asyncio.gather(*futs)
        await asyncio.sleep(0)
        assert var.get() == "unset"

    # A task made in an empty context runs in a copy of it: no variable set.
    await contextvars.Context().run(asyncio.ensure_future, body())
    assert seen == ["unset"] * 6
    await producer.close()


async def test_the_same_loop_run_nested_resolves_sends(platform):
    """A coroutine resumed by a send runs the same loop nested (as nest_asyncio's
    run_until_complete does, in Jupyter): the nested turns resolve its next send. The queue's
    reader once ran the resumed task inside its own handle, so the nested loop could not run
    the reader again ("cannot enter context") and spun."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    loop = asyncio.get_running_loop()
    await producer.send(topic, b"first")  # what follows runs where this send resumed the task
    fut = producer.send(topic, b"nested")
    errors = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        for _ in range(10_000):
            if fut.done():
                break
            loop._run_once()
    finally:
        loop.set_exception_handler(None)
    assert fut.done() and errors == []
    assert (await fut).topic == topic
    await producer.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_sends_not_awaited_when_the_loop_ends_leave_no_loop_behind():
    """A send not awaited when asyncio.run ends: its result is queued for a loop that is gone.
    The queue held the future, the future its loop, the loop its queue (through Rust, unseen by
    the cycle collector): every such run kept its loop and socket pair."""

    async def make():
        client = await onceflow.connect("memory://unawaited")
        return await client.producer()

    producer = asyncio.run(make())

    async def once():
        producer.send("t", b"x")  # not awaited

    async def awaited():
        await producer.send("t", b"last")

    def fds():
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(awaited())
    before = fds()
    for _ in range(100):
        asyncio.run(once())
    asyncio.run(awaited())
    time.sleep(0.5)  # the results of the sends not awaited reach their loops' queues
    assert fds() - before < 20


async def test_gather_over_sends_with_one_cancelled(platform):
    """asyncio.gather reads a cancelled child's error through `_make_cancelled_error`: without
    it, gather over sends with one cancelled never finished (nor wait_for around it)."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    futs = [producer.send(topic, b"g") for _ in range(3)]
    futs[1].cancel("not needed")
    results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30)
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[0].topic == topic and results[2].topic == topic
    futs = [producer.send(topic, b"g") for _ in range(3)]
    futs[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.gather(*futs), 30)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*[producer.send(topic, b"t") for _ in range(200)]), 0)
    await producer.flush(30)
    await producer.close()


async def test_a_raising_callback_goes_to_the_loop_exception_handler(memory):
    topic = await memory.topic()
    producer = await memory.client.producer()
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        fut = producer.send(topic, b"x")
        fut.add_done_callback(lambda f: 1 / 0)
        await fut
        await asyncio.sleep(0.01)
        assert len(reported) == 1 and isinstance(reported[0]["exception"], ZeroDivisionError)
    finally:
        loop.set_exception_handler(None)
    await producer.close()


async def test_errors_raise_the_onceflow_class(platform):
    producer = await platform.client.producer()
    # refused by validation at the call's first poll: a failed future, not an exception at the call
    fut = producer.send("", b"x")
    with pytest.raises(onceflow.ConfigError):
        await fut
    assert fut.done() and isinstance(fut.exception(), onceflow.ConfigError)
    with pytest.raises(onceflow.ConfigError):
        fut.result()
    # invalid arguments still raise at the call
    with pytest.raises(TypeError):
        producer.send("t", 42)
    await producer.close()


async def test_kafka_delivery_failure_raises(kafka):
    """A record for a partition the topic does not have fails on its delivery report."""
    topic = await kafka.topic(partitions=1)
    producer = await kafka.client.producer(options={"message.timeout.ms": "3000"})
    fut = producer.send(topic, b"nowhere", partition=7)
    with pytest.raises(onceflow.OnceflowError) as e:
        await fut
    assert isinstance(fut.exception(), onceflow.OnceflowError)
    assert e.value.kind
    await producer.close()


async def test_pending_state_and_manual_cancel(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer(options={"linger.ms": "1000"})
    fut = producer.send(topic, b"pending")
    assert not fut.done()
    with pytest.raises(asyncio.InvalidStateError):
        fut.result()
    with pytest.raises(asyncio.InvalidStateError):
        fut.exception()
    called = []
    fut.add_done_callback(called.append)
    removed = []
    fut.add_done_callback(removed.append)
    fut.add_done_callback(called.append)
    assert fut.remove_done_callback(removed.append) == 1
    assert fut.cancel("no longer needed") is True
    assert called == []  # scheduled, not inline
    await asyncio.sleep(0)
    assert called == [fut, fut] and removed == []
    with pytest.raises(asyncio.CancelledError, match="no longer needed"):
        await fut
    await producer.flush(30)
    consumer = await kafka.consumer(topic)
    [m] = await drain(consumer, 1)
    assert m.payload == b"pending"
    await consumer.close()
    await producer.close()


async def test_sends_and_send_nowaits_go_out_in_call_order(platform):
    """One producer's `send`s and `send_nowait`s reach the platform in call order (one
    background sender, batch after batch), `flush` waits for the `send`s as well, and every
    future resolves to its own record's position."""
    topic = await platform.topic()
    producer = await platform.client.producer()
    futs = {}
    for i in range(3000):
        payload = str(i).encode()
        if i % 3 == 2:
            producer.send_nowait(topic, payload)
        else:
            futs[i] = producer.send(topic, payload)
        if i % 500 == 0:
            await asyncio.sleep(0)  # let batches go while more records arrive
    await producer.flush(30)
    assert all(f.done() for f in futs.values())
    consumer = await platform.consumer(topic, start="earliest")
    got = await drain(consumer, 3000)
    assert [int(m.payload) for m in got] == list(range(3000))
    by_payload = {int(m.payload): m.position for m in got}
    for i, f in futs.items():
        assert f.result().position == by_payload[i]
    await consumer.close()
    await producer.close()


async def test_a_failed_send_does_not_fail_the_others_or_drain(kafka):
    """A record refused by the platform fails its own future only; the batch's other records
    are delivered and `flush` reports no `send_nowait` failure for it."""
    topic = await kafka.topic(partitions=1)
    producer = await kafka.client.producer(options={"message.timeout.ms": "3000"})
    ok1 = producer.send(topic, b"before")
    bad = producer.send(topic, b"nowhere", partition=7)
    ok2 = producer.send(topic, b"after")
    await producer.flush(30)
    assert (await ok1).topic == topic and (await ok2).topic == topic
    with pytest.raises(onceflow.OnceflowError):
        await bad
    await producer.close()


async def test_transaction_send_returns_a_send_future(kafka):
    topic = await kafka.topic()
    producer = await kafka.client.producer(transactional_id=f"tx-{topic}")
    async with producer.transaction() as tx:
        futs = [tx.send(topic, f"t{i}".encode()) for i in range(10)]
        assert all(isinstance(f, _native.SendFuture) for f in futs)
        ds = await asyncio.gather(*futs)
    assert len({d.position for d in ds}) == 10
    consumer = await kafka.consumer(topic)
    msgs = await drain(consumer, 10)
    assert sorted(m.payload for m in msgs) == sorted(f"t{i}".encode() for i in range(10))
    await consumer.close()
    await producer.close()


def test_sync_facade_send_waits_for_the_delivery():
    """The sync facade awaits the `SendFuture` on its own loop thread."""
    from onceflow import sync

    client = sync.connect("memory://sendfuture-sync")
    producer = client.producer()
    d = producer.send("t", b"sync")
    assert isinstance(d, onceflow.Delivery) and d.topic == "t"
    producer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
async def test_send_in_a_forked_child(memory):
    """A child process forked after sends on this loop sends on its own loop (its own waker
    and runtime: the parent's socket pair and threads are not the child's)."""
    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"parent")
    pid = os.fork()
    if pid == 0:  # child: a new loop and client, never pytest's
        code = 1
        try:

            async def child():
                c = await onceflow.connect("memory://forked-child")
                p = await c.producer()
                fut = p.send("t", b"child")
                assert isinstance(fut, _native.SendFuture)
                d = await asyncio.wait_for(fut, 10)
                assert d.topic == "t"
                await p.close()

            asyncio.run(child())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert (await producer.send(topic, b"parent again")).topic == topic
    await producer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
async def test_a_producer_from_before_fork_refuses_work_in_the_child(memory):
    """The child of a fork made while records are buffered gets `ClosedError` from the
    inherited producer at once (its client and send task stayed in the parent), instead of
    waiting forever; the parent's records are all delivered."""
    topic = await memory.topic()
    producer = await memory.client.producer()
    for i in range(20_000):
        producer.send_nowait(topic, b"%d" % i)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:

            async def child():
                for attempt in (
                    lambda: producer.send("t", b"x"),
                    lambda: producer.send_nowait("t", b"x"),
                    lambda: producer.send_batch([("t", b"x")]),
                    lambda: producer.flush(1),
                ):
                    try:
                        await attempt()
                    except onceflow.ClosedError as e:
                        assert "before os.fork()" in str(e)
                    else:
                        raise AssertionError("the inherited producer accepted work")

            asyncio.run(asyncio.wait_for(child(), 10))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    await producer.flush(30)
    await producer.close()


async def test_a_loop_run_nested_in_a_coroutine_gets_its_own_futures(memory):
    """A second loop run inside a coroutine of the first, with the running loop swapped as
    nest_asyncio and sync bridges do: `send` there belongs to the loop actually running (the
    first loop's `_thread_id` is still set while it waits for the nested run)."""
    import asyncio.events as events

    topic = await memory.topic()
    producer = await memory.client.producer()
    await producer.send(topic, b"outer")  # this thread last saw the outer loop

    async def inner():
        fut = producer.send(topic, b"inner")
        assert fut.get_loop() is asyncio.get_running_loop()
        return await fut

    outer = events._get_running_loop()
    nested = asyncio.new_event_loop()
    events._set_running_loop(None)
    try:
        d = nested.run_until_complete(inner())
    finally:
        events._set_running_loop(outer)
        nested.close()
    assert d.topic == topic
    await producer.close()


async def test_send_overridden_by_a_subclass_or_patched_on_the_class_is_the_one_called(memory):
    """`Producer.send` stays a method of the class: a subclass's override is what its
    instances call, and `mock.patch.object(onceflow.Producer, "send")` (a user's test double)
    intercepts `producer.send` (no instance attribute shadows either)."""
    from unittest import mock

    topic = await memory.topic()
    producer = await memory.client.producer()
    calls = []

    class Logged(onceflow.Producer):
        def send(self, topic, payload, **kw):
            calls.append(topic)
            return super().send(topic, payload, **kw)

    d = await Logged(producer.native).send(topic, b"through the subclass")
    assert d.topic == topic
    assert calls == [topic]

    with mock.patch.object(onceflow.Producer, "send", autospec=True) as patched:
        producer.send(topic, b"patched")
    assert patched.call_count == 1
    await producer.close()
