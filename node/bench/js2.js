'use strict'
// JS2: consume N pre-filled 100-byte messages with onceflow and with kafkajs, same broker, same
// run, same topic (each in its own consumer group, from the earliest offset); prints RATIO lines.
//
// - onceflow, batch path: `consumer.batches()` (one native crossing per batch of up to 1000
//   messages, each batch an array of messages);
// - onceflow, `for await (const m of consumer)` (the same crossings, one message at a time);
// - kafkajs 2.x: `consumer.run({ eachBatch })` with its defaults otherwise;
// - @confluentinc/kafka-javascript (issue 24, target onceflow >= 1.3x), when installed
//   (bench/install-confluent.sh): its KafkaJS-compatible `consumer.run({ eachBatch })` at its
//   defaults, auto commit off as onceflow's. Its RATIO line is the median of the per-round ratios
//   (both rates of the same round), as issue 24 asks; the kafkajs lines keep the best round.
// Every variant reads each message's payload (the byte total is checked) and counts until N.
// The rate is N over the time from the first message to the N-th (group join excluded, the
// same for every client). Rounds alternate the clients; the best round of each is kept.
//
// Usage: ONCEFLOW_KAFKA_URL=kafka://127.0.0.1:19092 node bench/js2.js [N] [ROUNDS (default 3)]
// ONCEFLOW_JS2_PARTITIONS sets the topic's partitions (default 1); ONCEFLOW_JS2_SKIP_KAFKAJS=1
// leaves kafkajs out, ONCEFLOW_JS2_SKIP_CONFLUENT=1 the confluent client.
const { Kafka, logLevel } = require('kafkajs')
const onceflow = require('..')
const crypto = require('node:crypto')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')

const N = Number(process.argv[2] || 1000000)
const ROUNDS = Number(process.argv[3] || 3)
const PARTITIONS = Number(process.env.ONCEFLOW_JS2_PARTITIONS || 1)
const SIZE = 100
const url = process.env.ONCEFLOW_KAFKA_URL || 'kafka://127.0.0.1:19092'
const broker = url.replace(/^kafka:\/\//, '').split(/[/?]/)[0]
const id = crypto.randomBytes(4).toString('hex')
let groups = 0
const group = (who) => `js2-${who}-${id}-${++groups}`

async function prefill(client, topic) {
  await (await client.admin()).createTopic(topic, { partitions: PARTITIONS })
  const producer = await client.producer()
  const per = 1000
  const t0 = process.hrtime.bigint()
  for (let i = 0; i < N; i += per) {
    const batch = []
    for (let j = i; j < Math.min(N, i + per); j++) {
      const payload = Buffer.alloc(SIZE, j & 0xff)
      payload.writeUInt32BE(j, 0)
      batch.push({ topic, payload, partition: j % PARTITIONS })
    }
    const rs = await producer.sendBatch(batch)
    const err = rs.find((r) => r instanceof Error)
    if (err) throw err
  }
  await producer.close()
  const s = Number(process.hrtime.bigint() - t0) / 1e9
  console.log(`pre-filled ${N} x ${SIZE} B into ${topic} (${PARTITIONS} partition(s)) in ${s.toFixed(1)} s`)
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

/** The confluent client, or the reason it is missing (looked up as bench/js1.js does). */
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

/** @confluentinc/kafka-javascript, KafkaJS-compatible `eachBatch`. */
async function confluentEachBatch(confluent, topic) {
  const { Kafka: CKafka, logLevel: cLogLevel } = confluent.mod.KafkaJS
  const kafka = new CKafka({ kafkaJS: { clientId: 'js2', brokers: [broker], logLevel: cLogLevel.NOTHING } })
  const consumer = kafka.consumer({ kafkaJS: { groupId: group('confluent'), fromBeginning: true, autoCommit: false } })
  await consumer.connect()
  await consumer.subscribe({ topics: [topic] })
  let count = 0
  let bytes = 0
  let t0
  let tEnd
  await new Promise((resolve, reject) => {
    consumer
      .run({
        eachBatch: async ({ batch }) => {
          if (t0 === undefined && batch.messages.length) t0 = process.hrtime.bigint()
          for (const m of batch.messages) bytes += m.value.length
          count += batch.messages.length
          if (count >= N && tEnd === undefined) {
            tEnd = process.hrtime.bigint()
            resolve()
          }
        },
      })
      .catch(reject)
  })
  await consumer.disconnect()
  check('confluent eachBatch', count, bytes)
  return N / (Number(tEnd - t0) / 1e9)
}

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2
}

const loadavg = () => os.loadavg().map((x) => x.toFixed(2)).join(' ')

function check(who, count, bytes) {
  if (count !== N || bytes !== N * SIZE) {
    throw new Error(`${who}: read ${count} messages / ${bytes} bytes, expected ${N} / ${N * SIZE}`)
  }
}

/** onceflow, batch path: arrays of messages, one native crossing each. */
async function onceflowBatches(client, topic) {
  const consumer = await client.consumer(group('onceflow-batches'), [topic], { start: 'earliest' })
  let count = 0
  let bytes = 0
  let t0
  for await (const batch of consumer.batches({ batchSize: 1000 })) {
    if (t0 === undefined && batch.length) t0 = process.hrtime.bigint()
    for (const m of batch) bytes += m.payload.length
    count += batch.length
    if (count >= N) break
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9
  await consumer.close()
  check('onceflow batches', count, bytes)
  return N / s
}

/** onceflow, `for await` one message at a time (batches underneath). */
async function onceflowForAwait(client, topic) {
  const consumer = await client.consumer(group('onceflow-each'), [topic], { start: 'earliest' })
  let count = 0
  let bytes = 0
  let t0
  for await (const m of consumer.messages({ batchSize: 1000 })) {
    if (t0 === undefined) t0 = process.hrtime.bigint()
    bytes += m.payload.length
    if (++count >= N) break
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9
  await consumer.close()
  check('onceflow for await', count, bytes)
  return N / s
}

/** kafkajs `eachBatch`. */
async function kafkajsEachBatch(topic) {
  const kafka = new Kafka({ clientId: 'js2', brokers: [broker], logLevel: logLevel.NOTHING })
  const consumer = kafka.consumer({ groupId: group('kafkajs') })
  await consumer.connect()
  await consumer.subscribe({ topics: [topic], fromBeginning: true })
  let count = 0
  let bytes = 0
  let t0
  let tEnd
  await new Promise((resolve, reject) => {
    consumer
      .run({
        eachBatch: async ({ batch }) => {
          if (t0 === undefined && batch.messages.length) t0 = process.hrtime.bigint()
          for (const m of batch.messages) bytes += m.value.length
          count += batch.messages.length
          if (count >= N && tEnd === undefined) {
            tEnd = process.hrtime.bigint()
            resolve()
          }
        },
      })
      .catch(reject)
  })
  await consumer.disconnect()
  check('kafkajs eachBatch', count, bytes)
  return N / (Number(tEnd - t0) / 1e9)
}

;(async () => {
  console.log(
    `node ${process.version}, onceflow ${onceflow.version} (librdkafka ${onceflowLibrdkafka()}), ` +
      `kafkajs ${require('kafkajs/package.json').version}, load average ${loadavg()}`
  )
  const confluent = loadConfluent()
  console.log(
    confluent.missing
      ? `@confluentinc/kafka-javascript not installed (bench/install-confluent.sh): ${confluent.missing}`
      : `@confluentinc/kafka-javascript ${confluent.version} (librdkafka ${confluent.librdkafka})`
  )
  const client = await onceflow.connect(url)
  const topic = `js2-${id}`
  await prefill(client, topic)
  const best = { kafkajs: 0, batches: 0, each: 0 }
  const vsConfluent = { batches: [], each: [] }
  for (let r = 1; r <= ROUNDS; r++) {
    const c = confluent.missing || process.env.ONCEFLOW_JS2_SKIP_CONFLUENT ? undefined : await confluentEachBatch(confluent, topic)
    const k = process.env.ONCEFLOW_JS2_SKIP_KAFKAJS ? NaN : await kafkajsEachBatch(topic)
    const b = await onceflowBatches(client, topic)
    const e = await onceflowForAwait(client, topic)
    if (c !== undefined) {
      vsConfluent.batches.push(b / c)
      vsConfluent.each.push(e / c)
    }
    console.log(
      `round ${r}: kafkajs eachBatch ${k.toFixed(0)} msg/s, onceflow batches ${b.toFixed(0)} msg/s, ` +
        `onceflow for-await ${e.toFixed(0)} msg/s` +
        (c === undefined ? '' : `, confluent eachBatch ${c.toFixed(0)} msg/s`) +
        `, load average ${loadavg()}`
    )
    best.kafkajs = Math.max(best.kafkajs, k)
    best.batches = Math.max(best.batches, b)
    best.each = Math.max(best.each, e)
  }
  const tail = `(N=${N}, ${SIZE} B, ${PARTITIONS} partition(s), best of ${ROUNDS})`
  const verdict = (x) => (x >= 1.3 ? 'PASS' : 'MISS')
  const rb = best.batches / best.kafkajs
  const re = best.each / best.kafkajs
  if (!process.env.ONCEFLOW_JS2_SKIP_KAFKAJS) {
    console.log(`RATIO JS2 onceflow-batches/kafkajs-eachBatch ${rb.toFixed(2)} target >=1.3 ${verdict(rb)} ${tail}`)
    console.log(`RATIO JS2 onceflow-for-await/kafkajs-eachBatch ${re.toFixed(2)} target >=1.3 ${verdict(re)} ${tail}`)
  }
  if (vsConfluent.batches.length) {
    const ctail = `(N=${N}, ${SIZE} B, ${PARTITIONS} partition(s), median of ${vsConfluent.batches.length})`
    const mb = median(vsConfluent.batches)
    const me = median(vsConfluent.each)
    console.log(`RATIO JS2 onceflow-batches/confluent-eachBatch ${mb.toFixed(2)} target >=1.3 ${verdict(mb)} ${ctail}`)
    console.log(`RATIO JS2 onceflow-for-await/confluent-eachBatch ${me.toFixed(2)} target >=1.3 ${verdict(me)} ${ctail}`)
  }
  console.log(`load average after: ${loadavg()}`)
})().catch((e) => {
  console.error(e)
  process.exit(1)
})
