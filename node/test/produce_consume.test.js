'use strict'
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { platforms, topic, collect, unique } = require('./helpers')

for (const p of platforms()) {
  test(`${p.name}: send, for await, commit, lag`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    const payloads = [Buffer.from([0, 255, 0]), Buffer.alloc(0), Buffer.from('plain text')]
    for (const [i, payload] of payloads.entries()) {
      const d = await producer.send({
        topic: t,
        payload,
        key: i === 0 ? Buffer.from([1, 2]) : `key-${i}`,
        headers: [['h', null], ['h', Buffer.alloc(0)], ['h', Buffer.from([0, 1])], ['text', 'v']],
      })
      assert.equal(d.topic, t)
      assert.equal(typeof d.position, 'string')
    }
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const got = []
    for await (const m of consumer) {
      got.push(m)
      if (got.length === payloads.length) break
    }
    assert.deepEqual(got.map((m) => m.payload), payloads)
    assert.deepEqual(got[0].key, Buffer.from([1, 2]))
    assert.deepEqual(got[1].key, Buffer.from('key-1'))
    const hs = got[0].headers.filter((h) => h.name === 'h')
    assert.equal(hs.length, 3, 'repeated header names are kept')
    if (p.name !== 'nats') assert.equal(hs[0].value, null, 'a null header stays null')
    assert.deepEqual(hs[1].value, Buffer.alloc(0), 'an empty header stays empty')
    assert.deepEqual(hs[2].value, Buffer.from([0, 1]))
    await consumer.commit()
    const lag = await consumer.lag()
    assert.ok(lag.length >= 1)
    assert.equal(lag.reduce((n, l) => n + l.messages, 0), 0)
    await consumer.close()
    await producer.close()
  })

  test(`${p.name}: a delivery says how many attempts its send took`, async () => {
    // Acknowledged at once: one attempt, from send and sendBatch alike (resends, which only
    // JetStream and Kinesis make themselves, are tested in Rust behind fault proxies).
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    const d = await producer.send(t, 'once')
    assert.equal(d.attempts, 1)
    const rs = await producer.sendBatch([{ topic: t, payload: 'a' }, { topic: t, payload: 'b' }])
    assert.deepEqual(rs.map((r) => r.attempts), [1, 1])
    await producer.close()
  })

  test(`${p.name}: batches(), poll's message shape, commit() after a break`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    const rs = await producer.sendBatch(Array.from({ length: 10 }, (_, i) => ({ topic: t, payload: `m${i}` })))
    assert.ok(rs.every((r) => !(r instanceof Error)))
    const a = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const seen = []
    for await (const batch of a.batches({ batchSize: 4, timeoutMs: 200 })) {
      assert.ok(Array.isArray(batch) && batch.length >= 1 && batch.length <= 4, `batch of ${batch.length}`)
      seen.push(...batch)
      if (seen.length >= 10) break
    }
    assert.deepEqual(seen.map((m) => m.payload.toString()), Array.from({ length: 10 }, (_, i) => `m${i}`))
    for (const m of seen) {
      assert.deepEqual(Object.keys(m), ['topic', 'partition', 'position', 'key', 'payload', 'headers', 'timestamp', 'deliveryCount'])
      assert.equal(m.topic, t)
      assert.equal(typeof m.partition, 'number')
      assert.equal(typeof m.position, 'string')
      assert.equal(m.key, null)
      assert.ok(Buffer.isBuffer(m.payload))
      assert.deepEqual(m.headers, [])
      assert.ok(m.timestamp === null || Number.isFinite(m.timestamp))
      assert.ok(m.deliveryCount >= 1)
    }
    await a.close()
    if (p.name === 'nats') return // fetched but unacknowledged messages come back after AckWait
    // commit() without arguments commits the last message yielded, not the rest of its batch.
    const group = unique('g')
    const b = await client.consumer(group, [t], { start: 'earliest' })
    const firstThree = []
    for await (const m of b.messages({ batchSize: 10, timeoutMs: 200 })) {
      firstThree.push(m.payload.toString())
      if (firstThree.length === 3) break
    }
    assert.deepEqual(firstThree, ['m0', 'm1', 'm2'])
    await b.commit()
    await b.close()
    const c = await client.consumer(group, [t])
    const rest = await collect(c, 7)
    assert.deepEqual(rest.map((m) => m.payload.toString()), ['m3', 'm4', 'm5', 'm6', 'm7', 'm8', 'm9'])
    await c.close()
    // poll() hands its whole batch out: commit() without arguments commits all of it, as
    // Python's does (it used to commit nothing after a poll()).
    const polledGroup = unique('g')
    const d = await client.consumer(polledGroup, [t], { start: 'earliest' })
    const polled = []
    while (polled.length < 4) polled.push(...(await d.poll(4 - polled.length, 200)))
    assert.deepEqual(polled.map((m) => m.payload.toString()), ['m0', 'm1', 'm2', 'm3'])
    await d.commit()
    await d.close()
    const e = await client.consumer(polledGroup, [t])
    const after = await collect(e, 6)
    assert.deepEqual(after.map((m) => m.payload.toString()), ['m4', 'm5', 'm6', 'm7', 'm8', 'm9'])
    await e.close()
    await producer.close()
  })

  test(`${p.name}: rewindUncommitted gives out again what was not committed`, async () => {
    // What a transactional loop does after an abort: everything after the committed position
    // comes again, in order (Pulsar: the broker's redelivery, elsewhere a seek).
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    await producer.sendBatch(Array.from({ length: 6 }, (_, i) => ({ topic: t, payload: `m${i}` })))
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const first = await collect(consumer, 6)
    assert.deepEqual(first.map((m) => m.payload.toString()), ['m0', 'm1', 'm2', 'm3', 'm4', 'm5'])
    await consumer.commit(first[1])
    const left = await consumer.rewindUncommitted([{ topic: t, partition: first[0].partition }])
    assert.deepEqual(left, [])
    const again = await collect(consumer, 4)
    assert.deepEqual(again.map((m) => m.payload.toString()), ['m2', 'm3', 'm4', 'm5'])
    await consumer.close()
    await producer.close()
  })

  test(`${p.name}: rewindUncommitted refuses what this consumer does not read`, async () => {
    // Each of these used to come back as a partition "with nothing committed", and 1.5 was
    // truncated to 1 on the way in (issue #27).
    const client = await onceflow.connect(p.url())
    const t = await topic(client, 2)
    const producer = await client.producer()
    await producer.sendBatch(Array.from({ length: 4 }, (_, i) => ({ topic: t, key: `k${i}`, payload: `m${i}` })))
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const polled = await collect(consumer, 4)
    assert.equal(polled.length, 4)
    const refused = async (partitions, kind, named) =>
      assert.rejects(consumer.rewindUncommitted(partitions), (e) => {
        assert.ok(e instanceof onceflow.OnceflowError, `${e}`)
        assert.equal(e.kind, kind, e.message)
        assert.ok(e.message.includes(named), `'${e.message}' names '${named}'`)
        return true
      })
    await refused([{ topic: t, partition: 1.5 }], 'config', 'partitions[0].partition: 1.5')
    await refused([{ topic: t, partition: '0' }], 'config', 'partitions[0].partition: string "0"')
    await refused([{ topic: t, partition: 2 ** 32 }], 'config', '4294967296')
    await refused([{ topic: 7, partition: 0 }], 'config', 'partitions[0].topic')
    await refused({ topic: t, partition: 0 }, 'config', 'partitions: expected an array')
    await refused([{ topic: t, partition: 7 }], 'fenced', `${t}[7]`)
    await refused([{ topic: t, partition: -1 }], 'config', 'partition -1')
    await refused([{ topic: 'nope-topic', partition: 0 }], 'config', 'nope-topic')
    await refused([{ topic: '', partition: 0 }], 'config', 'empty topic name')
    // Named as Node calls it (not rewind_uncommitted), and a missing partition as missing.
    await refused([{ topic: 'nope-topic', partition: 0 }], 'config', 'rewindUncommitted: topic')
    await refused([{ topic: t }], 'config', 'partitions[0].partition: missing')
    // commit and a transaction's commitOffsets refuse the same names the same way.
    const committed = async (call, kind, named) =>
      assert.rejects(call, (e) => {
        assert.ok(e instanceof onceflow.OnceflowError, `${e}`)
        assert.equal(e.kind, kind, e.message)
        assert.ok(e.message.includes(named), `'${e.message}' names '${named}'`)
        return true
      })
    const m0 = polled[0]
    await committed(consumer.commit({ topic: t, partition: -1, position: m0.position }), 'config', 'commit: partition -1')
    await committed(consumer.commit({ topic: 'nope-topic', partition: 0, position: m0.position }), 'config', 'nope-topic')
    if (client.capabilities().transactions) {
      const tp = await client.producer({ transactionalId: unique('tx') })
      const tx = await tp.begin()
      await committed(tx.commitOffsets(consumer, { topic: t, partition: -1, position: m0.position }), 'config', 'commitOffsets: partition -1')
      await tx.abort()
      await tp.close()
    }
    assert.ok(Array.isArray(await consumer.rewindUncommitted(consumer.assignment())))
    await consumer.close()
    await refused([], 'closed', 'closed')
    await refused([{ topic: t, partition: 0 }], 'closed', 'closed')
    await producer.close()
  })

  test(`${p.name}: sendBatch in one call, seek back`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    const rs = await producer.sendBatch(Array.from({ length: 50 }, (_, i) => ({ topic: t, payload: `m${i}` })))
    assert.equal(rs.length, 50)
    assert.ok(rs.every((r) => !(r instanceof Error)))
    const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
    const first = await collect(consumer, 50)
    assert.deepEqual(first.map((m) => m.payload.toString()), Array.from({ length: 50 }, (_, i) => `m${i}`))
    await consumer.seek(t, first[10].partition, first[10].position)
    const again = await collect(consumer, 40)
    assert.equal(again[0].payload.toString(), 'm10')
    await consumer.close()
  })
}

test('errors: OnceflowError with code, retriable and message naming the value', async () => {
  await assert.rejects(onceflow.connect('bogus://nowhere'), (e) => {
    assert.ok(e instanceof onceflow.OnceflowError)
    assert.ok(e instanceof Error)
    assert.equal(e.code, 'ONCEFLOW_CONFIG')
    assert.equal(e.kind, 'config')
    assert.equal(e.retriable, false)
    assert.match(e.message, /bogus/)
    return true
  })
  const client = await onceflow.connect(`memory://${unique('e')}`)
  const producer = await client.producer()
  await assert.rejects(producer.send({ topic: '', payload: 'x' }), { code: 'ONCEFLOW_CONFIG' })
  const rs = await producer.sendBatch([{ topic: 'ok', payload: 'x' }, { topic: '', payload: 'y' }])
  assert.ok(!(rs[0] instanceof Error))
  assert.ok(rs[1] instanceof onceflow.OnceflowError)
  const consumer = await client.consumer('g', ['ok'])
  await assert.rejects(consumer.seek('ok', 0, 'yesterday'), { code: 'ONCEFLOW_CONFIG' })
  assert.throws(() => producer.send({ topic: 'ok', payload: 42 }), TypeError)
  const codes = onceflow.errorKinds().map((k) => k.code)
  assert.equal(new Set(codes).size, codes.length)
  assert.ok(codes.includes('ONCEFLOW_FENCED'))
})

test('transaction commitOffsets names a consumer that is not one', async () => {
  const client = await onceflow.connect(`memory://${unique('e')}`)
  const producer = await client.producer({ transactionalId: unique('tx') })
  await assert.rejects(
    producer.transaction(async (tx) => {
      await tx.commitOffsets('orders')
    }),
    (e) => {
      assert.ok(e instanceof TypeError, String(e))
      assert.match(e.message, /commitOffsets\(consumer, \.\.\.\): expected the Consumer .* got string "orders"/)
      return true
    },
  )
})

test('the event loop keeps running while a poll waits', async () => {
  const client = await onceflow.connect(`memory://${unique('loop')}`)
  const consumer = await client.consumer('g', ['empty'])
  let ticks = 0
  const timer = setInterval(() => ticks++, 10)
  await consumer.poll(10, 500)
  clearInterval(timer)
  assert.ok(ticks >= 20, `only ${ticks} timer ticks during a 500 ms poll`)
})

test('client options: a misspelled key or a wrong type throws a config error naming it', async () => {
  const client = await onceflow.connect(`memory://${unique('opts')}`)
  const refused = async (call, text) => {
    const e = await (async () => call())().then(() => null, (err) => err)
    assert.ok(e instanceof onceflow.OnceflowError, `${text}: ${e}`)
    assert.equal(e.kind, 'config')
    assert.ok(e.message.includes(text), `expected '${text}' in: ${e.message}`)
  }
  const t = unique('t')
  await refused(() => client.consumer(unique('g'), [t], { ackWaitMs: 5000 }), "unknown consumer option 'ackWaitMs': expected one of start, isolation")
  await refused(() => client.consumer(unique('g'), [t], { start: 5 }), 'consumer option start: expected a string, got number')
  await refused(() => client.consumer(unique('g'), [t], { sessionTimeoutMs: -1 }), 'consumer option sessionTimeoutMs -1')
  await refused(() => client.consumer(unique('g'), [t], { options: { 'fetch.min.bytes': [1] } }), "option 'fetch.min.bytes': expected a string, boolean or number, got object")
  await refused(() => client.consumer(unique('g'), [t], { options: 'fetch.min.bytes=1' }), 'consumer option options: expected an object of strings, booleans or numbers, got string')
  await refused(() => client.consumer(unique('g'), [t], 'earliest'), 'consumer options: expected an object, got string')
  await refused(() => client.producer({ transactionalID: 'x' }), "unknown producer option 'transactionalID'")
  await refused(() => client.producer({ idempotent: 'yes' }), 'producer option idempotent: expected a boolean, got string')
  const admin = await client.admin()
  await refused(() => admin.createTopic(unique('t'), { partitions: -1 }), 'topic option partitions -1: expected a whole number')
  await refused(() => admin.createTopic(unique('t'), { partition: 3 }), "unknown topic option 'partition'")
  // The right keys still work, undefined ones included.
  const c = await client.consumer(unique('g'), [t], { start: 'earliest', clientId: undefined })
  await c.close()
})

test('raw client options take strings, booleans and numbers; other types are config errors naming the key', async () => {
  // auto_create: false as a boolean reaches the memory platform: a missing topic is NotFound.
  const refused = async (call, text) => {
    const e = await (async () => call())().then(() => null, (err) => err)
    assert.ok(e instanceof onceflow.OnceflowError, `${text}: ${e}`)
    assert.equal(e.code, 'ONCEFLOW_CONFIG')
    assert.equal(e.kind, 'config')
    assert.ok(e.message.includes(text), `expected '${text}' in: ${e.message}`)
    return e
  }
  const client = await onceflow.connect(`memory://${unique('raw')}`, { auto_create: false, partitions: 2 })
  // Booleans and numbers pass the conversion and reach the platform, which names them:
  // memory:// reads no producer or consumer options, so it refuses them (#31).
  await refused(
    () => client.producer({ options: { 'linger.ms': 5, 'enable.idempotence': true, ratio: 0.5 } }),
    "unknown memory:// producer options 'enable.idempotence', 'linger.ms', 'ratio'"
  )
  const producer = await client.producer()
  const missing = await producer.send(unique('missing'), 'x').then(() => null, (e) => e)
  assert.equal(missing?.code, 'ONCEFLOW_NOT_FOUND', `${missing}`)
  const admin = await client.admin()
  const t = unique('t')
  await admin.createTopic(t, { partitions: 2, options: { 'segment.ms': 1000, compacted: false } })
  await producer.send(t, 'm')
  await refused(
    () => client.consumer(unique('g'), [t], { start: 'earliest', options: { 'fetch.min.bytes': 1, 'check.crcs': true } }),
    "unknown memory:// consumer options 'check.crcs', 'fetch.min.bytes'"
  )
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const got = await consumer.poll(10, 5000)
  assert.equal(got.length, 1)
  await consumer.close()

  const url = `memory://${unique('raw')}`
  for (const [value, type] of [[[1], 'object'], [{ a: 1 }, 'object'], [null, 'null'], [undefined, 'undefined'], [10n, 'bigint']]) {
    const text = `option 'tls_hostname_verification': expected a string, boolean or number, got ${type}`
    const options = { tls_hostname_verification: value }
    await refused(() => onceflow.connect(url, options), text)
    await refused(() => client.producer({ options }), text)
    await refused(() => client.consumer(unique('g'), [t], { options }), text)
    await refused(() => admin.createTopic(unique('t'), { options }), text)
  }
  await refused(() => onceflow.connect(url, { 'linger.ms': NaN }), "option 'linger.ms': expected a finite number, got NaN or Infinity")
  await refused(() => client.producer({ options: { 'linger.ms': Infinity } }), "option 'linger.ms': expected a finite number")
  await refused(() => onceflow.connect(url, ['a=b']), 'options: expected an object of strings, booleans or numbers, got array')
  // A value is never shown: it may be a password.
  const e = await refused(() => client.producer({ options: { 'sasl.password': ['hunter2-s3cret'] } }), "option 'sasl.password'")
  assert.ok(!e.message.includes('hunter2'), e.message)
})

test('an iterator left mid-batch is continued, not skipped', async () => {
  const client = await onceflow.connect(`memory://${unique('rest')}`)
  const t = unique('t')
  const producer = await client.producer()
  await producer.sendBatch(Array.from({ length: 6 }, (_, i) => ({ topic: t, payload: `m${i}` })))
  const group = unique('g')
  const consumer = await client.consumer(group, [t], { start: 'earliest' })
  const seen = []
  for await (const m of consumer.messages({ batchSize: 6, timeoutMs: 200 })) {
    seen.push(m.payload.toString())
    if (seen.length === 2) break
  }
  await consumer.commit()
  for await (const m of consumer.messages({ batchSize: 6, timeoutMs: 200 })) {
    seen.push(m.payload.toString())
    if (seen.length === 3) break
  }
  for await (const batch of consumer.batches({ batchSize: 6, timeoutMs: 200 })) {
    seen.push(...batch.map((m) => m.payload.toString()))
    break
  }
  assert.deepEqual(seen, ['m0', 'm1', 'm2', 'm3', 'm4', 'm5'])
  await consumer.close()
  // The commit after the first loop took m1 only: a new member of the group starts at m2.
  const again = await client.consumer(group, [t])
  const rest = await collect(again, 4)
  assert.deepEqual(rest.map((m) => m.payload.toString()), ['m2', 'm3', 'm4', 'm5'])
  await again.close()
  await assert.rejects(async () => consumer.poll('10'), (e) => e instanceof onceflow.OnceflowError && e.kind === 'config' && e.message === 'max: expected a number, got string')
})

for (const p of platforms()) test(`${p.name}: header() gives the first value of a name and headerAll() every one`, async () => {
  const client = await onceflow.connect(p.url())
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'x', headers: [['h', null], ['h', '1'], ['other', 'o'], ['h', '2']] })
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const [m] = await collect(consumer, 1)
  assert.equal(onceflow.header(m, 'h'), null)
  assert.deepEqual(onceflow.headerAll(m, 'h').map((v) => v && v.toString()), [null, '1', '2'])
  assert.equal(onceflow.header(m, 'other').toString(), 'o')
  assert.equal(onceflow.header(m, 'missing'), undefined)
  assert.deepEqual(onceflow.headerAll(m, 'missing'), [])
  await consumer.close()
})

test('supportedSchemes() lists the URL schemes compiled in, and connect refuses another naming it', async () => {
  const schemes = onceflow.supportedSchemes()
  assert.ok(Array.isArray(schemes) && schemes.every((s) => typeof s === 'string'))
  for (const s of ['memory://', 'kafka://', 'nats://']) assert.ok(schemes.includes(s), `${s} in ${schemes}`)
  await assert.rejects(
    async () => onceflow.connect('nope://x'),
    (e) => e instanceof onceflow.OnceflowError && e.kind === 'config' && e.message.includes('nope')
  )
})

for (const p of platforms()) test(`${p.name}: a closed producer refuses sends`, async () => {
  // Kafka and JetStream went on sending after close().
  const client = await onceflow.connect(p.url())
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'before' })
  await producer.close()
  await assert.rejects(producer.send({ topic: t, payload: 'after' }), { code: 'ONCEFLOW_CLOSED' })
  const rs = await producer.sendBatch([{ topic: t, payload: 'a' }, { topic: t, payload: 'b' }])
  assert.equal(rs.length, 2)
  for (const r of rs) assert.equal(r.code, 'ONCEFLOW_CLOSED', String(r))
})
