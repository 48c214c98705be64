"""Reads N messages from TOPIC with confluent-kafka (read_committed, from the start) and prints
one JSON line: a list, in offset order per partition, of
{"payload": str, "headers": [[name, hex or null], ...]} with headers exactly as the client
returns them (a list of (name, bytes|None) tuples: order, repeats, null vs empty kept).

Usage: kafka_read_headers.py BOOTSTRAP TOPIC N
"""

import json
import sys
import time
import uuid

from confluent_kafka import Consumer


def main() -> None:
    bootstrap, topic, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"interop-py-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    out = []
    deadline = time.monotonic() + 60
    while len(out) < n and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None:
            continue
        if m.error():
            sys.exit(f"consume error: {m.error()}")
        headers = [[k, None if v is None else v.hex()] for k, v in (m.headers() or [])]
        out.append({"payload": m.value().decode(), "headers": headers})
    c.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
