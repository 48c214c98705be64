//! The header envelope: how a record's key, timestamp and headers travel inside the data of a
//! Kinesis record, which has none of them. The format is specified in
//! `docs/kinesis-envelope.md`; test vectors are in `tests/vectors/kinesis-envelope/`.
//!
//! ```text
//! magic    4 bytes  F5 4F 46 45   (0xF5 never starts UTF-8 text or JSON)
//! version  1 byte   01
//! flags    1 byte   bit 0: key present, bit 1: timestamp present, bit 2: unkeyed; others 0
//! [key]    varint length, bytes          (bit 0)
//! [ts]     8 bytes, big-endian i64 ms    (bit 1)
//! count    varint number of headers
//! header*  varint name length, name (UTF-8), varint (value length + 1) (0 = null), value
//! payload  the rest
//! ```
//!
//! Varints are unsigned LEB128 (7 bits per byte, low group first, at most 10 bytes).

use bytes::{BufMut, Bytes, BytesMut};
use onceflow_core::{Error, ErrorKind, Header, Headers, Result, TimestampMs};

/// First four bytes of an enveloped record.
pub const MAGIC: [u8; 4] = [0xF5, b'O', b'F', b'E'];
/// The version this build writes and reads.
pub const VERSION: u8 = 1;

const FLAG_KEY: u8 = 1;
const FLAG_TIMESTAMP: u8 = 2;
const FLAG_UNKEYED: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_KEY | FLAG_TIMESTAMP | FLAG_UNKEYED;

/// What the envelope carries besides the payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Envelope {
    /// The record key when it differs from the partition key (binary, or too long to be one).
    pub key: Option<Bytes>,
    /// The record had no key: the partition key was made up and is not a message key.
    pub unkeyed: bool,
    /// The record's timestamp, ms since the epoch.
    pub timestamp: Option<TimestampMs>,
    /// Headers in order, repeats and nulls kept.
    pub headers: Headers,
}

/// The data of a record as read: envelope fields (all empty for a plain record) and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Whether the data carried an envelope.
    pub enveloped: bool,
    /// The envelope fields.
    pub envelope: Envelope,
    /// The payload.
    pub payload: Bytes,
}

fn put_varint(buf: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        buf.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// Bytes the envelope adds in front of a payload.
pub fn overhead(env: &Envelope) -> usize {
    let mut n = MAGIC.len() + 2;
    if let Some(k) = &env.key {
        n += varint_len(k.len() as u64) + k.len();
    }
    if env.timestamp.is_some() {
        n += 8;
    }
    n += varint_len(env.headers.len() as u64);
    for h in env.headers.iter() {
        n += varint_len(h.name.len() as u64) + h.name.len();
        let vl = h.value.as_ref().map_or(0, |v| v.len() as u64 + 1);
        n += varint_len(vl) + h.value.as_ref().map_or(0, |v| v.len());
    }
    n
}

/// Whether `payload` can be written without an envelope for these fields: nothing to carry, and
/// the payload does not itself start with the magic.
pub fn needs_envelope(env: &Envelope, payload: &[u8]) -> bool {
    env.key.is_some()
        || env.unkeyed
        || env.timestamp.is_some()
        || !env.headers.is_empty()
        || payload.starts_with(&MAGIC)
}

/// Encodes `payload` with the envelope (always; see [`needs_envelope`] to decide).
pub fn encode(env: &Envelope, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(overhead(env) + payload.len());
    buf.put_slice(&MAGIC);
    buf.put_u8(VERSION);
    let mut flags = 0;
    if env.key.is_some() {
        flags |= FLAG_KEY;
    }
    if env.timestamp.is_some() {
        flags |= FLAG_TIMESTAMP;
    }
    if env.unkeyed {
        flags |= FLAG_UNKEYED;
    }
    buf.put_u8(flags);
    if let Some(k) = &env.key {
        put_varint(&mut buf, k.len() as u64);
        buf.put_slice(k);
    }
    if let Some(ts) = env.timestamp {
        buf.put_i64(ts);
    }
    put_varint(&mut buf, env.headers.len() as u64);
    for h in env.headers.iter() {
        put_varint(&mut buf, h.name.len() as u64);
        buf.put_slice(h.name.as_bytes());
        match &h.value {
            None => put_varint(&mut buf, 0),
            Some(v) => {
                put_varint(&mut buf, v.len() as u64 + 1);
                buf.put_slice(v);
            }
        }
    }
    buf.put_slice(payload);
    buf.freeze()
}

/// Encodes only when needed: plain payload otherwise.
pub fn encode_if_needed(env: &Envelope, payload: &Bytes) -> Bytes {
    if needs_envelope(env, payload) {
        encode(env, payload)
    } else {
        payload.clone()
    }
}

struct Reader<'a> {
    data: &'a Bytes,
    at: usize,
}

impl Reader<'_> {
    fn damaged(&self, what: &str) -> Error {
        Error::new(
            ErrorKind::Serialization,
            format!(
                "damaged onceflow envelope ({} bytes): {what} at byte {}",
                self.data.len(),
                self.at
            ),
        )
    }

    fn byte(&mut self, what: &str) -> Result<u8> {
        let b = *self
            .data
            .get(self.at)
            .ok_or_else(|| self.damaged(&format!("truncated {what}")))?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self, what: &str) -> Result<u64> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let b = self.byte(what)?;
            let part = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(self.damaged(&format!("{what} varint overflows 64 bits")));
            }
            v |= part << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.damaged(&format!("{what} varint longer than 10 bytes")))
    }

    fn slice(&mut self, len: u64, what: &str) -> Result<Bytes> {
        let len = usize::try_from(len).map_err(|_| self.damaged(what))?;
        let end = self
            .at
            .checked_add(len)
            .filter(|e| *e <= self.data.len())
            .ok_or_else(|| self.damaged(&format!("{what} of {len} bytes runs past the end")))?;
        let s = self.data.slice(self.at..end);
        self.at = end;
        Ok(s)
    }
}

/// Decodes record data: a plain payload when it does not start with [`MAGIC`]; otherwise the
/// envelope, or a [`ErrorKind::Serialization`] error when it is damaged (truncated, unknown
/// version or flags, a header name that is not UTF-8).
pub fn decode(data: Bytes) -> Result<Decoded> {
    if !data.starts_with(&MAGIC) {
        return Ok(Decoded {
            enveloped: false,
            envelope: Envelope::default(),
            payload: data,
        });
    }
    let mut r = Reader {
        data: &data,
        at: MAGIC.len(),
    };
    let version = r.byte("version")?;
    if version != VERSION {
        return Err(r.damaged(&format!(
            "version {version}, this build reads version {VERSION}"
        )));
    }
    let flags = r.byte("flags")?;
    if flags & !KNOWN_FLAGS != 0 {
        return Err(r.damaged(&format!("unknown flags {flags:#04x}")));
    }
    let mut env = Envelope {
        unkeyed: flags & FLAG_UNKEYED != 0,
        ..Default::default()
    };
    if flags & FLAG_KEY != 0 {
        let n = r.varint("key length")?;
        env.key = Some(r.slice(n, "key")?);
    }
    if flags & FLAG_TIMESTAMP != 0 {
        let b = r.slice(8, "timestamp")?;
        env.timestamp = Some(i64::from_be_bytes(b[..].try_into().expect("8 bytes")));
    }
    let count = r.varint("header count")?;
    let mut headers = Vec::new();
    for _ in 0..count {
        let n = r.varint("header name length")?;
        let name = r.slice(n, "header name")?;
        let name =
            String::from_utf8(name.to_vec()).map_err(|_| r.damaged("header name is not UTF-8"))?;
        let vl = r.varint("header value length")?;
        let value = if vl == 0 {
            None
        } else {
            Some(r.slice(vl - 1, "header value")?)
        };
        headers.push(Header { name, value });
    }
    env.headers = headers.into_iter().collect();
    let payload = data.slice(r.at..);
    Ok(Decoded {
        enveloped: true,
        envelope: env,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_plain() {
        let mut h = Headers::new();
        h.insert("a", "1")
            .insert_null("n")
            .insert("e", Bytes::new())
            .insert("a", "2");
        let env = Envelope {
            key: Some(Bytes::from_static(b"k\x00\xff")),
            unkeyed: false,
            timestamp: Some(-5),
            headers: h,
        };
        let data = encode(&env, b"payload");
        assert_eq!(data.len(), overhead(&env) + 7);
        let d = decode(data.clone()).unwrap();
        assert!(d.enveloped);
        assert_eq!(d.envelope, env);
        assert_eq!(&d.payload[..], b"payload");
        let plain = decode(Bytes::from_static(b"{\"a\":1}")).unwrap();
        assert!(!plain.enveloped);
        assert_eq!(&plain.payload[..], b"{\"a\":1}");
        for cut in MAGIC.len()..data.len() - 7 {
            let e = decode(data.slice(..cut)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Serialization, "cut at {cut}");
        }
        // A payload that starts with the magic is enveloped, and reads back unchanged.
        let tricky = Bytes::from_static(b"\xF5OFE\x01\x00\x00");
        let empty = Envelope::default();
        assert!(needs_envelope(&empty, &tricky));
        let d = decode(encode_if_needed(&empty, &tricky)).unwrap();
        assert_eq!(d.payload, tricky);
    }
}
