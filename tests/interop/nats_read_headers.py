"""Reads COUNT messages of a JetStream stream with nats-py (a pull consumer of its own) and
prints them with their headers exactly as nats-py sees them:

    MSG <seq> <payload>
    H <name>: <value>        (one line per header)
    END

usage: nats_read_headers.py URL STREAM SUBJECT COUNT
"""

import asyncio
import sys

import nats


async def main(url: str, stream: str, subject: str, count: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.pull_subscribe(subject, durable=None, stream=stream)
    got = 0
    while got < count:
        for msg in await sub.fetch(count - got, timeout=10):
            await msg.ack()
            print(f"MSG {msg.metadata.sequence.stream} {msg.data.decode()}")
            for name, value in (msg.headers or {}).items():
                print(f"H {name}: {value}")
            print("END", flush=True)
            got += 1
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
