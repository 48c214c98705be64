'use strict'
// JetStream from Node (#31), on the real nats-server (ONCEFLOW_NATS_URL): the durability report
// of describeTopic, require_durable, and the consumer options: a handler longer than
// ack_wait_ms is not redelivered (the in-progress keepalive), reset=true restarts an existing
// durable at an explicit start, idle_heartbeat_ms / pull_expires_ms are taken, and wrong
// types or unknown keys throw naming the option.
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { unique, topic, collect } = require('./helpers')

const url = process.env.ONCEFLOW_NATS_URL
const skip = !url && 'ONCEFLOW_NATS_URL is not set'
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const configError = (...parts) => (e) =>
  e instanceof onceflow.OnceflowError && e.kind === 'config' && parts.every((p) => e.message.includes(p))

test('nats: describeTopic reports the durability of a file and a memory stream', { skip }, async () => {
  const client = await onceflow.connect(url)
  const admin = await client.admin()
  const file = unique('t')
  const memory = unique('t')
  await admin.createTopic(file, { partitions: 1 })
  await admin.createTopic(memory, { partitions: 1, options: { storage: 'memory' } })
  try {
    const f = await admin.describeTopic(file)
    assert.equal(f.name, file)
    assert.equal(f.partitions, 1)
    assert.equal(f.storage, 'file')
    assert.equal(f.replicas, 1)
    // An ordinary user cannot read the server's sync_interval: unknown, and durableOnAck absent.
    assert.ok(f.sync === 'unknown' || f.sync === 'always' || /^\d+ ms$/.test(f.sync), f.sync)
    assert.equal(f.durableOnAck, f.sync === 'always' ? true : f.sync === 'unknown' ? undefined : false)
    assert.equal(f.options.sync, f.sync, 'the raw options carry the same report')
    const m = await admin.describeTopic(memory)
    assert.equal(m.storage, 'memory')
    assert.equal(m.durableOnAck, false, 'a memory stream loses acknowledged writes on a restart')
    await assert.rejects(admin.describeTopic(unique('missing')), (e) => e.kind === 'not_found')
  } finally {
    await admin.deleteTopic(file)
    await admin.deleteTopic(memory)
  }
})

test('nats: require_durable is a connection option; a memory topic still works with it', { skip }, async () => {
  const client = await onceflow.connect(url, { require_durable: true })
  const admin = await client.admin()
  const t = unique('t')
  await admin.createTopic(t, { partitions: 1, options: { storage: 'memory' } })
  try {
    // Not durable on ack: a warning in the log, not an error.
    const producer = await client.producer()
    await producer.send({ topic: t, payload: 'kept in memory' })
    assert.equal((await admin.describeTopic(t)).durableOnAck, false)
    const [m] = await collect(await client.consumer(unique('g'), [t], { start: 'earliest' }), 1)
    assert.equal(m.payload.toString(), 'kept in memory')
  } finally {
    await admin.deleteTopic(t)
  }
  await assert.rejects(async () => onceflow.connect(url, { require_durable: 'maybe' }), configError('require_durable'))
  await assert.rejects(async () => onceflow.connect(url, { require_durable: {} }), configError("option 'require_durable'", 'got object'))
})

test('nats: a handler longer than ack_wait_ms is not redelivered', { skip }, async () => {
  const client = await onceflow.connect(url)
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'slow job', idempotencyKey: 'slow-1' })
  const calls = []
  // No dedup store: a redelivery would run the handler again.
  const ic = new onceflow.IdempotentConsumer(
    await client.consumer(unique('g'), [t], { start: 'earliest', options: { ack_wait_ms: 1000, max_deliver: 3 } }),
    async (m) => {
      calls.push(m.deliveryCount)
      await sleep(3500) // three and a half ack waits
    },
    { pollTimeoutMs: 50 }
  )
  const run = ic.run()
  try {
    const deadline = Date.now() + 20000
    while (ic.metrics()?.processed !== 1 && Date.now() < deadline) await sleep(50)
    await sleep(2500) // a redelivery would arrive within two ack waits
  } finally {
    ic.stop()
  }
  const summary = await run
  assert.deepEqual(calls, [1], 'one call, first delivery')
  assert.equal(summary.metrics.consumed, 1, 'the message was delivered once')
  assert.equal(summary.metrics.processed, 1)
})

test('nats: reset=true restarts an existing durable at an explicit start; without it the group resumes', { skip }, async () => {
  const client = await onceflow.connect(url)
  const t = await topic(client)
  const producer = await client.producer()
  for (const v of ['a', 'b', 'c']) await producer.send({ topic: t, payload: v })
  const group = unique('g')
  const first = await client.consumer(group, [t], { start: 'earliest' })
  assert.equal((await collect(first, 3)).length, 3)
  await first.commit()
  await first.close()

  const resumed = await client.consumer(group, [t], { start: 'earliest' })
  assert.deepEqual(await collect(resumed, 1, 2000), [], 'an existing durable resumes at its ack floor')
  await resumed.close()

  const reset = await client.consumer(group, [t], { start: 'earliest', options: { reset: true } })
  const again = await collect(reset, 3)
  assert.deepEqual(again.map((m) => m.payload.toString()), ['a', 'b', 'c'], 'reset starts over at earliest')
  await reset.close()
})

test('nats: idle_heartbeat_ms and pull_expires_ms are taken; wrong types and unknown keys throw', { skip }, async () => {
  const client = await onceflow.connect(url)
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'x' })
  const c = await client.consumer(unique('g'), [t], {
    start: 'earliest',
    options: { idle_heartbeat_ms: 100, pull_expires_ms: 1000, ack_wait_ms: 5000 },
  })
  const [m] = await collect(c, 1)
  assert.equal(m.payload.toString(), 'x')
  await c.close()

  const open = (options) => client.consumer(unique('g'), [t], options)
  await assert.rejects(async () => open({ options: { ack_wait_ms: {} } }), configError("option 'ack_wait_ms'", 'got object'))
  await assert.rejects(async () => open({ options: { idle_heartbeat_ms: 5 } }), configError('idle_heartbeat_ms', 'at least 10 ms'))
  await assert.rejects(async () => open({ options: { pull_expires_ms: 'soon' } }), configError('pull_expires_ms'))
  await assert.rejects(async () => open({ options: { reset: 'maybe' } }), configError('reset'))
  await assert.rejects(async () => open({ options: { ackWaitMs: 1000 } }), configError("'ackWaitMs'", 'ack_wait_ms'))
  await assert.rejects(async () => open({ ackWaitMs: 1000 }), configError('ackWaitMs'))
})
