'use strict'
// Break-it findings (#31): an unknown key of a record, of send options, of dedupStore's options
// or of a memory:// producer / consumer `options` map is a config error naming it, never
// silently ignored (a misspelled idempotencyKey sent a keyless record, processed twice).
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { unique, topic } = require('./helpers')

const memory = () => `memory://${unique('node')}`
const ACCEPTED = 'expected topic, payload, key, headers, partition, timestamp, idempotencyKey, requeue'
const SEND_OPTIONS = 'expected key, headers, partition, timestamp, idempotencyKey, requeue'

function configError(text) {
  return (e) => {
    assert.equal(e.code, 'ONCEFLOW_CONFIG', e.message)
    assert.equal(e.kind, 'config')
    assert.ok(e instanceof onceflow.OnceflowError)
    assert.ok(e.message.includes(text), `${JSON.stringify(e.message)} lacks ${JSON.stringify(text)}`)
    return true
  }
}

test('an unknown key of send options or of a record is refused, naming it and the accepted ones', async () => {
  const client = await onceflow.connect(memory())
  const t = await topic(client)
  const producer = await client.producer()
  await assert.rejects(
    async () => producer.send(t, 'x', { idempotency_key: 'order-1' }),
    configError(`send options: unknown key 'idempotency_key' (did you mean idempotencyKey?): ${SEND_OPTIONS}`)
  )
  // topic and payload are arguments of this form, not options.
  await assert.rejects(async () => producer.send(t, 'x', { topic: 'other' }), configError(`send options: unknown key 'topic'`))
  await assert.rejects(async () => producer.send(t, 'x', 'k'), configError('send options: expected an object, got string'))
  await assert.rejects(
    async () => producer.send({ topic: t, payload: 'x', idempotencykey: 'k' }),
    configError(`record: unknown key 'idempotencykey' (did you mean idempotencyKey?): ${ACCEPTED}`)
  )
  await assert.rejects(
    async () => producer.send({ topic: t, payload: 'x', Key: 'k' }),
    configError(`record: unknown key 'Key' (did you mean key?)`)
  )
  await assert.rejects(
    async () => producer.send({ topic: t, payload: 'x', retries: 3 }),
    configError(`record: unknown key 'retries': ${ACCEPTED}`)
  )
  const bad = { topic: t, payload: 'x', idempotency_key: 'k' }
  const good = { topic: t, payload: 'ok', idempotencyKey: 'k' }
  await assert.rejects(async () => producer.sendBatch([good, bad]), configError(`record: unknown key 'idempotency_key'`))
  await assert.rejects(async () => producer.sendAtomic([good, bad]), configError(`record: unknown key 'idempotency_key'`))

  const txProducer = await client.producer({ transactionalId: unique('tx') })
  await assert.rejects(
    async () => txProducer.transaction(async (tx) => tx.send(t, 'x', { idempotency_key: 'k' })),
    configError(`send options: unknown key 'idempotency_key'`)
  )
  await assert.rejects(
    async () => txProducer.transaction(async (tx) => tx.sendBatch([bad])),
    configError(`record: unknown key 'idempotency_key'`)
  )

  // Nothing refused was written; the accepted spellings still send, keyed.
  const d = await producer.send(t, 'x', { idempotencyKey: 'order-1', key: 'k', headers: { a: '1' }, partition: 0 })
  assert.equal(d.position, 'offset:0')
  const [r] = await producer.sendBatch([good])
  assert.equal(r.position, 'offset:1')
})

test('a numeric record field given as a string is refused for its type, not its range', async () => {
  const client = await onceflow.connect(memory())
  const t = await topic(client)
  const producer = await client.producer()
  const record = { topic: t, payload: 'job', idempotencyKey: 'job-1' }
  await assert.rejects(async () => producer.send({ ...record, requeue: '1' }), configError('requeue: expected a number, got string'))
  await assert.rejects(async () => producer.send({ ...record, partition: '0' }), configError('partition: expected a number, got string'))
  await assert.rejects(async () => producer.send({ ...record, timestamp: '1700000000000' }), configError('timestamp: expected a number, got string'))
  await assert.rejects(async () => producer.send(t, 'x', { requeue: '1', idempotencyKey: 'k' }), configError('requeue: expected a number, got string'))
  // A number out of range still gets the range message.
  await assert.rejects(async () => producer.send({ ...record, requeue: -1 }), configError('requeue -1: expected a whole number from 0 to 4294967295'))
})

test('dedupStore takes { windowMs } only: a number or an unknown key is refused', async () => {
  const store = await onceflow.dedupStore('memory://', { windowMs: 1000 })
  assert.ok(store)
  assert.ok(await onceflow.dedupStore('memory://'))
  await assert.rejects(
    async () => onceflow.dedupStore('memory://', { window: 1000 }),
    configError(`dedupStore options: unknown key 'window': expected windowMs`)
  )
  await assert.rejects(
    async () => onceflow.dedupStore('memory://', { window_ms: 1000 }),
    configError(`dedupStore options: unknown key 'window_ms' (did you mean windowMs?)`)
  )
  await assert.rejects(
    async () => onceflow.dedupStore('memory://', 1000),
    configError('dedupStore options: expected an object { windowMs }, got number')
  )
  await assert.rejects(async () => onceflow.dedupStore('memory://', { windowMs: '1000' }), configError('windowMs: expected a number, got string'))
  // The native function is not the documented one.
  assert.equal(onceflow._dedupStore, undefined)
})

test('memory:// refuses producer and consumer options it does not read, naming them', async () => {
  const client = await onceflow.connect(memory())
  const t = await topic(client)
  await assert.rejects(
    async () => client.consumer(unique('g'), [t], { options: { ackWaitMs: 100 } }),
    configError(`unknown memory:// consumer option 'ackWaitMs'`)
  )
  await assert.rejects(
    async () => client.producer({ options: { 'linger.ms': 5, 'sasl.password': 'hunter2-s3cret' } }),
    (e) =>
      configError(`unknown memory:// producer options 'linger.ms', 'sasl.password'`)(e) &&
      e.message.includes('partitions, auto_create, max_record_bytes') &&
      !e.message.includes('hunter2')
  )
  // Without options both open as before.
  await client.producer()
  const c = await client.consumer(unique('g'), [t])
  await c.close()
})
