'use strict'
// JS1: produce N x 100-byte messages, 100 per call, one call in flight, with onceflow
// (`sendBatch`), kafkajs (`producer.send` with 100 messages) and, when it is installed,
// @confluentinc/kafka-javascript (its KafkaJS-compatible `producer.send`, at its defaults and
// with `linger.ms: 0`, the setting its MIGRATION.md gives for awaiting every send); same broker,
// same run, each on a fresh one-partition topic, all idempotent with acks=all and no
// compression. Rounds alternate the clients; the best round of each is kept. Prints RATIO lines.
//
// Usage: ONCEFLOW_KAFKA_URL=kafka://127.0.0.1:19092 node bench/js1.js [N] [ROUNDS]
// ONCEFLOW_JS1_LINGER_MS passes `linger.ms` to onceflow's producer (default: librdkafka's).
// @confluentinc/kafka-javascript is looked up in ONCEFLOW_BENCH_CONFLUENT_DIR (a folder whose
// node_modules holds it; default ~/.cache/onceflow/confluent-kafka-javascript, where
// bench/install-confluent.sh puts it), then in this package's node_modules.
const { Kafka, logLevel, CompressionTypes } = require('kafkajs')
const onceflow = require('..')
const crypto = require('node:crypto')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')

const N = Number(process.argv[2] || 500000)
const ROUNDS = Number(process.argv[3] || 2)
const PER_CALL = 100
const url = process.env.ONCEFLOW_KAFKA_URL || 'kafka://127.0.0.1:19092'
const broker = url.replace(/^kafka:\/\//, '').split(/[/?]/)[0]
const payload = Buffer.alloc(100, 7)
const id = crypto.randomBytes(4).toString('hex')
let topics = 0
const newTopic = (who) => `js1-${who}-${id}-${++topics}`

/** The confluent client, or the reason it is missing. */
function loadConfluent() {
  const dir = process.env.ONCEFLOW_BENCH_CONFLUENT_DIR || path.join(os.homedir(), '.cache', 'onceflow', 'confluent-kafka-javascript')
  try {
    const paths = [dir, path.join(__dirname, '..')]
    const mod = require(require.resolve('@confluentinc/kafka-javascript', { paths }))
    const pkg = require(require.resolve('@confluentinc/kafka-javascript/package.json', { paths }))
    return { mod, version: pkg.version, librdkafka: mod.librdkafkaVersion }
  } catch (e) {
    return { missing: `${e.code || 'error'}: ${String(e.message).split('\n')[0]}` }
  }
}

/** librdkafka compiled into onceflow: the rdkafka-sys version in the workspace's Cargo.lock. */
function onceflowLibrdkafka() {
  try {
    const lock = fs.readFileSync(path.join(__dirname, '..', '..', 'Cargo.lock'), 'utf8')
    const m = /name = "rdkafka-sys"\nversion = "[^"+]*\+([^"]+)"/.exec(lock)
    return m ? m[1] : '?'
  } catch {
    return '?'
  }
}

async function createTopic(client, topic) {
  await (await client.admin()).createTopic(topic, { partitions: 1 })
}

async function timed(sendOne) {
  const t0 = process.hrtime.bigint()
  for (let i = 0; i < N / PER_CALL; i++) await sendOne()
  return N / (Number(process.hrtime.bigint() - t0) / 1e9)
}

async function onceflowRun(client) {
  const topic = newTopic('onceflow')
  await createTopic(client, topic)
  const linger = process.env.ONCEFLOW_JS1_LINGER_MS
  const producer = await client.producer(linger ? { options: { 'linger.ms': linger } } : undefined)
  const batch = Array.from({ length: PER_CALL }, () => ({ topic, payload }))
  const rate = await timed(async () => {
    const rs = await producer.sendBatch(batch)
    for (const r of rs) if (r instanceof Error) throw r
  })
  await producer.close()
  return rate
}

async function kafkajsRun(client) {
  const topic = newTopic('kafkajs')
  await createTopic(client, topic)
  const kafka = new Kafka({ clientId: 'js1', brokers: [broker], logLevel: logLevel.NOTHING })
  const producer = kafka.producer({ idempotent: true, maxInFlightRequests: 1 })
  await producer.connect()
  const messages = Array.from({ length: PER_CALL }, () => ({ value: payload }))
  const rate = await timed(() => producer.send({ topic, acks: -1, compression: CompressionTypes.None, messages }))
  await producer.disconnect()
  return rate
}

async function confluentRun(client, confluent, extra) {
  const topic = newTopic('confluent')
  await createTopic(client, topic)
  const { Kafka: CKafka, logLevel: cLogLevel } = confluent.mod.KafkaJS
  const kafka = new CKafka({ kafkaJS: { clientId: 'js1', brokers: [broker], logLevel: cLogLevel.NOTHING } })
  const producer = kafka.producer({ kafkaJS: { idempotent: true, acks: -1 }, ...extra })
  await producer.connect()
  const messages = Array.from({ length: PER_CALL }, () => ({ value: payload }))
  const rate = await timed(() => producer.send({ topic, messages }))
  await producer.disconnect()
  return rate
}

;(async () => {
  const confluent = loadConfluent()
  const client = await onceflow.connect(url)
  const kafkajsVersion = require('kafkajs/package.json').version
  console.log(
    `node ${process.version}, onceflow ${onceflow.version} (librdkafka ${onceflowLibrdkafka()}), kafkajs ${kafkajsVersion}, ` +
      (confluent.mod
        ? `@confluentinc/kafka-javascript ${confluent.version} (librdkafka ${confluent.librdkafka})`
        : `@confluentinc/kafka-javascript not available (${confluent.missing})`) +
      `, load average ${os.loadavg().map((x) => x.toFixed(2)).join(' ')}`
  )
  const best = { onceflow: 0, kafkajs: 0, confluent: 0, confluentLinger0: 0 }
  for (let r = 1; r <= ROUNDS; r++) {
    const row = {}
    row.kafkajs = await kafkajsRun(client)
    if (confluent.mod) {
      row.confluent = await confluentRun(client, confluent, {})
      row.confluentLinger0 = await confluentRun(client, confluent, { 'linger.ms': 0 })
    }
    row.onceflow = await onceflowRun(client)
    console.log(`round ${r}: ` + Object.entries(row).map(([k, v]) => `${k} ${v.toFixed(0)} msg/s`).join(', '))
    for (const [k, v] of Object.entries(row)) best[k] = Math.max(best[k], v)
  }
  const tail = `(N=${N}, ${PER_CALL} per call, 100 B, best of ${ROUNDS})`
  const line = (name, other, target) => {
    const x = best.onceflow / other
    console.log(`RATIO JS1 onceflow/${name} ${x.toFixed(2)} target >=${target} ${x >= target ? 'PASS' : 'MISS'} ${tail}`)
  }
  line('kafkajs', best.kafkajs, 1)
  if (confluent.mod) {
    line('confluent-kafka-javascript', best.confluent, 1.5)
    line('confluent-kafka-javascript-linger0', best.confluentLinger0, 1.5)
  } else {
    console.log(`RATIO JS1 onceflow/confluent-kafka-javascript n/a target >=1.5 NOT-RUN (${confluent.missing})`)
  }
  console.log(`load average after: ${os.loadavg().map((x) => x.toFixed(2)).join(' ')}`)
})().catch((e) => {
  console.error(e)
  process.exit(1)
})
