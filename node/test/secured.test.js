'use strict'
// Secured connections from Node (#23): Kafka SASL_SSL with SCRAM given as the `options` object of
// connect() (nothing secret in the URL), a transaction over it, Pulsar mTLS (a client
// certificate as options), and refusals that reject with ONCEFLOW_AUTH quickly without showing
// the password. Runs on the secured listeners `tests/brokers/up.sh kafka nats-secure pulsar`
// start (ONCEFLOW_KAFKA_SASL_SSL_URL, ONCEFLOW_PULSAR_TLS_URL and the CAs, users, passwords and
// certificates they print).
const test = require('node:test')
const assert = require('node:assert/strict')
const onceflow = require('..')
const { topic, collect, unique } = require('./helpers')

const url = process.env.ONCEFLOW_KAFKA_SASL_SSL_URL
if (!url && process.env.ONCEFLOW_REQUIRE_BROKERS === '1') {
  throw new Error('ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_KAFKA_SASL_SSL_URL is not set')
}
const skip = url ? false : 'ONCEFLOW_KAFKA_SASL_SSL_URL is not set: start tests/brokers/up.sh kafka'

function scram(password, ca = process.env.ONCEFLOW_KAFKA_CA) {
  return {
    'security.protocol': 'SASL_SSL',
    'sasl.mechanism': 'SCRAM-SHA-256',
    'sasl.username': process.env.ONCEFLOW_KAFKA_SASL_USERNAME,
    'sasl.password': password,
    'ssl.ca.location': ca,
  }
}

test('SASL_SSL SCRAM with an options object: a transaction round trip', { skip }, async () => {
  const client = await onceflow.connect(url, scram(process.env.ONCEFLOW_KAFKA_SASL_PASSWORD))
  const t = await topic(client)
  const producer = await client.producer({ transactionalId: unique('node-secured-tx') })
  const tx = await producer.begin()
  await tx.send({ topic: t, payload: 'over-sasl-ssl-1' })
  await tx.send({ topic: t, payload: 'over-sasl-ssl-2' })
  await tx.commit()
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const got = await collect(consumer, 2)
  assert.deepEqual(got.map((m) => m.payload.toString()), ['over-sasl-ssl-1', 'over-sasl-ssl-2'])
  await consumer.close()
  await producer.close()
})

for (const kase of ['wrong password', 'untrusted CA']) {
  test(`${kase}: ONCEFLOW_AUTH within seconds, no secret shown`, { skip }, async () => {
    const wrong = 'node-wrong-password-8b1d'
    const real = process.env.ONCEFLOW_KAFKA_SASL_PASSWORD
    const options = kase === 'wrong password' ? scram(wrong) : scram(real, process.env.ONCEFLOW_KAFKA_OTHER_CA)
    const started = Date.now()
    const err = await onceflow.connect(url, options).then(
      () => assert.fail('connect succeeded'),
      (e) => e,
    )
    const ms = Date.now() - started
    console.log(`AUTH node ${kase} ${ms} ms: ${err.message}`)
    assert.equal(err.code, 'ONCEFLOW_AUTH', err.message)
    assert.equal(err.kind, 'auth')
    assert.equal(err.retriable, false)
    assert.ok(err instanceof onceflow.OnceflowError)
    assert.ok(ms < 15000, `${kase} took ${ms} ms`)
    const shown = `${err.message} ${err.stack} ${JSON.stringify(err)}`
    assert.ok(!shown.includes(wrong) && !shown.includes(real), shown)
  })
}

const natsUrl = process.env.ONCEFLOW_NATS_SECURE_URL
if (!natsUrl && process.env.ONCEFLOW_REQUIRE_BROKERS === '1') {
  throw new Error('ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_NATS_SECURE_URL is not set')
}
const skipNats = natsUrl ? false : 'ONCEFLOW_NATS_SECURE_URL is not set: start tests/brokers/up.sh nats-secure'

test('NATS over TLS with user and password options: round trip; a wrong password is ONCEFLOW_AUTH', { skip: skipNats }, async () => {
  const options = {
    user: process.env.ONCEFLOW_NATS_SECURE_USER,
    password: process.env.ONCEFLOW_NATS_SECURE_PASSWORD,
    tls_ca: process.env.ONCEFLOW_NATS_SECURE_CA,
  }
  const client = await onceflow.connect(natsUrl, options)
  const t = await topic(client)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'over-tls' })
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const got = await collect(consumer, 1)
  assert.deepEqual(got.map((m) => m.payload.toString()), ['over-tls'])
  await consumer.close()
  await producer.close()

  const wrong = 'node-wrong-nats-password-5e7a'
  const started = Date.now()
  const err = await onceflow.connect(natsUrl, { ...options, password: wrong }).then(
    () => assert.fail('connect succeeded'),
    (e) => e,
  )
  console.log(`AUTH node nats wrong password ${Date.now() - started} ms: ${err.message}`)
  assert.equal(err.code, 'ONCEFLOW_AUTH', err.message)
  const shown = `${err.message} ${err.stack}`
  assert.ok(!shown.includes(wrong) && !shown.includes(options.password), shown)
})

const pulsarUrl = process.env.ONCEFLOW_PULSAR_TLS_URL
if (!pulsarUrl && process.env.ONCEFLOW_REQUIRE_BROKERS === '1') {
  throw new Error('ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_PULSAR_TLS_URL is not set')
}
const skipPulsar = pulsarUrl ? false : 'ONCEFLOW_PULSAR_TLS_URL is not set: start tests/brokers/up.sh pulsar'

function pulsarMtls(cert, key) {
  return {
    admin: process.env.ONCEFLOW_PULSAR_TLS_ADMIN_URL,
    tls_trust_certs: process.env.ONCEFLOW_PULSAR_TLS_CA,
    tls_cert_file: cert,
    tls_key_file: key,
  }
}

test('Pulsar mTLS with a client certificate as options: round trip; a rogue certificate is ONCEFLOW_AUTH', { skip: skipPulsar }, async () => {
  const client = await onceflow.connect(
    pulsarUrl,
    pulsarMtls(process.env.ONCEFLOW_PULSAR_CLIENT_CERT, process.env.ONCEFLOW_PULSAR_CLIENT_KEY),
  )
  const t = await topic(client, 2)
  const producer = await client.producer()
  await producer.send({ topic: t, payload: 'over-mtls-1', key: 'a' })
  await producer.send({ topic: t, payload: 'over-mtls-2', key: 'b' })
  const consumer = await client.consumer(unique('g'), [t], { start: 'earliest' })
  const got = await collect(consumer, 2)
  assert.deepEqual(got.map((m) => m.payload.toString()).sort(), ['over-mtls-1', 'over-mtls-2'])
  await consumer.close()
  await producer.close()

  const keyFile = process.env.ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY
  const started = Date.now()
  const err = await onceflow.connect(pulsarUrl, pulsarMtls(process.env.ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT, keyFile)).then(
    () => assert.fail('connect succeeded'),
    (e) => e,
  )
  const ms = Date.now() - started
  console.log(`AUTH node pulsar mTLS rogue certificate ${ms} ms: ${err.message}`)
  assert.equal(err.code, 'ONCEFLOW_AUTH', err.message)
  assert.ok(ms < 15000, `took ${ms} ms`)
  assert.ok(err.message.includes('client certificate'), err.message)
  const shown = `${err.message} ${err.stack}`
  const keyLines = require('node:fs').readFileSync(keyFile, 'utf8').split('\n').filter((l) => l && !l.startsWith('-----'))
  assert.ok(!keyLines.some((l) => shown.includes(l)), shown)
})

test('a bad tls_trust_certs file is named as the option is written, not in camelCase', { skip: skipPulsar }, async () => {
  const fs = require('node:fs')
  const os = require('node:os')
  const path = require('node:path')
  const bad = path.join(os.tmpdir(), `onceflow-bad-ca-${process.pid}.pem`)
  // Base64, so read as PEM, but no certificate: rustls refuses it ('tls_trust_certs: invalid
  // peer certificate: BadEncoding'), which Node's errors once spelled 'tlsTrustCerts: …'.
  fs.writeFileSync(bad, '-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n')
  try {
    await assert.rejects(
      onceflow.connect(pulsarUrl, { admin: process.env.ONCEFLOW_PULSAR_TLS_ADMIN_URL, tls_trust_certs: bad }),
      (e) => {
        assert.equal(e.kind, 'config', e.message)
        assert.match(e.message, /^tls_trust_certs: /)
        assert.doesNotMatch(e.message, /tlsTrustCerts/)
        return true
      },
    )
  } finally {
    fs.rmSync(bad, { force: true })
  }
})
