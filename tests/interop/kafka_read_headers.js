// Reads N messages from TOPIC with kafkajs (from the start) and prints one JSON line: a list of
// {"payload": str, "headers": {name: hex | null | [hex | null, ...]}} exactly as kafkajs hands
// them over: an object keyed by name, so a repeated name becomes an array of its values in
// order, while the order *between* different names is the object's insertion order.
//
// Usage: NODE_PATH=... node kafka_read_headers.js BOOTSTRAP TOPIC N
const { Kafka, logLevel } = require('kafkajs');

const [bootstrap, topic, nArg] = process.argv.slice(2);
const n = Number(nArg);
const hex = (v) => (v === null || v === undefined ? null : Buffer.from(v).toString('hex'));

async function main() {
  const kafka = new Kafka({ clientId: 'onceflow-interop', brokers: [bootstrap], logLevel: logLevel.NOTHING });
  const consumer = kafka.consumer({ groupId: `interop-js-${Date.now()}-${Math.random()}`, readUncommitted: false });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const out = [];
  let done;
  const finished = new Promise((resolve) => { done = resolve; });
  const timer = setTimeout(() => done(), 60000);
  await consumer.run({
    eachMessage: async ({ message }) => {
      const headers = {};
      for (const [k, v] of Object.entries(message.headers || {})) {
        headers[k] = Array.isArray(v) ? v.map(hex) : hex(v);
      }
      out.push({ payload: message.value.toString(), headers });
      if (out.length >= n) done();
    },
  });
  await finished;
  clearTimeout(timer);
  await consumer.disconnect();
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((e) => { console.error(e); process.exit(1); });
