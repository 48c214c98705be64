'use strict'
// The committed index.d.ts equals the one generated from the code (scripts/types.js --check),
// and declares what users read (Delivery.attempts).
const test = require('node:test')
const assert = require('node:assert/strict')
const { spawnSync } = require('node:child_process')
const fs = require('node:fs')
const path = require('node:path')

test('index.d.ts has not drifted from the native declarations', () => {
  const r = spawnSync(process.execPath, [path.join(__dirname, '..', 'scripts', 'types.js'), '--check'], {
    encoding: 'utf8',
    timeout: 900000,
  })
  assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`)
})

test('Delivery declares attempts as a documented number', () => {
  const dts = fs.readFileSync(path.join(__dirname, '..', 'index.d.ts'), 'utf8')
  const delivery = dts.match(/export interface Delivery \{([\s\S]*?)\n\}/)
  assert.ok(delivery, 'index.d.ts declares interface Delivery')
  assert.match(delivery[1], /\/\*\*[^/]*onceflow\.send_retries[^/]*\*\/\s*attempts: number$/)
})
