#!/usr/bin/env node
// Generates index.d.ts: the hand-written declarations of dts-header.d.ts (what index.js adds)
// followed by the declarations napi-derive emits for the native addon, rendered by
// @napi-rs/cli's generateTypeDef. `--check` compares with the committed file instead of
// writing it (the drift check of the test suite). Reuses CARGO_TARGET_DIR.
'use strict'
const { spawnSync } = require('node:child_process')
const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')

const here = path.resolve(__dirname, '..')

async function generate() {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'onceflow-typedefs-'))
  try {
    const r = spawnSync(
      process.env.CARGO || 'cargo',
      ['build', '--manifest-path', path.join(here, 'Cargo.toml'), '-p', 'onceflow-node'],
      {
        stdio: ['ignore', 'inherit', 'inherit'],
        env: {
          ...process.env,
          CARGO_TARGET_DIR: process.env.CARGO_TARGET_DIR || path.join(here, '..', 'target'),
          NAPI_TYPE_DEF_TMP_FOLDER: tmp,
          NAPI_FORCE_BUILD_ONCEFLOW_NODE: String(Date.now()),
        },
      }
    )
    if (r.status !== 0) throw new Error(`cargo build failed (exit ${r.status})`)
    const { generateTypeDef } = await import('@napi-rs/cli')
    const { dts } = await generateTypeDef({
      typeDefDir: tmp,
      dtsHeaderFile: 'dts-header.d.ts',
      cwd: here,
      declareBindingTarget: false,
    })
    return dts
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true })
  }
}

async function main() {
  const dts = await generate()
  const file = path.join(here, 'index.d.ts')
  if (process.argv.includes('--check')) {
    const committed = fs.readFileSync(file, 'utf8')
    if (committed !== dts) {
      fs.writeFileSync(path.join(os.tmpdir(), 'onceflow-index.d.ts'), dts)
      console.error(`index.d.ts drifted from the code: run \`npm run types\` (generated copy in ${os.tmpdir()}/onceflow-index.d.ts)`)
      process.exit(1)
    }
    console.log('index.d.ts matches the generated declarations')
  } else {
    fs.writeFileSync(file, dts)
    console.log(`wrote ${file}`)
  }
}

main().catch((e) => {
  console.error(e)
  process.exit(1)
})
