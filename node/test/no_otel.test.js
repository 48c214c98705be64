'use strict'
// Without @opentelemetry/api, headers pass through untouched.
const test = require('node:test')
const assert = require('node:assert/strict')
const { execFileSync } = require('node:child_process')
const path = require('node:path')

test('without @opentelemetry/api, headers pass through untouched', () => {
  const out = execFileSync(process.execPath, [
    '-r', path.join(__dirname, 'fixtures', 'hide-otel.js'),
    path.join(__dirname, 'fixtures', 'passthrough.js'),
  ], { encoding: 'utf8', timeout: 30000 })
  const got = JSON.parse(out)
  // The trace context the caller put in is kept as it was; other headers keep their order.
  // (Core re-writes the trace headers at the end of the list, with an empty tracestate.)
  assert.deepEqual(got.find(([n]) => n === 'traceparent'), ['traceparent', '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'])
  assert.deepEqual(got.filter(([n]) => n !== 'traceparent' && n !== 'tracestate'), [['x', 'y'], ['x', null]])
})
