//! Options objects checked before napi reads them: napi's `#[napi(object)]` conversion drops a
//! misspelled key without a word (a consumer's `ackWaitMs` was ignored) and names a wrong type
//! in Rust's words (`into rust type u32`). [`Checked`] refuses both with a config error naming
//! the option as the user wrote it and what was expected, then lets napi convert.

use std::collections::BTreeMap;

use napi::bindgen_prelude::{FromNapiValue, JsValue, Object, ToNapiValue, TypeName, Unknown};
use napi::{sys, ValueType};
use onceflow::Error;
use onceflow_bindings::raw_options::raw_options;
use onceflow_bindings::settings::{Language, Value};

use crate::js_err;

/// What an option's value must be.
#[derive(Debug, Clone, Copy)]
pub enum Expect {
    /// A string.
    String,
    /// Any finite number from 0 (durations, sizes).
    Number,
    /// A whole number from 0 to 2^32 - 1 (counts).
    Count,
    /// `true` or `false`.
    Boolean,
    /// Raw client options: an object of string, boolean or number values ([`RawOptions`]
    /// checks the values as it reads them).
    RawOptions,
}

/// The keys an options object takes, for [`Checked`].
pub trait Known {
    /// The options' name in errors, e.g. `consumer option`.
    const WHAT: &'static str;
    /// Every key napi reads (its camelCase field names) with what its value must be.
    const KEYS: &'static [(&'static str, Expect)];
}

/// `T` read from an options object whose keys and value types were checked first.
pub struct Checked<T>(pub T);

fn config(message: String) -> napi::Error {
    js_err(&Error::config(message))
}

/// JavaScript's `typeof` name of a value of type `t` (`null` for null).
pub(crate) fn type_name(t: ValueType) -> &'static str {
    match t {
        ValueType::Undefined => "undefined",
        ValueType::Null => "null",
        ValueType::Boolean => "boolean",
        ValueType::Number => "number",
        ValueType::String => "string",
        ValueType::Symbol => "symbol",
        ValueType::Function => "function",
        ValueType::BigInt => "bigint",
        _ => "object",
    }
}

fn check_value(what: &str, key: &str, expect: Expect, obj: &Object) -> napi::Result<()> {
    let Some(value) = obj.get::<Unknown>(key)? else {
        return Ok(());
    };
    let t = value.get_type()?;
    if matches!(t, ValueType::Undefined | ValueType::Null) {
        return Ok(());
    }
    let wrong = |expected: &str| {
        config(format!(
            "{what} {key}: expected {expected}, got {}",
            type_name(t)
        ))
    };
    match expect {
        Expect::String if t != ValueType::String => Err(wrong("a string")),
        Expect::Boolean if t != ValueType::Boolean => Err(wrong("a boolean")),
        Expect::Number | Expect::Count if t != ValueType::Number => Err(wrong("a number")),
        Expect::Number => {
            let n = obj.get::<f64>(key)?.unwrap_or_default();
            if !(n >= 0.0 && n.is_finite()) {
                return Err(config(format!(
                    "{what} {key} {n}: expected a finite number from 0"
                )));
            }
            Ok(())
        }
        Expect::Count => {
            let n = obj.get::<f64>(key)?.unwrap_or_default();
            if n.fract() != 0.0 || !(0.0..=u32::MAX as f64).contains(&n) {
                return Err(config(format!(
                    "{what} {key} {n}: expected a whole number from 0 to {}",
                    u32::MAX
                )));
            }
            Ok(())
        }
        Expect::RawOptions if t != ValueType::Object || value.is_array()? => {
            Err(wrong("an object of strings, booleans or numbers"))
        }
        // Checked here, where an error is ours alone: napi appends " on Struct.field" to an
        // error of a field's own conversion.
        Expect::RawOptions => {
            read_raw_options(&obj.get::<Object>(key)?.expect("present")).map(drop)
        }
        _ => Ok(()),
    }
}

impl<T: FromNapiValue + Known> FromNapiValue for Checked<T> {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        // SAFETY: `env` and `value` are napi's own, handed through unchanged.
        let unknown = unsafe { Unknown::from_napi_value(env, value)? };
        let t = unknown.get_type()?;
        if t != ValueType::Object {
            return Err(config(format!(
                "{}s: expected an object, got {}",
                T::WHAT,
                type_name(t)
            )));
        }
        // SAFETY: as above; the value is an object.
        let obj = unsafe { Object::from_napi_value(env, value)? };
        for key in Object::keys(&obj)? {
            match T::KEYS.iter().find(|(k, _)| *k == key) {
                Some((_, expect)) => check_value(T::WHAT, &key, *expect, &obj)?,
                None => {
                    let names: Vec<&str> = T::KEYS.iter().map(|(k, _)| *k).collect();
                    return Err(config(format!(
                        "unknown {} '{}': expected one of {}",
                        T::WHAT,
                        onceflow::shown(&key),
                        names.join(", ")
                    )));
                }
            }
        }
        // SAFETY: as above.
        Ok(Checked(unsafe { T::from_napi_value(env, value)? }))
    }
}

impl<T: TypeName> TypeName for Checked<T> {
    fn type_name() -> &'static str {
        T::type_name()
    }

    fn value_type() -> ValueType {
        ValueType::Object
    }
}

/// The TypeScript type of raw client options.
pub const RAW_OPTIONS_TS: &str = "Record<string, string | boolean | number>";

/// Raw client options (`key=value` for the native client), read from an object whose values
/// are strings, booleans or numbers by the bindings' one rule
/// ([`onceflow_bindings::raw_options`]): `false` → `"false"`, `500` → `"500"`. A value of
/// another type (`undefined`, `null`, an object) is an `ONCEFLOW_CONFIG` error naming the key
/// and its type, NaN or Infinity one naming the key; never the value (it may be a password).
#[derive(Debug, Default)]
pub struct RawOptions(pub BTreeMap<String, String>);

impl FromNapiValue for RawOptions {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        // SAFETY: `env` and `value` are napi's own, handed through unchanged.
        let unknown = unsafe { Unknown::from_napi_value(env, value)? };
        let t = unknown.get_type()?;
        if t != ValueType::Object || unknown.is_array()? {
            return Err(config(format!(
                "options: expected an object of strings, booleans or numbers, got {}",
                if t == ValueType::Object {
                    "array"
                } else {
                    type_name(t)
                }
            )));
        }
        // SAFETY: as above; the value is an object.
        let obj = unsafe { Object::from_napi_value(env, value)? };
        read_raw_options(&obj).map(RawOptions)
    }
}

/// The raw options of the object `obj` by the bindings' rule.
fn read_raw_options(obj: &Object) -> napi::Result<BTreeMap<String, String>> {
    let mut entries = Vec::new();
    for name in Object::keys(obj)? {
        let value = match obj.get::<Unknown>(&name)? {
            None => Value::Absent,
            Some(v) => match v.get_type()? {
                ValueType::Undefined => Value::Absent,
                ValueType::Boolean => Value::Bool(obj.get::<bool>(&name)?.unwrap_or_default()),
                ValueType::Number => Value::Number(obj.get::<f64>(&name)?.unwrap_or_default()),
                ValueType::String => Value::Text(obj.get::<String>(&name)?.unwrap_or_default()),
                other => Value::Other(type_name(other).into()),
            },
        };
        entries.push((name, value));
    }
    raw_options(Language::Node, entries).map_err(|e| crate::js_err(&e))
}

impl ToNapiValue for RawOptions {
    unsafe fn to_napi_value(env: sys::napi_env, val: Self) -> napi::Result<sys::napi_value> {
        // SAFETY: `env` is napi's own.
        unsafe { BTreeMap::to_napi_value(env, val.0) }
    }
}

impl TypeName for RawOptions {
    fn type_name() -> &'static str {
        RAW_OPTIONS_TS
    }

    fn value_type() -> ValueType {
        ValueType::Object
    }
}
