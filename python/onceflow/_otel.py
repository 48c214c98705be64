"""OpenTelemetry propagation, used only when ``opentelemetry-api`` is installed.

On send, a ``send {topic}`` producer span is started as a child of the current context (or,
without a current span, of the valid ``traceparent`` the record carries) and its context is
written to the record's headers (W3C ``traceparent`` / ``tracestate`` / ``baggage``) before the
record crosses into Rust. On handling, the context a message carries is extracted, a
``process {topic}`` consumer span is started as its child, and the handler (or a pipeline's
transform, whose outputs are sent as children of that span) runs inside it. Without the
package, headers pass through to the Rust core untouched.

Trace header names are read, replaced and removed in any casing (``Traceparent`` as some older
clients write it is ``traceparent``; W3C Trace Context §3.1, §3.3), so a record leaves with one
``traceparent`` and at most one ``tracestate``, under the lowercase names. A record's own
``tracestate`` goes on with its own trace and is dropped when another trace is continued
(trace state belongs to its ``traceparent``, §3.3).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

try:  # pragma: no cover - exercised by both test environments
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind as _SpanKind
    from opentelemetry.trace import Status as _Status
    from opentelemetry.trace import StatusCode as _StatusCode

    ENABLED = True
except ImportError:  # pragma: no cover
    ENABLED = False

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")

HeaderValue = Union[bytes, str, None]
HeadersIn = Union[None, dict, Sequence[Tuple[str, HeaderValue]]]


def _tracer():
    return _trace.get_tracer("onceflow")


def _header_carrier(headers: HeadersIn) -> Optional[dict]:
    """The trace headers among ``headers`` (any casing; the first of each name), as a carrier
    for the propagator, or ``None`` when there are none."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    carrier = None
    for name, value in items:
        low = name.lower()
        if low in TRACE_HEADERS and value is not None:
            if carrier is None:
                carrier = {}
            if low not in carrier:
                carrier[low] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return carrier


def _send_parent(headers: HeadersIn):
    """The parent of a send's span: the current context when its span is valid, else the
    context the record's own headers carry when that is valid, else the current context (a
    new trace)."""
    current = _context.get_current()
    if _trace.get_current_span(current).get_span_context().is_valid:
        return current
    carrier = _header_carrier(headers)
    if carrier:
        own = _propagate.extract(carrier)
        if _trace.get_current_span(own).get_span_context().is_valid:
            return own
    return current


def same_trace_headers(records) -> bool:
    """Whether every record carries the same trace headers (or none): one span can then be
    the parent of the whole batch. Records whose own traceparents differ are better left to
    the Rust core, which continues each one's trace."""
    first = _header_carrier(records[0].headers)
    return all(_header_carrier(r.headers) == first for r in records[1:])


def start_send(topic: str, system: str, count: int = 1, headers: HeadersIn = None):
    """Starts the producer span of a send (one span for a batch, as the messaging semantic
    conventions say), a child of the current span or, without one, of the valid trace context
    ``headers`` carry. Returns ``(span, trace_headers)``; ``(None, None)`` when there is
    nothing to propagate."""
    if not ENABLED:
        return None, None
    parent = _send_parent(headers)
    attributes = {
        "messaging.system": system,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": topic,
    }
    if count != 1:
        attributes["messaging.batch.message_count"] = count
    span = _tracer().start_span(f"send {topic}", context=parent, kind=_SpanKind.PRODUCER, attributes=attributes)
    if not span.get_span_context().is_valid:
        span.end()
        return None, None
    carrier: dict = {}
    _propagate.inject(carrier, context=_trace.set_span_in_context(span, parent))
    if not carrier:
        span.end()
        return None, None
    return span, [(k, v.encode()) for k, v in carrier.items()]


def end_send(span, delivery: Any = None, error: Optional[BaseException] = None) -> None:
    if span is None:
        return
    if delivery is not None:
        span.set_attribute("messaging.destination.partition.id", str(delivery.partition))
        span.set_attribute("messaging.message.id", delivery.position)
    if error is not None:
        span.record_exception(error)
        span.set_status(_Status(_StatusCode.ERROR, str(error)))
        code = getattr(error, "code", None)
        if code:
            span.set_attribute("error.type", code)
    span.end()


def current_trace_headers() -> Optional[List[Tuple[str, bytes]]]:
    """The W3C headers of the current context (a pipeline's ``process`` span while its
    transform runs), ``None`` without OpenTelemetry or a valid current span: the parent a
    pipeline hands to the Rust core for the outputs."""
    if not ENABLED:
        return None
    if not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict = {}
    _propagate.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()] or None


def merge(headers: HeadersIn, trace_headers: List[Tuple[str, bytes]]) -> List[Tuple[str, HeaderValue]]:
    """``headers`` with any trace headers (in any casing) replaced by ``trace_headers``."""
    if headers is None:
        items: Iterable = ()
    elif isinstance(headers, dict):
        items = headers.items()
    else:
        items = headers
    out = [(k, v) for k, v in items if k.lower() not in TRACE_HEADERS]
    out.extend(trace_headers)
    return out


def _carrier(message) -> Optional[dict]:
    return _header_carrier(message.headers)


def context_of(message):
    """The OpenTelemetry context a message carries (``None`` without OpenTelemetry)."""
    if not ENABLED:
        return None
    carrier = _carrier(message)
    return _propagate.extract(carrier) if carrier else _context.Context()


def start_process(message, system: str, group: str):
    """Starts a ``process {topic}`` consumer span as the child of the message's context and
    makes it current. Returns ``(span, token)``; ``(None, None)`` without OpenTelemetry."""
    if not ENABLED:
        return None, None
    carrier = _carrier(message)
    parent = _propagate.extract(carrier) if carrier else None
    span = _tracer().start_span(
        f"process {message.topic}",
        context=parent,
        kind=_SpanKind.CONSUMER,
        attributes={
            "messaging.system": system,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": message.topic,
            "messaging.destination.partition.id": str(message.partition),
            "messaging.consumer.group.name": group,
            "messaging.message.id": message.position,
        },
    )
    ctx = _trace.set_span_in_context(span, parent)
    token = _context.attach(ctx)
    return span, token


def end_process(span, token, error: Optional[BaseException] = None) -> None:
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
        span.set_status(_Status(_StatusCode.ERROR, str(error)))
    _context.detach(token)
    span.end()
