"""Publishes messages to a JetStream subject with nats-py, each carrying a W3C `traceparent`
(one trace, one parent span id per message), plus an app header with a mixed-case name.

usage: nats_publish_traced.py URL SUBJECT COUNT TRACE_ID
Prints one `PUBLISHED <seq> <span id>` line per message.
"""

import asyncio
import secrets
import sys

import nats


async def main(url: str, subject: str, count: int, trace_id: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    for i in range(count):
        span_id = secrets.token_hex(8)
        ack = await js.publish(
            subject,
            f"py-{i}".encode(),
            headers={
                "traceparent": f"00-{trace_id}-{span_id}-01",
                "X-Py-Header": f"value-{i}",
                "idempotency-key": f"py-{i}",
            },
        )
        print(f"PUBLISHED {ack.seq} {span_id}", flush=True)
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
