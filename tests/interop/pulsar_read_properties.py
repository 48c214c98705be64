"""Reads COUNT messages from a Pulsar topic with pulsar-client (PyPI) from the earliest
message and prints, per message, its payload, partition key, event time and properties.

usage: pulsar_read_properties.py SERVICE_URL TOPIC COUNT
Output: `MSG <payload>`, `KEY <partition key>`, `EVENT_TIME <ms>`, then `P <name>: <value>`
lines sorted by name.
"""

import sys

import pulsar


def main(url: str, topic: str, count: int) -> None:
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    consumer = client.subscribe(
        topic,
        "pulsar-client-reader",
        initial_position=pulsar.InitialPosition.Earliest,
        consumer_type=pulsar.ConsumerType.Exclusive,
    )
    for _ in range(count):
        msg = consumer.receive(timeout_millis=30000)
        print(f"MSG {msg.data().decode()}")
        print(f"KEY {msg.partition_key()}")
        print(f"EVENT_TIME {msg.event_timestamp()}")
        for name, value in sorted(msg.properties().items()):
            print(f"P {name}: {value}")
        consumer.acknowledge(msg)
    consumer.close()
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
