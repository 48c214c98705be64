//! The envelope test vectors (`tests/vectors/kinesis-envelope/`, written by the independent
//! Python implementation `tests/interop/kinesis_envelope.py`) decode with onceflow's decoder to
//! their `.json`, and valid ones re-encode to the same bytes. The Python checker itself runs
//! here too when `python3` is available.

use std::path::PathBuf;

use bytes::Bytes;
use onceflow_core::{ErrorKind, Header};
use onceflow_kinesis::envelope::{self, Envelope};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/kinesis-envelope")
}

fn hex_opt(v: &Value) -> Option<Bytes> {
    v.as_str()
        .map(|s| Bytes::from(hex::decode(s).expect("hex")))
}

#[test]
fn vectors_decode_and_reencode() {
    let mut n = 0;
    let mut entries: Vec<_> = std::fs::read_dir(dir())
        .expect("vectors folder")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .collect();
    entries.sort();
    for bin in entries {
        let data = Bytes::from(std::fs::read(&bin).unwrap());
        let want: Value =
            serde_json::from_str(&std::fs::read_to_string(bin.with_extension("json")).unwrap())
                .unwrap();
        let name = bin.file_name().unwrap().to_string_lossy().to_string();
        if want["error"] == Value::Bool(true) {
            let e = envelope::decode(data).expect_err(&name);
            assert_eq!(e.kind(), ErrorKind::Serialization, "{name}: {e}");
            n += 1;
            continue;
        }
        let d = envelope::decode(data.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(d.enveloped, want["enveloped"].as_bool().unwrap(), "{name}");
        assert_eq!(d.envelope.key, hex_opt(&want["key_hex"]), "{name} key");
        assert_eq!(
            d.envelope.unkeyed,
            want["unkeyed"].as_bool().unwrap(),
            "{name}"
        );
        assert_eq!(
            d.envelope.timestamp,
            want["timestamp"].as_i64(),
            "{name} timestamp"
        );
        let headers: Vec<Header> = want["headers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| Header {
                name: h["name"].as_str().unwrap().to_string(),
                value: hex_opt(&h["value_hex"]),
            })
            .collect();
        assert_eq!(
            d.envelope.headers.iter().cloned().collect::<Vec<_>>(),
            headers,
            "{name} headers"
        );
        assert_eq!(
            d.payload,
            hex_opt(&want["payload_hex"]).unwrap(),
            "{name} payload"
        );
        if d.enveloped {
            let env = Envelope {
                headers: headers.into_iter().collect(),
                ..d.envelope.clone()
            };
            assert_eq!(
                envelope::encode(&env, &d.payload),
                data,
                "{name}: re-encoding"
            );
        }
        n += 1;
    }
    assert!(n >= 10, "only {n} vectors found");
}

#[test]
fn python_decoder_reads_the_vectors() {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/kinesis_envelope.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .output()
        .expect("python3 runs (the Python envelope decoder needs only its standard library)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("VECTORS OK"),
        "Python decoder failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
