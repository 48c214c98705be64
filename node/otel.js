'use strict'
// OpenTelemetry propagation, used only when `@opentelemetry/api` can be loaded (from this
// package or from the application's folder). On send, a `send {topic}` producer span is
// started as a child of the active context and its context is written to the record's
// headers (W3C traceparent / tracestate / baggage through the global propagator) before the
// record crosses into Rust. On handling, the context a message carries is extracted, a
// `process {topic}` consumer span is started as its child, and the handler runs inside it.
// Without the package, or without an active span, headers pass through untouched.
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

/**
 * Starts the producer span of a send (one span for a batch). Returns `{ span, headers }`
 * with the trace headers to add, or null when there is nothing to propagate.
 */
function startSend(topic, system, count) {
  const otel = api()
  if (!otel) return null
  const parent = otel.context.active()
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

/** `headers` (normalised) with any trace headers replaced by the injected ones. */
function merge(headers, injected) {
  const kept = (headers || []).filter((h) => !TRACE_HEADERS.has(h.name))
  return kept.concat(injected)
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

/** Runs `fn()` inside a `process {topic}` span, child of the context `message` carries. */
function runHandler(message, system, fn) {
  const otel = api()
  if (!otel) return fn()
  const carrier = {}
  for (const h of message.headers) {
    if (TRACE_HEADERS.has(h.name) && h.value !== null && !(h.name in carrier)) {
      carrier[h.name] = h.value.toString()
    }
  }
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
  return otel.context.with(otel.trace.setSpan(parent, span), async () => {
    try {
      return await fn()
    } catch (e) {
      span.recordException(e)
      span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String((e && e.message) || e) })
      throw e
    } finally {
      span.end()
    }
  })
}

module.exports = { api, startSend, merge, endSend, runHandler, TRACE_HEADERS }
