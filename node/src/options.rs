//! Options objects checked before napi reads them: napi's `#[napi(object)]` conversion drops a
//! misspelled key without a word (a consumer's `ackWaitMs` was ignored) and names a wrong type
//! in Rust's words (`into rust type u32`). [`Checked`] refuses both with a config error naming
//! the option as the user wrote it and what was expected, then lets napi convert.

use napi::bindgen_prelude::{FromNapiValue, Object, TypeName, Unknown};
use napi::{sys, ValueType};
use onceflow::Error;

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
    /// An object of string values (raw client options).
    StringMap,
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
        Expect::StringMap if t != ValueType::Object => Err(wrong("an object of strings")),
        Expect::StringMap => {
            let map = obj.get::<Object>(key)?.expect("present");
            for name in Object::keys(&map)? {
                let t = map
                    .get::<Unknown>(&name)?
                    .map(|v| v.get_type())
                    .transpose()?
                    .unwrap_or(ValueType::Undefined);
                if t != ValueType::String {
                    return Err(config(format!(
                        "{what} {key}['{}']: expected a string, got {} (raw client options are \
                         strings, as in the native client's configuration)",
                        onceflow::shown(&name),
                        type_name(t)
                    )));
                }
            }
            Ok(())
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
