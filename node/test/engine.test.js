'use strict'
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const onceflow = require('..')
const { platforms, topic, collect, unique, until } = require('./helpers')

function stores() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-node-'))
  return [
    { name: 'memory', url: () => 'memory://' },
    { name: 'embedded', url: () => `embedded://${path.join(dir, `${unique('d')}.db`)}` },
  ]
}

for (const p of platforms()) {
  test(`${p.name}: transaction commits, a throwing one aborts`, async (t) => {
    const client = await onceflow.connect(p.url())
    if (!client.capabilities().transactions) {
      t.skip(`${p.name} has no producer transactions (capabilities().transactions is false)`)
      return
    }
    const out = await topic(client)
    const producer = await client.producer({ transactionalId: unique('tx') })
    const r = await producer.transaction(async (tx) => {
      await tx.send({ topic: out, payload: 'a' })
      await tx.sendBatch([{ topic: out, payload: 'b' }, { topic: out, payload: 'c' }])
      return 'done'
    })
    assert.equal(r, 'done')
    await assert.rejects(
      producer.transaction(async (tx) => {
        await tx.send({ topic: out, payload: 'never' })
        throw new Error('changed my mind')
      }),
      /changed my mind/
    )
    const consumer = await client.consumer(unique('g'), [out], { start: 'earliest' })
    const got = await collect(consumer, 3)
    await new Promise((res) => setTimeout(res, 500))
    got.push(...(await consumer.poll(100, 500)))
    assert.deepEqual(got.map((m) => m.payload.toString()).sort(), ['a', 'b', 'c'])
    await consumer.close()
  })

  for (const s of stores()) {
    test(`${p.name}: idempotent handler with the ${s.name} store runs once per key`, async () => {
      const client = await onceflow.connect(p.url())
      const t = await topic(client)
      const producer = await client.producer()
      // JetStream itself drops a repeated idempotency key (Nats-Msg-Id) within its window:
      // count what the platform actually wrote.
      let written = 0
      for (const k of ['k1', 'k2', 'k1', 'k3', 'k2']) {
        const d = await producer.send({ topic: t, payload: `order ${k}`, idempotencyKey: k })
        if (!d.duplicate) written++
      }
      const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
      const seen = []
      const ic = new onceflow.IdempotentConsumer(
        consumer,
        async (m) => {
          seen.push(m.payload.toString())
          return Buffer.from('ok')
        },
        { store: s.url(), pollTimeoutMs: 50, commitIntervalMs: 100 }
      )
      const run = ic.run()
      try {
        assert.ok(await until(() => ic.metrics() && ic.metrics().consumed >= written))
      } finally {
        ic.stop()
      }
      const summary = await run
      assert.deepEqual(seen.sort(), ['order k1', 'order k2', 'order k3'])
      assert.equal(summary.metrics.duplicatesSkipped, written - 3)
      assert.equal(summary.guarantee, 'effectively-once')
    })
  }

  test(`${p.name}: a throwing handler is retried and its message not lost`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    for (let i = 0; i < 3; i++) await producer.send({ topic: t, payload: `m${i}`, idempotencyKey: `m${i}` })
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const attempts = new Map()
    const done = new Set()
    const ic = new onceflow.IdempotentConsumer(
      consumer,
      async (m) => {
        const k = m.payload.toString()
        const n = (attempts.get(k) || 0) + 1
        attempts.set(k, n)
        if (k === 'm1' && n < 3) throw new Error(`flaky ${n}`)
        done.add(k)
      },
      { store: 'memory://', minBackoffMs: 10, maxBackoffMs: 20, maxAttempts: 5, pollTimeoutMs: 50 }
    )
    const run = ic.run()
    try {
      assert.ok(await until(() => done.size === 3))
    } finally {
      ic.stop()
    }
    const summary = await run
    assert.equal(attempts.get('m1'), 3)
    assert.equal(summary.metrics.handlerErrors, 2)
    assert.equal(summary.metrics.processed, 3)
  })

  test(`${p.name}: onFailure stop rejects run() with the handler's error as cause`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    await producer.send({ topic: t, payload: 'poison' })
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const boom = new RangeError('poison pill')
    const ic = new onceflow.IdempotentConsumer(
      consumer,
      async () => {
        throw boom
      },
      { maxAttempts: 2, minBackoffMs: 5, maxBackoffMs: 5, onFailure: 'stop', pollTimeoutMs: 50 }
    )
    await assert.rejects(ic.run(), (e) => {
      assert.ok(e instanceof onceflow.OnceflowError)
      assert.equal(e.code, 'ONCEFLOW_HANDLER')
      let c = e.cause
      while (c && c !== boom) c = c.cause
      assert.equal(c, boom, 'the thrown error is in the cause chain')
      return true
    })
  })

  test(`${p.name}: Pipeline transforms and writes`, async () => {
    const client = await onceflow.connect(p.url())
    const input = await topic(client)
    const output = await topic(client)
    const producer = await client.producer()
    for (let i = 0; i < 5; i++) await producer.send({ topic: input, payload: `${i}` })
    const consumer = await client.consumer(unique('g'), [input], { start: 'earliest' })
    const outProducer = await client.producer(
      client.capabilities().transactions ? { transactionalId: unique('pipe') } : undefined
    )
    const pipe = new onceflow.Pipeline(
      consumer,
      outProducer,
      async (m) => ({ topic: output, payload: Buffer.from(String(Number(m.payload.toString()) * 10)) }),
      { store: 'memory://', pollTimeoutMs: 50, transactionIntervalMs: 50 }
    )
    const run = pipe.run()
    const reader = await client.consumer(unique('r'), [output], { start: 'earliest' })
    const got = await collect(reader, 5).finally(() => pipe.stop())
    await run
    assert.deepEqual(got.map((m) => m.payload.toString()).sort(), ['0', '10', '20', '30', '40'])
    assert.equal(typeof pipe.mechanism, 'string')
    await reader.close()
  })

  // No OpenTelemetry span here, and some inputs give no output: the transform's result reaches
  // the core with its fields left out, never null (08d9c90 sent `records: null` / `parent:
  // null`, which napi rejects as a wrong-typed array: every transform failed, no output).
  test(`${p.name}: Pipeline transform resolving to nothing writes nothing for that input`, async () => {
    const client = await onceflow.connect(p.url())
    const input = await topic(client)
    const output = await topic(client)
    const producer = await client.producer()
    for (let i = 0; i < 6; i++) await producer.send({ topic: input, payload: `${i}` })
    const consumer = await client.consumer(unique('g'), [input], { start: 'earliest' })
    const outProducer = await client.producer(
      client.capabilities().transactions ? { transactionalId: unique('pipe') } : undefined
    )
    const nothing = [null, undefined, []]
    const pipe = new onceflow.Pipeline(
      consumer,
      outProducer,
      async (m) => {
        const i = Number(m.payload.toString())
        return i % 2 === 1 ? nothing[(i - 1) / 2] : { topic: output, payload: `out${i}` }
      },
      { store: 'memory://', pollTimeoutMs: 50, transactionIntervalMs: 50, maxAttempts: 1, onFailure: 'stop' }
    )
    const run = pipe.run()
    try {
      assert.ok(await until(() => pipe.metrics() && pipe.metrics().processed === 6), 'all 6 inputs processed')
    } finally {
      pipe.stop()
    }
    const summary = await run
    assert.equal(summary.metrics.handlerErrors, 0)
    assert.equal(summary.metrics.produced, 3)
    const reader = await client.consumer(unique('r'), [output], { start: 'earliest' })
    const got = await collect(reader, 3)
    assert.deepEqual(got.map((m) => m.payload.toString()).sort(), ['out0', 'out2', 'out4'])
    await reader.close()
  })
}

test('engine options: a misspelled name, a wrong type or a bad value throws a config error naming it', async () => {
  const client = await onceflow.connect(`memory://${unique('opts')}`)
  const consumer = await client.consumer(unique('g'), [unique('t')])
  const producer = await client.producer()
  const refused = async (make, text) => {
    const err = await make().run().then(() => null, (e) => e)
    assert.ok(err instanceof onceflow.OnceflowError, `${text}: ${err}`)
    assert.equal(err.kind, 'config')
    assert.ok(err.message.includes(text), `expected '${text}' in: ${err.message}`)
    return err
  }
  const handler = async () => null
  const idem = (o) => () => new onceflow.IdempotentConsumer(consumer, handler, o)
  const err = await refused(idem({ leseMs: 100 }), "unknown setting 'leseMs'")
  assert.ok(err.message.includes('leaseMs') && err.message.endsWith('store, windowMs, deadLetterProducer'), err.message)
  await refused(idem({ maxAttempts: 0 }), 'maxAttempts 0: expected a whole number from 1')
  await refused(idem({ batchSize: -1 }), 'batchSize -1: expected a whole number from 1')
  await refused(idem({ commitEvery: 2.5 }), 'commitEvery 2.5: expected a whole number')
  await refused(idem({ leaseMs: '30000' }), 'leaseMs: expected a number of milliseconds, got string')
  await refused(idem({ tracing: 'yes' }), 'tracing: expected a boolean, got string')
  await refused(idem({ onFailure: 'retry' }), "onFailure: failure policy 'retry'")
  await refused(idem({ mode: 'idempotent' }), "unknown setting 'mode'")
  const pipe = (o) => () => new onceflow.Pipeline(consumer, producer, async () => null, o)
  await refused(pipe({ maxTransactionInputs: 0 }), 'maxTransactionInputs 0: expected a whole number from 1')
  await refused(pipe({ mode: 'exactly' }), "mode: pipeline mode 'exactly'")
  await refused(pipe({ deadLetterProducer: producer }), "unknown setting 'deadLetterProducer'")
  // undefined and null keep the default.
  const ok = new onceflow.IdempotentConsumer(consumer, handler, { leaseMs: undefined, namespace: null })
  assert.equal(await ok.step(), 0)
  await consumer.close()
})

test('poll sizes: 0, negative and fractional counts are refused, not rounded', async () => {
  const client = await onceflow.connect(`memory://${unique('poll')}`)
  const consumer = await client.consumer(unique('g'), [unique('t')])
  for (const max of [0, -1, 2.5]) {
    await assert.rejects(consumer.poll(max, 10), (e) => e.kind === 'config' && e.message.includes(`max ${max}`))
  }
  await assert.rejects(consumer.batches({ batchSize: 0, timeoutMs: 10 }).next(), (e) => e.kind === 'config')
  await consumer.close()
})
