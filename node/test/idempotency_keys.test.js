'use strict'
// Idempotency keys from Node (#31): keyless messages are counted, `requireKey: true`
// dead-letters them naming the header, a conflicting payload does not stop the consumer, and
// `requeue: n` runs a processed job once more (on the real JetStream when ONCEFLOW_NATS_URL is set).
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { unique, platforms, topic, collect, until } = require('./helpers')

const memory = () => `memory://${unique('node')}`

async function runUntil(ic, pred) {
  const run = ic.run()
  try {
    assert.ok(await until(pred), 'condition reached')
  } finally {
    ic.stop()
  }
  return run
}

for (const p of platforms()) test(`${p.name}: keyless messages run and are counted`, async () => {
  const client = await onceflow.connect(p.url())
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'no key' })
  await producer.send({ topic: t, payload: 'keyed', idempotencyKey: 'k1' })
  const seen = []
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest' }),
    async (m) => {
      seen.push(m.payload.toString())
    },
    { store: 'memory://', pollTimeoutMs: 50 }
  )
  const summary = await runUntil(ic, () => seen.length === 2)
  assert.deepEqual(seen, ['no key', 'keyed'])
  assert.equal(summary.metrics.keyless, 1)
})

for (const p of platforms()) test(`${p.name}: requireKey dead-letters a keyless message naming the header`, async () => {
  const client = await onceflow.connect(p.url())
  const t = await topic(client)
  const dlq = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'no key' })
  await producer.send({ topic: t, payload: 'keyed', idempotencyKey: 'k1' })
  const seen = []
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest' }),
    async (m) => {
      seen.push(m.payload.toString())
    },
    { store: 'memory://', pollTimeoutMs: 50, requireKey: true, onFailure: `dead-letter:${dlq}`, deadLetterProducer: producer }
  )
  const summary = await runUntil(ic, () => seen.length === 1 && ic.metrics().deadLettered === 1)
  assert.deepEqual(seen, ['keyed'])
  assert.equal(summary.metrics.keyless, 0)
  const [dead] = await collect(await client.consumer(unique('g'), [dlq], { start: 'earliest' }), 1)
  assert.equal(dead.payload.toString(), 'no key')
  assert.match(onceflow.header(dead, 'onceflow-error').toString(), /header 'idempotency-key'/)
  assert.equal(onceflow.header(dead, 'onceflow-error-kind').toString(), 'ONCEFLOW_CONFIG')
})

// Not on JetStream: the server drops the second publish of a key itself (Nats-Msg-Id).
for (const p of platforms().filter((p) => p.name !== 'nats')) test(`${p.name}: a conflicting payload does not stop the consumer`, async () => {
  const client = await onceflow.connect(p.url())
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'first', idempotencyKey: 'k' })
  await producer.send({ topic: t, payload: 'second', idempotencyKey: 'k' })
  const seen = []
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest' }),
    async (m) => {
      seen.push(m.payload.toString())
    },
    { store: 'memory://', pollTimeoutMs: 50, redeliveryDelayMs: 10 }
  )
  // Before #31 run() rejected with ONCEFLOW_CONFLICT; now the conflict is redelivered.
  const summary = await runUntil(ic, () => ic.metrics() && ic.metrics().redeliveryRequests >= 2)
  assert.deepEqual(seen, ['first'])
  assert.ok(summary.metrics.redeliveryRequests >= 2)
})

test('memory: requeue needs a whole number and an idempotency key', async () => {
  const client = await onceflow.connect(memory())
  const t = await topic(client)
  const producer = await client.producer()
  await assert.rejects(
    async () => producer.send({ topic: t, payload: 'job', idempotencyKey: 'job-1', requeue: 1.5 }),
    (e) => e.code === 'ONCEFLOW_CONFIG' && e.message.includes('requeue 1.5')
  )
  await assert.rejects(
    async () => producer.send({ topic: t, payload: 'job', requeue: 1 }),
    (e) => e.code === 'ONCEFLOW_CONFIG' && e.message.includes('no idempotency key')
  )
})

test('nats: requeue runs a processed job once more', { skip: !process.env.ONCEFLOW_NATS_URL && 'ONCEFLOW_NATS_URL is not set' }, async () => {
  const client = await onceflow.connect(process.env.ONCEFLOW_NATS_URL)
  const t = await topic(client)
  const producer = await client.producer()
  const job = { topic: t, payload: 'job', idempotencyKey: 'job-1' }
  const first = await producer.send(job)
  const seen = []
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest' }),
    async (m) => {
      const g = onceflow.header(m, 'onceflow-key-generation')
      seen.push(g === undefined ? 0 : Number(g.toString()))
    },
    { store: 'memory://', pollTimeoutMs: 50 }
  )
  const run = ic.run()
  let again, requeued, repeat
  try {
    assert.ok(await until(() => seen.length === 1))
    again = await producer.send(job)
    requeued = await producer.send({ ...job, requeue: 1 })
    repeat = await producer.send({ ...job, requeue: 1 })
    assert.ok(await until(() => seen.length === 2))
    await new Promise((r) => setTimeout(r, 1000))
  } finally {
    ic.stop()
  }
  await run
  assert.equal(first.duplicate, false)
  assert.equal(again.duplicate, true, 'a plain re-send is dropped by the duplicate window')
  assert.equal(requeued.duplicate, false, 'generation 1 is a new message id')
  assert.equal(repeat.duplicate, true, 'generation 1 twice is a duplicate')
  assert.deepEqual(seen, [0, 1])
})
