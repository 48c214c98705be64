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
    // The attributes come from the core's span plans (onceflow::trace::plan), as the Rust
    // engine's and Python's do: the same keys in every language.
    assert.deepEqual(Object.keys(send.attributes).sort(), [
      'messaging.destination.name', 'messaging.destination.partition.id', 'messaging.message.body.size',
      'messaging.message.id', 'messaging.operation.name', 'messaging.operation.type', 'messaging.system',
    ])
    assert.deepEqual(Object.keys(proc.attributes).sort(), [
      'messaging.consumer.group.name', 'messaging.destination.name', 'messaging.destination.partition.id',
      'messaging.message.body.size', 'messaging.message.id', 'messaging.operation.name',
      'messaging.operation.type', 'messaging.system',
    ])
    assert.equal(send.attributes['messaging.message.body.size'], 5)
    assert.equal(proc.attributes['messaging.consumer.group.name'], consumer.group)
  })
}

const parentOf = (s) => (s.parentSpanContext || (s.parentSpanId && { spanId: s.parentSpanId }) || {}).spanId
const anyCase = (m, name) => m.headers.filter((h) => h.name.toLowerCase() === name).map((h) => h.value && h.value.toString())
const TP = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'
const TS = 'congo=t61rcWkgMzE'

for (const p of platforms()) {
  // Issue #30, point 7: in every mode (Kafka: transactions; JetStream, memory: message ids)
  // each output is a child of the transform's `process` span, also when the transform copies
  // the input's headers (its traceparent) onto the output.
  test(`${p.name}: pipeline outputs are children of the JavaScript process span`, async () => {
    exporter.reset()
    const client = await onceflow.connect(p.url())
    const input = await topic(client)
    const output = await topic(client)
    const producer = await client.producer()
    for (let i = 0; i < 4; i++) {
      await tracer.startActiveSpan(`upstream ${i}`, async (span) => {
        await producer.send({ topic: input, payload: `in${i}`, idempotencyKey: unique('k') })
        span.end()
      })
    }
    const consumer = await client.consumer(unique('g'), [input], { start: 'earliest' })
    const outProducer = await client.producer(
      client.capabilities().transactions ? { transactionalId: unique('pipe') } : undefined
    )
    const pipe = new onceflow.Pipeline(
      consumer,
      outProducer,
      async (m) => {
        const copy = Number(m.payload.toString().slice(-1)) % 2 === 1
        return {
          topic: output,
          payload: m.payload.toString().toUpperCase(),
          headers: copy ? m.headers.filter((h) => h.name !== 'idempotency-key') : undefined,
        }
      },
      { store: 'memory://', pollTimeoutMs: 50, transactionIntervalMs: 50 }
    )
    const run = pipe.run()
    const reader = await client.consumer(unique('r'), [output], { start: 'earliest' })
    const got = await collect(reader, 4).finally(() => pipe.stop())
    await run
    await reader.close()
    assert.equal(got.length, 4)
    const spans = exporter.getFinishedSpans()
    const byId = new Map(spans.map((s) => [s.spanContext().spanId, s]))
    const sends = new Set(spans.filter((s) => s.name === `send ${input}`).map((s) => s.spanContext().spanId))
    assert.equal(sends.size, 4)
    for (const m of got) {
      const tps = anyCase(m, 'traceparent')
      assert.equal(tps.length, 1, `${m.payload}: one traceparent`)
      const [, traceId, spanId] = tps[0].split('-')
      const proc = byId.get(spanId)
      assert.ok(proc, `${m.payload}: its traceparent names no exported span (${tps[0]})`)
      assert.equal(proc.name, `process ${input}`)
      assert.equal(proc.spanContext().traceId, traceId)
      assert.ok(sends.has(parentOf(proc)), `${m.payload}: the process span is a child of the input's send span`)
    }
  })

  // Issue #30, point 8: `Traceparent` / `Tracestate` as older clients write them.
  test(`${p.name}: trace headers are read and replaced whatever their case`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    const headers = [['Traceparent', TP], ['Tracestate', TS], ['x', 'y']]
    await producer.send({ topic: t, payload: 'm0', headers })
    await producer.sendBatch([{ topic: t, payload: 'm1', headers }, { topic: t, payload: 'm2', headers }])
    let callerTrace
    await tracer.startActiveSpan('caller', async (span) => {
      callerTrace = span.spanContext().traceId
      await producer.send({ topic: t, payload: 'm3', headers })
      await producer.sendBatch([{ topic: t, payload: 'm4', headers }])
      span.end()
    })
    const reader = await client.consumer(unique('r'), [t], { start: 'earliest' })
    const got = (await collect(reader, 5)).sort((a, b) => a.payload.toString().localeCompare(b.payload.toString()))
    assert.equal(got.length, 5)
    got.forEach((m, i) => {
      const tps = anyCase(m, 'traceparent')
      const tss = anyCase(m, 'tracestate')
      assert.deepEqual(m.headers.filter((h) => h.name.toLowerCase() === 'traceparent').map((h) => h.name), ['traceparent'], `m${i}`)
      assert.ok(m.headers.some((h) => h.name === 'x' && h.value.toString() === 'y'))
      const traceId = tps[0].split('-')[1]
      if (i < 3) {
        assert.equal(traceId, TP.split('-')[1], `m${i}: the record's trace continues`)
        assert.deepEqual(tss, [TS], `m${i}: its tracestate kept`)
      } else {
        assert.equal(traceId, callerTrace, `m${i}: the caller's trace wins`)
        assert.deepEqual(tss, [], `m${i}: the record's tracestate is dropped`)
      }
    })

    await reader.close()
  })
}

// Issue #30, points 9 and 8. Written by kafkajs: onceflow's own producers replace a malformed
// traceparent, and write the lowercase name.
test('kafka: malformed traceparents are counted in engine metrics; a capitalised one is read', { skip: process.env.ONCEFLOW_KAFKA_URL ? false : 'ONCEFLOW_KAFKA_URL not set' }, async () => {
  const { Kafka, logLevel } = require('kafkajs')
  const url = process.env.ONCEFLOW_KAFKA_URL
  const client = await onceflow.connect(url)
  const t = await topic(client)
  const kafka = new Kafka({ clientId: unique('kjs'), brokers: [url.replace(/^kafka:\/\//, '').split('/')[0].split('?')[0]], logLevel: logLevel.NOTHING })
  const kp = kafka.producer()
  await kp.connect()
  await kp.send({
    topic: t,
    messages: [
      { value: 'bad', headers: { traceparent: '00-not-a-trace-01', 'idempotency-key': 'bad' } },
      { value: 'good', headers: { Traceparent: TP, 'idempotency-key': 'good' } },
    ],
  })
  await kp.disconnect()
  let seen = 0
  let goodTrace
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest' }),
    async (m) => {
      if (m.payload.toString() === 'good') goodTrace = api.trace.getSpan(api.context.active()).spanContext().traceId
      seen++
    },
    { store: 'memory://', pollTimeoutMs: 50 }
  )
  const run = ic.run()
  try {
    assert.ok(await until(() => seen === 2))
  } finally {
    ic.stop()
  }
  const summary = await run
  assert.equal(summary.metrics.malformedTraceparents, 1)
  assert.equal(ic.metrics().malformedTraceparents, 1)
  assert.equal(goodTrace, TP.split('-')[1], 'the handler runs in the trace of the `Traceparent` header')
})

test('contextOf: the context a message carries, its trace headers read in any casing', async () => {
  const TP = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'
  const client = await onceflow.connect(`memory://${unique('node')}`)
  const t = await topic(client)
  const producer = await client.producer()
  // No active span: the send span continues the record's own `TraceParent` context.
  await producer.send({ topic: t, payload: 'traced', headers: { TraceParent: TP } })
  await producer.send({ topic: t, payload: 'plain' })
  const [traced, plain] = await collect(await client.consumer(unique('g'), [t], { start: 'earliest' }), 2)
  const traceOf = (m) => api.trace.getSpanContext(onceflow.contextOf(m)).traceId
  assert.equal(traceOf(traced), TP.split('-')[1])
  // Without headers of its own, the record got its send span's new trace.
  const own = plain.headers.find((h) => h.name === 'traceparent').value.toString()
  assert.equal(traceOf(plain), own.split('-')[1])
  assert.notEqual(traceOf(plain), traceOf(traced))
})

// The transactional inbox's handler runs in the message's trace context, inside a `process`
// span per attempt (the core's plan, as the idempotent consumer's): a failed attempt's span is
// marked failed, the retry gets a new one, and a repeated key (a duplicate) starts none (#24).
for (const p of platforms()) {
  test(`${p.name}: the inbox handler runs in a process span, child of the producer span`, async () => {
    exporter.reset()
    const fs = require('node:fs')
    const os = require('node:os')
    const path = require('node:path')
    const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-otel-inbox-')), 'inbox.db')
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    let traceId
    await tracer.startActiveSpan('checkout', async (span) => {
      traceId = span.spanContext().traceId
      // The repeat rides in its own header: JetStream drops a repeated idempotency key.
      await producer.send({ topic: t, payload: 'order', headers: [{ name: 'order-id', value: 'o1' }] })
      await producer.send({ topic: t, payload: 'order', headers: [{ name: 'order-id', value: 'o1' }] })
      span.end()
    })
    await producer.close()
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const active = []
    let attempts = 0
    const inbox = new onceflow.Inbox(
      consumer,
      async (m, tx) => {
        active.push(api.trace.getSpan(api.context.active()).spanContext())
        await tx.query('SELECT 1')
        if (++attempts === 1) throw new Error('first attempt fails')
      },
      file,
      { namespace: unique('ns'), key: 'header:order-id', backoffMs: 10, pollTimeoutMs: 50 }
    )
    assert.ok(await until(async () => {
      await inbox.step()
      const s = inbox.summary()
      return s.handled + s.duplicates >= 2
    }))
    assert.deepEqual(inbox.summary(), { handled: 1, duplicates: 1, behindPosition: 0 })
    await consumer.close()
    const spans = exporter.getFinishedSpans()
    const sends = spans.filter((s) => s.name === `send ${t}`)
    const procs = spans.filter((s) => s.name === `process ${t}`)
    assert.equal(sends.length, 2)
    // Two attempts of the first message, none for the duplicate.
    assert.equal(procs.length, 2, procs.map((s) => s.name).join())
    for (const proc of procs) {
      assert.equal(proc.kind, api.SpanKind.CONSUMER)
      assert.equal(proc.spanContext().traceId, traceId)
      assert.ok(sends.map((x) => x.spanContext().spanId).includes(parentOf(proc)), 'a child of a send span')
      assert.equal(proc.attributes['messaging.consumer.group.name'], consumer.group)
      assert.deepEqual(Object.keys(proc.attributes).sort(), [
        'messaging.consumer.group.name', 'messaging.destination.name', 'messaging.destination.partition.id',
        'messaging.message.body.size', 'messaging.message.id', 'messaging.operation.name',
        'messaging.operation.type', 'messaging.system',
      ])
    }
    assert.equal(parentOf(procs[0]), parentOf(procs[1]), 'both attempts continue the same message')
    assert.equal(procs[0].status.code, api.SpanStatusCode.ERROR)
    assert.notEqual(procs[1].status.code, api.SpanStatusCode.ERROR)
    assert.deepEqual(active.map((c) => c.spanId), procs.map((s) => s.spanContext().spanId))
  })
}
