'use strict'
// JS1: produce N x 100-byte messages, 100 per call, with onceflow (sendBatch) and with kafkajs
// (producer.send with 100 messages), same broker, same run; prints a RATIO line.
// Usage: ONCEFLOW_KAFKA_URL=kafka://127.0.0.1:19092 node bench/js1.js [N]
const { Kafka, logLevel, CompressionTypes } = require('kafkajs')
const onceflow = require('..')
const crypto = require('node:crypto')

const N = Number(process.argv[2] || 500000)
const PER_CALL = 100
const url = process.env.ONCEFLOW_KAFKA_URL || 'kafka://127.0.0.1:19092'
const broker = url.replace(/^kafka:\/\//, '').split('/')[0]
const payload = Buffer.alloc(100, 7)

async function onceflowRun(topic) {
  const client = await onceflow.connect(url)
  await (await client.admin()).createTopic(topic, { partitions: 1 })
  // librdkafka waits linger.ms (5 ms) before sending a batch; with one call in flight that
  // wait is paid on every call. ONCEFLOW_JS1_LINGER_MS overrides it (raw pass-through option).
  const linger = process.env.ONCEFLOW_JS1_LINGER_MS
  const producer = await client.producer(linger ? { options: { 'linger.ms': linger } } : undefined)
  const batch = Array.from({ length: PER_CALL }, () => ({ topic, payload }))
  const t0 = process.hrtime.bigint()
  for (let i = 0; i < N / PER_CALL; i++) {
    const rs = await producer.sendBatch(batch)
    if (rs.some((r) => r instanceof Error)) throw rs.find((r) => r instanceof Error)
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9
  await producer.close()
  return N / s
}

async function kafkajsRun(topic) {
  const kafka = new Kafka({ clientId: 'js1', brokers: [broker], logLevel: logLevel.NOTHING })
  const admin = kafka.admin()
  await admin.connect()
  await admin.createTopics({ topics: [{ topic, numPartitions: 1 }] })
  await admin.disconnect()
  const producer = kafka.producer({ idempotent: true, maxInFlightRequests: 1 })
  await producer.connect()
  const messages = Array.from({ length: PER_CALL }, () => ({ value: payload }))
  const t0 = process.hrtime.bigint()
  for (let i = 0; i < N / PER_CALL; i++) {
    await producer.send({ topic, acks: -1, compression: CompressionTypes.None, messages })
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9
  await producer.disconnect()
  return N / s
}

;(async () => {
  const id = crypto.randomBytes(4).toString('hex')
  const k = await kafkajsRun(`js1-kafkajs-${id}`)
  console.log(`kafkajs   ${k.toFixed(0)} msg/s`)
  const o = await onceflowRun(`js1-onceflow-${id}`)
  console.log(`onceflow  ${o.toFixed(0)} msg/s`)
  console.log(`RATIO JS1 onceflow/kafkajs ${(o / k).toFixed(2)} (N=${N}, ${PER_CALL} per call, 100 B)`)
})().catch((e) => {
  console.error(e)
  process.exit(1)
})
