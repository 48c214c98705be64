'use strict'
// Shared by the tests: the platforms to run on (memory:// always; Kafka and NATS when
// ONCEFLOW_KAFKA_URL / ONCEFLOW_NATS_URL are set, as tests/run-all.sh does), unique names,
// and a helper that reads until a predicate holds or a deadline passes.
const crypto = require('node:crypto')

function unique(prefix) {
  return `${prefix}-${crypto.randomBytes(6).toString('hex')}`
}

function platforms() {
  const out = [{ name: 'memory', url: () => `memory://${unique('node')}` }]
  if (process.env.ONCEFLOW_KAFKA_URL) out.push({ name: 'kafka', url: () => process.env.ONCEFLOW_KAFKA_URL })
  else if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') throw new Error('ONCEFLOW_KAFKA_URL is not set')
  if (process.env.ONCEFLOW_NATS_URL) out.push({ name: 'nats', url: () => process.env.ONCEFLOW_NATS_URL })
  else if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') throw new Error('ONCEFLOW_NATS_URL is not set')
  return out
}

/** Creates a topic where the platform needs one (Kafka, JetStream). */
async function topic(client, partitions = 1) {
  const name = unique('t')
  const admin = await client.admin()
  await admin.createTopic(name, { partitions })
  return name
}

/** Collects messages from `consumer` until `n` arrived or `ms` passed. */
async function collect(consumer, n, ms = 20000) {
  const out = []
  const deadline = Date.now() + ms
  while (out.length < n && Date.now() < deadline) {
    out.push(...(await consumer.poll(500, 200)))
  }
  return out
}

async function until(pred, ms = 20000) {
  const deadline = Date.now() + ms
  while (Date.now() < deadline) {
    if (await pred()) return true
    await new Promise((r) => setTimeout(r, 50))
  }
  return false
}

module.exports = { unique, platforms, topic, collect, until }
