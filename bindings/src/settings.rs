//! Engine and pipeline settings from a binding's options: one table of names, kinds and
//! limits, so Python and Node accept, spell and refuse settings by the same rules.
//!
//! A binding turns its host's options (a Python `**config` dict, a Node options object) into
//! `(name, Value)` pairs and calls [`engine_config`] or [`pipeline_config`]. Names are spelled
//! in the host's convention ([`Language`]): `max_backoff` in seconds for Python, `maxBackoffMs`
//! in milliseconds for Node. An unknown name, a value of the wrong type, a count that is not a
//! whole number or a duration out of range is an [`onceflow::ErrorKind::Config`] error naming the setting
//! as the user spelled it and what was expected, in the host's words.

use std::time::Duration;

use onceflow::inbox::InboxConfig;
use onceflow::{EngineConfig, Error, PipelineConfig, Result};

/// The language a binding serves: how its users spell setting names, durations and types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    /// snake_case names, durations in seconds (`lease=30.0`), Python's type names.
    Python,
    /// camelCase names, durations in milliseconds with an `Ms` suffix (`leaseMs: 30000`),
    /// JavaScript's type names.
    Node,
}

/// A setting's value as the host language gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None` / `undefined` / `null`: the setting keeps its default.
    Absent,
    /// A boolean.
    Bool(bool),
    /// A number (Python `int` or `float`, a JavaScript number).
    Number(f64),
    /// A string.
    Text(String),
    /// Anything else, by the host's name for its type (`list`, `object`, ...).
    Other(String),
}

/// The source of an error about a value of the wrong type (a Python binding raises
/// `TypeError` for it, as for any argument of the wrong type); see [`is_wrong_type`].
#[derive(Debug)]
pub struct WrongType;

impl std::fmt::Display for WrongType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a setting's value has the wrong type")
    }
}

impl std::error::Error for WrongType {}

/// Whether `e` refuses a setting's value for its type (rather than for its value).
pub fn is_wrong_type(e: &Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<WrongType>())
}

/// Longest duration a setting takes: 100 years.
const MAX_SECONDS: f64 = 100.0 * 365.25 * 24.0 * 3600.0;
/// Largest count a setting takes: the largest integer a JavaScript number holds exactly.
const MAX_COUNT: f64 = 9_007_199_254_740_991.0;

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Free text; `non_empty` refuses `""`.
    Text {
        non_empty: bool,
    },
    /// Text in one of the forms of a core type's `FromStr`.
    Form,
    Bool,
    /// A whole number from `min` up.
    Count {
        min: u64,
        max: f64,
    },
    /// A non-negative duration from `min_ms` up, in the host's unit.
    Duration {
        min_ms: u64,
    },
}

/// Canonical (snake_case) name, kind.
type Entry = (&'static str, Kind);

const TEXT: Kind = Kind::Text { non_empty: false };
const DURATION: Kind = Kind::Duration { min_ms: 0 };

/// The settings of [`EngineConfig`], in its field order.
const ENGINE: &[Entry] = &[
    ("key", Kind::Form),
    ("namespace", TEXT),
    ("worker_id", Kind::Text { non_empty: true }),
    ("lease", Kind::Duration { min_ms: 100 }),
    ("fingerprint", Kind::Bool),
    ("require_key", Kind::Bool),
    (
        "max_attempts",
        Kind::Count {
            min: 1,
            max: u32::MAX as f64,
        },
    ),
    ("min_backoff", DURATION),
    ("max_backoff", DURATION),
    ("on_failure", Kind::Form),
    ("redelivery_delay", DURATION),
    (
        "batch_size",
        Kind::Count {
            min: 1,
            max: MAX_COUNT,
        },
    ),
    ("poll_timeout", DURATION),
    ("commit_interval", DURATION),
    (
        "commit_every",
        Kind::Count {
            min: 1,
            max: MAX_COUNT,
        },
    ),
    ("shutdown_deadline", DURATION),
    ("tracing", Kind::Bool),
];

/// The settings [`PipelineConfig`] adds.
const PIPELINE: &[Entry] = &[
    ("mode", Kind::Form),
    ("transaction_interval", DURATION),
    (
        "max_transaction_inputs",
        Kind::Count {
            min: 1,
            max: MAX_COUNT,
        },
    ),
];

impl Language {
    /// `name` (snake_case) as this language's users spell it; `duration` adds Node's `Ms`.
    pub fn spell(self, name: &str, duration: bool) -> String {
        match self {
            Language::Python => name.to_string(),
            Language::Node => {
                let mut out = String::with_capacity(name.len() + 2);
                let mut upper = false;
                for c in name.chars() {
                    if c == '_' {
                        upper = true;
                    } else if upper {
                        out.extend(c.to_uppercase());
                        upper = false;
                    } else {
                        out.push(c);
                    }
                }
                if duration {
                    out.push_str("Ms");
                }
                out
            }
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Language::Python => "seconds",
            Language::Node => "milliseconds",
        }
    }

    fn per_second(self) -> f64 {
        match self {
            Language::Python => 1.0,
            Language::Node => 1000.0,
        }
    }

    /// What a setting of `kind` takes, in this language's words.
    fn type_words(self, kind: Kind) -> &'static str {
        match (self, kind) {
            (Language::Python, Kind::Text { .. } | Kind::Form) => "str",
            (Language::Node, Kind::Text { .. } | Kind::Form) => "a string",
            (Language::Python, Kind::Bool) => "bool",
            (Language::Node, Kind::Bool) => "a boolean",
            (Language::Python, Kind::Count { .. }) => "int",
            (Language::Node, Kind::Count { .. }) => "a whole number",
            (Language::Python, Kind::Duration { .. }) => {
                "int, float or datetime.timedelta (seconds)"
            }
            (Language::Node, Kind::Duration { .. }) => "a number of milliseconds",
        }
    }

    /// The type of `value`, as this language names it (`type(v).__name__`, `typeof v`).
    pub(crate) fn type_name(self, value: &Value) -> String {
        match (self, value) {
            (Language::Python, Value::Absent) => "NoneType".into(),
            (Language::Node, Value::Absent) => "undefined".into(),
            (Language::Python, Value::Bool(_)) => "bool".into(),
            (Language::Node, Value::Bool(_)) => "boolean".into(),
            (Language::Python, Value::Number(n)) if n.fract() == 0.0 => "int".into(),
            (Language::Python, Value::Number(_)) => "float".into(),
            (Language::Node, Value::Number(_)) => "number".into(),
            (Language::Python, Value::Text(_)) => "str".into(),
            (Language::Node, Value::Text(_)) => "string".into(),
            (_, Value::Other(t)) => t.clone(),
        }
    }

    /// A duration given in this language's unit (seconds for Python, milliseconds for Node)
    /// for the option `name` as the user spelled it: a number from 0 to 100 years, else an
    /// [`onceflow::ErrorKind::Config`] error naming both.
    pub fn duration(self, name: &str, amount: f64) -> Result<Duration> {
        let max = MAX_SECONDS * self.per_second();
        if !(0.0..=max).contains(&amount) {
            return Err(Error::config(format!(
                "{name} {}: expected a number of {} from 0 to {} (100 years)",
                number_text(amount),
                self.unit(),
                number_text(max)
            )));
        }
        Ok(Duration::from_secs_f64(amount / self.per_second()))
    }

    /// A count given as a number for the argument `name`: a whole number from `min` to
    /// 2^53 - 1, else an [`onceflow::ErrorKind::Config`] error naming both.
    pub fn count(self, name: &str, amount: f64, min: u64) -> Result<u64> {
        match parse(
            self,
            name,
            Kind::Count {
                min,
                max: MAX_COUNT,
            },
            Value::Number(amount),
        )? {
            Parsed::Count(n) => Ok(n),
            _ => unreachable!("a count parses to a count"),
        }
    }
}

/// A number as an error shows it: whole numbers without a fraction, huge ones in exponent form.
fn number_text(n: f64) -> String {
    if n.is_finite() && n.abs() < 1e16 {
        n.to_string()
    } else {
        format!("{n:e}")
    }
}

/// A value that passed its kind's checks.
enum Parsed {
    Text(String),
    Bool(bool),
    Count(u64),
    Duration(Duration),
}

fn parse(language: Language, spelled: &str, kind: Kind, value: Value) -> Result<Parsed> {
    let wrong = |value: &Value| {
        Error::config(format!(
            "{spelled}: expected {}, got {}",
            language.type_words(kind),
            language.type_name(value)
        ))
        .with_source(WrongType)
    };
    match (kind, value) {
        (Kind::Text { non_empty }, Value::Text(t)) => {
            if non_empty && t.is_empty() {
                return Err(Error::config(format!(
                    "{spelled} is empty: expected a non-empty {}",
                    match language {
                        Language::Python => "str",
                        Language::Node => "string",
                    }
                )));
            }
            Ok(Parsed::Text(t))
        }
        (Kind::Form, Value::Text(t)) => Ok(Parsed::Text(t)),
        (Kind::Bool, Value::Bool(b)) => Ok(Parsed::Bool(b)),
        (Kind::Count { min, max }, Value::Number(n)) => {
            if n.fract() != 0.0 || !(min as f64..=max).contains(&n) {
                return Err(Error::config(format!(
                    "{spelled} {}: expected a whole number from {min} to {}",
                    number_text(n),
                    number_text(max)
                )));
            }
            Ok(Parsed::Count(n as u64))
        }
        (Kind::Duration { min_ms }, Value::Number(n)) => {
            let d = language.duration(spelled, n)?;
            if d < Duration::from_millis(min_ms) {
                return Err(Error::config(format!(
                    "{spelled} {}: too short, expected at least {} {}",
                    number_text(n),
                    number_text(min_ms as f64 / 1000.0 * language.per_second()),
                    language.unit()
                )));
            }
            Ok(Parsed::Duration(d))
        }
        (_, other) => Err(wrong(&other)),
    }
}

/// `core`'s error for a text form, prefixed with the setting as the user spelled it.
fn form<T>(spelled: &str, text: &str) -> Result<T>
where
    T: std::str::FromStr<Err = Error>,
{
    text.parse::<T>()
        .map_err(|e| Error::config(format!("{spelled}: {}", e.message())))
}

fn apply_engine(c: &mut EngineConfig, spelled: &str, name: &str, v: Parsed) -> Result<()> {
    match (name, v) {
        ("key", Parsed::Text(t)) => c.key = form(spelled, &t)?,
        ("namespace", Parsed::Text(t)) => c.namespace = Some(t),
        ("worker_id", Parsed::Text(t)) => c.worker_id = t,
        ("lease", Parsed::Duration(d)) => c.lease = d,
        ("fingerprint", Parsed::Bool(b)) => c.fingerprint = b,
        ("require_key", Parsed::Bool(b)) => c.require_key = b,
        ("max_attempts", Parsed::Count(n)) => c.max_attempts = n as u32,
        ("min_backoff", Parsed::Duration(d)) => c.min_backoff = d,
        ("max_backoff", Parsed::Duration(d)) => c.max_backoff = d,
        ("on_failure", Parsed::Text(t)) => c.on_failure = form(spelled, &t)?,
        ("redelivery_delay", Parsed::Duration(d)) => c.redelivery_delay = d,
        ("batch_size", Parsed::Count(n)) => c.batch_size = n as usize,
        ("poll_timeout", Parsed::Duration(d)) => c.poll_timeout = d,
        ("commit_interval", Parsed::Duration(d)) => c.commit_interval = d,
        ("commit_every", Parsed::Count(n)) => c.commit_every = n,
        ("shutdown_deadline", Parsed::Duration(d)) => c.shutdown_deadline = d,
        ("tracing", Parsed::Bool(b)) => c.tracing = b,
        _ => unreachable!("engine setting {name} and its kind disagree"),
    }
    Ok(())
}

fn apply_pipeline(c: &mut PipelineConfig, spelled: &str, name: &str, v: Parsed) -> Result<()> {
    match (name, v) {
        ("mode", Parsed::Text(t)) => c.mode = form(spelled, &t)?,
        ("transaction_interval", Parsed::Duration(d)) => c.transaction_interval = d,
        ("max_transaction_inputs", Parsed::Count(n)) => c.max_transaction_inputs = n as usize,
        (name, v) => apply_engine(&mut c.engine, spelled, name, v)?,
    }
    Ok(())
}

/// The settings of [`InboxConfig`], in its field order.
const INBOX: &[Entry] = &[
    ("key", Kind::Form),
    ("namespace", TEXT),
    (
        "batch_size",
        Kind::Count {
            min: 1,
            max: MAX_COUNT,
        },
    ),
    ("poll_timeout", DURATION),
    (
        "max_attempts",
        Kind::Count {
            min: 1,
            max: u32::MAX as f64,
        },
    ),
    ("backoff", DURATION),
    ("broker_commit_interval", DURATION),
];

fn apply_inbox(c: &mut InboxConfig, spelled: &str, name: &str, v: Parsed) -> Result<()> {
    match (name, v) {
        ("key", Parsed::Text(t)) => c.key = form(spelled, &t)?,
        ("namespace", Parsed::Text(t)) => c.namespace = Some(t),
        ("batch_size", Parsed::Count(n)) => c.batch_size = n as usize,
        ("poll_timeout", Parsed::Duration(d)) => c.poll_timeout = d,
        ("max_attempts", Parsed::Count(n)) => c.max_attempts = n as u32,
        ("backoff", Parsed::Duration(d)) => c.backoff = d,
        ("broker_commit_interval", Parsed::Duration(d)) => c.broker_commit_interval = d,
        _ => unreachable!("inbox setting {name} and its kind disagree"),
    }
    Ok(())
}

/// The names a table accepts, as `language` spells them.
fn names(language: Language, tables: &[&[Entry]]) -> Vec<String> {
    tables
        .iter()
        .flat_map(|t| t.iter())
        .map(|(n, k)| language.spell(n, matches!(k, Kind::Duration { .. })))
        .collect()
}

/// The caller's own option names, listed after the table's in an unknown-setting error.
pub type OwnNames<'a> = &'a [&'a str];

/// Applies `entries` to `config` through `apply`, looking each name up in `tables`.
fn build<C>(
    language: Language,
    tables: &[&[Entry]],
    own: OwnNames<'_>,
    entries: impl IntoIterator<Item = (String, Value)>,
    config: &mut C,
    apply: fn(&mut C, &str, &str, Parsed) -> Result<()>,
) -> Result<()> {
    for (spelled, value) in entries {
        let found = tables
            .iter()
            .flat_map(|t| t.iter())
            .find(|(n, k)| language.spell(n, matches!(k, Kind::Duration { .. })) == spelled);
        let Some(&(name, kind)) = found else {
            return Err(Error::config(format!(
                "unknown setting '{}': expected one of {}",
                onceflow::shown(&spelled),
                names(language, tables)
                    .into_iter()
                    .chain(own.iter().map(|n| n.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        if value == Value::Absent {
            continue;
        }
        let parsed = parse(language, &spelled, kind, value)?;
        apply(config, &spelled, name, parsed)?;
    }
    Ok(())
}

/// An [`EngineConfig`]: the defaults with `entries` applied in order.
///
/// Names (as `language` spells them; [`Value::Absent`] keeps the default):
/// `key` (`header:NAME` or `coordinates`), `namespace`, `worker_id`, `lease` (at least 100 ms),
/// `fingerprint`, `require_key`, `max_attempts` (at least 1), `min_backoff`, `max_backoff`, `on_failure`
/// (`redeliver`, `stop` or `dead-letter:TOPIC`), `redelivery_delay`, `batch_size` (at least 1),
/// `poll_timeout`, `commit_interval`, `commit_every` (at least 1), `shutdown_deadline`,
/// `tracing`. Their meanings and defaults are [`EngineConfig`]'s fields'.
///
/// `own` lists the names the binding itself takes from the same options object (Node's
/// `store`), for the error about an unknown name.
///
/// Errors: [`onceflow::ErrorKind::Config`] naming the setting as spelled and what was expected.
pub fn engine_config(
    language: Language,
    entries: impl IntoIterator<Item = (String, Value)>,
    own: OwnNames<'_>,
) -> Result<EngineConfig> {
    let mut c = EngineConfig::default();
    build(language, &[ENGINE], own, entries, &mut c, apply_engine)?;
    c.validate()?;
    Ok(c)
}

/// A [`PipelineConfig`]: the defaults with `entries` applied in order; the names of
/// [`engine_config`] plus `mode` (`auto`, `transactional` or `idempotent`),
/// `transaction_interval` and `max_transaction_inputs` (at least 1); `own` as there.
///
/// Errors: [`onceflow::ErrorKind::Config`] naming the setting as spelled and what was expected.
pub fn pipeline_config(
    language: Language,
    entries: impl IntoIterator<Item = (String, Value)>,
    own: OwnNames<'_>,
) -> Result<PipelineConfig> {
    let mut c = PipelineConfig::default();
    build(
        language,
        &[ENGINE, PIPELINE],
        own,
        entries,
        &mut c,
        apply_pipeline,
    )?;
    c.engine.validate()?;
    Ok(c)
}

/// An [`InboxConfig`] (the transactional inbox's settings): the defaults with `entries`
/// applied in order. Names (as `language` spells them): `key` (`header:NAME` or
/// `coordinates`), `namespace`, `batch_size` (at least 1), `poll_timeout`, `max_attempts` (at
/// least 1), `backoff`, `broker_commit_interval`; meanings and defaults are [`InboxConfig`]'s
/// fields'. `own` as in [`engine_config`].
///
/// Errors: [`onceflow::ErrorKind::Config`] naming the setting as spelled and what was expected.
pub fn inbox_config(
    language: Language,
    entries: impl IntoIterator<Item = (String, Value)>,
    own: OwnNames<'_>,
) -> Result<InboxConfig> {
    let mut c = InboxConfig::default();
    build(language, &[INBOX], own, entries, &mut c, apply_inbox)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onceflow::{ErrorKind, KeyStrategy, OnFailure, PipelineMode};

    fn n(v: f64) -> Value {
        Value::Number(v)
    }

    fn t(v: &str) -> Value {
        Value::Text(v.into())
    }

    fn entries(pairs: &[(&str, Value)]) -> Vec<(String, Value)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    fn err(language: Language, pairs: &[(&str, Value)]) -> String {
        let e = pipeline_config(language, entries(pairs), &["store"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        e.message().to_string()
    }

    #[test]
    fn each_language_spells_the_same_settings_its_own_way() {
        let py = pipeline_config(
            Language::Python,
            entries(&[
                ("lease", n(2.5)),
                ("key", t("coordinates")),
                ("on_failure", t("dead-letter:dlq")),
                ("max_attempts", n(3.0)),
                ("mode", t("idempotent")),
                ("transaction_interval", n(0.25)),
                ("tracing", Value::Bool(false)),
                ("namespace", Value::Absent),
            ]),
            &[],
        )
        .unwrap();
        let node = pipeline_config(
            Language::Node,
            entries(&[
                ("leaseMs", n(2500.0)),
                ("key", t("coordinates")),
                ("onFailure", t("dead-letter:dlq")),
                ("maxAttempts", n(3.0)),
                ("mode", t("idempotent")),
                ("transactionIntervalMs", n(250.0)),
                ("tracing", Value::Bool(false)),
                ("namespace", Value::Absent),
            ]),
            &[],
        )
        .unwrap();
        for c in [&py, &node] {
            assert_eq!(c.engine.lease, Duration::from_millis(2500));
            assert!(matches!(c.engine.key, KeyStrategy::Coordinates));
            assert_eq!(c.engine.on_failure, OnFailure::DeadLetter("dlq".into()));
            assert_eq!(c.engine.max_attempts, 3);
            assert_eq!(c.mode, PipelineMode::Idempotent);
            assert_eq!(c.transaction_interval, Duration::from_millis(250));
            assert!(!c.engine.tracing);
            assert_eq!(c.engine.namespace, None);
        }
        assert_eq!(names(Language::Node, &[ENGINE]).len(), ENGINE.len());
        assert!(names(Language::Node, &[ENGINE]).contains(&"shutdownDeadlineMs".to_string()));
    }

    #[test]
    fn a_misspelled_setting_is_refused_with_the_accepted_names_in_its_spelling() {
        let m = err(Language::Node, &[("leseMs", n(1.0))]);
        assert!(m.contains("unknown setting 'leseMs'"), "{m}");
        assert!(
            m.contains("leaseMs") && m.contains("maxTransactionInputs"),
            "{m}"
        );
        assert!(!m.contains("max_attempts"), "{m}");
        let m = err(Language::Python, &[("leaseMs", n(1.0))]);
        assert!(m.contains("'leaseMs'") && m.contains("lease, "), "{m}");
        assert!(m.ends_with(", store"), "{m}");
        let e = engine_config(Language::Node, entries(&[("mode", t("auto"))]), &[]).unwrap_err();
        assert!(
            e.message().contains("unknown setting 'mode'"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn wrong_types_and_ranges_are_named_in_the_users_words() {
        let m = err(Language::Node, &[("batchSize", n(0.0))]);
        assert!(
            m.contains("batchSize 0: expected a whole number from 1"),
            "{m}"
        );
        let m = err(Language::Node, &[("maxAttempts", n(2.5))]);
        assert!(
            m.contains("maxAttempts 2.5: expected a whole number"),
            "{m}"
        );
        let m = err(Language::Node, &[("commitEvery", n(-1.0))]);
        assert!(m.contains("commitEvery -1"), "{m}");
        let m = err(Language::Node, &[("tracing", t("yes"))]);
        assert_eq!(m, "tracing: expected a boolean, got string");
        let m = err(Language::Python, &[("tracing", n(1.0))]);
        assert_eq!(m, "tracing: expected bool, got int");
        let m = err(Language::Python, &[("lease", t("5"))]);
        assert_eq!(
            m,
            "lease: expected int, float or datetime.timedelta (seconds), got str"
        );
        let m = err(
            Language::Python,
            &[("namespace", Value::Other("list".into()))],
        );
        assert_eq!(m, "namespace: expected str, got list");
        let e = pipeline_config(
            Language::Node,
            entries(&[("key", Value::Other("object".into()))]),
            &[],
        )
        .unwrap_err();
        assert_eq!(e.message(), "key: expected a string, got object");
        assert!(is_wrong_type(&e));
        let e = pipeline_config(Language::Node, entries(&[("batchSize", n(0.0))]), &[]);
        assert!(!is_wrong_type(&e.unwrap_err()));
        let e = Language::Node.count("max", 2.5, 1).unwrap_err();
        assert_eq!(
            e.message(),
            "max 2.5: expected a whole number from 1 to 9007199254740991"
        );
        let m = err(Language::Node, &[("leaseMs", n(50.0))]);
        assert!(
            m.contains("leaseMs 50: too short, expected at least 100 milliseconds"),
            "{m}"
        );
        let m = err(Language::Python, &[("lease", n(0.05))]);
        assert!(
            m.contains("lease 0.05: too short, expected at least 0.1 seconds"),
            "{m}"
        );
        let m = err(Language::Python, &[("poll_timeout", n(1e308))]);
        assert!(
            m.contains("poll_timeout 1e308: expected a number of seconds from 0 to"),
            "{m}"
        );
        let m = err(Language::Node, &[("pollTimeoutMs", n(-5.0))]);
        assert!(
            m.contains("pollTimeoutMs -5: expected a number of milliseconds"),
            "{m}"
        );
        let m = err(Language::Node, &[("workerId", t(""))]);
        assert_eq!(m, "workerId is empty: expected a non-empty string");
        let m = err(Language::Node, &[("onFailure", t("retry"))]);
        assert!(m.starts_with("onFailure: failure policy 'retry'"), "{m}");
        let m = err(Language::Python, &[("mode", t("exactly"))]);
        assert!(m.starts_with("mode: pipeline mode 'exactly'"), "{m}");
        let m = err(Language::Python, &[("key", t("header:"))]);
        assert!(m.starts_with("key: key strategy 'header:'"), "{m}");
    }

    #[test]
    fn inbox_settings_follow_each_languages_spelling() {
        let c = inbox_config(
            Language::Node,
            [
                ("backoffMs".to_string(), n(250.0)),
                ("brokerCommitIntervalMs".to_string(), n(2000.0)),
                ("maxAttempts".to_string(), n(3.0)),
                ("namespace".to_string(), t("billing")),
            ],
            &["store"],
        )
        .unwrap();
        assert_eq!(c.backoff, Duration::from_millis(250));
        assert_eq!(c.broker_commit_interval, Duration::from_secs(2));
        assert_eq!(c.max_attempts, 3);
        assert_eq!(c.namespace.as_deref(), Some("billing"));
        let c = inbox_config(Language::Python, [("poll_timeout".into(), n(0.5))], &[]).unwrap();
        assert_eq!(c.poll_timeout, Duration::from_millis(500));
        let e = inbox_config(Language::Python, [("lease".into(), n(1.0))], &["store"])
            .unwrap_err()
            .message()
            .to_string();
        assert!(
            e.contains("unknown setting 'lease'")
                && e.contains("backoff, broker_commit_interval, store"),
            "{e}"
        );
        let e = inbox_config(Language::Python, [("max_attempts".into(), n(0.0))], &[]).unwrap_err();
        assert!(
            e.message()
                .starts_with("max_attempts 0: expected a whole number from 1"),
            "{e}"
        );
    }
}
