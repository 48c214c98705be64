"""Secured Kafka from Python (#23): SASL_SSL with SCRAM given as an ``options`` dict (nothing
secret in the URL), a transaction over it, and refusals that raise ``AuthError`` quickly
without showing the password. Runs on the secured listeners ``tests/brokers/up.sh kafka``
starts (``ONCEFLOW_KAFKA_SASL_SSL_URL`` and the CA / user / password it prints).
"""

from __future__ import annotations

import os
import time

import pytest

import onceflow

from conftest import drain, unique

SASL_SSL_URL = os.environ.get("ONCEFLOW_KAFKA_SASL_SSL_URL")

if not SASL_SSL_URL:
    if os.environ.get("ONCEFLOW_REQUIRE_BROKERS") == "1":
        raise RuntimeError("ONCEFLOW_REQUIRE_BROKERS=1 but ONCEFLOW_KAFKA_SASL_SSL_URL is not set")
    pytestmark = pytest.mark.skip(
        reason="ONCEFLOW_KAFKA_SASL_SSL_URL is not set: start tests/brokers/up.sh kafka"
    )


def scram_options(password: str, ca: str = "") -> dict:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": os.environ["ONCEFLOW_KAFKA_SASL_USERNAME"],
        "sasl.password": password,
        "ssl.ca.location": ca or os.environ["ONCEFLOW_KAFKA_CA"],
    }


async def test_sasl_ssl_scram_with_an_options_dict():
    client = await onceflow.connect(
        SASL_SSL_URL, options=scram_options(os.environ["ONCEFLOW_KAFKA_SASL_PASSWORD"])
    )
    admin = await client.admin()
    topic = unique("py-secured")
    await admin.create_topic(topic, 1)
    producer = await client.producer(transactional_id=unique("py-secured-tx"))
    async with producer.transaction() as tx:
        await tx.send(topic, b"over-sasl-ssl-1")
        await tx.send(topic, b"over-sasl-ssl-2")
    consumer = await client.consumer(unique("py-group"), [topic], start="earliest", poll_timeout=0.5)
    got = await drain(consumer, 2)
    assert [m.payload for m in got] == [b"over-sasl-ssl-1", b"over-sasl-ssl-2"]
    await consumer.close()
    await producer.close()


@pytest.mark.parametrize(
    "case", ["wrong password", "untrusted CA"],
)
async def test_refusals_raise_auth_error_quickly_without_the_secret(case):
    wrong = "py-wrong-password-3e9f"
    real = os.environ["ONCEFLOW_KAFKA_SASL_PASSWORD"]
    if case == "wrong password":
        options = scram_options(wrong)
    else:
        options = scram_options(real, ca=os.environ["ONCEFLOW_KAFKA_OTHER_CA"])
    started = time.monotonic()
    with pytest.raises(onceflow.AuthError) as raised:
        await onceflow.connect(SASL_SSL_URL, options=options)
    took = time.monotonic() - started
    print(f"AUTH python {case} {took * 1000:.0f} ms: {raised.value}")
    assert took < 15, f"{case} took {took:.1f} s"
    err = raised.value
    assert err.kind == "auth" and err.code == "ONCEFLOW_AUTH"
    assert not err.retriable
    shown = f"{err} {err!r} {err.message}"
    assert wrong not in shown and real not in shown, shown
