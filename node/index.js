'use strict'
// The `onceflow` package: loads the native addon (built by scripts/build.js on install) and
// adds what is JavaScript's business: OnceflowError, `for await` over consumers,
// `producer.transaction(async tx => ...)`, argument normalisation and OpenTelemetry
// propagation. The behaviour is the Rust crate's; nothing here holds platform logic.
const path = require('node:path')
const fs = require('node:fs')
const otel = require('./otel')

function load() {
  const candidates = [
    process.env.ONCEFLOW_NODE_BINARY,
    path.join(__dirname, `onceflow.${process.platform}-${process.arch}.node`),
  ].filter(Boolean)
  for (const file of candidates) {
    if (fs.existsSync(file)) return require(file)
  }
  throw new Error(
    `onceflow: no native addon for ${process.platform}-${process.arch} in ${__dirname}; ` +
      'run `npm run build` in the package folder (needs Rust and cargo)'
  )
}

const native = load()
otel.setNative(native)

const MARKER = '\u0001onceflow-error:'
const JS_ERROR = /\[onceflow-js-error:(\d+)\]/
// Errors thrown by handlers and transforms, so an engine error can chain the original as cause.
const thrown = new Map()
let thrownSeq = 0

/** Every error onceflow raises: `code` (stable, per kind), `kind`, `retriable`, `cause`. */
class OnceflowError extends Error {
  constructor(info, cause) {
    super(info.message, cause === undefined ? undefined : { cause })
    this.name = info.name || 'OnceflowError'
    this.code = info.code
    this.kind = info.kind
    this.retriable = Boolean(info.retriable)
    this.outcomeUnknown = Boolean(info.outcomeUnknown)
  }
}

function decode(json) {
  const info = JSON.parse(json)
  let cause
  for (let i = info.causes.length - 1; i >= 0; i--) {
    const text = info.causes[i]
    const m = JS_ERROR.exec(text)
    cause = m && thrown.has(Number(m[1])) ? thrown.get(Number(m[1])) : new Error(text, cause === undefined ? undefined : { cause })
  }
  return new OnceflowError(info, cause)
}

/** A native error as an OnceflowError; anything else unchanged. */
function convert(e) {
  if (e && typeof e.message === 'string' && e.message.startsWith(MARKER)) {
    return decode(e.message.slice(MARKER.length))
  }
  return e
}

/** A config error raised by this file for an argument of the wrong type. */
function configError(message) {
  const info = native.errorKinds().find((k) => k.kind === 'config')
  return new OnceflowError({ message, kind: info.kind, code: info.code, name: info.name, retriable: false })
}

/** `v` when it is a number, undefined or null (the default); a config error naming `name` otherwise. */
function numberArg(name, v) {
  if (v === undefined || v === null) return undefined
  if (typeof v !== 'number') throw configError(`${name}: expected a number, got ${typeof v}`)
  return v
}
// The range and wholeness of a count are checked natively (onceflow-bindings' one rule).
const countArg = numberArg

function guard(fn) {
  return function (...args) {
    let r
    try {
      r = fn.apply(this, args)
    } catch (e) {
      throw convert(e)
    }
    if (r && typeof r.then === 'function') {
      return r.then(undefined, (e) => {
        throw convert(e)
      })
    }
    return r
  }
}

// Every native function and method converts its errors.
for (const [name, value] of Object.entries(native)) {
  if (typeof value !== 'function') continue
  if (/^[A-Z]/.test(name)) {
    for (const key of Object.getOwnPropertyNames(value.prototype)) {
      const d = Object.getOwnPropertyDescriptor(value.prototype, key)
      if (key !== 'constructor' && typeof d.value === 'function') {
        value.prototype[key] = guard(d.value)
      }
    }
  }
}
const connect = guard(native.connect)
const nativeDedupStore = guard(native._dedupStore)

// ---- conversions -------------------------------------------------------------------------

function toBuffer(v, what) {
  if (Buffer.isBuffer(v)) return v
  if (typeof v === 'string') return Buffer.from(v)
  if (v instanceof Uint8Array) return Buffer.from(v.buffer, v.byteOffset, v.byteLength)
  throw new TypeError(`${what}: expected a Buffer, a Uint8Array or a string, got ${v === null ? 'null' : typeof v}`)
}

/** Headers from an object `{name: value | value[]}`, a Map, or `[name, value]` / `{name, value}` items. */
function toHeaders(h) {
  if (h === undefined || h === null) return undefined
  const out = []
  const push = (name, value) =>
    out.push({ name: String(name), value: value === null || value === undefined ? null : toBuffer(value, `header '${name}'`) })
  if (Array.isArray(h)) {
    for (const item of h) {
      if (Array.isArray(item)) push(item[0], item[1])
      else push(item.name, item.value)
    }
  } else if (h instanceof Map) {
    for (const [k, v] of h) push(k, v)
  } else if (typeof h === 'object') {
    for (const k of Object.keys(h)) {
      const v = h[k]
      if (Array.isArray(v)) for (const x of v) push(k, x)
      else push(k, v)
    }
  } else {
    throw new TypeError('headers: expected an object, a Map or an array of [name, value]')
  }
  return out
}

/**
 * Refuses a key of `obj` that is not in `known` (a Set): a config error naming it and the
 * accepted ones, with a hint when it is another spelling of one (`idempotency_key`). A
 * misspelled option must not be dropped: a keyless record sent twice is processed twice (#31).
 */
function checkKeys(what, obj, known) {
  for (const k of Object.keys(obj)) {
    if (!known.has(k)) throw unknownKey(what, k, known)
  }
}

function unknownKey(what, k, known) {
  const loose = (s) => s.toLowerCase().replace(/[-_\s]/g, '')
  const near = [...known].find((n) => loose(n) === loose(k))
  const hint = near ? ` (did you mean ${near}?)` : ''
  return configError(`${what}: unknown key '${k}'${hint}: expected ${[...known].join(', ')}`)
}

const RECORD_KEYS = new Set(['topic', 'payload', 'key', 'headers', 'partition', 'timestamp', 'idempotencyKey', 'requeue'])
const SEND_OPTION_KEYS = new Set([...RECORD_KEYS].filter((k) => k !== 'topic' && k !== 'payload'))

/** A record from `{topic, payload, key, headers, partition, timestamp, idempotencyKey, requeue}`. */
function toRecord(r, what = 'record') {
  if (r === null || typeof r !== 'object') throw new TypeError('record: expected an object {topic, payload, ...}')
  checkKeys(what, r, RECORD_KEYS)
  if (typeof r.topic !== 'string') throw new TypeError(`record.topic: expected a string, got ${typeof r.topic}`)
  const out = { topic: r.topic, payload: toBuffer(r.payload, 'payload') }
  if (r.key !== undefined && r.key !== null) out.key = toBuffer(r.key, 'key')
  const headers = toHeaders(r.headers)
  if (headers) out.headers = headers
  // A string is refused for its type (not by a range message showing a valid-looking '1');
  // the range of a number is checked natively.
  const partition = numberArg('partition', r.partition)
  if (partition !== undefined) out.partition = partition
  const timestamp = numberArg('timestamp', r.timestamp)
  if (timestamp !== undefined) out.timestamp = timestamp
  if (r.idempotencyKey !== undefined && r.idempotencyKey !== null) out.idempotencyKey = String(r.idempotencyKey)
  const n = numberArg('requeue', r.requeue)
  if (n !== undefined) {
    if (!Number.isInteger(n) || n < 0 || n > 4294967295) {
      throw configError(`requeue ${String(n)}: expected a whole number from 0 to 4294967295`)
    }
    out.requeue = n
  }
  return out
}

function recordArgs(args) {
  // send(record) or send(topic, payload, options)
  if (typeof args[0] === 'string') {
    const options = args[2]
    if (options === undefined || options === null) return toRecord({ topic: args[0], payload: args[1] })
    if (typeof options !== 'object') throw configError(`send options: expected an object, got ${typeof options}`)
    checkKeys('send options', options, SEND_OPTION_KEYS)
    return toRecord({ ...options, topic: args[0], payload: args[1] })
  }
  return toRecord(args[0])
}

function batchResults(rs) {
  return rs.map((r) => (r.error ? decode(r.error) : r.delivery))
}

async function sendOne(target, system, record) {
  const started = otel.startSend(record.topic, system, 1, record.headers, record.payload.length)
  if (started) record.headers = otel.merge(record.headers, started.headers)
  try {
    const d = await target._send(record)
    otel.endSend(started, d)
    return d
  } catch (e) {
    otel.endSend(started, undefined, e)
    throw e
  }
}

async function sendMany(target, system, records, atomic = false) {
  const what = atomic ? 'sendAtomic' : 'sendBatch'
  if (!Array.isArray(records)) throw new TypeError(`${what}: expected an array of records`)
  const rs = records.map((r) => toRecord(r))
  const started = rs.length && otel.sameTraceHeaders(rs) ? otel.startSend(rs[0].topic, system, rs.length, rs[0].headers, rs[0].payload.length) : null
  if (started) for (const r of rs) r.headers = otel.merge(r.headers, started.headers)
  try {
    const out = atomic ? await target._sendAtomic(rs) : batchResults(await target._sendBatch(rs))
    otel.endSend(started, undefined, out.find((x) => x instanceof Error))
    return out
  } catch (e) {
    otel.endSend(started, undefined, e)
    throw e
  }
}

// ---- Producer and Transaction -------------------------------------------------------------

const { Producer, Transaction, Consumer } = native

/** Sends one record; resolves to its delivery `{topic, partition, position, timestamp, duplicate, attempts}`. */
Producer.prototype.send = function (...args) {
  return sendOne(this, this.platform, recordArgs(args))
}
/** Sends records pipelined in one crossing; one result per record: a delivery or an OnceflowError. */
Producer.prototype.sendBatch = function (records) {
  return sendMany(this, this.platform, records)
}
/**
 * Writes every record or none, as one atomic batch; resolves to their deliveries in order.
 * JetStream (atomic batch publish, ADR-50, nats-server 2.12+) and `memory://`; an
 * `unsupported` OnceflowError elsewhere (on Kafka, send in a transaction).
 */
Producer.prototype.sendAtomic = function (records) {
  return sendMany(this, this.platform, records, true)
}
/** Runs `fn(tx)` in a transaction: commits when it resolves, aborts and rethrows when it throws. */
Producer.prototype.transaction = async function (fn) {
  const tx = await this.begin()
  tx._system = this.platform
  let result
  try {
    result = await fn(tx)
  } catch (e) {
    try {
      await tx.abort()
    } catch {
      // the original error matters more
    }
    throw e
  }
  await tx.commit()
  return result
}

Transaction.prototype.send = function (...args) {
  return sendOne(this, this._system || 'onceflow', recordArgs(args))
}
Transaction.prototype.sendBatch = function (records) {
  return sendMany(this, this._system || 'onceflow', records)
}
/** Commits `consumer`'s positions with the transaction: the given messages/positions, or what it yielded last. */
Transaction.prototype.commitOffsets = async function (consumer, positions) {
  if (!(consumer instanceof Consumer)) {
    const got = consumer === null ? 'null' : typeof consumer === 'object' ? (consumer.constructor?.name ?? 'object') : `${typeof consumer} ${JSON.stringify(consumer)?.slice(0, 60)}`
    throw new TypeError(`commitOffsets(consumer, ...): expected the Consumer whose messages the transaction commits, got ${got}`)
  }
  return this._commitOffsets(consumer, explicitPositions(positions), consumer._batch ?? 0, consumer._handedOut ?? null)
}

// ---- Consumer -----------------------------------------------------------------------------

/**
 * Message objects from a batch in columns (`Consumer._poll`): the shape of `Message`. The
 * payloads, keys and header values of one batch are views of one Buffer (as kafkajs's are of
 * its fetch response); copy one (`Buffer.from(m.payload)`) to keep it apart from its batch.
 */
function messagesOf(c) {
  const n = c.partition.length
  const out = new Array(n)
  const { data, lengths, topics, topic, partition, position, timestamp, deliveryCount, headerCount, headerNames } = c
  let at = 0
  let li = 0
  let hi = 0
  for (let i = 0; i < n; i++) {
    let key = null
    const kl = lengths[li++]
    if (kl >= 0) {
      key = data.subarray(at, at + kl)
      at += kl
    }
    const pl = lengths[li++]
    const payload = data.subarray(at, at + pl)
    at += pl
    const hc = headerCount[i]
    const headers = new Array(hc)
    for (let h = 0; h < hc; h++) {
      let value = null
      const vl = lengths[li++]
      if (vl >= 0) {
        value = data.subarray(at, at + vl)
        at += vl
      }
      headers[h] = { name: headerNames[hi++], value }
    }
    const ts = timestamp[i]
    out[i] = {
      topic: topics[topic[i]],
      partition: partition[i],
      position: position[i],
      key,
      payload,
      headers,
      timestamp: ts === ts ? ts : null,
      deliveryCount: deliveryCount[i],
    }
  }
  return out
}

/**
 * Fetches up to `max` messages (default 500), waiting at most `timeoutMs` (default 1000) for
 * the first; resolves to an array (empty on timeout). One native crossing per batch.
 * `commit()` without arguments then commits the batch (the last message of each partition).
 */
Consumer.prototype.poll = async function (max, timeoutMs) {
  const batch = await fetchBatch(this, max, timeoutMs)
  if (batch.length) this._handedOut = null
  return batch
}

// What `commit()` without arguments commits is worked out natively (onceflow-bindings'
// `yielded`): per partition, the last message handed to the user. This side keeps its
// progress: the latest non-empty batch (`_latest`, its number `_batch`) and how far into it
// it has handed messages out (`_handedOut`: null for all of it, after `poll()` or
// `batches()`; a count for the message iterator). The number keeps a commit made while a poll
// completes from applying this side's count to a batch it has not received.
function fetchBatch(consumer, max, timeoutMs) {
  const args = [countArg('max', max), numberArg('timeoutMs', timeoutMs), consumer._batch ?? 0, consumer._handedOut ?? null]
  return consumer._poll(...args).then((c) => {
    const batch = messagesOf(c)
    if (c.batch !== (consumer._batch ?? 0)) {
      consumer._batch = c.batch
      consumer._latest = batch
      consumer._handedOut = 0
    }
    return batch
  })
}

/** The messages of the latest batch not handed out yet (an iterator left mid-batch), or null. */
function rest(consumer) {
  const batch = consumer._latest
  const handed = consumer._handedOut
  return batch && handed !== null && handed !== undefined && handed < batch.length ? batch : null
}

/**
 * The positions to commit from messages / `{topic, partition, position}` objects. An entry of
 * `committed()` (it has `next`: the next position to read) is refused: committing it would
 * skip the message at it, since `commit()` takes the last *processed* position.
 */
function explicitPositions(arg) {
  if (arg === undefined || arg === null) return null
  const list = Array.isArray(arg) ? arg : [arg]
  return list.map((p) => {
    if (p !== null && typeof p === 'object' && 'next' in p) {
      throw configError(
        `position {topic: ${JSON.stringify(String(p.topic)).slice(0, 80)}, partition: ${String(p.partition)}, next: ...}: ` +
          'an entry of committed() is the next position to read; commit() takes processed messages ' +
          '(or their {topic, partition, position}), the last processed one per partition: committing ' +
          "'next' would skip the message at it"
      )
    }
    if (p === null || typeof p !== 'object' || typeof p.topic !== 'string' || !Number.isInteger(p.partition) || typeof p.position !== 'string') {
      const shown = (v) => (typeof v === 'string' ? JSON.stringify(v).slice(0, 80) : String(v))
      const got =
        p === null
          ? 'null'
          : Array.isArray(p)
            ? 'an array'
            : typeof p !== 'object'
              ? typeof p
              : `{topic: ${shown(p.topic)}, partition: ${shown(p.partition)}, position: ${shown(p.position)}}`
      throw configError(`position: expected a message or {topic: string, partition: integer, position: string}, got ${got}`)
    }
    return { topic: p.topic, partition: p.partition, position: p.position }
  })
}

/**
 * Messages one by one, fetched in batches (one native crossing per batch) until `close()`
 * or `break`. Options: `batchSize` (default 500), `timeoutMs` per poll (default 1000). An
 * iterator started after another was left mid-batch hands out the rest of that batch first,
 * so no message fetched is skipped.
 */
Consumer.prototype.messages = async function* (options = {}) {
  const max = options.batchSize ?? 500
  const timeoutMs = options.timeoutMs ?? 1000
  this._closed = false
  while (!this._closed) {
    let batch = rest(this)
    if (!batch) {
      batch = await fetchBatch(this, max, timeoutMs)
      if (batch.length === 0) continue
    }
    for (let i = this._handedOut; i < batch.length; i++) {
      this._handedOut = i + 1
      yield batch[i]
      if (this._closed) return
    }
  }
}
/**
 * Batches of messages, fetched with one native crossing each, until `close()` or `break`: every
 * value is a non-empty array of up to `batchSize` messages (default 500), in the order the
 * platform delivered them. `timeoutMs` bounds each poll (default 1000); an empty poll yields
 * nothing and polls again. `commit()` without arguments commits the last message of each
 * partition of the batches yielded so far. The rest of a batch a message iterator was left in
 * comes first.
 */
Consumer.prototype.batches = async function* (options = {}) {
  const max = options.batchSize ?? 500
  const timeoutMs = options.timeoutMs ?? 1000
  this._closed = false
  const left = rest(this)
  if (left) {
    const from = this._handedOut
    this._handedOut = null
    yield left.slice(from)
  }
  while (!this._closed) {
    const batch = await fetchBatch(this, max, timeoutMs)
    if (batch.length === 0) continue
    this._handedOut = null
    yield batch
  }
}
Consumer.prototype[Symbol.asyncIterator] = function () {
  return this.messages()
}
/**
 * Commits, per partition, the last of the given processed messages (or their
 * `{topic, partition, position}`), or the last message yielded of each partition: the group
 * resumes after it. Unlike kafkajs' `commitOffsets` (the next offset to read), this takes the
 * processed message's own position; an entry of `committed()` (`{topic, partition, next}`)
 * throws an `OnceflowError` of kind `config`.
 */
Consumer.prototype.commit = async function (positions) {
  return this._commit(explicitPositions(positions), this._batch ?? 0, this._handedOut ?? null)
}
/**
 * `partitions` as `[{topic, partition}]`, checked before the native call: a partition that
 * is not an integer (1.5 would be truncated to 1 on the way in) or outside 32 bits, a topic
 * that is not a string, or anything but an array is a config error naming the value.
 */
function topicPartitions(what, partitions) {
  if (!Array.isArray(partitions)) {
    const got = partitions === null ? 'null' : typeof partitions
    throw configError(`${what}: expected an array of {topic, partition}, got ${got}`)
  }
  return partitions.map((tp, i) => {
    if (tp === null || typeof tp !== 'object' || Array.isArray(tp)) {
      const got = tp === null ? 'null' : Array.isArray(tp) ? 'an array' : typeof tp
      throw configError(`${what}[${i}]: expected {topic: string, partition: number}, got ${got}`)
    }
    if (typeof tp.topic !== 'string') {
      throw configError(`${what}[${i}].topic: expected a string, got ${tp.topic === null ? 'null' : typeof tp.topic}`)
    }
    const p = tp.partition
    if (typeof p !== 'number' || !Number.isInteger(p) || p < -2147483648 || p > 2147483647) {
      const shown = p === undefined ? 'missing' : typeof p === 'number' ? String(p) : `${p === null ? 'null' : typeof p} ${JSON.stringify(p) ?? String(p)}`.slice(0, 80)
      throw configError(
        `${what}[${i}].partition: ${shown} (topic ${JSON.stringify(tp.topic).slice(0, 80)}): expected an integer partition number from 0 to 2147483647`
      )
    }
    return { topic: tp.topic, partition: p }
  })
}
const nativeRewindUncommitted = Consumer.prototype.rewindUncommitted
Consumer.prototype.rewindUncommitted = async function (partitions) {
  return nativeRewindUncommitted.call(this, topicPartitions('partitions', partitions))
}
const nativeClose = Consumer.prototype.close
Consumer.prototype.close = function () {
  this._closed = true
  return nativeClose.call(this)
}

// ---- engine ------------------------------------------------------------------------------

function handlerResult(v) {
  if (v === undefined || v === null) return null
  return toBuffer(v, 'handler result')
}

// `convertResult(value, ctx)` gets the process span's context too (undefined without
// OpenTelemetry): a pipeline hands it to the core as the parent of the outputs.
function wrapUserFn(fn, system, group, convertResult) {
  if (typeof fn !== 'function') throw new TypeError('expected a function (message) => Promise')
  return async (message) => {
    try {
      return await otel.runHandler(message, system, group, async (ctx) => convertResult(await fn(message), ctx))
    } catch (e) {
      const id = ++thrownSeq
      thrown.set(id, e)
      if (thrown.size > 1000) thrown.delete(thrown.keys().next().value)
      throw new Error(`${(e && e.message) || e} [onceflow-js-error:${id}]`)
    }
  }
}

async function openStore(o) {
  if (o.store === undefined || o.store === null) return null
  if (typeof o.store === 'string') return nativeDedupStore(o.store, o.windowMs)
  return o.store
}

const DEDUP_STORE_KEYS = new Set(['windowMs'])

/**
 * Opens a dedup store by URL: `memory://`, `embedded:///path/file.db` or a file path;
 * `options.windowMs`: how long completed keys are remembered (default one day).
 */
async function dedupStore(url, options) {
  if (options === undefined || options === null) return nativeDedupStore(url, undefined)
  if (typeof options !== 'object' || Array.isArray(options)) {
    throw configError(`dedupStore options: expected an object { windowMs }, got ${Array.isArray(options) ? 'an array' : typeof options}`)
  }
  checkKeys('dedupStore options', options, DEDUP_STORE_KEYS)
  return nativeDedupStore(url, numberArg('windowMs', options.windowMs))
}

class Engine {
  constructor(options) {
    this._options = options || {}
    this._native = null
    this._stopped = false
  }
  async _ready() {
    if (!this._native) {
      const store = await openStore(this._options)
      try {
        this._native = this._build(store)
      } catch (e) {
        throw convert(e)
      }
      if (this._stopped) this._native.stop()
    }
    return this._native
  }
  /** Runs until `stop()` or an error; resolves to `{metrics, guarantee, drained}`. */
  async run() {
    return (await this._ready()).run()
  }
  /** Asks a running `run()` to stop: work in flight finishes and is committed. */
  stop() {
    this._stopped = true
    if (this._native) this._native.stop()
  }
  /** Counters, live. */
  metrics() {
    return this._native ? this._native.metrics() : null
  }
  get guarantee() {
    return this._native ? this._native.guarantee : undefined
  }
}

/**
 * At-least-once consumption plus a dedup store chosen by URL (`options.store`): `handler`
 * runs once per idempotency key. A throwing handler is retried, then redelivered.
 */
class IdempotentConsumer extends Engine {
  constructor(consumer, handler, options) {
    super(options)
    this._consumer = consumer
    this._handler = wrapUserFn(handler, consumer.platform, consumer.group, handlerResult)
  }
  _build(store) {
    // The rest of the options are engine settings: the native side checks every name, type
    // and range, so a misspelled option throws instead of being dropped.
    const { store: _store, windowMs: _windowMs, deadLetterProducer, ...settings } = this._options
    return new native.NativeIdempotentConsumer(
      this._consumer, this._handler, store, settings, deadLetterProducer || null
    )
  }
  /** Polls once and handles what arrived; resolves to the number of messages polled. */
  async step() {
    return (await this._ready()).step()
  }
  /** Lag per assigned partition. */
  lag() {
    return this._consumer.lag()
  }
}

/** Consume-transform-produce with the strongest mechanism the platform offers. */
class Pipeline extends Engine {
  constructor(consumer, producer, transform, options) {
    super(options)
    this._consumer = consumer
    this._producer = producer
    // The outputs go to the core with the W3C headers of the transform's process span: the
    // core sends them as that span's children, whatever trace headers they carry.
    // Absent fields are left undefined, not null: napi reads a null where it expects an
    // array as a wrong type (the transform then failed on every input).
    this._transform = wrapUserFn(transform, consumer.platform, consumer.group, (v, ctx) => {
      const out = {}
      if (v !== undefined && v !== null) out.records = (Array.isArray(v) ? v : [v]).map((r) => toRecord(r))
      const parent = otel.traceHeaders(ctx)
      if (parent) out.parent = parent
      return out
    })
  }
  _build(store) {
    const { store: _store, windowMs: _windowMs, ...settings } = this._options
    return new native.NativePipeline(
      this._consumer, this._producer, this._transform, store, settings
    )
  }
  get mechanism() {
    return this._native ? this._native.mechanism : undefined
  }
}

/** Rethrows a handler's error so the engine's error can chain it as `cause`. */
function stash(e) {
  const id = ++thrownSeq
  thrown.set(id, e)
  if (thrown.size > 1000) thrown.delete(thrown.keys().next().value)
  return new Error(`${(e && e.message) || e} [onceflow-js-error:${id}]`)
}

const nativeOpenInbox = guard(native.openInbox)

/** SQL parameters checked on this side, so a wrong one names its index and type. */
function sqlParams(params) {
  if (params === undefined || params === null) return []
  if (!Array.isArray(params)) {
    throw new TypeError(`params: expected an array of values, got ${params === null ? 'null' : typeof params}`)
  }
  return params.map((v, i) => {
    const t = typeof v
    if (v === undefined || v === null || t === 'boolean' || t === 'number' || t === 'bigint' || t === 'string' || Buffer.isBuffer(v)) {
      return v === undefined ? null : v
    }
    if (v instanceof Uint8Array) return Buffer.from(v.buffer, v.byteOffset, v.byteLength)
    const got = Array.isArray(v) ? 'array' : t === 'object' ? (v.constructor && v.constructor.name) || 'object' : t
    throw new TypeError(`params[${i}]: expected a string, number, bigint, boolean, Buffer, null or undefined, got ${got}`)
  })
}

/**
 * The message's open database transaction, given to an `Inbox` handler: its statements commit
 * or roll back with the message's idempotency key and position. Usable only while the handler
 * runs; afterwards every call rejects with a `ClosedError` (`ONCEFLOW_CLOSED`).
 */
class InboxTransaction {
  constructor(call) {
    this._call = call
  }
  /** `postgres` (placeholders `$1, $2, …`) or `embedded` (SQLite: `?` or `?1, ?2, …`). */
  get store() {
    return this._call.store
  }
  /** Whether the handler still runs. */
  get open() {
    return this._call.open
  }
  /** Runs one statement; resolves to the number of rows it changed. */
  async execute(sql, params) {
    return this._call.execute(sql, sqlParams(params))
  }
  /**
   * Runs one query; resolves to its rows as arrays (one value per column, as Python's tuples),
   * or as objects keyed by column name with `{ asObjects: true }`.
   */
  async query(sql, params, options = {}) {
    const r = await this._call.query(sql, sqlParams(params))
    if (!options.asObjects) return r.rows
    return r.rows.map((row) => Object.fromEntries(r.columns.map((c, i) => [c, row[i]])))
  }
}

/**
 * The transactional inbox: `handler(message, tx)` runs inside one database transaction that
 * also records the message's idempotency key and the consumer's position (see the README).
 * `store` is `postgres://…` or an embedded store (`embedded:///path.db` or a file path);
 * `options` are `windowMs` and the inbox settings.
 */
class Inbox {
  constructor(consumer, handler, store, options) {
    if (typeof handler !== 'function') throw new TypeError('handler: expected a function (message, tx) => Promise')
    if (typeof store !== 'string') {
      throw new TypeError(`store: expected a postgres:// URL or an embedded store path (a string), got ${store === null ? 'null' : typeof store}`)
    }
    this._consumer = consumer
    this._store = store
    this._options = options || {}
    this._native = null
    this._stopped = false
    // The handler runs in a `process {topic}` span, a child of the message's trace context,
    // as the idempotent consumer's handler does (the core's span plan; a no-op without
    // @opentelemetry/api); a key already handled runs no handler and starts no span.
    const system = consumer.platform
    const group = consumer.group
    this._handler = async (call) => {
      try {
        await otel.runHandler(call.message, system, group, () => handler(call.message, new InboxTransaction(call)))
      } catch (e) {
        throw stash(e)
      }
    }
  }
  /** Opens the store and builds the inbox now (`run()` / `step()` do it otherwise). */
  async open() {
    if (!this._native) {
      const { windowMs, ...settings } = this._options
      this._native = await nativeOpenInbox(this._consumer, this._handler, this._store, windowMs, settings)
      if (this._stopped) this._native.stop()
    }
    return this
  }
  /** `postgres` or `embedded` once opened. */
  get store() {
    return this._native ? this._native.store : undefined
  }
  /** The namespace of the inbox's keys and positions, once opened. */
  get namespace() {
    return this._native ? this._native.namespace : undefined
  }
  /** Runs until `stop()` or an error; resolves to the summary. Does not close the consumer. */
  async run() {
    await this.open()
    return this._native.run()
  }
  /** Polls once and handles what came; resolves to the number of messages polled. */
  async step() {
    await this.open()
    return this._native.step()
  }
  /** Asks a running `run()` to return once the message in hand is committed. */
  stop() {
    this._stopped = true
    if (this._native) this._native.stop()
  }
  /** `{ handled, duplicates, behindPosition }` so far. */
  summary() {
    return this._native ? this._native.summary() : { handled: 0, duplicates: 0, behindPosition: 0 }
  }
  /**
   * The positions stored for the namespace: `[{ topic, partition, position }]`, the last message
   * committed per partition; also while `run()` runs and after it returned.
   */
  async storedPositions() {
    await this.open()
    return this._native.storedPositions()
  }
}

/**
 * The first value of header `name` of `message` (exact name, as Rust's `Headers::get`): a
 * Buffer, `null` for a null header, `undefined` when absent.
 */
function header(message, name) {
  for (const h of message.headers) if (h.name === name) return h.value
  return undefined
}

/** Every value of header `name` of `message`, in order (`null` for a null one; `[]` when absent). */
function headerAll(message, name) {
  return message.headers.filter((h) => h.name === name).map((h) => h.value)
}

module.exports = {
  connect,
  contextOf: otel.contextOf,
  dedupStore,
  header,
  headerAll,
  OnceflowError,
  IdempotentConsumer,
  Inbox,
  InboxTransaction,
  Pipeline,
  Client: native.Client,
  Producer,
  Transaction,
  Consumer,
  Admin: native.Admin,
  DedupStore: native.DedupStore,
  errorKinds: native.errorKinds,
  supportedSchemes: native.supportedSchemes,
  version: native.nativeVersion(),
}
