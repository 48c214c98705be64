"""Produces messages to a Pulsar topic with pulsar-client (PyPI), each carrying a W3C
`traceparent` property (one trace, one parent span id per message), a mixed-case app property
and a partition key.

usage: pulsar_produce_traced.py SERVICE_URL TOPIC COUNT TRACE_ID
Prints one `PUBLISHED <message id> <span id>` line per message.
"""

import secrets
import sys

import pulsar


def main(url: str, topic: str, count: int, trace_id: str) -> None:
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    producer = client.create_producer(topic, batching_enabled=False)
    for i in range(count):
        span_id = secrets.token_hex(8)
        msg_id = producer.send(
            f"py-{i}".encode(),
            properties={
                "traceparent": f"00-{trace_id}-{span_id}-01",
                "X-Py-Header": f"value-{i}",
                "idempotency-key": f"py-{i}",
            },
            partition_key=f"py-key-{i}",
        )
        print(f"PUBLISHED {msg_id} {span_id}", flush=True)
    producer.close()
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
