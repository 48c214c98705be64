'use strict'
// The transactional inbox from Node: the handler's SQL, the idempotency key and the position
// commit in one database transaction, on the real PostgreSQL (ONCEFLOW_POSTGRES_URL) and on the
// embedded (SQLite) store, over the memory backend and the real Kafka and JetStream brokers. What was
// committed is read from outside the inbox with psql / Python's sqlite3.
const test = require('node:test')
const assert = require('node:assert/strict')
const { execFileSync } = require('node:child_process')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const onceflow = require('..')
const { unique, topic } = require('./helpers')

function platforms() {
  const out = [{ name: 'memory', url: () => `memory://${unique('node')}` }]
  if (process.env.ONCEFLOW_KAFKA_URL) out.push({ name: 'kafka', url: () => process.env.ONCEFLOW_KAFKA_URL })
  else if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') throw new Error('ONCEFLOW_KAFKA_URL is not set')
  if (process.env.ONCEFLOW_NATS_URL) out.push({ name: 'nats', url: () => process.env.ONCEFLOW_NATS_URL })
  else if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') throw new Error('ONCEFLOW_NATS_URL is not set')
  return out
}

const stores = ['postgres', 'embedded']

// Reads the embedded store's file with Python's sqlite3 module (Node 20 has no SQLite, and the
// sqlite3 shell is not everywhere): tab-separated rows, as psql -tAF prints them.
const SQLITE = [
  'import sqlite3, sys',
  'c = sqlite3.connect(sys.argv[1], timeout=10)',
  'rows = c.execute(sys.argv[2]).fetchall()',
  'c.commit()',
  'print("\\n".join("\\t".join(str(v) for v in r) for r in rows))',
].join('\n')

/** A store for one test with its own table `(key TEXT, payload TEXT)`; undefined without PostgreSQL. */
function database(kind, t) {
  const table = unique('node_inbox').replace(/-/g, '_')
  let url, file
  if (kind === 'postgres') {
    url = process.env.ONCEFLOW_POSTGRES_URL
    if (!url) {
      if (process.env.ONCEFLOW_REQUIRE_BROKERS === '1') throw new Error('ONCEFLOW_POSTGRES_URL is not set')
      t.skip('ONCEFLOW_POSTGRES_URL is not set: no PostgreSQL (tests/brokers/up.sh postgres starts one)')
      return undefined
    }
  } else {
    file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-inbox-')), 'inbox.db')
    url = `embedded://${file}`
  }
  const db = {
    kind,
    url,
    table,
    ph: (i) => (kind === 'postgres' ? `$${i}` : '?'),
    sql(statement) {
      const out =
        kind === 'postgres'
          ? execFileSync('psql', [url, '-v', 'ON_ERROR_STOP=1', '-qtAF', '\t', '-c', statement], { encoding: 'utf8' })
          : execFileSync('python3', ['-c', SQLITE, file, statement], { encoding: 'utf8' })
      return out.split('\n').filter((l) => l).map((l) => l.split('\t'))
    },
    rows() {
      return db.sql(`SELECT key, payload FROM ${table} ORDER BY key, payload`)
    },
  }
  db.insert = `INSERT INTO ${table} (key, payload) VALUES (${db.ph(1)}, ${db.ph(2)})`
  db.sql(`CREATE TABLE ${table} (key TEXT NOT NULL, payload TEXT NOT NULL)`)
  t.after(() => {
    if (kind === 'postgres') db.sql(`DROP TABLE IF EXISTS ${table}`)
  })
  return db
}

async function send(client, t, items) {
  const producer = await client.producer()
  for (const [key, payload] of items) await producer.send({ topic: t, payload, idempotencyKey: key })
  await producer.flush()
  await producer.close()
}

async function stepUntil(inbox, done, ms = 30000) {
  const deadline = Date.now() + ms
  while (!done(inbox.summary())) {
    if (Date.now() > deadline) throw new Error(`inbox did not get there: ${JSON.stringify(inbox.summary())}`)
    await inbox.step()
  }
}

const keyOf = (m) => onceflow.header(m, 'idempotency-key').toString()

function inserting(db, calls) {
  return async (m, tx) => {
    const key = keyOf(m)
    calls[key] = (calls[key] || 0) + 1
    assert.equal(await tx.execute(db.insert, [key, m.payload.toString()]), 1)
  }
}

for (const p of platforms()) {
  for (const kind of stores) {
    const name = `${p.name}/${kind}`

    test(`${name}: one row per message; a redelivered message writes none`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      // The business key rides in its own header (the inbox's `key` setting), so the repeat of
      // k1 reaches the consumer on every platform (JetStream's producer dedup drops a repeated
      // idempotencyKey before it is stored).
      const producer = await client.producer()
      for (const [key, payload] of [['k0', 'a'], ['k1', 'b'], ['k2', 'c'], ['k1', 'b']]) {
        await producer.send({ topic: tp, payload, headers: { 'order-id': key } })
      }
      await producer.flush()
      await producer.close()
      const calls = {}
      const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(
        consumer,
        async (m, tx) => {
          const key = onceflow.header(m, 'order-id').toString()
          calls[key] = (calls[key] || 0) + 1
          assert.equal(await tx.execute(db.insert, [key, m.payload.toString()]), 1)
        },
        db.url, { namespace: unique('ns'), key: 'header:order-id' }
      )
      await stepUntil(inbox, (s) => s.handled + s.duplicates >= 4)
      assert.equal(inbox.store, kind)
      assert.deepEqual(inbox.summary(), { handled: 3, duplicates: 1, behindPosition: 0 })
      assert.deepEqual(calls, { k0: 1, k1: 1, k2: 1 })
      assert.deepEqual(db.rows(), [['k0', 'a'], ['k1', 'b'], ['k2', 'c']])
      await consumer.close()
    })

    test(`${name}: query sees the transaction's rows, as arrays or objects`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      await send(client, tp, [['q0', 'x'], ['q1', 'y']])
      const seen = []
      const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(
        consumer,
        async (m, tx) => {
          await tx.execute(db.insert, [keyOf(m), m.payload.toString()])
          const arrays = await tx.query(`SELECT key, payload FROM ${db.table} ORDER BY key`, [])
          const objects = await tx.query(`SELECT count(*) AS n, CAST(${db.ph(1)} AS INTEGER) AS echoed FROM ${db.table}`, [7], { asObjects: true })
          seen.push([arrays, objects])
        },
        db.url, { namespace: unique('ns') }
      )
      await stepUntil(inbox, (s) => s.handled >= 2)
      assert.deepEqual(seen[0], [[['q0', 'x']], [{ n: 1, echoed: 7 }]])
      assert.deepEqual(seen[1], [[['q0', 'x'], ['q1', 'y']], [{ n: 2, echoed: 7 }]])
      await consumer.close()
    })

    test(`${name}: a handler that throws writes nothing and is retried`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      await send(client, tp, [['r0', 'a'], ['r1', 'b']])
      const calls = {}
      const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(
        consumer,
        async (m, tx) => {
          const key = keyOf(m)
          calls[key] = (calls[key] || 0) + 1
          await tx.execute(db.insert, [key, `attempt ${calls[key]}`])
          if (key === 'r1' && calls[key] === 1) throw new Error('first attempt fails after its insert')
        },
        db.url, { namespace: unique('ns'), backoffMs: 10 }
      )
      await stepUntil(inbox, (s) => s.handled >= 2)
      assert.deepEqual(calls, { r0: 1, r1: 2 })
      assert.deepEqual(db.rows(), [['r0', 'attempt 1'], ['r1', 'attempt 2']])
      await consumer.close()
    })

    test(`${name}: a SQL error fails the message even when the handler catches it`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      await send(client, tp, [['s0', 'a']])
      const errors = []
      let calls = 0
      const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(
        consumer,
        async (m, tx) => {
          calls++
          await tx.execute(db.insert, ['s0', `attempt ${calls}`])
          if (calls === 1) {
            try {
              await tx.execute('INSERT INTO no_such_table_at_all VALUES (1)')
            } catch (e) {
              errors.push(e) // swallowed: the transaction still rolls back
            }
          }
        },
        db.url, { namespace: unique('ns'), backoffMs: 10 }
      )
      await stepUntil(inbox, (s) => s.handled >= 1)
      assert.equal(calls, 2)
      assert.ok(errors[0] instanceof onceflow.OnceflowError)
      assert.equal(errors[0].code, 'ONCEFLOW_DEDUP_STORE')
      assert.match(errors[0].message, /no_such_table_at_all/)
      assert.deepEqual(db.rows(), [['s0', 'attempt 2']])
      await consumer.close()
    })

    test(`${name}: a message failing every attempt stops the inbox with nothing committed`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      await send(client, tp, [['f0', 'a']])
      const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const boom = new Error('always')
      const inbox = new onceflow.Inbox(
        consumer,
        async (m, tx) => {
          await tx.execute(db.insert, ['f0', 'a'])
          throw boom
        },
        db.url, { namespace: unique('ns'), maxAttempts: 2, backoffMs: 10 }
      )
      await assert.rejects(stepUntil(inbox, () => false), (e) => {
        assert.equal(e.code, 'ONCEFLOW_HANDLER')
        assert.match(e.message, /always/)
        assert.equal(e.cause, boom)
        return true
      })
      assert.deepEqual(db.rows(), [])
      assert.deepEqual(await inbox.storedPositions(), [])
      await consumer.close()
    })

    test(`${name}: stored positions, and a fresh group resumes from them`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(p.url())
      const tp = await topic(client)
      await send(client, tp, [['p0', 'a'], ['p1', 'b'], ['p2', 'c']])
      const namespace = unique('ns')
      const calls = {}
      const positions = []
      const handle = async (m, tx) => {
        positions.push(m.position)
        await inserting(db, calls)(m, tx)
      }
      const first = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(first, handle, db.url, { namespace })
      await stepUntil(inbox, (s) => s.handled >= 3)
      assert.deepEqual(await inbox.storedPositions(), [{ topic: tp, partition: 0, position: positions[2] }])
      await first.close()

      await send(client, tp, [['p3', 'd'], ['p4', 'e']])
      // A new group reading from the earliest message: the inbox seeks past the stored position.
      const fresh = await client.consumer(unique('g-fresh'), [tp], { start: 'earliest' })
      const resumed = new onceflow.Inbox(fresh, handle, db.url, { namespace })
      await stepUntil(resumed, (s) => s.handled >= 2)
      for (let i = 0; i < 3; i++) await resumed.step()
      assert.equal(resumed.summary().handled, 2)
      assert.equal(resumed.summary().duplicates, 0)
      assert.deepEqual(calls, { p0: 1, p1: 1, p2: 1, p3: 1, p4: 1 })
      assert.deepEqual(db.rows().map((r) => r[0]), ['p0', 'p1', 'p2', 'p3', 'p4'])
      assert.equal(positions.length, 5)
      assert.deepEqual(await resumed.storedPositions(), [{ topic: tp, partition: 0, position: positions[4] }])
      await fresh.close()
    })
  }
}

// The inbox's keys and positions belong to its namespace ('default' unless set), not to the
// consumer group: a second group reading the topic from the earliest offset on the same database
// resumes after the stored position and skips the keys already done (#24). Keys are unique per
// run, since the default namespace is shared by every run on the database.
if (process.env.ONCEFLOW_KAFKA_URL) {
  for (const kind of stores) {
    test(`kafka/${kind}: a new group with the default namespace handles nothing twice`, async (t) => {
      const db = database(kind, t)
      if (!db) return
      const client = await onceflow.connect(process.env.ONCEFLOW_KAFKA_URL)
      const tp = await topic(client)
      const run = unique('ng')
      const firstKeys = Array.from({ length: 30 }, (_, i) => `${run}-${i}`)
      await send(client, tp, firstKeys.map((k) => [k, 'a']))
      const calls = {}
      const handle = inserting(db, calls)
      const first = await client.consumer(unique('g'), [tp], { start: 'earliest' })
      const inbox = new onceflow.Inbox(first, handle, db.url)
      await stepUntil(inbox, (s) => s.handled >= 30)
      assert.equal(inbox.namespace, 'default')
      await first.close()

      // Two new keys and a repeat of the first one, after the stored position.
      await send(client, tp, [[`${run}-new0`, 'b'], [`${run}-new1`, 'b'], [firstKeys[0], 'a']])
      const second = await client.consumer(unique('g-second'), [tp], { start: 'earliest' })
      const again = new onceflow.Inbox(second, handle, db.url)
      await stepUntil(again, (s) => s.handled + s.duplicates >= 3)
      assert.equal(again.namespace, 'default')
      assert.equal(again.summary().handled, 2, JSON.stringify(again.summary()))
      assert.equal(again.summary().duplicates, 1, JSON.stringify(again.summary()))
      assert.ok(Object.values(calls).every((n) => n === 1), JSON.stringify(calls))
      assert.equal(db.rows().filter((r) => r[0].startsWith(run)).length, 32)
      await second.close()
    })
  }
}

for (const kind of stores) {
  test(`memory/${kind}: the transaction is closed after the handler; params are typed`, async (t) => {
    const db = database(kind, t)
    if (!db) return
    const client = await onceflow.connect(`memory://${unique('node')}`)
    const tp = await topic(client)
    await send(client, tp, [['c0', 'a']])
    const kept = []
    const typeErrors = []
    const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
    const inbox = new onceflow.Inbox(
      consumer,
      async (m, tx) => {
        kept.push(tx)
        assert.ok(tx.open)
        assert.equal(tx.store, kind)
        await assert.rejects(tx.execute(db.insert, ['c0', { not: 'a value' }]), (e) => {
          typeErrors.push(e.message)
          return e instanceof TypeError
        })
        await assert.rejects(tx.execute(db.insert, 'c0'), /params: expected an array/)
        await tx.execute(db.insert, ['c0', 'a'])
      },
      db.url, { namespace: unique('ns') }
    )
    await stepUntil(inbox, (s) => s.handled >= 1)
    assert.deepEqual(typeErrors, ['params[1]: expected a string, number, bigint, boolean, Buffer, null or undefined, got Object'])
    assert.equal(kept[0].open, false)
    await assert.rejects(kept[0].execute(db.insert, ['late', 'write']), (e) => {
      assert.equal(e.code, 'ONCEFLOW_CLOSED')
      assert.match(e.message, /only while the handler runs/)
      return true
    })
    assert.deepEqual(db.rows(), [['c0', 'a']])
    await consumer.close()
  })

  test(`memory/${kind}: values round-trip`, async (t) => {
    const db = database(kind, t)
    if (!db) return
    const client = await onceflow.connect(`memory://${unique('node')}`)
    const tp = await topic(client)
    await send(client, tp, [['v0', 'a']])
    const got = []
    const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
    const sql =
      kind === 'postgres'
        ? 'SELECT $1::bigint AS i, $2::float8 AS f, $3::text AS s, $4::bytea AS b, $5::bool AS t, $6::text AS n, $7::bigint AS big'
        : 'SELECT ? AS i, ? AS f, ? AS s, ? AS b, ? AS t, ? AS n, ? AS big'
    const inbox = new onceflow.Inbox(
      consumer,
      async (m, tx) => {
        got.push(...(await tx.query(sql, [2 ** 40, 1.5, 'é', Buffer.from([0, 255]), true, undefined, 2n ** 60n], { asObjects: true })))
      },
      db.url, { namespace: unique('ns') }
    )
    await stepUntil(inbox, (s) => s.handled >= 1)
    // SQLite has no boolean type: true is stored and read back as 1.
    assert.deepEqual(got, [
      { i: 2 ** 40, f: 1.5, s: 'é', b: Buffer.from([0, 255]), t: kind === 'postgres' ? true : 1, n: null, big: 2n ** 60n },
    ])
    await consumer.close()
  })
}

test('a store without an inbox is a config error; settings are checked', async () => {
  const client = await onceflow.connect(`memory://${unique('node')}`)
  const tp = await topic(client)
  const consumer = await client.consumer(unique('g'), [tp])
  for (const url of ['memory://', 'redis://user:secret@127.0.0.1:1']) {
    const inbox = new onceflow.Inbox(consumer, async () => {}, url)
    await assert.rejects(inbox.step(), (e) => {
      assert.equal(e.code, 'ONCEFLOW_CONFIG')
      assert.match(e.message, /PostgreSQL or the embedded store/)
      assert.doesNotMatch(e.message, /secret/)
      return true
    })
  }
  assert.throws(() => new onceflow.Inbox(consumer, async () => {}, { namespace: 'x' }), (e) => e instanceof TypeError && /store: expected a postgres:\/\/ URL/.test(e.message))
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-inbox-'))
  await assert.rejects(new onceflow.Inbox(consumer, async () => {}, path.join(dir, 'x.db'), { backoff: 1 }).step(), /unknown setting 'backoff'.*backoffMs/)
  await assert.rejects(new onceflow.Inbox(consumer, async () => {}, path.join(dir, 'x.db'), { maxAttempts: 0 }).step(), /maxAttempts 0/)
  await consumer.close()
})

for (const kind of stores) {
  test(`memory/${kind}: run() until stop() resolves to the summary`, async (t) => {
    const db = database(kind, t)
    if (!db) return
    const client = await onceflow.connect(`memory://${unique('node')}`)
    const tp = await topic(client)
    await send(client, tp, [['u0', 'a'], ['u1', 'b'], ['u0', 'a']])
    const calls = {}
    const handle = inserting(db, calls)
    const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
    const namespace = unique('ns')
    const inbox = new onceflow.Inbox(
      consumer,
      async (m, tx) => {
        await handle(m, tx)
        if (Object.keys(calls).length === 2) inbox.stop()
      },
      db.url,
      { namespace }
    )
    const summary = await inbox.run()
    // The batch in hand is handled to its end: the repeat of u0 is skipped as a duplicate.
    assert.deepEqual(summary, { handled: 2, duplicates: 1, behindPosition: 0 })
    assert.deepEqual(inbox.summary(), summary)
    assert.equal(inbox.namespace, namespace)
    await assert.rejects(inbox.step(), /already ran/)
    assert.deepEqual(db.rows(), [['u0', 'a'], ['u1', 'b']])
    // The positions are still readable after run() returned: the last of the three committed.
    assert.deepEqual(await inbox.storedPositions(), [{ topic: tp, partition: 0, position: 'offset:2' }])
    await consumer.close()
  })
}

test('memory/postgres: a param PostgreSQL cannot take names its index and types', async (t) => {
  const db = database('postgres', t)
  if (!db) return
  const client = await onceflow.connect(`memory://${unique('node')}`)
  const tp = await topic(client)
  await send(client, tp, [['m0', 'a']])
  const errors = []
  const attempts = [['m0', 'seven'], ['m0', 2 ** 40], ['m0', 7]]
  const consumer = await client.consumer(unique('g'), [tp], { start: 'earliest' })
  const inbox = new onceflow.Inbox(
    consumer,
    async (m, tx) => {
      try {
        await tx.execute(`INSERT INTO ${db.table} (key, payload) SELECT $1, CAST($2::int4 AS text)`, attempts[errors.length])
      } catch (e) {
        errors.push(e)
        throw e
      }
    },
    db.url,
    { namespace: unique('ns'), backoffMs: 10 }
  )
  await stepUntil(inbox, (s) => s.handled >= 1)
  assert.deepEqual(
    errors.map((e) => [e.code, e.message]),
    [
      ['ONCEFLOW_SERIALIZATION', 'params[1] ($2): cannot send a value of kind text as PostgreSQL type int4: send a value of that type, or convert in SQL (CAST($2 AS text)::int4)'],
      ['ONCEFLOW_SERIALIZATION', 'params[1] ($2): 1099511627776 is out of range for PostgreSQL type int4'],
    ]
  )
  assert.deepEqual(db.rows(), [['m0', '7']])
  await consumer.close()
})
