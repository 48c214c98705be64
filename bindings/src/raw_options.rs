//! Raw client options (`options=` in Python, `options:` in Node): `key=value` pairs handed to
//! the native client (librdkafka properties, URL query parameters), so their values are text.
//!
//! One rule for every binding and every place that takes them (connect, producer, consumer,
//! topic creation): a value may be a string, a boolean (`"true"` / `"false"`) or a finite number
//! (`500` → `"500"`, `0.25` → `"0.25"`: whole numbers without a decimal point, others as the
//! shortest decimal that reads back as the same number). Anything else is an
//! [`onceflow::ErrorKind::Config`] error naming the option's key and the type given, never the
//! value: an option may be a password.

use std::collections::BTreeMap;

use onceflow::{Error, Result};

use crate::settings::{Language, Value, WrongType};

/// What a raw option takes, in `language`'s words.
fn expected(language: Language) -> &'static str {
    match language {
        Language::Python => "str, bool, int or float",
        Language::Node => "a string, boolean or number",
    }
}

/// A number as an option's text: whole numbers without a decimal point (`500`), others as the
/// shortest decimal that reads back as the same `f64` (`0.25`), never in exponent form.
fn number_text(n: f64) -> String {
    if n == 0.0 {
        // Not "-0".
        "0".to_string()
    } else {
        n.to_string()
    }
}

/// The text of the raw option `key` given as `value`.
///
/// Errors: [`onceflow::ErrorKind::Config`] naming `key` and the type of `value` (its source a
/// [`WrongType`], see [`crate::settings::is_wrong_type`]) for a value that is not a string,
/// boolean or number; and naming `key` for NaN or an infinity. The value itself is never shown.
pub fn option_text(language: Language, key: &str, value: Value) -> Result<String> {
    match value {
        Value::Text(t) => Ok(t),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) if n.is_finite() => Ok(number_text(n)),
        Value::Number(_) => Err(Error::config(format!(
            "option '{}': expected a finite number, got {}",
            onceflow::shown(key),
            match language {
                Language::Python => "nan or inf",
                Language::Node => "NaN or Infinity",
            }
        ))),
        other => Err(Error::config(format!(
            "option '{}': expected {}, got {}",
            onceflow::shown(key),
            expected(language),
            language.type_name(&other)
        ))
        .with_source(WrongType)),
    }
}

/// Raw options from `(key, value)` pairs by [`option_text`]; a later key replaces an earlier one.
///
/// Errors: the first value [`option_text`] refuses.
pub fn raw_options(
    language: Language,
    entries: impl IntoIterator<Item = (String, Value)>,
) -> Result<BTreeMap<String, String>> {
    entries
        .into_iter()
        .map(|(k, v)| {
            let text = option_text(language, &k, v)?;
            Ok((k, text))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::is_wrong_type;
    use onceflow::ErrorKind;

    fn text(language: Language, v: Value) -> String {
        option_text(language, "k", v).unwrap()
    }

    #[test]
    fn strings_booleans_and_numbers_become_text() {
        for l in [Language::Python, Language::Node] {
            assert_eq!(text(l, Value::Text("SASL_SSL".into())), "SASL_SSL");
            assert_eq!(text(l, Value::Bool(false)), "false");
            assert_eq!(text(l, Value::Bool(true)), "true");
            assert_eq!(text(l, Value::Number(500.0)), "500");
            assert_eq!(text(l, Value::Number(-3.0)), "-3");
            assert_eq!(text(l, Value::Number(-0.0)), "0");
            assert_eq!(text(l, Value::Number(0.25)), "0.25");
            assert_eq!(text(l, Value::Number(0.1)), "0.1");
            assert_eq!(text(l, Value::Number(1e21)), "1000000000000000000000");
            assert_eq!(text(l, Value::Number(1e-7)), "0.0000001");
        }
        let m = raw_options(
            Language::Node,
            [
                ("linger.ms".to_string(), Value::Number(5.0)),
                ("enable.idempotence".to_string(), Value::Bool(true)),
            ],
        )
        .unwrap();
        assert_eq!(m["linger.ms"], "5");
        assert_eq!(m["enable.idempotence"], "true");
    }

    #[test]
    fn other_types_are_refused_naming_the_key_and_type_never_the_value() {
        let e = option_text(
            Language::Python,
            "tls_hostname_verification",
            Value::Other("list".into()),
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(is_wrong_type(&e));
        assert_eq!(
            e.message(),
            "option 'tls_hostname_verification': expected str, bool, int or float, got list"
        );
        let e = option_text(Language::Python, "password", Value::Absent).unwrap_err();
        assert_eq!(
            e.message(),
            "option 'password': expected str, bool, int or float, got NoneType"
        );
        let e = option_text(
            Language::Node,
            "sasl.password",
            Value::Other("object".into()),
        )
        .unwrap_err();
        assert_eq!(
            e.message(),
            "option 'sasl.password': expected a string, boolean or number, got object"
        );
        let e = option_text(Language::Node, "x", Value::Absent).unwrap_err();
        assert!(e.message().ends_with("got undefined"), "{}", e.message());
        for n in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = option_text(Language::Node, "linger.ms", Value::Number(n)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert!(!is_wrong_type(&e));
            assert_eq!(
                e.message(),
                "option 'linger.ms': expected a finite number, got NaN or Infinity"
            );
        }
        let e = raw_options(
            Language::Node,
            [
                ("a".to_string(), Value::Text("s3cret".into())),
                ("b".to_string(), Value::Other("object".into())),
            ],
        )
        .unwrap_err();
        assert!(e.message().starts_with("option 'b'"), "{}", e.message());
        assert!(!e.to_string().contains("s3cret"));
    }
}
