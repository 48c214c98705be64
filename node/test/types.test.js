'use strict'
// The committed index.d.ts equals the one generated from the code (scripts/types.js --check).
const test = require('node:test')
const assert = require('node:assert/strict')
const { spawnSync } = require('node:child_process')
const path = require('node:path')

test('index.d.ts has not drifted from the native declarations', () => {
  const r = spawnSync(process.execPath, [path.join(__dirname, '..', 'scripts', 'types.js'), '--check'], {
    encoding: 'utf8',
    timeout: 900000,
  })
  assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`)
})
