'use strict'
// Trace continuity with the OpenTelemetry SDK's in-memory exporter: a span active around
// `send` is the parent of the producer span, and the handler runs inside a `process` span
// of the same trace, child of the producer span.
const test = require('node:test')
const assert = require('node:assert/strict')
const api = require('@opentelemetry/api')
const { AsyncLocalStorageContextManager } = require('@opentelemetry/context-async-hooks')
const { W3CTraceContextPropagator } = require('@opentelemetry/core')
const { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } = require('@opentelemetry/sdk-trace-base')
const onceflow = require('..')
const { platforms, topic, unique, until, collect } = require('./helpers')

const exporter = new InMemorySpanExporter()
api.context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable())
api.propagation.setGlobalPropagator(new W3CTraceContextPropagator())
api.trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }))
const tracer = api.trace.getTracer('test')

for (const p of platforms()) {
  test(`${p.name}: trace context flows from send to the handler`, async () => {
    exporter.reset()
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    let traceId
    await tracer.startActiveSpan('checkout', async (span) => {
      traceId = span.spanContext().traceId
      await producer.send({ topic: t, payload: 'order', idempotencyKey: unique('k') })
      span.end()
    })
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    let inHandler
    const ic = new onceflow.IdempotentConsumer(
      consumer,
      async () => {
        inHandler = api.trace.getSpan(api.context.active()).spanContext()
      },
      { store: 'memory://', pollTimeoutMs: 50 }
    )
    const run = ic.run()
    try {
      assert.ok(await until(() => inHandler !== undefined))
    } finally {
      ic.stop()
    }
    await run
    const spans = exporter.getFinishedSpans()
    const send = spans.find((s) => s.name === `send ${t}`)
    const proc = spans.find((s) => s.name === `process ${t}`)
    assert.ok(send, 'a producer span')
    assert.ok(proc, 'a process span')
    assert.equal(send.spanContext().traceId, traceId)
    assert.equal(proc.spanContext().traceId, traceId)
    assert.equal(inHandler.traceId, traceId, 'the handler runs inside the extracted context')
    const parentOf = (s) => (s.parentSpanContext || s.parentSpanId && { spanId: s.parentSpanId } || {}).spanId
    assert.equal(parentOf(proc), send.spanContext().spanId)
  })
}
