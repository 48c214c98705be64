'use strict'
// OpenTelemetry propagation, used only when `@opentelemetry/api` can be loaded (from this
// package or from the application's folder). What each span looks like is decided by the Rust
// core (`onceflow::trace::plan`), the same code that decides the Rust engine's own spans: the
// span's name, kind and attributes, where its parent comes from, and how injected trace
// headers replace a record's own. This file only hands those plans to `@opentelemetry/api`.
//
// On send, a `send {topic}` producer span is started as a child of the active context (or,
// without an active span, of the valid traceparent the record carries) and its context is
// written to the record's headers (W3C traceparent / tracestate / baggage through the global
// propagator) before the record crosses into Rust. On handling, a `process {topic}` consumer
// span is started as the child of the context the message carries, and the handler runs inside
// it. A pipeline's transform runs inside that span too, and its outputs are sent as its
// children. Without the package, headers pass through to the Rust core untouched.
//
// Trace header names are read, replaced and removed in any casing (`Traceparent`, as some
// older clients write it, is `traceparent`; W3C Trace Context §3.1, §3.3): a record leaves
// with one `traceparent` and at most one `tracestate`, under the lowercase names, and a
// record's own `tracestate` goes on with its own trace only (it belongs to its traceparent).
const path = require('node:path')
const { createRequire } = require('node:module')

let cached
let native

/** Set by index.js once the addon is loaded: the span plans come from it. */
function setNative(n) {
  native = n
}

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

const getter = {
  keys(carrier) {
    return Object.keys(carrier)
  },
  get(carrier, key) {
    return carrier[key]
  },
}

const valid = (otel, ctx) => {
  const span = otel.trace.getSpan(ctx)
  return Boolean(span && otel.isSpanContextValid(span.spanContext()))
}

/** The context `carrier` carries, on an empty base (none: an empty context). */
function extract(otel, carrier) {
  return carrier ? otel.propagation.extract(otel.ROOT_CONTEXT, carrier, getter) : otel.ROOT_CONTEXT
}

/** A plan's parent (`onceflow::trace::plan::Parent`). */
function parentOf(otel, plan) {
  const active = otel.context.active()
  if (plan.parent === 'current') return active
  if (plan.parent === 'headers') return extract(otel, plan.carrier)
  // current_else: the active span when valid, else the record's own valid context.
  if (valid(otel, active) || !plan.carrier) return active
  const own = extract(otel, plan.carrier)
  return valid(otel, own) ? own : active
}

/** Starts the span of `plan`; returns `{ span, parent }`. */
function start(otel, plan) {
  const parent = parentOf(otel, plan)
  const links = []
  for (const c of plan.links) {
    const span = otel.trace.getSpan(extract(otel, c))
    if (span && otel.isSpanContextValid(span.spanContext())) links.push({ context: span.spanContext() })
  }
  const kind = plan.kind === 'producer' ? otel.SpanKind.PRODUCER : otel.SpanKind.CONSUMER
  const span = tracer(otel).startSpan(plan.name, { kind, attributes: plan.attributes, links }, parent)
  return { span, parent }
}

function fail(otel, span, error) {
  span.recordException(error)
  span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String((error && error.message) || error) })
  if (error && error.code) span.setAttributes(native._failedSpanAttributes(String(error.code)))
}

/**
 * Whether every record carries the same trace headers (or none): one span can then be the
 * parent of the whole batch (decided by the core). Records whose own traceparents differ are
 * left to the Rust core, which continues each one's trace.
 */
function sameTraceHeaders(records) {
  return native._oneSpanForBatch(records.map((r) => r.headers || null))
}

/**
 * Starts the producer span of a send (one span for a batch), a child of the active span or,
 * without one, of the valid trace context `headers` (normalised) carry. Returns
 * `{ span, headers }` with the trace headers to add (a name → value object), or null when there
 * is nothing to propagate. `bodySize`: the payload's bytes, for a single record.
 */
function startSend(topic, system, count, headers, bodySize) {
  const otel = api()
  if (!otel) return null
  const plan = native._sendSpanPlan(system, topic, count, count === 1 ? bodySize : undefined, headers || null)
  const { span, parent } = start(otel, plan)
  if (!otel.isSpanContextValid(span.spanContext())) {
    span.end()
    return null
  }
  const carrier = {}
  otel.propagation.inject(otel.trace.setSpan(parent, span), carrier)
  if (Object.keys(carrier).length === 0) {
    span.end()
    return null
  }
  return { span, headers: carrier }
}

/** `headers` (normalised) with the injected trace headers applied by the core's rule. */
function merge(headers, injected) {
  const out = {}
  for (const [k, v] of Object.entries(injected)) out[k] = String(v)
  return native._applyTraceHeaders(headers || null, out)
}

/**
 * The W3C headers (`{name, value}` items) of `ctx`, or null when its span is not valid: the
 * parent a pipeline hands to the Rust core for the outputs of a transform run in `ctx`.
 */
function traceHeaders(ctx) {
  const otel = api()
  if (!otel || !ctx || !valid(otel, ctx)) return null
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
    span.setAttributes(native._deliveredSpanAttributes(delivery.partition, delivery.position))
  }
  if (error) fail(otel, span, error)
  span.end()
}

/**
 * Runs `fn(ctx)` inside a `process {topic}` span, child of the context `message` carries (trace
 * headers read in any casing), for a member of `group`; `ctx` is the span's context (undefined
 * without OpenTelemetry).
 */
function runHandler(message, system, group, fn) {
  const otel = api()
  if (!otel) return fn(undefined)
  const plan = native._processSpanPlan(
    system,
    group,
    message.topic,
    message.partition,
    message.position,
    message.payload ? message.payload.length : 0,
    message.headers || null
  )
  const { span, parent } = start(otel, plan)
  const ctx = otel.trace.setSpan(parent, span)
  return otel.context.with(ctx, async () => {
    try {
      return await fn(ctx)
    } catch (e) {
      fail(otel, span, e)
      throw e
    } finally {
      span.end()
    }
  })
}

/**
 * The OpenTelemetry context `message` carries (its trace headers, read in any casing by the
 * core): an empty context when it carries none, undefined without OpenTelemetry.
 */
function contextOf(message) {
  const otel = api()
  if (!otel) return undefined
  return extract(otel, native._traceCarrier(message.headers || null))
}

module.exports = { api, setNative, startSend, sameTraceHeaders, merge, endSend, runHandler, traceHeaders, contextOf }
