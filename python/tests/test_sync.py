"""The blocking facade, and fork safety of the runtime underneath it."""

from __future__ import annotations

import os
import threading

import pytest

import onceflow
from onceflow import sync

from conftest import unique


def test_sync_round_trip_transaction_and_idempotent_handler():
    client = sync.connect(f"memory://{unique('sync')}")
    producer = client.producer(transactional_id=unique("tx"))
    with producer.transaction() as tx:
        tx.send("orders", b"a", idempotency_key="a")
        tx.send("orders", b"a", idempotency_key="a")  # a retry: same key, same payload
        tx.send("orders", b"b", idempotency_key="b")

    consumer = client.consumer("reader", ["orders"], start="earliest", poll_timeout=0.2)
    got = []
    for m in consumer:
        got.append(m.payload)
        if len(got) == 3:
            break
    consumer.commit()
    assert got == [b"a", b"a", b"b"]

    handled = []

    @sync.idempotent(client.consumer("billing", ["orders"], start="earliest"), store="memory://", poll_timeout=0.05)
    def bill(message):
        handled.append(message.payload)
        if len(handled) == 2:
            bill.stop()

    summary = bill.run()
    assert handled == [b"a", b"b"]
    assert summary["metrics"]["duplicates_skipped"] == 1


def test_sync_errors_are_the_same_classes():
    with pytest.raises(onceflow.ConfigError):
        sync.connect("nope://x")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_runtime_works_in_a_forked_child():
    client = sync.connect(f"memory://{unique('fork')}")
    client.producer().send("t", b"before fork")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a new runtime and loop must serve it
        ok = b"0"
        try:
            child = sync.connect(f"memory://{unique('child')}")
            d = child.producer().send("t", b"in child")
            ok = b"1" if d.position else b"0"
        finally:
            os.write(w, ok)
            os._exit(0)
    os.close(w)
    result = os.read(r, 1)
    _, status = os.waitpid(pid, 0)
    assert result == b"1" and status == 0
    # the parent still works
    assert client.producer().send("t", b"after fork").position
    assert threading.active_count() >= 1
