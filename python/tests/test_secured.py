"""Secured connections from Python (#23): Kafka SASL_SSL with SCRAM given as an ``options``
dict (nothing secret in the URL) and a transaction over it, NATS over TLS with a user and
password, Pulsar mTLS (a client certificate as options), and refusals that raise ``AuthError``
quickly without showing the password. Runs on the secured listeners
``tests/brokers/up.sh kafka nats-secure pulsar`` start (the URLs, CA, users, passwords and
certificates they print).
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


PULSAR_TLS_URL = os.environ.get("ONCEFLOW_PULSAR_TLS_URL")


def pulsar_mtls_options(cert: str, key: str) -> dict:
    return {
        "admin": os.environ["ONCEFLOW_PULSAR_TLS_ADMIN_URL"],
        "tls_trust_certs": os.environ["ONCEFLOW_PULSAR_TLS_CA"],
        "tls_cert_file": cert,
        "tls_key_file": key,
    }


@pytest.mark.skipif(not PULSAR_TLS_URL, reason="ONCEFLOW_PULSAR_TLS_URL is not set: start tests/brokers/up.sh pulsar")
async def test_pulsar_mtls_with_a_client_certificate():
    """pulsar+ssl:// with a client certificate given as options (through the adapter's loopback
    bridge): a round trip; a certificate from another CA is an AuthError within seconds."""
    options = pulsar_mtls_options(
        os.environ["ONCEFLOW_PULSAR_CLIENT_CERT"], os.environ["ONCEFLOW_PULSAR_CLIENT_KEY"]
    )
    client = await onceflow.connect(PULSAR_TLS_URL, options=options)
    admin = await client.admin()
    topic = unique("py-mtls")
    await admin.create_topic(topic, 2)
    producer = await client.producer()
    await producer.send(topic, b"over-mtls-1", key=b"a")
    await producer.send(topic, b"over-mtls-2", key=b"b")
    consumer = await client.consumer(unique("py-group"), [topic], start="earliest", poll_timeout=0.5)
    got = await drain(consumer, 2)
    assert sorted(m.payload for m in got) == [b"over-mtls-1", b"over-mtls-2"]
    await consumer.close()
    await producer.close()

    rogue = pulsar_mtls_options(
        os.environ["ONCEFLOW_PULSAR_ROGUE_CLIENT_CERT"], os.environ["ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY"]
    )
    started = time.monotonic()
    with pytest.raises(onceflow.AuthError) as raised:
        await onceflow.connect(PULSAR_TLS_URL, options=rogue)
    took = time.monotonic() - started
    print(f"AUTH python pulsar mTLS rogue certificate {took * 1000:.0f} ms: {raised.value}")
    assert took < 15, f"took {took:.1f} s"
    shown = f"{raised.value} {raised.value!r}"
    assert "client certificate" in shown, shown
    with open(os.environ["ONCEFLOW_PULSAR_ROGUE_CLIENT_KEY"]) as f:
        key_lines = [line for line in f.read().splitlines() if not line.startswith("-----")]
    assert not any(line in shown for line in key_lines), shown
