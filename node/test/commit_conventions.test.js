'use strict'
// Commit conventions (#31): `committed()` returns `{ topic, partition, next }`, the next position
// to read, while `commit()` takes the last processed message; `commit()` refuses an entry of
// `committed()`, so the two cannot be confused into skipping a message. On every platform
// configured (memory always; Kafka and NATS when their URLs are set).
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { unique, platforms, topic, collect } = require('./helpers')

for (const p of platforms()) {
  test(`${p.name}: committed() gives the next position to read and commit() refuses it`, async () => {
    const client = await onceflow.connect(p.url())
    const t = await topic(client)
    const producer = await client.producer()
    for (const v of ['m0', 'm1', 'm2']) await producer.send({ topic: t, payload: v })
    const group = unique('g')
    const consumer = await client.consumer(group, [t], { start: 'earliest' })
    const got = await collect(consumer, 3)
    assert.deepEqual(got.map((m) => m.payload.toString()), ['m0', 'm1', 'm2'])
    const [before] = await consumer.committed([{ topic: t, partition: 0 }])
    assert.deepEqual(before, { topic: t, partition: 0, next: null }, 'nothing committed yet')

    await consumer.commit(got[1]) // processed m0 and m1
    const committed = await consumer.committed([{ topic: t, partition: 0 }])
    assert.deepEqual(committed, [{ topic: t, partition: 0, next: got[2].position }], 'next is m2, the first not processed')

    for (const wrong of [committed, committed[0], [got[2], committed[0]]]) {
      await assert.rejects(
        consumer.commit(wrong),
        (e) =>
          e instanceof onceflow.OnceflowError &&
          e.kind === 'config' &&
          e.message.includes('committed() is the next position to read') &&
          e.message.includes('last processed'),
        'commit() refuses an entry of committed()'
      )
    }
    for (const [wrong, shape] of [
      [{ topic: t, partition: 0, committed: got[2].position }, `{topic: ${JSON.stringify(t)}, partition: 0, position: undefined}`],
      [[t, 0, got[1].position], 'an array'],
      ['offset:1', 'string'],
      // A partition that is not a whole number was truncated (1.5 committed partition 1).
      [{ topic: t, partition: 1.5, position: got[1].position }, `{topic: ${JSON.stringify(t)}, partition: 1.5, position: ${JSON.stringify(got[1].position)}}`],
      [{ topic: t, partition: 'x', position: got[1].position }, `{topic: ${JSON.stringify(t)}, partition: "x", position: ${JSON.stringify(got[1].position)}}`],
    ]) {
      await assert.rejects(
        consumer.commit([wrong]),
        (e) => e.kind === 'config' && e.message === `position: expected a message or {topic: string, partition: integer, position: string}, got ${shape}`
      )
    }
    // The refusals committed nothing: the group still resumes at m2.
    assert.deepEqual(await consumer.committed([{ topic: t, partition: 0 }]), committed)
    await consumer.close()

    const again = await client.consumer(group, [t]) // start: committed
    const [first] = await collect(again, 1)
    assert.equal(first.payload.toString(), 'm2')
    assert.equal(first.position, committed[0].next)
    await again.close()
  })
}

test('memory: a transaction refuses an entry of committed() too', async () => {
  const client = await onceflow.connect(`memory://${unique('node')}`)
  const t = await topic(client)
  await (await client.producer()).send({ topic: t, payload: 'm0' })
  const producer = await client.producer({ transactionalId: unique('tx') })
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const [m] = await collect(consumer, 1)
  await consumer.commit(m)
  const committed = await consumer.committed([{ topic: t, partition: 0 }])
  await assert.rejects(
    producer.transaction((tx) => tx.commitOffsets(consumer, committed)),
    (e) => e.kind === 'config' && e.message.includes('committed()')
  )
})
