#!/usr/bin/env python3
"""onceflow's Kinesis header envelope in Python (stdlib only): a decoder, an encoder, and a
check of the test vectors in tests/vectors/kinesis-envelope/.

Format: docs/kinesis-envelope.md. Run without arguments to check every vector (exit 0 when all
decode to their .json and every valid vector re-encodes to the same bytes); prints one line per
vector and `VECTORS OK n`.
"""
import json
import pathlib
import struct
import sys

MAGIC = b"\xf5OFE"
VERSION = 1
FLAG_KEY, FLAG_TIMESTAMP, FLAG_UNKEYED = 1, 2, 4


class Damaged(ValueError):
    """The data starts with the magic but is not a valid envelope."""


def _varint(data, at):
    value = 0
    for i in range(10):
        if at >= len(data):
            raise Damaged("truncated varint")
        b = data[at]
        at += 1
        if i == 9 and b > 1:
            raise Damaged("varint overflows 64 bits")
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return value, at
    raise Damaged("varint longer than 10 bytes")


def _take(data, at, n):
    if at + n > len(data):
        raise Damaged("field runs past the end")
    return data[at:at + n], at + n


def decode(data):
    """Returns a dict: enveloped, key (bytes or None), unkeyed, timestamp (int or None),
    headers (list of (name, bytes or None)), payload (bytes). Raises Damaged."""
    if not data.startswith(MAGIC):
        return {"enveloped": False, "key": None, "unkeyed": False, "timestamp": None,
                "headers": [], "payload": data}
    at = len(MAGIC)
    (version, flags), at = _take(data, at, 2)
    if version != VERSION:
        raise Damaged("unknown version %d" % version)
    if flags & ~(FLAG_KEY | FLAG_TIMESTAMP | FLAG_UNKEYED):
        raise Damaged("unknown flags %#x" % flags)
    key = timestamp = None
    if flags & FLAG_KEY:
        n, at = _varint(data, at)
        key, at = _take(data, at, n)
    if flags & FLAG_TIMESTAMP:
        raw, at = _take(data, at, 8)
        (timestamp,) = struct.unpack(">q", raw)
    count, at = _varint(data, at)
    headers = []
    for _ in range(count):
        n, at = _varint(data, at)
        name, at = _take(data, at, n)
        try:
            name = name.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Damaged("header name is not UTF-8") from e
        n, at = _varint(data, at)
        value = None
        if n:
            value, at = _take(data, at, n - 1)
        headers.append((name, value))
    return {"enveloped": True, "key": key, "unkeyed": bool(flags & FLAG_UNKEYED),
            "timestamp": timestamp, "headers": headers, "payload": data[at:]}


def _put_varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def encode(key=None, unkeyed=False, timestamp=None, headers=(), payload=b""):
    flags = (FLAG_KEY if key is not None else 0) | (FLAG_TIMESTAMP if timestamp is not None
                                                     else 0) | (FLAG_UNKEYED if unkeyed else 0)
    out = bytearray(MAGIC) + bytes([VERSION, flags])
    if key is not None:
        out += _put_varint(len(key)) + key
    if timestamp is not None:
        out += struct.pack(">q", timestamp)
    out += _put_varint(len(headers))
    for name, value in headers:
        raw = name.encode("utf-8")
        out += _put_varint(len(raw)) + raw
        out += _put_varint(0) if value is None else _put_varint(len(value) + 1) + value
    return bytes(out + payload)


def _hex(b):
    return None if b is None else b.hex()


def as_json(d):
    return {"enveloped": d["enveloped"], "key_hex": _hex(d["key"]), "unkeyed": d["unkeyed"],
            "timestamp": d["timestamp"],
            "headers": [{"name": n, "value_hex": _hex(v)} for n, v in d["headers"]],
            "payload_hex": d["payload"].hex()}


def check(folder):
    ok = 0
    for binf in sorted(folder.glob("*.bin")):
        want = json.loads(binf.with_suffix(".json").read_text())
        data = binf.read_bytes()
        if want.get("error"):
            try:
                decode(data)
            except Damaged as e:
                print("%s: damaged as expected (%s)" % (binf.name, e))
                ok += 1
                continue
            raise SystemExit("%s: decoded, but the vector is damaged" % binf.name)
        got = as_json(decode(data))
        if got != want:
            raise SystemExit("%s: decoded %r, expected %r" % (binf.name, got, want))
        if got["enveloped"]:
            again = encode(
                key=None if want["key_hex"] is None else bytes.fromhex(want["key_hex"]),
                unkeyed=want["unkeyed"], timestamp=want["timestamp"],
                headers=[(h["name"], None if h["value_hex"] is None
                          else bytes.fromhex(h["value_hex"])) for h in want["headers"]],
                payload=bytes.fromhex(want["payload_hex"]))
            if again != data:
                raise SystemExit("%s: re-encoded to other bytes" % binf.name)
        print("%s: ok" % binf.name)
        ok += 1
    if ok == 0:
        raise SystemExit("no vectors in %s" % folder)
    print("VECTORS OK %d" % ok)


def write_vectors(folder):
    """Writes the vectors (used once to create them; the Rust tests check onceflow's encoder
    against the same files)."""
    folder.mkdir(parents=True, exist_ok=True)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    valid = {
        "01-empty-envelope": dict(),
        "02-headers-only": dict(headers=[("traceparent", tp.encode()),
                                         ("idempotency-key", b"order-42")],
                                payload=b'{"order":42}'),
        "03-all-fields": dict(key=b"k\x00\xff", timestamp=1700000000123,
                              headers=[("rep", b"1"), ("null", None), ("empty", b""),
                                       ("rep", b"2"), ("bin", bytes([0, 1, 0x7F, 0x80, 0xFF]))],
                              payload=b"\x00payload\xff"),
        "04-unkeyed-negative-timestamp": dict(unkeyed=True, timestamp=-1, payload=b"x"),
        "05-long-header-value": dict(headers=[("h" * 200, b"v" * 300)], payload=b""),
        "06-payload-starts-with-magic": dict(payload=MAGIC + b"\x01\x00\x00"),
    }
    for name, fields in valid.items():
        data = encode(**fields)
        (folder / (name + ".bin")).write_bytes(data)
        (folder / (name + ".json")).write_text(json.dumps(as_json(decode(data)), indent=1) + "\n")
    plain = b'{"from":"boto3"}'
    (folder / "07-plain-json.bin").write_bytes(plain)
    (folder / "07-plain-json.json").write_text(json.dumps(as_json(decode(plain)), indent=1) + "\n")
    damaged = {
        "90-truncated-header": encode(headers=[("abc", b"defg")], payload=b"")[:-2],
        "91-unknown-version": MAGIC + b"\x02\x00\x00",
        "92-unknown-flag": MAGIC + b"\x01\x08\x00",
        "93-key-past-end": MAGIC + b"\x01\x01\x7f" + b"k",
        "94-name-not-utf8": MAGIC + b"\x01\x00\x01\x01\xff\x00",
    }
    for name, data in damaged.items():
        (folder / (name + ".bin")).write_bytes(data)
        (folder / (name + ".json")).write_text('{"error": true}\n')


if __name__ == "__main__":
    here = pathlib.Path(__file__).resolve().parent.parent / "vectors" / "kinesis-envelope"
    if sys.argv[1:] == ["--write"]:
        write_vectors(here)
    check(here)
