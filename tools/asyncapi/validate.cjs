#!/usr/bin/env node
// node tools/asyncapi/validate.cjs FILE...
// Validates AsyncAPI documents with the AsyncAPI parser (@asyncapi/parser, what the AsyncAPI
// CLI's `validate` runs: the spec's JSON schema, bindings included, and its ruleset).
// Prints every diagnostic; exits 0 when every document is valid, 1 when one is not, 2 when
// the validator itself cannot run (not installed: `make tools-node`).
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { createRequire } = require('node:module');

// `make tools-node` installs this folder's lock file there, outside the source tree.
const TOOLS = path.resolve(__dirname, '..', '..', '.tools', 'node');
const SEVERITY = ['error', 'warning', 'info', 'hint'];

function loadParser() {
  try {
    return createRequire(path.join(TOOLS, 'package.json'))('@asyncapi/parser').Parser;
  } catch (error) {
    console.error(`error: @asyncapi/parser is not installed in ${TOOLS}: run make tools-node (${error.code})`);
    process.exit(2);
  }
}

async function main(files) {
  if (files.length === 0) {
    console.error('usage: validate.cjs FILE...');
    return 2;
  }
  const parser = new (loadParser())();
  let valid = true;
  for (const file of files) {
    const { document, diagnostics } = await parser.parse(fs.readFileSync(file, 'utf8'), { source: path.resolve(file) });
    for (const d of diagnostics) {
      console.log(`${file}: ${SEVERITY[d.severity]} ${d.code} at /${d.path.join('/')}: ${d.message}`);
    }
    valid = valid && document !== undefined && !diagnostics.some((d) => d.severity === 0);
  }
  return valid ? 0 : 1;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (error) => {
    console.error(error);
    process.exit(2);
  },
);
