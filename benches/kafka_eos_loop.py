"""K4's consume-transform-produce transactional loop in confluent-kafka-python: the same loop
as the hand-written rdkafka one in benches/src/kafka.rs (read_committed consumer, manual
commit, transactional producer, deliveries awaited + next offsets sent with
send_offsets_to_transaction + commit every 100 ms).

Usage: kafka_eos_loop.py BOOTSTRAP INPUT OUTPUT N GROUP   (prints messages per second last)
"""

import sys
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition


def main() -> None:
    bootstrap, inp, out, n, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    start = time.monotonic()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([inp])
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"k4-py-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    started = time.monotonic()
    nxt = {}
    done = 0

    def commit():
        producer.flush(30)
        if nxt:
            offsets = [TopicPartition(inp, p, o) for p, o in nxt.items()]
            producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata(), 30)
            nxt.clear()
        producer.commit_transaction(30)

    while done < n:
        for m in consumer.consume(500, 0.1):
            if m.error():
                raise SystemExit(f"consume error: {m.error()}")
            while True:
                try:
                    producer.produce(out, value=m.value(), key=m.key())
                    break
                except BufferError:
                    producer.poll(0.001)
            producer.poll(0)
            nxt[m.partition()] = m.offset() + 1
            done += 1
        if time.monotonic() - started >= 0.1:
            commit()
            producer.begin_transaction()
            started = time.monotonic()
    # The clock stops at the last input, as for the other contenders; the final commit is unmeasured.
    elapsed = time.monotonic() - start
    commit()
    consumer.close()
    print(f"{n / elapsed:.1f}")


if __name__ == "__main__":
    main()
