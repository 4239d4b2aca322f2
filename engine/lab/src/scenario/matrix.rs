//! Matrices and settings: expanding `{var}` over every combination of a matrix, and setting a
//! dotted path (`tasks[0].env.step_latency_s.normal.std`) in the base spec.

use std::collections::BTreeMap;

use serde_json::Value;

use job::spec::{self, JobSpec, SpecErrors};

/// Why [`set_path`] could not set a field.
#[derive(Debug, thiserror::Error)]
pub enum SetPathError {
    #[error("{path}: bad index [{index}")]
    BadIndex {
        path: String,
        index: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("empty path {path:?}")]
    Empty { path: String },
    #[error("{path}: {key:?} is not inside a table")]
    NotInTable { path: String, key: String },
    #[error("{path}: [{index}] is not inside an array")]
    NotInArray { path: String, index: usize },
    #[error("{path}: index {index} out of range (length {len})")]
    OutOfRange {
        path: String,
        index: usize,
        len: usize,
    },
}

/// Why [`build_spec`] could not build a run's spec.
#[derive(Debug, thiserror::Error)]
pub enum BuildSpecError {
    #[error(transparent)]
    Path(#[from] SetPathError),
    #[error(transparent)]
    Invalid(#[from] SpecErrors),
}

/// One step of a dotted path: a table key or an array index.
enum Segment {
    Key(String),
    Index(usize),
}

fn segments(path: &str) -> Result<Vec<Segment>, SetPathError> {
    let mut parts = Vec::new();
    for seg in path.split('.') {
        let (key, rest) = match seg.find('[') {
            Some(i) => (&seg[..i], &seg[i..]),
            None => (seg, ""),
        };
        if !key.is_empty() {
            parts.push(Segment::Key(key.to_string()));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            let n: usize =
                idx.trim_end_matches(']')
                    .parse()
                    .map_err(|source| SetPathError::BadIndex {
                        path: path.to_string(),
                        index: idx.to_string(),
                        source,
                    })?;
            parts.push(Segment::Index(n));
        }
    }
    Ok(parts)
}

fn array_slot<'a>(
    cur: &'a mut Value,
    path: &str,
    index: usize,
) -> Result<&'a mut Value, SetPathError> {
    let arr = cur.as_array_mut().ok_or_else(|| SetPathError::NotInArray {
        path: path.to_string(),
        index,
    })?;
    let len = arr.len();
    arr.get_mut(index).ok_or_else(|| SetPathError::OutOfRange {
        path: path.to_string(),
        index,
        len,
    })
}

fn table<'a>(
    cur: &'a mut Value,
    path: &str,
    key: &str,
) -> Result<&'a mut serde_json::Map<String, Value>, SetPathError> {
    cur.as_object_mut().ok_or_else(|| SetPathError::NotInTable {
        path: path.to_string(),
        key: key.to_string(),
    })
}

/// Sets `path` (`a.b[2].c`) in `v` to `new`, creating tables on the way.
pub fn set_path(v: &mut Value, path: &str, new: Value) -> Result<(), SetPathError> {
    let mut parts = segments(path)?;
    let last = parts.pop().ok_or_else(|| SetPathError::Empty {
        path: path.to_string(),
    })?;
    let mut cur = v;
    for p in parts {
        cur = match p {
            Segment::Key(k) => table(cur, path, &k)?
                .entry(k)
                .or_insert_with(|| Value::Object(Default::default())),
            Segment::Index(i) => array_slot(cur, path, i)?,
        };
    }
    match last {
        Segment::Key(k) => {
            table(cur, path, &k)?.insert(k, new);
        }
        Segment::Index(i) => *array_slot(cur, path, i)? = new,
    }
    Ok(())
}

/// Every combination of a matrix, in a stable order (variables sorted by name, values in the
/// given order, the last variable fastest).
pub(super) fn combinations(m: &BTreeMap<String, Vec<Value>>) -> Vec<BTreeMap<String, Value>> {
    let mut out = vec![BTreeMap::new()];
    for (k, vals) in m {
        let mut next = Vec::new();
        for base in &out {
            for v in vals {
                let mut b = base.clone();
                b.insert(k.clone(), v.clone());
                next.push(b);
            }
        }
        out = next;
    }
    out
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Substitutes `{var}` in strings: a string that is exactly `{var}` becomes the value itself.
pub(super) fn substitute(v: &Value, vars: &BTreeMap<String, Value>) -> Value {
    match v {
        Value::String(s) => {
            for (k, val) in vars {
                if s == &format!("{{{k}}}") {
                    return val.clone();
                }
            }
            let mut t = s.clone();
            for (k, val) in vars {
                t = t.replace(&format!("{{{k}}}"), &show(val));
            }
            Value::String(t)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| substitute(x, vars)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| {
                    (
                        substitute(&Value::String(k.clone()), vars)
                            .as_str()
                            .unwrap_or(k)
                            .to_string(),
                        substitute(x, vars),
                    )
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A string with `{var}` substituted.
pub(super) fn sub_str(s: &str, vars: &BTreeMap<String, Value>) -> String {
    show(&substitute(&Value::String(s.to_string()), vars))
}

/// Builds a run's spec from the base and its settings, with errors naming the field.
pub fn build_spec(base: &Value, set: &BTreeMap<String, Value>) -> Result<JobSpec, BuildSpecError> {
    let mut v = base.clone();
    for (path, val) in set {
        set_path(&mut v, path, val.clone())?;
    }
    Ok(spec::from_value(v)?)
}
