'use strict'
// Interop with kafkajs on the same Kafka broker: its messages (binary payloads, headers,
// W3C trace context) reach our consumer intact, and ours reach it.
const test = require('node:test')
const assert = require('node:assert/strict')
const { Kafka, logLevel } = require('kafkajs')
const onceflow = require('..')
const { topic, unique, collect, until } = require('./helpers')

const url = process.env.ONCEFLOW_KAFKA_URL
const brokers = url ? [url.replace(/^kafka:\/\//, '').split('/')[0].split('?')[0]] : []

test('kafkajs -> onceflow and onceflow -> kafkajs on the same broker', { skip: url ? false : 'ONCEFLOW_KAFKA_URL not set' }, async () => {
  const client = await onceflow.connect(url)
  const t = await topic(client)
  const kafka = new Kafka({ clientId: unique('kjs'), brokers, logLevel: logLevel.NOTHING })
  const kp = kafka.producer()
  await kp.connect()
  const traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'
  await kp.send({
    topic: t,
    messages: [{ key: Buffer.from([0, 1]), value: Buffer.from([0xff, 0, 0xfe]), headers: { traceparent, app: Buffer.from('kjs') } }],
  })
  await kp.disconnect()

  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const [m] = await collect(consumer, 1)
  assert.deepEqual(m.payload, Buffer.from([0xff, 0, 0xfe]))
  assert.deepEqual(m.key, Buffer.from([0, 1]))
  assert.equal(m.headers.find((h) => h.name === 'traceparent').value.toString(), traceparent)
  assert.equal(m.headers.find((h) => h.name === 'app').value.toString(), 'kjs')
  await consumer.close()

  const producer = await client.producer()
  await producer.send({ topic: t, payload: Buffer.from([1, 2, 3]), key: 'ours', headers: { mine: 'yes', traceparent } })
  const kc = kafka.consumer({ groupId: unique('kg') })
  await kc.connect()
  await kc.subscribe({ topic: t, fromBeginning: true })
  const seen = []
  await kc.run({ eachMessage: async ({ message }) => { seen.push(message) } })
  try {
    assert.ok(await until(() => seen.length >= 2, 30000), `kafkajs saw ${seen.length} messages`)
  } finally {
    await kc.disconnect()
  }
  const ours = seen.find((x) => x.key && x.key.toString() === 'ours')
  assert.ok(ours)
  assert.deepEqual(ours.value, Buffer.from([1, 2, 3]))
  assert.equal(ours.headers.mine.toString(), 'yes')
  assert.equal(ours.headers.traceparent.toString(), traceparent)
})
