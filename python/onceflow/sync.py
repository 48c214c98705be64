"""Blocking facade over onceflow's asyncio API, for code without an event loop::

    from onceflow import sync as onceflow

    client = onceflow.connect("memory://quickstart")
    producer = client.producer()
    producer.send("orders", b"order #1", idempotency_key="order-1")

    consumer = client.consumer("billing", ["orders"])
    for message in consumer:
        print(message.payload)
        consumer.commit()
        break

Every call runs the asyncio API on one background event loop thread and waits for it
(waiting releases the GIL). Handlers given to ``IdempotentConsumer`` may be plain functions;
they run on that thread. The loop is created again in a child process after ``fork()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import (
    Committed,
    DedupStore,
    Delivery,
    Lag,
    Message,
    MessageBatch,
    Record,
)
from . import Client as _AsyncClient
from . import Consumer as _AsyncConsumer
from . import IdempotentConsumer as _AsyncIdempotentConsumer
from . import Inbox as _AsyncInbox
from . import StoredPosition
from . import Pipeline as _AsyncPipeline
from . import Producer as _AsyncProducer
from . import Transaction as _AsyncTransaction
from . import connect as _connect
from . import dedup_store as _dedup_store

__all__ = [
    "Client",
    "Consumer",
    "IdempotentConsumer",
    "Inbox",
    "InboxTransaction",
    "Pipeline",
    "Producer",
    "Record",
    "Transaction",
    "connect",
    "dedup_store",
    "idempotent",
]

_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            t = threading.Thread(target=loop.run_forever, name="onceflow-sync", daemon=True)
            t.start()
            _loop = loop
        return _loop


def _after_fork() -> None:
    global _loop, _lock
    _loop = None  # the parent's loop thread does not exist in the child
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _run(coro) -> Any:
    loop = _get_loop()
    if threading.current_thread().name == "onceflow-sync":
        coro.close()
        raise RuntimeError("onceflow.sync called from a handler running on its own loop: use the async API there")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def _awaited(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``call`` on the loop thread and awaits what it returns (for methods that return a
    future instead of a coroutine, such as ``send``)."""
    return await call(*args, **kwargs)


def connect(url: str, options: Optional[Mapping[str, Union[str, bool, int, float, datetime.timedelta]]] = None) -> "Client":
    """Connects to the platform named by the URL, ``options`` added to its query parameters
    (see ``onceflow.connect``)."""
    return Client(_run(_connect(url, options)))


def dedup_store(url: str, window: float = 86400.0) -> DedupStore:
    return _run(_dedup_store(url, window))


class Client:
    def __init__(self, inner: _AsyncClient):
        self._inner = inner

    @property
    def platform(self) -> str:
        return self._inner.platform

    def capabilities(self) -> Dict[str, bool]:
        return self._inner.capabilities()

    def producer(self, **kwargs: Any) -> "Producer":
        return Producer(_run(self._inner.producer(**kwargs)))

    def consumer(self, group: str, topics: Union[str, Sequence[str]], **kwargs: Any) -> "Consumer":
        return Consumer(_run(self._inner.consumer(group, topics, **kwargs)))


class Producer:
    def __init__(self, inner: _AsyncProducer):
        self._inner = inner

    @property
    def guarantee(self) -> str:
        return self._inner.guarantee

    def send(self, topic: str, payload: Any, **kwargs: Any) -> Delivery:
        return _run(_awaited(self._inner.send, topic, payload, **kwargs))

    def send_nowait(self, topic: str, payload: Any, **kwargs: Any) -> None:
        """See ``onceflow.Producer.send_nowait``: no waiting; ``flush()`` reports failures."""
        self._inner.send_nowait(topic, payload, **kwargs)

    def send_batch(self, records: Iterable[Union[Record, tuple]]) -> Sequence[Delivery]:
        return _run(self._inner.send_batch(records))

    @contextlib.contextmanager
    def transaction(self) -> Iterator["Transaction"]:
        """``with producer.transaction() as tx:`` commits on normal exit, aborts when the
        block raises. After an abort (or a failed commit), call
        ``consumer.rewind_uncommitted(consumer.assignment())`` before reading on."""
        tx = Transaction(_run(self._inner.begin()))
        try:
            yield tx
        except BaseException:
            tx.abort()
            raise
        else:
            if not tx._inner.finished:
                tx.commit()

    def flush(self, timeout: float = 30.0) -> None:
        _run(self._inner.flush(timeout))

    def close(self) -> None:
        _run(self._inner.close())


class Transaction:
    """An open transaction (see ``onceflow.Transaction``). After ``abort()`` (or a
    ``commit()`` that raised), call ``consumer.rewind_uncommitted(consumer.assignment())``
    before reading on, so that the transaction's inputs are given out again."""

    def __init__(self, inner: _AsyncTransaction):
        self._inner = inner

    def send(self, topic: str, payload: Any, **kwargs: Any) -> Delivery:
        return _run(_awaited(self._inner.send, topic, payload, **kwargs))

    def send_batch(self, records: Iterable[Union[Record, tuple]]) -> Sequence[Delivery]:
        return _run(self._inner.send_batch(records))

    def commit_offsets(self, consumer: "Consumer", messages: Optional[Iterable[Any]] = None) -> None:
        """Commits ``consumer``'s positions with the transaction (see the asyncio
        ``Transaction.commit_offsets``); a ``consumer`` that is not a ``onceflow.sync.Consumer``
        raises ``TypeError``."""
        if not isinstance(consumer, Consumer):
            raise TypeError(
                f"commit_offsets(consumer=...): expected the onceflow.sync.Consumer whose "
                f"messages the transaction commits, got {type(consumer).__name__} {consumer!r:.60}"
            )
        _run(self._inner.commit_offsets(consumer._inner, messages))

    def commit(self) -> None:
        _run(self._inner.commit())

    def abort(self) -> None:
        """Aborts; then call ``consumer.rewind_uncommitted(consumer.assignment())`` before
        reading on."""
        _run(self._inner.abort())


class Consumer:
    """``for message in consumer`` pulls batches and yields their messages."""

    def __init__(self, inner: _AsyncConsumer):
        self._inner = inner

    @property
    def group(self) -> str:
        return self._inner.group

    def poll(self, max: Optional[int] = None, timeout: Optional[float] = None) -> MessageBatch:
        return _run(self._inner.poll(max, timeout))

    def __iter__(self) -> Iterator[Message]:
        inner = self._inner
        while True:
            batch = inner._rest()
            if batch is None:
                batch = _run(inner._fetch())
                if not batch:
                    continue
            for i in range(inner._handed_out or 0, len(batch)):
                inner._handed_out = i + 1
                yield batch[i]

    def commit(self, messages: Union[None, Message, Iterable[Any]] = None) -> None:
        """Commits processed messages (the last per partition), or the last yielded; see
        ``onceflow.Consumer.commit`` (a ``Committed`` raises ``ConfigError``)."""
        _run(self._inner.commit(messages))

    def committed(self, partitions: Sequence[Tuple[str, int]]) -> List[Committed]:
        """The group's ``Committed(topic, partition, next)`` of each partition: ``next`` is the
        next position to read, not one to pass to ``commit()``; see
        ``onceflow.Consumer.committed``."""
        return _run(self._inner.committed(partitions))

    def seek(self, topic: str, partition: int, to: str) -> None:
        _run(self._inner.seek(topic, partition, to))

    def rewind_uncommitted(self, partitions: Sequence[Tuple[str, int]]) -> List[Tuple[str, int]]:
        """After an aborted transaction, gives out again what was polled and not committed,
        keeping every acknowledgement; returns the partitions with nothing committed. Call it
        after every ``Transaction.abort()`` before reading on. ``TypeError`` naming
        ``partitions`` for a value of another type; see
        ``onceflow.Consumer.rewind_uncommitted`` for the rest."""
        return _run(self._inner.rewind_uncommitted(partitions))

    def assignment(self) -> List[Tuple[str, int]]:
        """Partitions assigned to this member now; empty until a ``poll()`` has joined the
        group (see :meth:`onceflow.Consumer.assignment`)."""
        return self._inner.assignment()

    def lag(self) -> List[Lag]:
        return _run(self._inner.lag())

    def close(self) -> None:
        _run(self._inner.close())


class _SyncEngine:
    _inner: Any

    def run(self) -> Dict[str, Any]:
        """Blocks until ``stop()`` (from a handler or another thread) or an error."""
        return _run(self._inner.run())

    def stop(self) -> None:
        loop = _get_loop()
        loop.call_soon_threadsafe(self._inner.stop)

    def metrics(self) -> Dict[str, int]:
        return self._inner.metrics()


class IdempotentConsumer(_SyncEngine):
    """See ``onceflow.IdempotentConsumer``; ``handler`` may be a plain function."""

    def __init__(self, consumer: Consumer, handler: Callable[[Message], Any], store: Union[None, str, DedupStore] = None, **kwargs: Any):
        self._inner = _AsyncIdempotentConsumer(consumer._inner, handler, store, **kwargs)


def idempotent(consumer: Consumer, store: Union[None, str, DedupStore] = None, **kwargs: Any):
    def wrap(handler: Callable[[Message], Any]) -> IdempotentConsumer:
        return IdempotentConsumer(consumer, handler, store, **kwargs)

    return wrap


class Pipeline(_SyncEngine):
    """See ``onceflow.Pipeline``."""

    def __init__(self, consumer: Consumer, producer: Producer, transform: Callable[[Message], Any], store: Union[None, str, DedupStore] = None, **kwargs: Any):
        self._inner = _AsyncPipeline(consumer._inner, producer._inner, transform, store, **kwargs)


class InboxTransaction:
    """The sync view of an inbox handler's database transaction (see
    ``onceflow.InboxTransaction``): the same calls, blocking. Usable only while the handler
    runs; afterwards every call raises ``ClosedError``."""

    def __init__(self, native: Any):
        self._native = native

    @property
    def store(self) -> str:
        """``"postgres"`` (placeholders ``$1, $2, ...``) or ``"embedded"`` (``?``)."""
        return self._native.store

    def execute(self, sql: str, params: Optional[Sequence[Any]] = None) -> int:
        """Runs one statement in the message's transaction; returns the rows it changed."""
        return self._native.execute_blocking(sql, params)

    def query(self, sql: str, params: Optional[Sequence[Any]] = None, *, as_dicts: bool = False) -> List[Any]:
        """Runs one query in the message's transaction; returns a list of tuples (dicts keyed
        by column with ``as_dicts=True``)."""
        return self._native.query_blocking(sql, params, as_dicts=as_dicts)


class Inbox:
    """See ``onceflow.Inbox``: ``handler(message, tx)`` is a plain function and ``tx`` an
    ``onceflow.sync.InboxTransaction`` whose ``execute`` / ``query`` block. The handler runs on
    the sync API's loop thread."""

    def __init__(self, consumer: Consumer, handler: Callable[[Message, InboxTransaction], Any], store: Union[str, "os.PathLike[str]"], **kwargs: Any):
        self._inner = _AsyncInbox(consumer._inner, handler, store, **kwargs)
        self._inner._wrap_tx = InboxTransaction

    def open(self) -> "Inbox":
        """Opens the store and builds the inbox now."""
        _run(self._inner.open())
        return self

    @property
    def store(self) -> Optional[str]:
        return self._inner.store

    @property
    def namespace(self) -> Optional[str]:
        return self._inner.namespace

    def run(self) -> Dict[str, int]:
        """Blocks until ``stop()`` (from the handler or another thread) or an error; returns the
        summary."""
        return _run(self._inner.run())

    def step(self) -> int:
        """Polls once and handles what came; returns how many messages were polled."""
        return _run(self._inner.step())

    def stop(self) -> None:
        loop = _get_loop()
        loop.call_soon_threadsafe(self._inner.stop)

    def summary(self) -> Dict[str, int]:
        return self._inner.summary()

    def stored_positions(self) -> List[StoredPosition]:
        return _run(self._inner.stored_positions())
