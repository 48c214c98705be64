"""OpenTelemetry propagation, used only when ``opentelemetry-api`` is installed.

What each span looks like is decided by the Rust core (``onceflow::trace::plan``), the same
code that decides the Rust engine's own spans: the span's name, kind and attributes, where its
parent comes from, the links of a batch, and how injected trace headers replace a record's
own. This module only hands those plans to the ``opentelemetry`` API, so that the
application's tracer provider, sampler and exporter see the spans.

On send, a ``send {topic}`` producer span is started as a child of the current context (or,
without a current span, of the valid ``traceparent`` the record carries) and its context is
written to the record's headers (W3C ``traceparent`` / ``tracestate`` / ``baggage``) before the
record crosses into Rust. On handling, a ``process {topic}`` consumer span is started as the
child of the context the message carries (a batch handler: one span, child of the current
context, linked to every message's context), and the handler (or a pipeline's transform,
whose outputs are sent as children of that span) runs inside it. Without the package, headers
pass through to the Rust core untouched.

Trace header names are read, replaced and removed in any casing (``Traceparent`` as some older
clients write it is ``traceparent``; W3C Trace Context §3.1, §3.3), so a record leaves with one
``traceparent`` and at most one ``tracestate``, under the lowercase names. A record's own
``tracestate`` goes on with its own trace and is dropped when another trace is continued
(trace state belongs to its ``traceparent``, §3.3).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _native

try:  # pragma: no cover - exercised by both test environments
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.trace import Link as _Link
    from opentelemetry.trace import SpanKind as _SpanKind
    from opentelemetry.trace import Status as _Status
    from opentelemetry.trace import StatusCode as _StatusCode

    ENABLED = True
    _KINDS = {"producer": _SpanKind.PRODUCER, "consumer": _SpanKind.CONSUMER}
except ImportError:  # pragma: no cover
    ENABLED = False

HeaderValue = Union[bytes, str, None]
HeadersIn = Union[None, dict, Sequence[Tuple[str, HeaderValue]]]


def body_size(payload: Any) -> Optional[int]:
    """The size in bytes of a payload as the core will send it (``str`` as UTF-8), ``None``
    for a type the core converts otherwise (it raises there)."""
    if isinstance(payload, (bytes, bytearray)):
        return len(payload)
    if isinstance(payload, memoryview):
        return payload.nbytes
    if isinstance(payload, str):
        return len(payload.encode("utf-8", "surrogatepass"))
    return None


def _tracer():
    return _trace.get_tracer("onceflow")


def _valid(ctx) -> bool:
    return _trace.get_current_span(ctx).get_span_context().is_valid


def _extract(carrier: Optional[dict]):
    """The context ``carrier`` carries, on an empty base (``None`` carrier: an empty context)."""
    empty = _context.Context()
    return _propagate.extract(carrier, context=empty) if carrier else empty


def _parent(mode: str, carrier: Optional[dict]):
    """A plan's parent (``onceflow::trace::plan::Parent``)."""
    current = _context.get_current()
    if mode == "current":
        return current
    if mode == "headers":
        return _extract(carrier)
    # "current_else": the current span when valid, else the record's own valid context.
    if _valid(current) or not carrier:
        return current
    own = _extract(carrier)
    return own if _valid(own) else current


def _start(plan) -> Tuple[Any, Any]:
    """Starts the span of ``plan`` (the tuple of ``_native.*_span_plan``); returns
    ``(span, parent_context)``."""
    name, kind, attributes, mode, carrier, links = plan
    parent = _parent(mode, carrier)
    span_links = []
    for c in links:
        sc = _trace.get_current_span(_extract(c)).get_span_context()
        if sc.is_valid:
            span_links.append(_Link(sc))
    span = _tracer().start_span(name, context=parent, kind=_KINDS[kind], attributes=attributes, links=span_links)
    return span, parent


def _fail(span, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(_Status(_StatusCode.ERROR, str(error)))
    code = getattr(error, "code", None)
    if code:
        span.set_attributes(_native.failed_span_attributes(str(code)))


def same_trace_headers(records) -> bool:
    """Whether one span can be the parent of the whole batch (every record carries the same
    trace headers, or none; decided by the core). Records whose own traceparents differ are
    left to the Rust core, which continues each one's trace."""
    return _native.one_span_for_batch([r.headers for r in records])


def start_send(topic: str, system: str, count: int = 1, headers: HeadersIn = None, body_size: Optional[int] = None):
    """Starts the producer span of a send (one span for a batch, as the messaging semantic
    conventions say), a child of the current span or, without one, of the valid trace context
    ``headers`` carry. Returns ``(span, trace_headers)``; ``(None, None)`` when there is
    nothing to propagate."""
    if not ENABLED or not isinstance(topic, str):
        # A topic that is not text: the send itself raises the error that names it.
        return None, None
    try:
        plan = _native.send_span_plan(system, topic, count, body_size, headers)
    except (TypeError, ValueError):
        # Headers the send will refuse (naming the bad one): no span for a send that fails.
        return None, None
    span, parent = _start(plan)
    if not span.get_span_context().is_valid:
        span.end()
        return None, None
    carrier: dict = {}
    _propagate.inject(carrier, context=_trace.set_span_in_context(span, parent))
    if not carrier:
        span.end()
        return None, None
    return span, [(k, str(v)) for k, v in carrier.items()]


def end_send(span, delivery: Any = None, error: Optional[BaseException] = None) -> None:
    if span is None:
        return
    if delivery is not None:
        span.set_attributes(_native.delivered_span_attributes(delivery.partition, delivery.position))
    if error is not None:
        _fail(span, error)
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


def merge(headers: HeadersIn, trace_headers: List[Tuple[str, str]]) -> List[Tuple[str, HeaderValue]]:
    """``headers`` with the injected ``trace_headers`` applied by the core's rule: any
    ``traceparent`` / ``tracestate`` in any casing removed, each injected header replacing its
    name in any casing (a record's own ``baggage`` stays unless one is injected)."""
    return _native.apply_trace_headers(headers, [(k, v.decode() if isinstance(v, bytes) else v) for k, v in trace_headers])


def context_of(message):
    """The OpenTelemetry context a message carries (``None`` without OpenTelemetry)."""
    if not ENABLED:
        return None
    return _extract(_native.trace_carrier(message))


def start_process(message, system: str, group: str):
    """Starts a ``process {topic}`` consumer span as the child of the message's context and
    makes it current. Returns ``(span, token)``; ``(None, None)`` without OpenTelemetry."""
    if not ENABLED:
        return None, None
    span, parent = _start(_native.process_span_plan(message, system, group))
    token = _context.attach(_trace.set_span_in_context(span, parent))
    return span, token


def start_process_batch(batch, system: str, group: str):
    """Starts one ``process {topic}`` consumer span for a batch handler's call: a child of the
    current context, linked to every message's context. Returns ``(span, token)``."""
    if not ENABLED:
        return None, None
    span, parent = _start(_native.process_batch_span_plan(batch, system, group))
    token = _context.attach(_trace.set_span_in_context(span, parent))
    return span, token


def end_process(span, token, error: Optional[BaseException] = None) -> None:
    if span is None:
        return
    if error is not None:
        _fail(span, error)
    _context.detach(token)
    span.end()
