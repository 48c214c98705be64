'use strict'
// OpenTelemetry propagation, used only when `@opentelemetry/api` can be loaded (from this
// package or from the application's folder). On send, a `send {topic}` producer span is
// started as a child of the active context and its context is written to the record's
// headers (W3C traceparent / tracestate / baggage through the global propagator) before the
// record crosses into Rust. On handling, the context a message carries is extracted, a
// `process {topic}` consumer span is started as its child, and the handler runs inside it.
// A pipeline's transform runs inside that span too, and its outputs are sent as its children.
// Without the package, headers pass through to the Rust core untouched.
//
// Trace header names are read, replaced and removed in any casing (`Traceparent`, as some
// older clients write it, is `traceparent`; W3C Trace Context §3.1, §3.3): a record leaves
// with one `traceparent` and at most one `tracestate`, under the lowercase names, and a
// record's own `tracestate` goes on with its own trace only (it belongs to its traceparent).
const path = require('node:path')
const { createRequire } = require('node:module')

const TRACE_HEADERS = new Set(['traceparent', 'tracestate', 'baggage'])
let cached

function api() {
  if (cached !== undefined) return cached
  cached = null
  for (const req of [require, createRequire(path.join(process.cwd(), 'index.js'))]) {
    try {
      cached = req('@opentelemetry/api')
      break
    } catch {
      // not installed there
    }
  }
  return cached
}

function tracer(otel) {
  return otel.trace.getTracer('onceflow')
}

const isTraceHeader = (name) => TRACE_HEADERS.has(String(name).toLowerCase())

/** The trace headers among normalised `headers` (`{name, value}` items, any casing; the first of each name) as a carrier, or null. */
function carrierOf(headers) {
  let carrier = null
  for (const h of headers || []) {
    const low = String(h.name).toLowerCase()
    if (TRACE_HEADERS.has(low) && h.value !== null && h.value !== undefined) {
      carrier = carrier || {}
      if (!(low in carrier)) carrier[low] = h.value.toString()
    }
  }
  return carrier
}

/**
 * Whether every record carries the same trace headers (or none): one span can then be the
 * parent of the whole batch. Records whose own traceparents differ are left to the Rust core,
 * which continues each one's trace.
 */
function sameTraceHeaders(records) {
  const key = (r) => JSON.stringify(carrierOf(r.headers))
  const first = key(records[0])
  return records.every((r) => key(r) === first)
}

/**
 * The parent of a send's span: the active context when its span is valid, else the context
 * the record's own headers carry when valid, else the active context (a new trace).
 */
function sendParent(otel, headers) {
  const active = otel.context.active()
  const current = otel.trace.getSpan(active)
  if (current && otel.isSpanContextValid(current.spanContext())) return active
  const carrier = carrierOf(headers)
  if (carrier) {
    const own = otel.propagation.extract(otel.ROOT_CONTEXT, carrier, getter)
    const span = otel.trace.getSpan(own)
    if (span && otel.isSpanContextValid(span.spanContext())) return own
  }
  return active
}

/**
 * Starts the producer span of a send (one span for a batch), a child of the active span or,
 * without one, of the valid trace context `headers` (normalised) carry. Returns
 * `{ span, headers }` with the trace headers to add, or null when there is nothing to
 * propagate.
 */
function startSend(topic, system, count, headers) {
  const otel = api()
  if (!otel) return null
  const parent = sendParent(otel, headers)
  const attributes = {
    'messaging.system': system,
    'messaging.operation.type': 'send',
    'messaging.operation.name': 'send',
    'messaging.destination.name': topic,
  }
  if (count !== 1) attributes['messaging.batch.message_count'] = count
  const span = tracer(otel).startSpan(
    `send ${topic}`,
    { kind: otel.SpanKind.PRODUCER, attributes },
    parent
  )
  if (!otel.isSpanContextValid(span.spanContext())) {
    span.end()
    return null
  }
  const carrier = {}
  otel.propagation.inject(otel.trace.setSpan(parent, span), carrier)
  const names = Object.keys(carrier)
  if (names.length === 0) {
    span.end()
    return null
  }
  return { span, headers: names.map((name) => ({ name, value: Buffer.from(String(carrier[name])) })) }
}

/** `headers` (normalised) with any trace headers, in any casing, replaced by the injected ones. */
function merge(headers, injected) {
  const kept = (headers || []).filter((h) => !isTraceHeader(h.name))
  return kept.concat(injected)
}

/**
 * The W3C headers (`{name, value}` items) of `ctx`, or null when its span is not valid: the
 * parent a pipeline hands to the Rust core for the outputs of a transform run in `ctx`.
 */
function traceHeaders(ctx) {
  const otel = api()
  if (!otel || !ctx) return null
  const span = otel.trace.getSpan(ctx)
  if (!span || !otel.isSpanContextValid(span.spanContext())) return null
  const carrier = {}
  otel.propagation.inject(ctx, carrier)
  const names = Object.keys(carrier)
  return names.length ? names.map((name) => ({ name, value: Buffer.from(String(carrier[name])) })) : null
}

function endSend(started, delivery, error) {
  if (!started) return
  const otel = api()
  const { span } = started
  if (delivery && !(delivery instanceof Error)) {
    span.setAttribute('messaging.destination.partition.id', String(delivery.partition))
    span.setAttribute('messaging.message.id', delivery.position)
  }
  if (error) {
    span.recordException(error)
    span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String(error.message || error) })
    if (error.code) span.setAttribute('error.type', error.code)
  }
  span.end()
}

const getter = {
  keys(carrier) {
    return Object.keys(carrier)
  },
  get(carrier, key) {
    return carrier[key]
  },
}

/**
 * Runs `fn(ctx)` inside a `process {topic}` span, child of the context `message` carries (trace
 * headers read in any casing); `ctx` is the span's context (undefined without OpenTelemetry).
 */
function runHandler(message, system, fn) {
  const otel = api()
  if (!otel) return fn(undefined)
  const carrier = carrierOf(message.headers) || {}
  const parent = otel.propagation.extract(otel.context.active(), carrier, getter)
  const span = tracer(otel).startSpan(
    `process ${message.topic}`,
    {
      kind: otel.SpanKind.CONSUMER,
      attributes: {
        'messaging.system': system,
        'messaging.operation.type': 'process',
        'messaging.operation.name': 'process',
        'messaging.destination.name': message.topic,
        'messaging.destination.partition.id': String(message.partition),
        'messaging.message.id': message.position,
      },
    },
    parent
  )
  const ctx = otel.trace.setSpan(parent, span)
  return otel.context.with(ctx, async () => {
    try {
      return await fn(ctx)
    } catch (e) {
      span.recordException(e)
      span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String((e && e.message) || e) })
      throw e
    } finally {
      span.end()
    }
  })
}

module.exports = { api, startSend, sameTraceHeaders, merge, endSend, runHandler, traceHeaders, TRACE_HEADERS }
