#!/usr/bin/env node
// Builds the native addon with cargo when no prebuilt binary for this platform is present
// (run by `npm install`). `--force` rebuilds; `--debug` builds the dev profile (tests).
// CARGO_TARGET_DIR is honoured, so repeated builds reuse one target dir.
'use strict'
const { spawnSync } = require('node:child_process')
const fs = require('node:fs')
const path = require('node:path')

const here = path.resolve(__dirname, '..')
const args = process.argv.slice(2)
const force = args.includes('--force') || process.env.ONCEFLOW_NODE_FORCE_BUILD === '1'
const debug = args.includes('--debug') || process.env.ONCEFLOW_NODE_PROFILE === 'debug'
// `--strip`: drop debug info from the copied addon (node/dist.sh, for the published package).
const strip = args.includes('--strip')
const binary = path.join(here, `onceflow.${process.platform}-${process.arch}.node`)

if (!force && fs.existsSync(binary)) {
  console.log(`[onceflow] using prebuilt ${path.basename(binary)}`)
  process.exit(0)
}

// The addon builds from the onceflow repository only (its crate depends on the workspace's);
// a published package carries a prebuilt binary instead.
if (!fs.existsSync(path.join(here, 'Cargo.toml'))) {
  console.error(
    `[onceflow] this package has no prebuilt native addon for ${process.platform}-${process.arch} ` +
      `(it has: ${fs.readdirSync(here).filter((f) => f.endsWith('.node')).join(', ') || 'none'}); ` +
      'build one from a clone of the onceflow repository with `npm install ./node`'
  )
  process.exit(1)
}

const cargo = process.env.CARGO || 'cargo'
if (spawnSync(cargo, ['--version'], { stdio: 'ignore' }).status !== 0) {
  console.error(
    `[onceflow] no prebuilt binary for ${process.platform}-${process.arch} and no cargo found: ` +
      'install Rust (https://rustup.rs) and run `npm install` again'
  )
  process.exit(1)
}

const targetDir = process.env.CARGO_TARGET_DIR || path.join(here, '..', 'target')
const cargoArgs = ['build', '--manifest-path', path.join(here, 'Cargo.toml'), '-p', 'onceflow-node']
if (!debug) cargoArgs.push('--release')
if (fs.existsSync(path.join(here, '..', 'Cargo.lock'))) cargoArgs.push('--locked')
console.log(`[onceflow] building the native addon: ${cargo} ${cargoArgs.join(' ')} (target dir ${targetDir})`)
const r = spawnSync(cargo, cargoArgs, {
  stdio: 'inherit',
  env: { ...process.env, CARGO_TARGET_DIR: targetDir },
})
if (r.status !== 0) {
  console.error(`[onceflow] cargo build failed (exit ${r.status})`)
  process.exit(r.status || 1)
}

const libName = { win32: 'onceflow_node.dll', darwin: 'libonceflow_node.dylib' }[process.platform] || 'libonceflow_node.so'
const built = path.join(targetDir, debug ? 'debug' : 'release', libName)
// Copy to a temporary name and rename, so a running process never sees a half-written file.
const tmp = `${binary}.tmp-${process.pid}`
fs.copyFileSync(built, tmp)
if (strip) {
  const s = spawnSync('strip', ['--strip-debug', tmp], { stdio: 'inherit' })
  if (s.status !== 0) {
    console.error(`[onceflow] strip --strip-debug ${tmp} failed (exit ${s.status})`)
    process.exit(s.status || 1)
  }
}
fs.renameSync(tmp, binary)
console.log(`[onceflow] built ${path.basename(binary)}`)
