"""Secured connections from Python (#23): Kafka SASL_SSL with SCRAM given as an ``options``
dict (nothing secret in the URL) and a transaction over it, NATS over TLS with a user and
password, and refusals that raise ``AuthError`` quickly without showing the password. Runs on
the secured listeners ``tests/brokers/up.sh kafka nats-secure`` start (the URLs, CA, users and
passwords they print).
"""

from __future__ import annotations

import os
import time

import pytest

import onceflow

from conftest import drain, unique

SASL_SSL_URL = os.environ.get("ONCEFLOW_KAFKA_SASL_SSL_URL")

NO_KAFKA = "ONCEFLOW_KAFKA_SASL_SSL_URL is not set: start tests/brokers/up.sh kafka"
if os.environ.get("ONCEFLOW_REQUIRE_BROKERS") == "1":
    for var in ("ONCEFLOW_KAFKA_SASL_SSL_URL", "ONCEFLOW_NATS_SECURE_URL"):
        if not os.environ.get(var):
            raise RuntimeError(f"ONCEFLOW_REQUIRE_BROKERS=1 but {var} is not set")


def scram_options(password: str, ca: str = "") -> dict:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": os.environ["ONCEFLOW_KAFKA_SASL_USERNAME"],
        "sasl.password": password,
        "ssl.ca.location": ca or os.environ["ONCEFLOW_KAFKA_CA"],
    }


@pytest.mark.skipif(not SASL_SSL_URL, reason=NO_KAFKA)
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


@pytest.mark.skipif(not SASL_SSL_URL, reason=NO_KAFKA)
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


NATS_SECURE_URL = os.environ.get("ONCEFLOW_NATS_SECURE_URL")


@pytest.mark.skipif(not NATS_SECURE_URL, reason="ONCEFLOW_NATS_SECURE_URL is not set: start tests/brokers/up.sh nats-secure")
async def test_nats_over_tls_with_user_and_password_options():
    """tls:// with the user, password and CA as options: a JetStream round trip; a wrong
    password is an AuthError that does not show it."""
    options = {
        "user": os.environ["ONCEFLOW_NATS_SECURE_USER"],
        "password": os.environ["ONCEFLOW_NATS_SECURE_PASSWORD"],
        "tls_ca": os.environ["ONCEFLOW_NATS_SECURE_CA"],
    }
    client = await onceflow.connect(NATS_SECURE_URL, options=options)
    admin = await client.admin()
    topic = unique("py-secured")
    await admin.create_topic(topic, 1)
    producer = await client.producer()
    await producer.send(topic, b"over-tls")
    consumer = await client.consumer(unique("py-group"), [topic], start="earliest", poll_timeout=0.5)
    got = await drain(consumer, 1)
    assert [m.payload for m in got] == [b"over-tls"]
    await consumer.close()
    await producer.close()

    wrong = "py-wrong-nats-password-1c2b"
    started = time.monotonic()
    with pytest.raises(onceflow.AuthError) as raised:
        await onceflow.connect(NATS_SECURE_URL, options={**options, "password": wrong})
    print(f"AUTH python nats wrong password {(time.monotonic() - started) * 1000:.0f} ms")
    shown = f"{raised.value} {raised.value!r}"
    assert wrong not in shown and options["password"] not in shown, shown
