//! Numeric settings declared once. A [`Knob`] holds a field's bounds, default and meaning;
//! validation ([`Knob::check`]), the values a job runs with ([`Knob::or_default`]), the
//! OpenAPI schema and the job-spec manual (both through [`super::catalogue`]) all read it, so
//! none of them can drift.

use std::fmt::Display;

use super::Problems;

/// A number a knob can hold.
pub trait KnobValue: Copy + PartialOrd + Display {
    fn as_f64(self) -> f64;
    /// Whole numbers are written `1..=65536`; seconds `(0, 2592000]`.
    const WHOLE: bool;
}

macro_rules! whole {
    ($($t:ty),*) => {$(
        impl KnobValue for $t {
            fn as_f64(self) -> f64 {
                self as f64
            }
            const WHOLE: bool = true;
        }
    )*};
}
whole!(u32, u64, usize);

impl KnobValue for f64 {
    fn as_f64(self) -> f64 {
        self
    }
    const WHOLE: bool = false;
}

/// One numeric field of a spec section.
#[derive(Clone, Copy, Debug)]
pub struct Knob<T> {
    /// The section's schema name (`RolloutSpec`) and the field's name in it.
    pub schema: &'static str,
    pub section: &'static str,
    pub name: &'static str,
    pub min: T,
    /// The minimum itself is refused (a timeout must be positive).
    pub exclusive_min: bool,
    pub max: T,
    /// The value a spec that leaves the field out gets, when it is a constant.
    pub default: Option<T>,
    /// The unit of a fractional value: `s` (seconds) or none (a plain number).
    pub unit: &'static str,
    /// How the default is derived when it is not a constant (or what it depends on).
    pub default_note: &'static str,
    pub doc: &'static str,
}

/// A knob of `schema`'s field `name` (at `section.name` in a spec), with no unit.
pub const fn knob<T: Copy>(
    (schema, section, name): (&'static str, &'static str, &'static str),
    (min, exclusive_min, max): (T, bool, T),
    default: Option<T>,
    default_note: &'static str,
    doc: &'static str,
) -> Knob<T> {
    Knob {
        schema,
        section,
        name,
        min,
        exclusive_min,
        max,
        default,
        unit: "",
        default_note,
        doc,
    }
}

impl<T: KnobValue> Knob<T> {
    /// The field's dotted path (`rollout.batch_size`).
    pub fn field(&self) -> String {
        format!("{}.{}", self.section, self.name)
    }

    /// The allowed range as the messages and the manual write it.
    pub fn range(&self) -> String {
        if T::WHOLE && !self.exclusive_min {
            format!("{}..={}", self.min, self.max)
        } else {
            let open = if self.exclusive_min { '(' } else { '[' };
            format!("{open}{}, {}]", self.min, self.max)
        }
    }

    /// Whether `v` is allowed.
    pub fn allows(&self, v: T) -> bool {
        let low = if self.exclusive_min {
            v > self.min
        } else {
            v >= self.min
        };
        // NaN is allowed by neither comparison.
        low && v <= self.max
    }

    /// Adds a problem when the spec sets the field outside its range.
    pub fn check(&self, v: Option<T>, problems: &mut Problems) {
        self.check_at(self.section, v, problems);
    }

    /// [`Knob::check`] for a field of a list item (`at`: `tasks[2]`).
    pub fn check_at(&self, at: &str, v: Option<T>, problems: &mut Problems) {
        if let Some(v) = v
            && !self.allows(v)
        {
            let what = match (T::WHOLE, self.unit) {
                (true, _) => "must be in",
                (false, "s") => "must be a number of seconds in",
                (false, _) => "must be a number in",
            };
            let field = format!("{at}.{}", self.name);
            problems.push(field, format!("{what} {}, got {v}", self.range()));
        }
    }

    /// The spec's value, else the constant default. A knob without one panics: its default
    /// is derived by the caller (a programming error, caught by the tests of `knobs()`).
    pub fn or_default(&self, v: Option<T>) -> T {
        v.or(self.default)
            .unwrap_or_else(|| panic!("{} has no constant default", self.field()))
    }

    /// The knob with its value type erased (for the schema and the manual).
    pub fn info(&'static self) -> KnobInfo {
        KnobInfo {
            schema: self.schema,
            name: self.name,
            field: self.field(),
            min: self.min.as_f64(),
            exclusive_min: self.exclusive_min,
            max: self.max.as_f64(),
            default: self.default.map(|d| d.to_string()),
            default_json: self.default.map(|d| {
                if T::WHOLE {
                    serde_json::json!(d.as_f64() as u64)
                } else {
                    serde_json::json!(d.as_f64())
                }
            }),
            unit: self.unit,
            default_note: self.default_note,
            range: self.range(),
            doc: self.doc,
        }
    }
}

/// A knob as the schema and the manual see it.
#[derive(Clone, Debug)]
pub struct KnobInfo {
    pub schema: &'static str,
    pub name: &'static str,
    pub field: String,
    pub min: f64,
    pub exclusive_min: bool,
    pub max: f64,
    pub default: Option<String>,
    pub default_json: Option<serde_json::Value>,
    pub unit: &'static str,
    pub default_note: &'static str,
    pub range: String,
    pub doc: &'static str,
}

#[cfg(test)]
mod tests;
