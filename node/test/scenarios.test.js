'use strict'
// The Node interpreter of the cross-language scenario suite (tests/scenarios/scenarios.json,
// issue #24): every (scenario, platform) cell of the spec runs against the real broker named by
// the spec's environment variable, one test per cell, and prints
// `SCENARIO <name> node <platform> PASS|FAIL` (also written to
// `$CARGO_TARGET_DIR/scenarios/node.txt` for tests/scenarios/check.py). The cells run
// concurrently (a few at a time) before the first test reads its result.
const test = require('node:test')
const assert = require('node:assert/strict')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const api = require('@opentelemetry/api')
const { AsyncLocalStorageContextManager } = require('@opentelemetry/context-async-hooks')
const { W3CTraceContextPropagator } = require('@opentelemetry/core')
const { BasicTracerProvider } = require('@opentelemetry/sdk-trace-base')
const onceflow = require('..')
const { unique } = require('./helpers')

const ROOT = path.resolve(__dirname, '..', '..')
const SPEC = JSON.parse(fs.readFileSync(path.join(ROOT, 'tests', 'scenarios', 'scenarios.json'), 'utf8'))
const LANGUAGE = 'node'
const TRACE_HEADERS = new Set(['traceparent', 'tracestate', 'baggage'])
const CELL_TIMEOUT_MS = 120000
const WAIT_MS = 60000
const PARALLEL = 12

api.context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable())
api.propagation.setGlobalPropagator(new W3CTraceContextPropagator())
api.trace.setGlobalTracerProvider(new BasicTracerProvider())
const tracer = api.trace.getTracer('onceflow-scenarios')

class MissingEnv extends Error {}

function cells() {
  const out = []
  for (const s of SPEC.scenarios) {
    for (const store of s.stores || [null]) {
      const name = store === null ? s.name : `${s.name}[${store}]`
      for (const platform of Object.keys(SPEC.platforms)) out.push({ name, scenario: s, store, platform })
    }
  }
  return out
}

function envUrl(v) {
  const url = process.env[v]
  if (!url) throw new MissingEnv(`${v} is not set (tests/brokers/up.sh starts the broker)`)
  return url
}

function platformUrl(name) {
  const p = SPEC.platforms[name]
  if (p.url) return p.url + unique('node-scn')
  let url = envUrl(p.env)
  const extra = []
  if (p.query) extra.push(p.query)
  if (p.admin_env && process.env[p.admin_env] && !url.includes('admin=')) extra.push(`admin=${process.env[p.admin_env]}`)
  if (extra.length) url += (url.includes('?') ? '&' : '?') + extra.join('&')
  return url
}

function storeUrl(name, tmp) {
  const s = SPEC.stores[name]
  if (s.url) return s.url
  if (s.file) return path.join(tmp, `${unique('dedup')}.db`)
  return envUrl(s.env)
}

/** A spec value, `hex:…` or `text:…`, as a Buffer; null stays null. */
function value(v) {
  if (v === null || v === undefined) return null
  const i = v.indexOf(':')
  const kind = v.slice(0, i)
  const rest = v.slice(i + 1)
  if (kind === 'hex') return Buffer.from(rest, 'hex')
  if (kind === 'text') return Buffer.from(rest, 'utf8')
  throw new Error(`spec value ${v}: expected hex:… or text:…`)
}

const show = (b) => (b === null ? 'null' : `hex:${b.toString('hex')}`)

function subst(s, vars) {
  for (const [k, v] of Object.entries(vars)) s = s.split(`$${k}`).join(String(v))
  return s
}

/** Spec engine settings (snake_case, `*_ms` in milliseconds) as the Node options (camelCase). */
function engineOptions(cfg) {
  const out = { pollTimeoutMs: 50 }
  for (const [k, v] of Object.entries(cfg || {})) {
    out[k.replace(/_([a-z])/g, (_, c) => c.toUpperCase())] = v
  }
  return out
}

const camel = (k) => k.replace(/_([a-z])/g, (_, c) => c.toUpperCase())
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** Polls until `want` messages arrived (or the wait ran out), then `quietMs` more. */
async function read(consumer, want, quietMs) {
  const got = []
  const deadline = Date.now() + WAIT_MS
  while (got.length < want && Date.now() < deadline) got.push(...(await consumer.poll(want - got.length, 200)))
  const quiet = Date.now() + quietMs
  while (Date.now() < quiet) got.push(...(await consumer.poll(10, 200)))
  return got
}

/** The payloads of `got` are those of the spec, as a multiset. */
function checkPayloads(got, expected, what) {
  const actual = got.map((m) => show(m.payload)).sort()
  assert.deepStrictEqual(actual, expected.map((p) => show(value(p))).sort(), `payloads ${what}`)
}

async function waitUntil(pred, what, ms = WAIT_MS) {
  const deadline = Date.now() + ms
  while (!(await pred())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`)
    await sleep(50)
  }
}

class Cell {
  constructor(scenario, store, platform, client, tmp) {
    Object.assign(this, { scenario, store, platform, client, tmp })
    this.topics = {}
    this.vars = {}
  }

  storeOf(step) {
    return storeUrl(step.store === '$store' ? this.store : step.store, this.tmp)
  }

  async run() {
    for (const [i, raw] of this.scenario.steps.entries()) {
      // A platform's documented difference replaces fields of the step ("why" says why).
      const { why: _why, ...override } = (raw.overrides || {})[this.platform] || {}
      const step = { ...raw, ...override }
      const unsupported = (step.unsupported || {})[this.platform]
      try {
        await this[`op_${step.op}`](step)
      } catch (e) {
        if (unsupported && e instanceof onceflow.OnceflowError && e.kind === unsupported.kind) return
        e.message = `step ${i} (${step.op}): ${e.message}`
        throw e
      }
      if (unsupported) {
        throw new Error(
          `step ${i} (${step.op}) succeeded on ${this.platform}, where the spec documents a ` +
            `${unsupported.kind} error: ${unsupported.reason}`
        )
      }
    }
  }

  async op_topic(step) {
    const name = unique('node-scn')
    const admin = await this.client.admin()
    await admin.createTopic(name, { partitions: step.partitions || 1 })
    this.topics[step.as] = name
  }

  async op_produce(step) {
    const producer = await this.client.producer()
    const topic = this.topics[step.topic]
    const deliveries = []
    const sendAll = async () => {
      for (const r of step.records) {
        const rec = { topic, payload: value(r.payload), headers: (r.headers || []).map(([n, v]) => [n, value(v)]) }
        const key = value(r.key)
        if (key !== null) rec.key = key
        if (r.idempotency_key) rec.idempotencyKey = r.idempotency_key
        deliveries.push(await producer.send(rec))
      }
    }
    if (step.traceparent) {
      const parent = api.propagation.extract(api.ROOT_CONTEXT, { traceparent: step.traceparent })
      await tracer.startActiveSpan('scenario produce', {}, parent, async (span) => {
        try {
          await sendAll()
        } finally {
          span.end()
        }
      })
    } else {
      await sendAll()
    }
    await producer.flush()
    await producer.close()
    if (step.expect_attempts) {
      assert.deepStrictEqual(deliveries.map((d) => d.attempts), step.expect_attempts, 'Delivery.attempts per record')
    }
    if (step.expect_duplicate) {
      assert.deepStrictEqual(deliveries.map((d) => d.duplicate), step.expect_duplicate, 'Delivery.duplicate per record')
    }
  }

  async op_transaction(step) {
    const producer = await this.client.producer({ transactionalId: unique('node-scn-tx') })
    const topic = this.topics[step.topic]
    const records = (rs) => rs.map((r) => ({ topic, payload: value(r.payload) }))
    class Abort extends Error {}
    try {
      await producer.transaction(async (tx) => {
        for (const r of records(step.commit)) await tx.send(r)
      })
      // transaction() aborts when its function throws, and rethrows.
      await assert.rejects(
        producer.transaction(async (tx) => {
          for (const r of records(step.abort)) await tx.send(r)
          throw new Abort('scenario: abort')
        }),
        Abort
      )
    } finally {
      await producer.close()
    }
  }

  async op_atomic_batch(step) {
    const producer = await this.client.producer()
    const topic = this.topics[step.topic]
    try {
      // Rust's Producer::send_atomic; the name the Node API would give it, next to sendBatch.
      // Until the binding has it, every cell of this scenario fails here.
      assert.equal(
        typeof producer.sendAtomic,
        'function',
        'the Node binding has no Producer.sendAtomic (Rust: Producer::send_atomic, JetStream atomic batches; issue #24 asks for them in Node)'
      )
      const records = step.records.map((r) => ({ topic, payload: value(r.payload) }))
      const deliveries = await producer.sendAtomic(records)
      assert.equal(deliveries.length, records.length, 'one delivery per record')
    } finally {
      await producer.close()
    }
  }

  async op_inbox(step) {
    // The transactional inbox (Rust: PostgresStore::inbox / EmbeddedStore::inbox; Python:
    // onceflow.Inbox). Until the Node binding has one, every cell of this scenario fails here.
    assert.equal(
      typeof onceflow.Inbox,
      'function',
      'the Node binding has no transactional inbox (onceflow.Inbox; Rust and Python have it, issue #24 asks for it in Node)'
    )
    const consumer = await this.client.consumer(unique('node-scn-g'), [this.topics[step.topic]], { start: 'earliest' })
    const table = unique('scn_inbox').replace(/-/g, '_')
    const sql = {}
    for (const [k, v] of Object.entries(step.sql)) sql[k] = (typeof v === 'string' ? v : v[this.store]).split('{table}').join(table)
    const keyHeader = step.key_header || 'idempotency-key'
    const calls = {}
    const rowsSeen = []
    // Each cell its own namespace: keys are the inbox's per namespace, not per group, and the
    // PostgreSQL database is shared by every cell and run.
    const options = { pollTimeoutMs: 50, namespace: unique('scn-ns') }
    if (step.key_header) options.key = `header:${keyHeader}`
    const inbox = new onceflow.Inbox(
      consumer,
      async (m, tx) => {
        const h = onceflow.header(m, keyHeader)
        const k = h ? h.toString() : ''
        await tx.execute(sql.create)
        const rows = Number((await tx.query(sql.count))[0][0])
        await tx.execute(sql.insert, [k, m.payload.toString()])
        calls[k] = (calls[k] || 0) + 1
        rowsSeen.push(rows)
      },
      storeUrl(this.store, this.tmp),
      options
    )
    const want = step.expect_summary
    const deadline = Date.now() + WAIT_MS
    let summary
    for (;;) {
      await inbox.step()
      summary = inbox.summary()
      if (Object.entries(want).every(([k, v]) => summary[k] >= v) || Date.now() > deadline) break
    }
    await consumer.close()
    for (const [k, v] of Object.entries(want)) assert.equal(summary[k], v, `inbox summary ${k}`)
    assert.deepStrictEqual(calls, step.expect_calls, 'handler calls per key')
    assert.deepStrictEqual(rowsSeen, step.expect_rows_seen, 'rows seen by each handler call')
  }

  async op_sleep(step) {
    await sleep(step.ms)
  }

  async op_mark_time(step) {
    this.vars[step.as] = Date.now()
  }

  async op_consume(step) {
    const start = subst(step.start || 'earliest', this.vars)
    const consumer = await this.client.consumer(unique('node-scn-g'), [this.topics[step.topic]], { start })
    const want = step.expect ? step.expect.length : step.expect_payloads.length
    // Without a seek to follow, `quiet_ms` more after the last expected record: nothing more.
    const got = await read(consumer, want, step.seek ? 0 : step.quiet_ms || 0)
    if (step.expect) {
      const actual = got.map((m) => ({
        key: show(m.key),
        payload: show(m.payload),
        headers: m.headers.filter((h) => !TRACE_HEADERS.has(h.name.toLowerCase())).map((h) => [h.name, show(h.value)]),
      }))
      const expected = step.expect.map((r) => ({
        key: show(value(r.key)),
        payload: show(value(r.payload)),
        headers: (r.headers || []).map(([n, v]) => [n, show(value(v))]),
      }))
      assert.deepStrictEqual(actual, expected)
    } else {
      checkPayloads(got, step.expect_payloads, 'read')
    }
    if (step.seek) {
      const to = subst(step.seek, this.vars)
      const assignment = consumer.assignment()
      assert.ok(assignment.length > 0, 'no partition assigned after reading')
      for (const { topic, partition } of assignment) await consumer.seek(topic, partition, to)
      const again = await read(consumer, step.expect_after_seek.length, step.quiet_ms || 0)
      checkPayloads(again, step.expect_after_seek, `read after seek to ${to}`)
    }
    await consumer.close()
  }

  async op_idempotent(step) {
    const consumer = await this.client.consumer(unique('node-scn-g'), [this.topics[step.topic]], { start: 'earliest' })
    const calls = {}
    const deliveryCounts = {}
    const failFirst = new Set(step.fail_first || [])
    const seenTraces = []
    const keyHeader = step.key_header || 'idempotency-key'
    const options = { ...engineOptions(step.config), store: this.storeOf(step) }
    if (step.key_header) options.key = `header:${keyHeader}`
    const handler = async (m) => {
      const h = onceflow.header(m, keyHeader)
      const k = h ? h.toString() : ''
      calls[k] = (calls[k] || 0) + 1
      ;(deliveryCounts[k] = deliveryCounts[k] || []).push(m.deliveryCount)
      if (step.expect_trace) {
        const span = api.trace.getSpan(api.context.active())
        const tp = onceflow.header(m, 'traceparent')
        seenTraces.push([span ? span.spanContext().traceId : null, tp ? tp.toString() : null])
      }
      if (failFirst.has(k) && calls[k] === 1) throw new Error(`scenario: the first delivery of ${k} fails`)
    }
    const engine = new onceflow.IdempotentConsumer(consumer, handler, options)
    let finished = false
    const run = engine.run().finally(() => {
      finished = true
    })
    const expectMetrics = step.expect_metrics
    const callsMatch = () => JSON.stringify(Object.entries(calls).sort()) === JSON.stringify(Object.entries(step.expect_calls).sort())
    try {
      await waitUntil(() => {
        if (finished) return true
        const m = engine.metrics()
        return m !== null && callsMatch() && Object.entries(expectMetrics).every(([k, v]) => m[camel(k)] >= v)
      }, `handler calls ${JSON.stringify(step.expect_calls)} and metrics ${JSON.stringify(expectMetrics)}`)
    } finally {
      engine.stop()
    }
    const summary = await run
    assert.deepStrictEqual(calls, step.expect_calls, 'handler calls per key')
    for (const [k, v] of Object.entries(expectMetrics)) {
      assert.equal(summary.metrics[camel(k)], v, `metrics.${camel(k)} (all: ${JSON.stringify(summary.metrics)})`)
    }
    for (const [k, want] of Object.entries(step.expect_delivery_counts || {})) {
      assert.deepStrictEqual(deliveryCounts[k], want, `deliveryCount of ${k} per handler call`)
    }
    if (step.expect_trace) {
      const want = step.expect_trace
      assert.ok(seenTraces.length > 0, 'the handler never ran')
      for (const [traceId, tp] of seenTraces) {
        assert.equal(traceId, want.trace_id, 'the trace the handler ran in')
        assert.ok(tp, 'the message carries a traceparent')
        const parts = tp.split('-')
        assert.equal(parts[1], want.trace_id, `traceparent ${tp}: another trace`)
        assert.notEqual(parts[2], want.not_span_id, `traceparent ${tp} names the given span, not the producer's`)
      }
    }
  }

  async op_pipeline(step) {
    const tx = (step.transactional_producer || []).includes(this.platform)
    const producer = await this.client.producer(tx ? { transactionalId: unique('node-scn-tx') } : {})
    const consumer = await this.client.consumer(unique('node-scn-g'), [this.topics[step.in]], { start: 'earliest' })
    const out = this.topics[step.out]
    const suffix = value(step.suffix)
    const pipeline = new onceflow.Pipeline(
      consumer,
      producer,
      async (m) => ({ topic: out, payload: Buffer.concat([m.payload, suffix]) }),
      { store: this.storeOf(step), pollTimeoutMs: 50 }
    )
    let finished = false
    const run = pipeline.run().finally(() => {
      finished = true
    })
    const want = step.expect_processed
    try {
      await waitUntil(() => finished || (pipeline.metrics() || { processed: 0 }).processed >= want, `${want} inputs processed`)
    } finally {
      pipeline.stop()
    }
    const summary = await run
    await producer.close()
    assert.equal(summary.metrics.processed, want, `processed (all: ${JSON.stringify(summary.metrics)})`)
    const expected = step.expect_guarantee[this.platform]
    assert.equal(pipeline.guarantee, expected, 'Pipeline.guarantee')
    assert.equal(summary.guarantee, expected, 'run() guarantee')
  }

  async op_lag(step) {
    const consumer = await this.client.consumer(unique('node-scn-g'), [this.topics[step.topic]], { start: 'earliest' })
    const taken = []
    const deadline = Date.now() + WAIT_MS
    while (taken.length < step.read) {
      assert.ok(Date.now() < deadline, `read ${taken.length} of ${step.read}`)
      taken.push(...(await consumer.poll(step.read - taken.length, 200)))
    }
    await consumer.commit(taken)
    const want = step.expect_messages
    let lags = []
    const lagDeadline = Date.now() + WAIT_MS
    let previous = null
    for (;;) {
      // The same figure twice in a row, 300 ms apart: not one seen while a commit lands.
      lags = await consumer.lag()
      const total = lags.reduce((a, l) => a + l.messages, 0)
      if (total === want && previous === want) break
      previous = total
      assert.ok(Date.now() < lagDeadline, `lag ${total} messages (${JSON.stringify(lags)}), expected ${want}`)
      await sleep(300)
    }
    const assignment = consumer.assignment()
    const committed = await consumer.committed(assignment)
    assert.ok(
      committed.length === assignment.length && committed.every((c) => c.next !== null && c.next !== undefined),
      `committed() = ${JSON.stringify(committed)}: a next position for every partition expected`
    )
    await consumer.close()
    if (step.expect_resume) {
      const member = await this.client.consumer(consumer.group, [this.topics[step.topic]], { start: 'committed' })
      const first = await read(member, 1, 0)
      await member.close()
      assert.ok(first.length > 0, 'a new member of the group read nothing')
      assert.equal(show(first[0].payload), show(value(step.expect_resume)), 'the first record a new member of the group reads')
    }
  }
}

async function runCell(c, tmp) {
  try {
    const url = platformUrl(c.platform)
    if (c.store !== null) storeUrl(c.store, tmp)
    const client = await onceflow.connect(url)
    let timer
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`the cell took longer than ${CELL_TIMEOUT_MS} ms`)), CELL_TIMEOUT_MS)
    })
    try {
      await Promise.race([new Cell(c.scenario, c.store, c.platform, client, tmp).run(), timeout])
    } finally {
      clearTimeout(timer)
    }
    return { status: 'PASS', why: '' }
  } catch (e) {
    if (e instanceof MissingEnv) {
      if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') return { status: 'FAIL', why: `${e.message} and ONCEFLOW_REQUIRE_BROKERS=1` }
      return { status: 'SKIP', why: e.message }
    }
    return { status: 'FAIL', why: (e && e.stack) || String(e) }
  }
}

async function runAll() {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-scenarios-'))
  const all = cells()
  const results = new Map()
  const lines = []
  let next = 0
  const worker = async () => {
    while (next < all.length) {
      const c = all[next++]
      const t0 = Date.now()
      const r = await runCell(c, tmp)
      results.set(`${c.name} ${c.platform}`, r)
      if (r.status !== 'SKIP') {
        const line = `SCENARIO ${c.name} ${LANGUAGE} ${c.platform} ${r.status}`
        console.log(`${line} (${((Date.now() - t0) / 1000).toFixed(1)}s)`)
        lines.push(line)
      }
    }
  }
  await Promise.all(Array.from({ length: PARALLEL }, worker))
  const dir = path.join(process.env.CARGO_TARGET_DIR || path.join(ROOT, 'target'), 'scenarios')
  fs.mkdirSync(dir, { recursive: true })
  fs.writeFileSync(path.join(dir, `${LANGUAGE}.txt`), lines.sort().map((l) => `${l}\n`).join(''))
  return results
}

let results
test.before(async () => {
  results = await runAll()
})

for (const c of cells()) {
  test(`SCENARIO ${c.name} ${LANGUAGE} ${c.platform}`, (t) => {
    const r = results.get(`${c.name} ${c.platform}`)
    if (r.status === 'SKIP') return t.skip(r.why)
    assert.equal(r.status, 'PASS', `SCENARIO ${c.name} ${LANGUAGE} ${c.platform} FAIL:\n${r.why}`)
  })
}
