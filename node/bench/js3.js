'use strict'
// JS3 (issue 24): onceflow's Node package on NATS JetStream against the official client
// (@nats-io/jetstream 3.x over @nats-io/transport-node), same server, same run, target
// onceflow >= 1.5x. Prints `RATIO JS3 <what> <median> target >=1.5 PASS|MISS`: the median of
// the per-round ratios (both rates of the same round), rounds alternating which client goes
// first, each client on fresh streams every round.
//
// - produce N x 100 B: onceflow `sendBatch` of 1000 records, 4 calls in flight (every record's
//   publish acknowledged by the stream) against @nats-io/jetstream `js.publish` (a promise of
//   the PubAck each) with at most 5000 awaiting, then all awaited; both wait for every ack.
// - consume N with explicit acks: onceflow `consumer.batches({ batchSize: 1000 })` + `commit(batch)`
//   (the commit acks each message) against a durable pull consumer (AckPolicy.Explicit) read
//   with `consumer.consume({ max_messages: 1000 })` and `m.ack()` per message. Both read every
//   payload; the rate is N over the time from the first message to the N-th.
//
// Usage: ONCEFLOW_NATS_URL=nats://127.0.0.1:14222 node bench/js3.js [N (50000)] [ROUNDS (3)]
// The official client is looked up in ONCEFLOW_BENCH_NATS_DIR (a folder whose node_modules holds
// @nats-io/jetstream and @nats-io/transport-node: `npm install @nats-io/jetstream
// @nats-io/transport-node` there), then in this package's node_modules.
const onceflow = require('..')
const crypto = require('node:crypto')
const os = require('node:os')
const path = require('node:path')

const N = Number(process.argv[2] || 50000)
const ROUNDS = Number(process.argv[3] || 3)
const SIZE = 100
const WINDOW = 5000
const url = process.env.ONCEFLOW_NATS_URL || 'nats://127.0.0.1:14222'
const server = url.replace(/^nats:\/\//, '').split(/[/?]/)[0]
const id = crypto.randomBytes(4).toString('hex')
let streams = 0
const newName = (who) => `js3-${who}-${id}-${++streams}`
const payload = Buffer.alloc(SIZE, 7)
const loadavg = () => os.loadavg().map((x) => x.toFixed(2)).join(' ')

function loadNats() {
  const paths = [process.env.ONCEFLOW_BENCH_NATS_DIR || path.join(os.homedir(), '.cache', 'onceflow', 'nats-js'), path.join(__dirname, '..')]
  const need = (m) => require(require.resolve(m, { paths }))
  // Their package.json is not exported: read it next to the resolved entry point.
  const version = (m) => {
    let dir = path.dirname(require.resolve(m, { paths }))
    while (!require('node:fs').existsSync(path.join(dir, 'package.json'))) dir = path.dirname(dir)
    return require(path.join(dir, 'package.json')).version
  }
  return {
    transport: need('@nats-io/transport-node'),
    jetstream: need('@nats-io/jetstream'),
    version: version('@nats-io/jetstream'),
    transportVersion: version('@nats-io/transport-node'),
  }
}

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2
}

const secsSince = (t0) => Number(process.hrtime.bigint() - t0) / 1e9

async function onceflowProduce(client, topic) {
  await (await client.admin()).createTopic(topic, { partitions: 1 })
  const producer = await client.producer()
  await producer.send({ topic, payload })
  const records = Array.from({ length: 1000 }, () => ({ topic, payload }))
  const pending = []
  const t0 = process.hrtime.bigint()
  const settle = async (p) => {
    const err = (await p).find((r) => r instanceof Error)
    if (err) throw err
  }
  for (let sent = 0; sent < N; sent += 1000) {
    pending.push(producer.sendBatch(records.slice(0, Math.min(1000, N - sent))))
    if (pending.length >= 4) await settle(pending.shift())
  }
  for (const p of pending) await settle(p)
  const s = secsSince(t0)
  await producer.close()
  return N / s
}

async function natsProduce(nats, nc, stream) {
  const jsm = await nats.jetstream.jetstreamManager(nc)
  // The server's default (file) storage, as onceflow's createTopic makes.
  await jsm.streams.add({ name: stream, subjects: [stream] })
  const js = nats.jetstream.jetstream(nc)
  await js.publish(stream, payload)
  let inflight = []
  const t0 = process.hrtime.bigint()
  for (let i = 0; i < N; i++) {
    inflight.push(js.publish(stream, payload))
    if (inflight.length >= WINDOW) {
      await Promise.all(inflight)
      inflight = []
    }
  }
  await Promise.all(inflight)
  return N / secsSince(t0)
}

async function onceflowConsume(client, topic) {
  const consumer = await client.consumer(newName('g'), [topic], { start: 'earliest' })
  let count = 0
  let bytes = 0
  let t0
  for await (const batch of consumer.batches({ batchSize: 1000 })) {
    if (t0 === undefined && batch.length) t0 = process.hrtime.bigint()
    for (const m of batch) bytes += m.payload.length
    count += batch.length
    if (batch.length) await consumer.commit(batch)
    if (count >= N + 1) break
  }
  const s = secsSince(t0)
  await consumer.close()
  if (bytes !== count * SIZE) throw new Error(`onceflow read ${bytes} bytes for ${count} messages`)
  return N / s
}

async function natsConsume(nats, nc, stream) {
  const jsm = await nats.jetstream.jetstreamManager(nc)
  const durable = newName('d')
  await jsm.consumers.add(stream, { durable_name: durable, ack_policy: nats.jetstream.AckPolicy.Explicit })
  const js = nats.jetstream.jetstream(nc)
  const c = await js.consumers.get(stream, durable)
  const iter = await c.consume({ max_messages: 1000 })
  let count = 0
  let bytes = 0
  let t0
  for await (const m of iter) {
    if (t0 === undefined) t0 = process.hrtime.bigint()
    bytes += m.data.length
    m.ack()
    if (++count >= N + 1) break
  }
  const s = secsSince(t0)
  await iter.close()
  if (bytes !== count * SIZE) throw new Error(`@nats-io/jetstream read ${bytes} bytes for ${count} messages`)
  return N / s
}

;(async () => {
  const nats = loadNats()
  console.log(
    `node ${process.version}, onceflow ${onceflow.version}, @nats-io/jetstream ${nats.version}, ` +
      `@nats-io/transport-node ${nats.transportVersion}, load average ${loadavg()}`
  )
  const client = await onceflow.connect(url)
  const nc = await nats.transport.connect({ servers: server })
  const ratios = { produce: [], consume: [] }
  for (let r = 1; r <= ROUNDS; r++) {
    const ours = newName('of')
    const theirs = newName('nats')
    let po, pn, co, cn
    if (r % 2) {
      po = await onceflowProduce(client, ours)
      pn = await natsProduce(nats, nc, theirs)
      // Each reads what the other wrote (N + 1 messages with the warm-up).
      co = await onceflowConsume(client, theirs)
      cn = await natsConsume(nats, nc, ours)
    } else {
      pn = await natsProduce(nats, nc, theirs)
      po = await onceflowProduce(client, ours)
      cn = await natsConsume(nats, nc, ours)
      co = await onceflowConsume(client, theirs)
    }
    ratios.produce.push(po / pn)
    ratios.consume.push(co / cn)
    console.log(
      `round ${r}: produce onceflow ${po.toFixed(0)}/s @nats-io ${pn.toFixed(0)}/s (${(po / pn).toFixed(2)}); ` +
        `consume onceflow ${co.toFixed(0)}/s @nats-io ${cn.toFixed(0)}/s (${(co / cn).toFixed(2)}); load average ${loadavg()}`
    )
  }
  await nc.close()
  const tail = `(N=${N}, ${SIZE} B, median of ${ROUNDS})`
  const verdict = (x) => (x >= 1.5 ? 'PASS' : 'MISS')
  const mp = median(ratios.produce)
  const mc = median(ratios.consume)
  console.log(`RATIO JS3 jetstream-produce-vs-nats-io-jetstream ${mp.toFixed(2)} target >=1.5 ${verdict(mp)} ${tail}`)
  console.log(`RATIO JS3 jetstream-consume-vs-nats-io-jetstream ${mc.toFixed(2)} target >=1.5 ${verdict(mc)} ${tail}`)
  console.log(`load average after: ${loadavg()}`)
  process.exit(0)
})().catch((e) => {
  console.error(e)
  process.exit(1)
})
