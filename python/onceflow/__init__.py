"""onceflow: one API for an idempotent consumer and a transactional producer over Kafka,
NATS JetStream, Pulsar and Kinesis; a URL picks the platform.

Asyncio first; ``onceflow.sync`` is a blocking facade over the same objects::

    import asyncio, onceflow

    async def main():
        client = await onceflow.connect("memory://quickstart")
        producer = await client.producer()
        await producer.send("orders", b"order #1", key=b"customer-7", idempotency_key="order-1")

        consumer = await client.consumer("billing", ["orders"])

        @onceflow.idempotent(consumer, store="memory://")
        async def bill(message: onceflow.Message) -> None:
            print("charging for", message.payload)
            bill.stop()

        await bill.run()

    asyncio.run(main())

The engine (dedup, retries, commits, transactions) is the Rust crate's; this package converts
types and errors, and propagates OpenTelemetry context when ``opentelemetry-api`` is
installed.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import datetime
import functools
import inspect
import os
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    Union,
)

from . import _native, _otel

# Whether OpenTelemetry is installed (fixed at import): one global read on `send`'s fast path.
_OTEL = _otel.ENABLED
from ._native import (
    AbortedError,
    AuthError,
    ClosedError,
    ConfigError,
    ConflictError,
    ConnectError,
    DedupStore,
    DedupStoreError,
    Deliveries,
    Delivery,
    FencedError,
    HandlerError,
    Lag,
    Message,
    MessageBatch,
    NativeError,
    NotFoundError,
    OnceflowError,
    PlatformError,
    SerializationError,
    TimeoutError,
    UnsupportedError,
    supported_schemes,
)

__version__: str = _native.__version__

# Raw client options: values are text for the native client; a bool goes as "true" / "false",
# an int or float as its decimal, a timedelta (for a key ending in "_ms") as whole milliseconds.
_Options = Mapping[str, Union[str, bool, int, float, datetime.timedelta]]

# Stop the tokio runtime before the interpreter tears down, so no worker thread touches it.
atexit.register(_native._shutdown)

__all__ = [
    "AbortedError",
    "AuthError",
    "Client",
    "ClosedError",
    "Committed",
    "ConfigError",
    "ConflictError",
    "ConnectError",
    "Consumer",
    "DedupStore",
    "DedupStoreError",
    "Deliveries",
    "Delivery",
    "FencedError",
    "HandlerError",
    "IdempotentConsumer",
    "Inbox",
    "InboxTransaction",
    "Lag",
    "Message",
    "MessageBatch",
    "NativeError",
    "NotFoundError",
    "OnceflowError",
    "Pipeline",
    "PlatformError",
    "Producer",
    "Record",
    "SendError",
    "SerializationError",
    "StoredPosition",
    "TimeoutError",
    "TopicDescription",
    "Transaction",
    "UnsupportedError",
    "connect",
    "context_of",
    "dedup_store",
    "error_class",
    "idempotent",
    "supported_schemes",
]

HeaderValue = Union[bytes, str, None]
Headers = Union[None, Dict[str, HeaderValue], Sequence[Tuple[str, HeaderValue]]]
Payload = Union[bytes, bytearray, memoryview, str]


class Record(NamedTuple):
    """A record to send (a tuple, so batches cross into Rust without per-field lookups)."""

    topic: str
    payload: Payload
    key: Optional[Payload] = None
    headers: Headers = None
    partition: Optional[int] = None
    timestamp: Optional[int] = None
    idempotency_key: Optional[str] = None
    #: Requeue a processed job on purpose: generation ``n`` (an int from 0 to 4294967295) of
    #: its idempotency key (see ``Producer.send``).
    requeue: int = 0


class Committed(NamedTuple):
    """A consumer group's committed position in one partition, as ``Consumer.committed()``
    returns it: ``next`` is the position the group reads next (one past the last processed
    message, as Kafka's committed offset), or ``None`` where the group has committed nothing.

    It is not what ``Consumer.commit()`` takes: ``commit()`` takes processed messages (or
    their ``(topic, partition, position)``), the *last processed* one per partition, and
    refuses a ``Committed`` with a ``ConfigError`` (passing ``next`` back would skip the
    message at it). Unpacking works as for a tuple: ``topic, partition, next = c``."""

    topic: str
    partition: int
    #: The next position the group reads (e.g. ``"offset:42"``), or ``None``.
    next: Optional[str]


class TopicDescription(TypedDict):
    """What ``Admin.describe_topic`` returns (every key is present).

    ``retention_ms`` / ``retention_bytes``: ``None`` when not set. ``options``: every setting
    the platform reports, as text. The durability fields are read from them where the
    platform reports them (JetStream), and are ``None`` elsewhere:

    - ``storage``: ``"file"`` or ``"memory"`` (a memory stream loses its messages when the
      server restarts);
    - ``replicas``: the stream's replica count;
    - ``sync``: the server's ``sync_interval``: ``"always"``, ``"N ms"``, or ``"unknown"``
      where this client cannot read it (only a system-account user can);
    - ``durable_on_ack``: ``True`` when an acknowledged write is synced to disk (file storage,
      ``sync_interval: always``), ``False`` when it is not (memory storage, or an interval),
      ``None`` when it cannot be told.

    With the connection option ``require_durable=True`` (``connect(url, {"require_durable":
    True})`` or ``?require_durable=true``), the native client warns once about a JetStream
    topic whose ``durable_on_ack`` is not ``True`` when first used, in its Rust ``tracing``
    log, which this package does not forward to ``logging`` yet: read ``durable_on_ack`` here
    to act on it."""

    name: str
    partitions: int
    retention_ms: Optional[int]
    retention_bytes: Optional[int]
    compacted: bool
    options: Dict[str, str]
    storage: Optional[str]
    replicas: Optional[int]
    sync: Optional[str]
    durable_on_ack: Optional[bool]


_CLASSES: Dict[str, type] = {code: getattr(_native, cls) for _kind, code, cls in _native.error_kinds()}


def error_class(code: str) -> type:
    """The exception class of an error code such as ``"ONCEFLOW_FENCED"``."""
    return _CLASSES[code]


class SendError(OnceflowError):
    """Some records of a batch failed: ``.results`` holds, per record in order, its
    ``Delivery`` or its exception; ``__cause__`` is the first failure."""

    kind = "batch"
    code = "ONCEFLOW_BATCH"

    def __init__(self, results: List[Union[Delivery, BaseException]]):
        failed = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(failed)} of {len(results)} records failed; first: {failed[0]}")
        self.results = results
        self.retriable = all(getattr(e, "retriable", False) for e in failed)


def _check(results: Sequence[Union[Delivery, BaseException]]) -> Sequence[Delivery]:
    if isinstance(results, Deliveries):
        if results.failed():
            raise SendError(list(results)) from results.first_error()
        return results
    for r in results:
        if isinstance(r, BaseException):
            err = SendError(results)
            raise err from r
    return results  # type: ignore[return-value]


def _with_trace(records: List[Record], trace_headers) -> List[Record]:
    return [r._replace(headers=_otel.merge(r.headers, trace_headers)) for r in records]


def _as_records(records: Iterable[Union[Record, tuple]]) -> List[Record]:
    """Records from ``records``: ``Record``s or ``(topic, payload, ...)`` tuples; one ``Record``
    alone (a transform's single output) is a list of one. Anything else raises ``TypeError``
    naming it."""
    if isinstance(records, Record):
        return [records]
    out = []
    for r in records:
        if isinstance(r, Record):
            out.append(r)
        elif isinstance(r, (tuple, list)):
            out.append(Record(*r))
        else:
            raise TypeError(
                f"expected a list of Records (or (topic, payload, ...) tuples), got an item "
                f"{type(r).__name__} {r!r:.60}"
            )
    return out


async def connect(url: str, options: Optional[_Options] = None) -> "Client":
    """Connects to the platform named by the URL: ``memory://NAME``, ``kafka://HOST:PORT``,
    ``nats://HOST:PORT`` (``tls://`` for NATS over TLS), ``pulsar://`` / ``pulsar+ssl://``,
    ``kinesis://``.

    ``options`` are added to the URL's query parameters, so credentials can stay out of the
    URL string: for Kafka they are librdkafka properties, e.g.
    ``{"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": user, "sasl.password": password}``. A value is a ``str``, a ``bool``
    (sent as ``"true"`` / ``"false"``) or a number (``500`` as ``"500"``, ``0.5`` as
    ``"0.5"``); another type (``None``, a list, a dict) raises ``TypeError`` naming the key
    and the type, never the value.

    Raises ``ConfigError`` for an unknown scheme, a malformed option or a NaN / infinite one, ``UnsupportedError``
    for a platform not compiled in, ``ConnectError`` when it cannot be reached, ``AuthError``
    when the server refuses the credentials or the TLS certificate (never showing the
    secret)."""
    return Client(await _native.connect(url, dict(options) if options is not None else None))


async def dedup_store(url: str, window: float = 86400.0) -> DedupStore:
    """Opens a dedup store: ``memory://`` or a file path (embedded, survives restarts).
    Completed keys are remembered for ``window`` seconds."""
    return await _native.dedup_store(url, window)


def context_of(message: Message):
    """The OpenTelemetry context ``message`` carries (``None`` without ``opentelemetry-api``)."""
    return _otel.context_of(message)


class Client:
    """A connected platform."""

    def __init__(self, native: _native.Client):
        self._native = native

    @property
    def platform(self) -> str:
        return self._native.platform

    def capabilities(self) -> Dict[str, bool]:
        return self._native.capabilities()

    async def producer(
        self,
        *,
        transactional_id: Optional[str] = None,
        client_id: Optional[str] = None,
        idempotent: Optional[bool] = None,
        options: Optional[_Options] = None,
    ) -> "Producer":
        """A producer; ``transactional_id`` enables ``transaction()``; ``options`` go to the
        native client (librdkafka properties, for example), each value a ``str``, ``bool``
        or number as for ``connect``."""
        native = await self._native.producer(
            transactional_id=transactional_id, client_id=client_id, idempotent=idempotent, options=options
        )
        return Producer(native)

    async def consumer(
        self,
        group: str,
        topics: Union[str, Sequence[str]],
        *,
        start: str = "committed",
        isolation: str = "read_committed",
        client_id: Optional[str] = None,
        session_timeout: Optional[float] = None,
        options: Optional[_Options] = None,
        batch_size: int = 500,
        poll_timeout: float = 1.0,
    ) -> "Consumer":
        """A consumer of ``group`` on ``topics``. ``start``: ``committed`` (else earliest),
        ``committed-or-latest``, ``earliest``, ``latest``, ``timestamp:MS`` or a position.
        ``options`` go to the native client, each value a ``str``, ``bool`` or number as for
        ``connect``; an option in milliseconds (a key ending in ``_ms``) also takes a
        ``datetime.timedelta`` (whole milliseconds). An unknown key raises ``ConfigError``
        naming it and the keys expected.

        JetStream consumer options (the durable's settings; reopening a group with other ones
        updates the durable where the server allows, else raises ``ConfigError`` naming each):

        - ``ack_wait_ms`` (default 30000): a delivered message not acked for this long is
          redelivered. A handler may run longer: every message delivered and not yet acked is
          signalled in progress within four fifths of it, so it is not redelivered (give
          ``session_timeout`` above your longest batch of handler calls);
        - ``max_deliver`` (default -1, unlimited), ``max_ack_pending``, ``backoff_ms``
          (comma-separated ms);
        - ``idle_heartbeat_ms`` (0: none, else at least 10): the server's heartbeat on an idle
          pull request, so a pull request lost with a restarting server is made again sooner;
        - ``pull_expires_ms`` (at least 100, default 500): how long one pull request waits;
        - ``reset`` (default ``False``): with an explicit ``start`` (``earliest``, ``latest``,
          a position or a timestamp), deletes the group's existing durables and starts over at
          ``start`` (the group's progress is forgotten; give it to one run only). Without it
          an existing durable resumes at its ack floor whatever ``start`` says, as Kafka's
          ``auto.offset.reset`` applies only to a group without committed offsets."""
        if isinstance(topics, str):
            topics = [topics]
        native = await self._native.consumer(
            group,
            list(topics),
            start=start,
            isolation=isolation,
            client_id=client_id,
            session_timeout=session_timeout,
            options=options,
        )
        return Consumer(native, batch_size=batch_size, poll_timeout=poll_timeout)

    async def admin(self) -> _native.Admin:
        """Topic administration: ``create_topic``, ``describe_topic`` (a
        ``TopicDescription``, with JetStream's durability report), ``delete_topic``."""
        return await self._native.admin()

    def __repr__(self) -> str:
        return f"Client(platform={self.platform!r})"


class Producer:
    """Sends records; ``transaction()`` for atomic writes with consumer positions.

    A producer belongs to the process that created it. After ``os.fork()`` the child connects
    and creates its own: the inherited one raises ``ClosedError`` from ``send``,
    ``send_nowait``, ``send_batch``, ``flush``, ``close`` and ``begin``, because its platform
    client and its send task stayed in the parent."""

    def __init__(self, native: _native.Producer):
        self._native = native

    @property
    def native(self) -> _native.Producer:
        return self._native

    @property
    def platform(self) -> str:
        return self._native.platform

    @property
    def guarantee(self) -> str:
        return self._native.guarantee

    def send(
        self,
        topic: str,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        headers: Headers = None,
        partition: Optional[int] = None,
        timestamp: Optional[int] = None,
        idempotency_key: Optional[str] = None,
        requeue: int = 0,
    ) -> "_native.SendFuture[Delivery]":
        """Sends one record: hands it at once to the producer's background sender, which
        passes it to the platform client (for Kafka, librdkafka's queue) together with the
        records handed over around it, ``send`` and ``send_nowait`` alike, in call order, in
        batches (the next one handed over while the previous one's acknowledgements are
        outstanding; the Python thread only converts the arguments). Returns a
        ``SendFuture`` resolved with its ``Delivery`` when the platform acknowledges it, or
        failing with the ``OnceflowError`` of the send. A ``SendFuture``
        is asyncio-compatible without being an ``asyncio.Future``: ``await`` it, keep many in
        flight and ``asyncio.gather`` / ``asyncio.wait`` them, give it a timeout with
        ``asyncio.wait_for``, or ``add_done_callback`` (no task and no ``asyncio.Future`` per
        record). Cancelling it (or a timeout) drops the result only: the record is sent
        anyway. ``flush()`` and ``close()`` wait for it too. Call it on the event loop's thread (from a
        coroutine or a loop callback); invalid arguments raise at the call, a record the
        platform refuses fails the future. It is not a coroutine: ``asyncio.ensure_future``
        returns it as is, ``asyncio.create_task`` does not take it (and needs not).

        ``requeue=n`` (an int from 0 to 4294967295) requeues a job already processed, on
        purpose: generation ``n`` of its ``idempotency_key`` (required), written to the
        ``onceflow-key-generation`` header. The platform message id becomes
        ``{key}#requeue-{n}`` (JetStream's duplicate window drops only repeats of it) and
        the idempotent consumer's dedup key gets the same suffix, so the handler runs once
        more; sending generation ``n`` twice is deduplicated like any repeat. ``0`` (the
        default) sends the record as it is."""
        if (
            key is None
            and headers is None
            and partition is None
            and timestamp is None
            and idempotency_key is None
            and not requeue
            and not _OTEL
        ):
            return self._native.send(topic, payload)  # no keyword dict to build and parse
        return _send(self._native, self.platform, topic, payload, key, headers, partition, timestamp, idempotency_key, requeue)

    async def send_batch(self, records: Iterable[Union[Record, tuple]]) -> Sequence[Delivery]:
        """Sends records pipelined (one boundary crossing for the batch); returns their
        ``Delivery``s in order as ``Deliveries``, a sequence whose items are made when read
        (an empty list for no records).
        Raises ``SendError`` (with ``.results``) if any record failed; the others were sent."""
        return _check(await _send_batch(self._native, self.platform, records))

    async def send_atomic(self, records: Iterable[Union[Record, tuple]]) -> List[Delivery]:
        """Writes every record or none, as one atomic batch; returns their ``Delivery``s in
        order. Platforms with an atomic multi-record write outside transactions: JetStream
        (atomic batch publish, ADR-50, nats-server 2.12 or later, on a stream that allows it)
        and ``memory://``. Raises ``UnsupportedError`` elsewhere (on Kafka write the records in
        a ``transaction()``), and the batch's error when the platform refused it: then none of
        it was written."""
        return await _send_batch(self._native, self.platform, records, atomic=True)

    async def send_batch_results(self, records: Iterable[Union[Record, tuple]]) -> Sequence[Union[Delivery, OnceflowError]]:
        """Like ``send_batch`` but returns each record's ``Delivery`` or exception (a
        ``Deliveries`` sequence; ``failed()`` counts the exceptions)."""
        return await _send_batch(self._native, self.platform, records)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator["Transaction"]:
        """``async with producer.transaction() as tx:`` commits on normal exit, aborts when
        the block raises. Needs a producer made with a ``transactional_id``.

        After an abort (the block raised, or the commit failed), call
        ``consumer.rewind_uncommitted(consumer.assignment())`` before reading on: the
        transaction's inputs were acknowledged only inside it, and they come again only
        through that call (``Pipeline`` does it itself)."""
        tx = Transaction(await self._native.begin(), self.platform)
        try:
            yield tx
        except BaseException as exc:
            try:
                await tx.abort()
            except Exception as abort_error:  # the block's own exception is the one to raise
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"onceflow: aborting the transaction failed too: {abort_error!r}")
            raise
        else:
            if not tx.finished:
                await tx.commit()

    async def begin(self) -> "Transaction":
        """Starts a transaction explicitly (prefer ``transaction()``)."""
        return Transaction(await self._native.begin(), self.platform)

    def send_nowait(
        self,
        topic: str,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        headers: Headers = None,
        partition: Optional[int] = None,
        timestamp: Optional[int] = None,
        idempotency_key: Optional[str] = None,
        requeue: int = 0,
    ) -> None:
        """Hands one record over and returns at once, without an awaitable (the cheap path for
        many single records, like confluent-kafka's ``produce``). The record is buffered and
        sent, in call order, together with the records handed over around it, by a background
        task: one ``send_batch`` of everything buffered at a time, the next one with what was
        buffered while it ran. Nothing reports its delivery: ``flush()`` (and
        ``close()``) wait for every record handed over and raise ``SendError`` whose
        ``.results`` are the exceptions of the records that failed. Invalid arguments raise at
        the call. Use ``send`` when each record's ``Delivery`` is needed. With OpenTelemetry
        installed the current trace context is injected and the send span covers the
        hand-over only."""
        if _otel.ENABLED:
            span, trace_headers = _otel.start_send(topic, self.platform, headers=headers, body_size=_otel.body_size(payload))
            if trace_headers is not None:
                headers = _otel.merge(headers, trace_headers)
            try:
                self._native.send_nowait(
                    topic, payload, key=key, headers=headers, partition=partition, timestamp=timestamp, idempotency_key=idempotency_key, requeue=requeue
                )
            except BaseException as e:
                _otel.end_send(span, error=e)
                raise
            _otel.end_send(span)
            return
        if key is None and headers is None and partition is None and timestamp is None and idempotency_key is None and not requeue:
            self._native.send_nowait(topic, payload)  # no keyword dict to build and parse
            return
        self._native.send_nowait(
            topic, payload, key=key, headers=headers, partition=partition, timestamp=timestamp, idempotency_key=idempotency_key, requeue=requeue
        )

    async def flush(self, timeout: float = 30.0) -> None:
        """Waits, at most ``timeout`` seconds, until everything sent is acknowledged. Raises
        ``SendError`` (``.results``: the exceptions) when records given to ``send_nowait``
        since the last ``flush`` failed, ``TimeoutError`` when records are still in flight."""
        failures = await self._native.drain(timeout)
        await self._native.flush(timeout)
        _raise_failures(failures)

    async def close(self) -> None:
        """Waits for the records given to ``send_nowait`` (at most 30 s), flushes and releases
        the producer; raises ``SendError`` afterwards if some of them failed."""
        try:
            failures = await self._native.drain(30.0)
        finally:
            await self._native.close()
        _raise_failures(failures)

    async def __aenter__(self) -> "Producer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _send(native, platform, topic, payload, key, headers, partition, timestamp, idempotency_key, requeue=0) -> "_native.SendFuture[Delivery]":
    if _otel.ENABLED:
        span, trace_headers = _otel.start_send(topic, platform, headers=headers, body_size=_otel.body_size(payload))
        if trace_headers is not None:
            try:
                fut = native.send(
                    topic,
                    payload,
                    key=key,
                    headers=_otel.merge(headers, trace_headers),
                    partition=partition,
                    timestamp=timestamp,
                    idempotency_key=idempotency_key,
                    requeue=requeue,
                )
            except BaseException as e:
                _otel.end_send(span, error=e)
                raise
            fut.add_done_callback(functools.partial(_end_send_span, span))
            return fut
    if key is None and headers is None and partition is None and timestamp is None and idempotency_key is None and not requeue:
        return native.send(topic, payload)  # no keyword dict to build and parse
    return native.send(
        topic, payload, key=key, headers=headers, partition=partition, timestamp=timestamp, idempotency_key=idempotency_key, requeue=requeue
    )


def _raise_failures(failures: List[BaseException]) -> None:
    if failures:
        raise SendError(failures) from failures[0]


def _end_send_span(span, fut: "_native.SendFuture[Delivery]") -> None:
    if fut.cancelled():
        _otel.end_send(span, error=asyncio.CancelledError())
    elif fut.exception() is not None:
        _otel.end_send(span, error=fut.exception())
    else:
        _otel.end_send(span, delivery=fut.result())


async def _send_batch(native, platform, records, atomic: bool = False):
    if not isinstance(records, list):
        records = list(records)
    if not records:
        return []
    span, trace_headers = (None, None)
    if _otel.ENABLED:
        records = _as_records(records)
        if _otel.same_trace_headers(records):
            span, trace_headers = _otel.start_send(
                records[0].topic, platform, len(records), records[0].headers, body_size=_otel.body_size(records[0].payload) if len(records) == 1 else None
            )
            if trace_headers is not None:
                records = _with_trace(records, trace_headers)
    try:
        results = await (native.send_atomic(records) if atomic else native.send_batch(records))
    except BaseException as e:
        _otel.end_send(span, error=e)
        raise
    if span is not None:
        _otel.end_send(span, error=None if atomic else results.first_error())
    return results


def _shown(v: Any) -> str:
    """``repr(v)`` cut to 80 characters (bad input is echoed, never in full)."""
    r = repr(v)
    return r if len(r) <= 80 else f"{r[:80]}…({len(r)} characters)"


def _positions(messages: Iterable[Any]) -> List[Tuple[str, int, str]]:
    """The last position per partition of messages (or ``(topic, partition, position)``)."""
    if isinstance(messages, MessageBatch):
        return messages.last_positions()
    if isinstance(messages, Committed):  # one, not a sequence of three fields
        messages = [messages]
    last: Dict[Tuple[str, int], str] = {}
    for m in messages:
        if isinstance(m, Committed):
            raise ConfigError(
                f"position {_shown(m)}: a Committed is the next position to read, from "
                f"committed(); commit() takes processed messages (or their (topic, partition, "
                f"position)), the last processed one per partition: committing 'next' would "
                f"skip the message at it"
            )
        if isinstance(m, tuple):
            if len(m) != 3:
                raise ConfigError(
                    f"position {_shown(m)}: expected (topic, partition, position), e.g. "
                    f"('orders', 0, 'offset:42'), or a Message"
                )
            t, p, pos = m
        elif hasattr(m, "position") and hasattr(m, "partition") and hasattr(m, "topic"):
            t, p, pos = m.topic, m.partition, m.position
        else:
            raise TypeError(
                f"position: expected a Message or a (topic, partition, position) tuple, got {type(m).__name__}"
            )
        if not isinstance(t, str) or isinstance(p, bool) or not isinstance(p, int) or not isinstance(pos, str):
            raise TypeError(
                f"position {_shown(m)}: expected (topic: str, partition: int, position: str), e.g. "
                f"('orders', 0, 'offset:42')"
            )
        last[(t, p)] = pos
    return [(t, p, pos) for (t, p), pos in last.items()]


_I32_MAX = 2**31 - 1


def _topic_partitions(partitions: Any, name: str) -> List[Tuple[str, int]]:
    """``partitions`` as a list of ``(topic, partition)``; ``TypeError`` naming ``name`` and
    the value for anything else (a bare pair, a string, a float partition, ...), and
    ``ConfigError`` for a partition number outside 32 bits."""
    if isinstance(partitions, (str, bytes, dict)) or not isinstance(partitions, Iterable):
        raise TypeError(
            f"{name}: expected a list of (topic, partition) pairs, e.g. [('orders', 0)], "
            f"got {type(partitions).__name__} {_shown(partitions)}"
        )
    items = list(partitions)
    if len(items) == 2 and isinstance(items[0], str) and isinstance(items[1], int):
        raise TypeError(
            f"{name}: expected a list of (topic, partition) pairs, got one pair "
            f"{_shown(tuple(items))}: write [{_shown(tuple(items))}]"
        )
    out: List[Tuple[str, int]] = []
    for i, tp in enumerate(items):
        if not isinstance(tp, (tuple, list)) or len(tp) != 2:
            raise TypeError(
                f"{name}[{i}]: expected a (topic, partition) pair, e.g. ('orders', 0), got "
                f"{type(tp).__name__} {_shown(tp)}"
            )
        t, p = tp
        if not isinstance(t, str):
            raise TypeError(f"{name}[{i}]: topic {_shown(t)}: expected a str, got {type(t).__name__}")
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(
                f"{name}[{i}]: partition {_shown(p)} of topic {_shown(t)}: expected an int, got "
                f"{type(p).__name__}"
            )
        if not -_I32_MAX - 1 <= p <= _I32_MAX:
            raise ConfigError(
                f"{name}[{i}]: partition {p} of topic {_shown(t)}: expected 0 to {_I32_MAX}"
            )
        out.append((t, p))
    return out


class Transaction:
    """An open transaction: ``send``, ``send_batch``, ``commit_offsets``, then ``commit`` or
    ``abort`` (``Producer.transaction()`` does the last two).

    After ``abort()`` (or a ``commit()`` that raised), call
    ``consumer.rewind_uncommitted(consumer.assignment())`` before reading on, so that the
    inputs whose offsets the transaction carried are given out again; reading on without it
    skips them (Kafka, JetStream) or leaves them unacknowledged (Pulsar)."""

    def __init__(self, native: _native.Transaction, platform: str):
        self._native = native
        self._platform = platform
        self.finished = False

    def send(
        self,
        topic: str,
        payload: Payload,
        *,
        key: Optional[Payload] = None,
        headers: Headers = None,
        partition: Optional[int] = None,
        timestamp: Optional[int] = None,
        idempotency_key: Optional[str] = None,
        requeue: int = 0,
    ) -> "_native.SendFuture[Delivery]":
        """Sends a record inside the transaction; a ``SendFuture`` of its ``Delivery`` (see
        ``Producer.send``)."""
        return _send(self._native, self._platform, topic, payload, key, headers, partition, timestamp, idempotency_key, requeue)

    async def send_batch(self, records: Iterable[Union[Record, tuple]]) -> Sequence[Delivery]:
        return _check(await _send_batch(self._native, self._platform, records))

    async def commit_offsets(self, consumer: "Consumer", messages: Optional[Iterable[Any]] = None) -> None:
        """Commits ``consumer``'s positions with the transaction: of ``messages`` (processed
        ``Message``s or their ``(topic, partition, position)``, the last per partition), or of
        every message the consumer has yielded so far. A ``Committed`` (the next position to
        read, from ``Consumer.committed()``) raises ``ConfigError``, as for ``commit()``; a
        ``consumer`` that is not a ``Consumer`` raises ``TypeError``."""
        if not isinstance(consumer, Consumer):
            raise TypeError(
                f"commit_offsets(consumer=...): expected the Consumer whose messages the "
                f"transaction commits, got {type(consumer).__name__} {consumer!r:.60}"
            )
        if messages is None:
            await self._native.commit_offsets(consumer._native, None, consumer._batch, consumer._handed_out)
        else:
            await self._native.commit_offsets(consumer._native, _positions(messages))

    async def commit(self) -> None:
        self.finished = True
        await self._native.commit()

    async def abort(self) -> None:
        """Aborts: nothing sent in the transaction becomes visible and its ``commit_offsets``
        are void. Then call ``consumer.rewind_uncommitted(consumer.assignment())`` before
        reading on, so that the transaction's inputs are given out again."""
        self.finished = True
        await self._native.abort()


class Consumer:
    """A member of a consumer group. ``async for message in consumer`` pulls batches (one
    boundary crossing per batch) and yields their messages; ``commit()`` then commits what was
    yielded."""

    def __init__(self, native: _native.Consumer, *, batch_size: int = 500, poll_timeout: float = 1.0):
        self._native = native
        self.batch_size = batch_size
        self.poll_timeout = poll_timeout
        # The progress from which the native side works out what ``commit()`` without
        # arguments commits: the latest non-empty batch (its number ``_batch``) and how far
        # into it messages were handed out (None: all of it, after ``poll()``). The number
        # keeps a commit made while a poll completes (another task's) from applying this count
        # to a batch not received yet.
        self._latest: Optional[MessageBatch] = None
        self._batch = 0
        self._handed_out: Optional[int] = None

    @property
    def native(self) -> _native.Consumer:
        return self._native

    @property
    def group(self) -> str:
        return self._native.group

    @property
    def platform(self) -> str:
        return self._native.platform

    async def poll(self, max: Optional[int] = None, timeout: Optional[float] = None) -> MessageBatch:
        """One batch: up to ``max`` messages, waiting at most ``timeout`` s for the first
        (empty on timeout). ``commit()`` without arguments commits it.

        The ``MessageBatch`` is a sequence of ``Message`` (``len``, indexing, slicing,
        iteration) whose ``Message`` objects are made only when accessed; its column methods
        (``payloads()``, ``keys()``, ``positions()``, ``partitions()``, ``topics()``,
        ``timestamps()``, ``last_positions()``) return one list for the whole batch without
        a ``Message`` per message."""
        batch = await self._fetch(max, timeout)
        if batch:
            self._handed_out = None
        return batch

    async def _fetch(self, max: Optional[int] = None, timeout: Optional[float] = None) -> MessageBatch:
        batch = await self._native.poll(
            self.batch_size if max is None else max,
            self.poll_timeout if timeout is None else timeout,
            self._batch,
            self._handed_out,
        )
        if batch._batch != self._batch:
            self._latest, self._batch, self._handed_out = batch, batch._batch, 0
        return batch

    def _rest(self) -> Optional[MessageBatch]:
        """The latest batch when an iterator left it before its end (its messages from
        ``_handed_out`` on are still to hand out), else None."""
        latest, handed = self._latest, self._handed_out
        return latest if latest is not None and handed is not None and handed < len(latest) else None

    async def batches(self) -> AsyncIterator[MessageBatch]:
        """Yields non-empty batches forever (``commit()`` commits the batches yielded). The
        rest of a batch a message iterator was left in comes first."""
        rest = self._rest()
        if rest is not None:
            start, self._handed_out = self._handed_out, None
            yield rest._tail(start)
        while True:
            batch = await self.poll()
            if batch:
                yield batch

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        # An iterator started after another was left mid-batch hands out the rest of that
        # batch first: no message fetched is skipped.
        while True:
            batch = self._rest()
            if batch is None:
                batch = await self._fetch()
                if not batch:
                    continue
            for i in range(self._handed_out or 0, len(batch)):
                self._handed_out = i + 1
                yield batch[i]

    async def commit(self, messages: Union[None, Message, Iterable[Any]] = None) -> None:
        """Commits, per partition, the last of ``messages`` (``Message``s, a ``MessageBatch``
        or ``(topic, partition, position)`` of processed messages), or, without argument,
        the last message yielded so far: the group resumes *after* it.

        Unlike Kafka's ``commitSync(offsets)`` / confluent-kafka's ``commit(offsets=...)``,
        which take the next offset to read, this takes the last *processed* message's own
        position. What ``committed()`` returns is the next one (``Committed.next``): a
        ``Committed`` given here raises ``ConfigError`` (it would skip a message)."""
        if messages is None:
            await self._native.commit(None, self._batch, self._handed_out)
            return
        positions = _positions([messages] if isinstance(messages, Message) else messages)
        if positions:
            await self._native.commit(positions)

    async def committed(self, partitions: Sequence[Tuple[str, int]]) -> List[Committed]:
        """The group's committed position of each ``(topic, partition)``, in the order asked,
        as ``Committed(topic, partition, next)``: ``next`` is where the group resumes (one
        past the last processed message, as Kafka's committed offset), ``None`` where it has
        committed nothing. Not for ``commit()``, which takes processed positions and refuses
        a ``Committed``."""
        return [Committed(t, p, n) for t, p, n in await self._native.committed(list(partitions))]

    async def seek(self, topic: str, partition: int, to: str) -> None:
        """Replays from ``to``: ``earliest``, ``latest``, ``timestamp:MS`` or a position such
        as ``offset:42`` (inclusive)."""
        await self._native.seek(topic, partition, to)

    async def rewind_uncommitted(
        self, partitions: Sequence[Tuple[str, int]]
    ) -> List[Tuple[str, int]]:
        """After an aborted transaction: gives out again, in order and from the group's
        committed position, every message of the ``(topic, partition)``\ s that ``poll()``
        returned and no commit covered, without undoing any acknowledgement. A hand-written
        transactional loop calls it after every ``Transaction.abort()`` (and after a failed
        ``commit()``) before it reads on, usually with ``consumer.assignment()``.

        On Pulsar this is the broker's redelivery of unacknowledged messages; a ``seek()`` to
        the committed position would be wrong there: it resets the subscription's cursor and
        makes messages a committed transaction acknowledged past that position
        unacknowledged again, so they would be processed twice. Elsewhere (Kafka, Kinesis,
        JetStream, memory) it seeks each partition to its committed position.

        ``partitions`` is a sequence of ``(topic, partition)`` pairs (``str``, ``int``), each
        assigned to this consumer now; nothing is done unless every one is.

        Returns the ``(topic, partition)``\ s on which the group has committed nothing: they
        are left as they are, for the caller to ``seek()`` (for instance to the transaction's
        first input).

        Raises ``TypeError`` naming ``partitions`` for a value of another shape or type;
        ``ConfigError`` for an empty topic, a negative partition or a topic this consumer does
        not read; ``FencedError`` for a partition not assigned to it now (moved to another
        member, or one the topic does not have); ``ClosedError`` once the consumer is closed,
        also for an empty list."""
        return [tuple(tp) for tp in await self._native.rewind_uncommitted(_topic_partitions(partitions, "partitions"))]

    async def pause(self, partitions: Sequence[Tuple[str, int]]) -> None:
        await self._native.pause(list(partitions))

    async def resume(self, partitions: Sequence[Tuple[str, int]]) -> None:
        await self._native.resume(list(partitions))

    def assignment(self) -> List[Tuple[str, int]]:
        """Partitions assigned to this member now, as ``[(topic, partition)]``.

        Empty until a ``poll()`` has joined the group (the group assigns partitions while the
        consumer polls, as Kafka's ``assignment()``), and after a rebalance took them all away.
        """
        return self._native.assignment()

    async def lag(self) -> List[Lag]:
        return await self._native.lag()

    async def close(self) -> None:
        await self._native.close()

    async def __aenter__(self) -> "Consumer":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _traced(func: Callable[[Message], Any], system: str, group: str) -> Callable[[Message], Awaitable[Any]]:
    """The callable the engine calls: runs ``func`` (sync or async) inside the message's
    trace context, as an awaitable."""

    async def call(message: Message) -> Any:
        return await _run_in_process_span(func, message, message, system, group)

    return call


async def _run_in_process_span(func: Callable[[Any], Any], arg: Any, context_of: Message, system: str, group: str) -> Any:
    """Runs ``func(arg)`` (sync or async) inside a process span whose parent is the trace
    context carried by ``context_of``; the span records an exception ``func`` raises."""
    return await _run_in_span(func, arg, _otel.start_process(context_of, system, group))


async def _run_in_span(func: Callable[[Any], Any], arg: Any, started: Tuple[Any, Any]) -> Any:
    """Runs ``func(arg)`` (sync or async) inside the started process span ``(span, token)``,
    which records an exception ``func`` raises and ends with the call."""
    span, token = started
    try:
        result = func(arg)
        if inspect.isawaitable(result):
            result = await result
    except BaseException as e:
        _otel.end_process(span, token, e)
        raise
    _otel.end_process(span, token)
    return result


def _traced_batch(
    func: Callable[[MessageBatch], Any], system: str, group: str
) -> Callable[[MessageBatch], Awaitable[Any]]:
    """The callable the engine calls with a batch: runs ``func`` (sync or async) as an
    awaitable, inside one ``process`` span per call when OpenTelemetry is installed: a child of
    the current context linked to every message's context, as the core's batch spans are."""
    if not _otel.ENABLED:

        async def plain(messages: MessageBatch) -> Any:
            result = func(messages)
            if inspect.isawaitable(result):
                result = await result
            return result

        return plain

    async def call(messages: MessageBatch) -> Any:
        return await _run_in_span(func, messages, _otel.start_process_batch(messages, system, group))

    return call


def _check_store(store: Any) -> Any:
    """``store`` as given to an engine, checked at construction: ``None``, a ``DedupStore``, a
    URL or path (``str`` or ``os.PathLike``, opened by ``run()``). Anything else raises
    ``TypeError`` naming its type (before, it surfaced only when ``run()`` opened it)."""
    if store is None or isinstance(store, (DedupStore, str)):
        return store
    if isinstance(store, os.PathLike):
        return os.fspath(store)
    raise TypeError(
        f"store: expected None, a DedupStore, or a dedup store URL or path (str or os.PathLike), "
        f"got {type(store).__name__}"
    )


async def _store(store: Union[None, str, DedupStore], window: float) -> Optional[DedupStore]:
    if store is None or isinstance(store, DedupStore):
        return store
    return await dedup_store(store, window)


class _Engine(abc.ABC):
    _native: Any = None

    @abc.abstractmethod
    async def _build(self) -> Any:
        """Creates the native engine (each subclass builds its own)."""

    async def _get(self):
        if self._native is None:
            self._native = await self._build()
        return self._native

    async def run(self) -> Dict[str, Any]:
        """Runs until ``stop()`` or an error, then drains, commits and closes the consumer.
        Returns ``{"metrics": ..., "guarantee": ..., "drained": ...}``. Cancelling the awaiting
        task stops the engine gracefully."""
        native = await self._get()
        if self._stop_requested:
            native.stop()
        try:
            return await native.run()
        except asyncio.CancelledError:
            native.stop()
            raise

    def stop(self) -> None:
        """Asks ``run()`` to finish work in flight, commit and return (safe from a handler)."""
        self._stop_requested = True
        if self._native is not None:
            self._native.stop()

    def metrics(self) -> Dict[str, int]:
        """Counters, live (empty before ``run()`` or ``step()`` built the engine): ``consumed``,
        ``processed``, ``duplicates_skipped``, ``handler_errors``, ``retries``,
        ``dead_lettered``, ``redelivery_requests``, ``transactions_committed``,
        ``transactions_aborted``, ``rebalances``, ``fenced``, ``commits``, ``produced`` and
        ``malformed_traceparents`` (messages whose W3C ``traceparent`` was malformed and
        ignored; also the OpenTelemetry counter ``onceflow.malformed_traceparents`` when a
        meter provider is installed in Rust) and ``keyless`` (messages handled without an
        idempotency key although a dedup store was set: at-least-once, no dedup record;
        the OpenTelemetry counter ``onceflow.keyless``)."""
        return self._native.metrics() if self._native is not None else {}

    @property
    def guarantee(self) -> Optional[str]:
        return self._native.guarantee if self._native is not None else None


class IdempotentConsumer(_Engine):
    """Runs ``handler`` once per idempotency key (header ``idempotency-key`` by default):
    at-least-once delivery plus a dedup ``store`` (``memory://``, a file path, or an opened
    ``DedupStore``). A handler that raises is retried with backoff, then redelivered.

    Engine settings are keyword arguments: ``max_attempts``, ``min_backoff``, ``max_backoff``,
    ``on_failure`` (``redeliver``, ``stop``, ``dead-letter:TOPIC``), ``key``
    (``header:NAME`` or ``coordinates``), ``lease``, ``batch_size``, ``poll_timeout``,
    ``commit_interval``, ``commit_every``, ``shutdown_deadline``, ``namespace``, ``worker_id``,
    ``fingerprint``, ``require_key``, ``redelivery_delay``, ``tracing``. Durations are
    seconds (``int`` or ``float``) or a ``datetime.timedelta``; ``None`` keeps a default.
    A message without a key (no ``idempotency-key`` header) runs at-least-once and writes no
    dedup record (counted in ``metrics()["keyless"]``); ``require_key=True`` makes it an
    error naming the header, routed like a failed handler (dead-letter topic or
    ``on_failure``). A payload conflicting with its key's fingerprint is routed the same
    way and never stops the consumer by itself (only ``on_failure="stop"`` does). Raised by ``run()`` /
    ``step()``: ``TypeError`` for a value of the wrong type, ``ConfigError`` naming the setting
    for an unknown name, a count that is not a whole number from 1, or a duration out of range
    (the same table the Node package uses).

    With ``batch=True`` the handler takes a ``MessageBatch`` (a sequence of ``Message`` with
    column methods such as ``payloads()``; see ``Consumer.poll``): consecutive messages of one
    partition whose keys were claimed together, duplicates already removed. It returns
    ``None`` or one result (``None`` or bytes) per message, in order: one call, one dedup
    claim and one completion per batch instead of per message. A batch handler that raises
    fails the whole batch: it is retried with backoff, then every message of it is given up
    as ``on_failure`` says (redelivered by default), so none is lost."""

    def __init__(
        self,
        consumer: Consumer,
        handler: Callable[..., Any],
        store: Union[None, str, DedupStore] = None,
        *,
        window: float = 86400.0,
        dead_letter_producer: Optional[Producer] = None,
        batch: bool = False,
        **config: Any,
    ):
        self.consumer = consumer
        self.handler = handler
        self.batch = batch
        self._store = _check_store(store)
        self._window = window
        self._dlq = dead_letter_producer
        self._config = config
        self._stop_requested = False
        self.__wrapped__ = handler

    async def _build(self):
        store = await _store(self._store, self._window)
        wrap = _traced_batch if self.batch else _traced
        return _native.IdempotentConsumer(
            self.consumer._native,
            wrap(self.handler, self.consumer.platform, self.consumer.group),
            store,
            config=self._config or None,
            dead_letter_producer=self._dlq._native if self._dlq else None,
            batch=self.batch,
        )

    async def step(self) -> int:
        """Polls once and handles what arrived; returns how many messages were polled."""
        return await (await self._get()).step()

    async def lag(self) -> List[Lag]:
        return await (await self._get()).lag()

    def __call__(self, message: Message) -> Any:
        return self.handler(message)


def idempotent(
    consumer: Consumer, store: Union[None, str, DedupStore] = None, **kwargs: Any
) -> Callable[[Callable[[Message], Any]], IdempotentConsumer]:
    """Decorator: turns a handler into an ``IdempotentConsumer`` over ``consumer``::

        @onceflow.idempotent(consumer, store="/var/lib/app/dedup.db")
        async def handle(message): ...

        await handle.run()

    ``batch=True`` makes it a batch handler (``async def handle(messages)``; see
    ``IdempotentConsumer``).
    """

    def wrap(handler: Callable[[Message], Any]) -> IdempotentConsumer:
        return IdempotentConsumer(consumer, handler, store, **kwargs)

    return wrap


InboxTransaction = _native.InboxTransaction


class StoredPosition(NamedTuple):
    """A position an ``Inbox`` stored in its database: the last message of ``topic`` /
    ``partition`` handled (or skipped) and committed; ``position`` as text (a Kafka offset, a
    JetStream sequence, ...)."""

    topic: str
    partition: int
    position: str


class Inbox:
    """The transactional inbox: ``handler(message, tx)`` runs inside one database transaction
    that also records the message's idempotency key and the consumer's position, so the
    handler's rows, the key and the position are committed together or not at all.

    ``store`` is ``postgres://user:password@host/db`` (PostgreSQL) or an embedded store: a
    file path or ``embedded:///absolute/path.db`` (SQLite). ``tx`` is an
    ``InboxTransaction``; its SQL runs in that transaction:

    - ``await tx.execute(sql, params)`` runs a statement and returns the rows it changed;
    - ``await tx.query(sql, params)`` returns a list of tuples (``as_dicts=True``: dicts keyed
      by column name).

    ``params`` is a list (or tuple) of ``str``, ``int``, ``float``, ``bytes``, ``bool`` or
    ``None``; another type raises ``TypeError`` naming its index. Placeholders: ``$1, $2, ...``
    on PostgreSQL, ``?`` (or ``?1, ?2, ...``) on the embedded store (``tx.store`` says which).
    PostgreSQL result columns other than booleans, integers, floats, text and ``bytea`` raise
    ``SerializationError`` (cast them in SQL, e.g. ``created::text``). A failing statement
    raises ``DedupStoreError`` (the database's message) and fails the message even if the
    handler catches it: the transaction rolls back and the message is retried. ``tx`` works
    only while the handler runs; afterwards it raises ``ClosedError``. Do not commit or roll
    back yourself.

    A message whose key was already recorded within ``window`` seconds (default one day) is a
    duplicate: the handler does not run. On start the inbox seeks the consumer to just after
    the positions stored in the database, so a new consumer group (or lost broker offsets)
    handles nothing twice: keys and positions belong to the inbox's ``namespace``, never to
    the consumer group. The handler runs inside a ``process {topic}`` span (kind CONSUMER), a
    child of the trace context the message carries, with the idempotent consumer's attributes
    (OpenTelemetry messaging semantic conventions), when ``opentelemetry-api`` is installed;
    a duplicate starts none. A handler that raises rolls its transaction back and is retried
    with backoff; after ``max_attempts`` ``run()`` / ``step()`` raise ``HandlerError`` and
    nothing of that message is committed.

    Settings (keyword arguments, ``None`` keeps the default): ``key`` (``header:NAME`` or
    ``coordinates``; default the ``idempotency-key`` header, else the coordinates),
    ``namespace`` (the inbox's identity in its database: names its keys and positions;
    default ``"default"``, whatever the consumer group; give each application that shares the
    database and reads the same topics its own, e.g. ``namespace="billing"``; an inbox that
    ran when the default was the group name keeps its keys with ``namespace=<that group>``),
    ``batch_size`` (100), ``poll_timeout`` (0.1 s), ``max_attempts`` (5), ``backoff`` (first
    retry delay, doubled per attempt, 0.1 s), ``broker_commit_interval`` (1 s). Durations are
    seconds or ``datetime.timedelta``. A wrong type raises ``TypeError``, a bad value or
    unknown name ``ConfigError``; both, like a store that cannot be opened, from the first
    ``run()`` / ``step()`` (or ``open()``)."""

    def __init__(
        self,
        consumer: Consumer,
        handler: Callable[[Message, Any], Any],
        store: Union[str, "os.PathLike[str]"],
        *,
        window: float = 86400.0,
        **config: Any,
    ):
        if not callable(handler):
            raise TypeError(f"handler: expected a callable (message, tx), got {type(handler).__name__}")
        if isinstance(store, os.PathLike):
            store = os.fspath(store)
        if not isinstance(store, str):
            raise TypeError(
                f"store: expected a postgres:// URL or an embedded store path (str or os.PathLike), "
                f"got {type(store).__name__}"
            )
        self.consumer = consumer
        self.handler = handler
        self._store = store
        self._window = window
        self._config = config
        self._native: Any = None
        self._stop_requested = False
        self._wrap_tx: Callable[[Any], Any] = lambda tx: tx

    async def open(self) -> "Inbox":
        """Opens the store and builds the inbox now (``run()`` / ``step()`` do it otherwise)."""
        if self._native is None:
            handler, wrap_tx = self.handler, self._wrap_tx
            system, group = self.consumer.platform, self.consumer.group

            async def call(message: Message, tx: Any) -> None:
                # A ``process {topic}`` span, child of the message's trace context, as the
                # idempotent consumer's handler gets (the core's span plan); no span without
                # OpenTelemetry, nor for a key already handled (the handler does not run).
                span, token = _otel.start_process(message, system, group)
                try:
                    result = handler(message, wrap_tx(tx))
                    if inspect.isawaitable(result):
                        await result
                except BaseException as e:
                    _otel.end_process(span, token, e)
                    raise
                _otel.end_process(span, token)

            self._native = await _native.open_inbox(
                self.consumer._native, call, self._store, window=self._window, config=self._config or None
            )
        return self

    @property
    def store(self) -> Optional[str]:
        """``"postgres"`` or ``"embedded"`` once opened (the handler's placeholder style)."""
        return self._native.store if self._native is not None else None

    @property
    def namespace(self) -> Optional[str]:
        """The namespace of the inbox's keys and positions, once opened."""
        return self._native.namespace if self._native is not None else None

    async def run(self) -> Dict[str, int]:
        """Runs until ``stop()`` or an error; returns the summary (see ``summary()``). Does not
        close the consumer. Cancelling the awaiting task stops the inbox."""
        await self.open()
        if self._stop_requested:
            self._native.stop()
        try:
            return await self._native.run()
        except asyncio.CancelledError:
            self._native.stop()
            raise

    async def step(self) -> int:
        """Polls once and handles what came; returns how many messages were polled."""
        await self.open()
        return await self._native.step()

    def stop(self) -> None:
        """Asks ``run()`` to return once the message in hand is committed (safe from a handler)."""
        self._stop_requested = True
        if self._native is not None:
            self._native.stop()

    def summary(self) -> Dict[str, int]:
        """``{"handled", "duplicates", "behind_position"}``: messages whose handler ran and
        committed, skipped as already recorded keys, skipped as at or before the stored
        position (empty counts before the inbox opened)."""
        if self._native is None:
            return {"handled": 0, "duplicates": 0, "behind_position": 0}
        return self._native.summary()

    async def stored_positions(self) -> List[StoredPosition]:
        """The positions stored for this inbox's namespace, per partition: the last message
        committed on each (``StoredPosition(topic, partition, position)``); also while
        ``run()`` runs and after it returned."""
        await self.open()
        return [StoredPosition(*p) for p in await self._native.stored_positions()]

    def __repr__(self) -> str:
        return f"Inbox(store={self.store!r}, namespace={self.namespace!r})"


class Pipeline(_Engine):
    """Consume-transform-produce: ``transform(message)`` returns the records to write
    (``Record``s or tuples, or ``None``). ``mode``: ``auto`` (transactions where the platform
    has them), ``transactional`` or ``idempotent``. ``guarantee`` and ``mechanism`` say what
    runs."""

    def __init__(
        self,
        consumer: Consumer,
        producer: Producer,
        transform: Callable[[Message], Any],
        store: Union[None, str, DedupStore] = None,
        *,
        mode: str = "auto",
        window: float = 86400.0,
        transaction_interval: Optional[float] = None,
        max_transaction_inputs: Optional[int] = None,
        **config: Any,
    ):
        self.consumer = consumer
        self.producer = producer
        self.transform = transform
        self._store = _check_store(store)
        self._window = window
        self._mode = mode
        self._tx_interval = transaction_interval
        self._tx_inputs = max_transaction_inputs
        self._config = config
        self._stop_requested = False

    async def _build(self):
        store = await _store(self._store, self._window)
        transform = self.transform

        def records(message: Message) -> Any:
            # Runs inside the process span: its context goes to the core with the records,
            # which sends them as its children (whatever trace headers they carry).
            out = transform(message)
            if inspect.isawaitable(out):
                return _records_async(out)
            return (_as_records(out) if out is not None else None), _otel.current_trace_headers()

        return _native.Pipeline(
            self.consumer._native,
            self.producer._native,
            _traced(records, self.consumer.platform, self.consumer.group),
            store,
            mode=self._mode,
            config=self._config or None,
            transaction_interval=self._tx_interval,
            max_transaction_inputs=self._tx_inputs,
        )

    async def mechanism(self) -> str:
        return (await self._get()).mechanism


async def _records_async(aw: Awaitable[Any]) -> Tuple[Optional[List[Record]], Any]:
    out = await aw
    return (_as_records(out) if out is not None else None), _otel.current_trace_headers()
