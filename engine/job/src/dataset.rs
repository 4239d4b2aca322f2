//! Prompt datasets: rows from JSONL or parquet files (verl's layout works with no key
//! settings), their prompts in chat form, and the order groups draw them in.
//!
//! A task with a dataset draws one row per group. Groups take dataset *positions* 0, 1, 2, …;
//! position `k` is row `perm(epoch)[k mod n]` of epoch `k div n`, where `perm(epoch)` is a
//! permutation seeded by the dataset's shuffle seed and the epoch (the identity without
//! shuffling). The scheduler's cursor keeps the next position and the positions admitted but
//! not yet used (see `job::scheduler`), so a resumed job neither repeats nor skips a row.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use serde_json::Value;

use crate::spec::{DatasetFormat, DatasetSpec};

/// Keys tried for the prompt when `prompt_key` is not set (verl, then common layouts).
pub const PROMPT_KEYS: [&str; 4] = ["prompt", "question", "problem", "input"];
/// Keys tried for the answer when `answer_key` is not set.
pub const ANSWER_KEYS: [&str; 4] = ["reward_model.ground_truth", "answer", "solution", "label"];

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read parquet file {path}")]
    Parquet {
        path: String,
        #[source]
        source: parquet::errors::ParquetError,
    },
    #[error("{path} line {line} is not a JSON object")]
    Json {
        path: String,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} row {row}: {message}")]
    Row {
        path: String,
        row: usize,
        message: String,
    },
    #[error("{path}: no row is left after the split and filter")]
    Empty { path: String },
    #[error("{path}: cannot tell the format from the name; set format = \"jsonl\" or \"parquet\"")]
    UnknownFormat { path: String },
}

/// One usable row.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// `[{role, content}]`, the dataset's system prompt first when it has one.
    pub messages: Vec<(String, String)>,
    pub answer: Value,
    /// The row as stored (handed to protocol-v2 environments).
    pub raw: Value,
}

/// A loaded dataset and its drawing order.
#[derive(Debug)]
pub struct Dataset {
    pub rows: Vec<Row>,
    pub epochs: u64,
    shuffle: Option<u64>,
    perms: Mutex<HashMap<u64, Arc<Vec<u32>>>>,
}

/// The value at a dotted path (`reward_model.ground_truth`, `messages.0.content`).
pub fn lookup<'a>(row: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(row, |v, k| match v {
        Value::Object(m) => m.get(k),
        Value::Array(a) => k.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// The format of `path`: as set, else from its extension.
pub fn format_of(path: &str, format: Option<DatasetFormat>) -> Option<DatasetFormat> {
    format.or_else(|| {
        let lower = path.to_ascii_lowercase();
        if lower.ends_with(".parquet") {
            Some(DatasetFormat::Parquet)
        } else if lower.ends_with(".jsonl")
            || lower.ends_with(".json")
            || lower.ends_with(".ndjson")
        {
            Some(DatasetFormat::Jsonl)
        } else {
            None
        }
    })
}

/// The longest line of a JSONL dataset: 16 MiB.
pub const MAX_ROW_BYTES: u64 = 16 << 20;

/// Reads the raw rows of a file (at most `limit`).
pub fn read_rows(
    path: &str,
    format: Option<DatasetFormat>,
    limit: Option<usize>,
) -> Result<Vec<Value>, DatasetError> {
    let limit = limit.unwrap_or(usize::MAX);
    match format_of(path, format) {
        None => Err(DatasetError::UnknownFormat { path: path.into() }),
        Some(DatasetFormat::Jsonl) => {
            use std::io::{BufRead, Read};
            let read_err = |source| DatasetError::Read {
                path: path.into(),
                source,
            };
            // Line by line, each line at most MAX_ROW_BYTES: checking the first row reads the
            // first line, not the file (a 1 GiB file without a newline used to be read whole).
            let file = std::fs::File::open(path).map_err(read_err)?;
            let mut reader =
                std::io::BufReader::new(file).take(infra::files::FileKind::Dataset.cap());
            let mut out = Vec::new();
            let mut buf = Vec::new();
            let mut i = 0;
            while out.len() < limit {
                buf.clear();
                let n = (&mut reader)
                    .take(MAX_ROW_BYTES + 1)
                    .read_until(b'\n', &mut buf)
                    .map_err(read_err)?;
                if n == 0 {
                    break;
                }
                i += 1;
                let i = i - 1;
                if buf.len() as u64 > MAX_ROW_BYTES {
                    return Err(DatasetError::Row {
                        path: path.into(),
                        row: out.len(),
                        message: format!("line {} is over {MAX_ROW_BYTES} bytes", i + 1),
                    });
                }
                let line = String::from_utf8_lossy(&buf);
                if line.trim().is_empty() {
                    continue;
                }
                let v: Value =
                    serde_json::from_str(&line).map_err(|source| DatasetError::Json {
                        path: path.into(),
                        line: i + 1,
                        source,
                    })?;
                if !v.is_object() {
                    return Err(DatasetError::Row {
                        path: path.into(),
                        row: out.len(),
                        message: format!("line {} is not a JSON object", i + 1),
                    });
                }
                out.push(v);
            }
            Ok(out)
        }
        Some(DatasetFormat::Parquet) => {
            use parquet::file::reader::SerializedFileReader;
            let err = |source| DatasetError::Parquet {
                path: path.into(),
                source,
            };
            let file = std::fs::File::open(path).map_err(|source| DatasetError::Read {
                path: path.into(),
                source,
            })?;
            let reader = SerializedFileReader::new(file).map_err(err)?;
            let mut out = Vec::new();
            for row in reader {
                if out.len() >= limit {
                    break;
                }
                out.push(row.map_err(err)?.to_json_value());
            }
            Ok(out)
        }
    }
}

/// The first of `keys` present in `row` (or the one set).
fn pick<'a>(row: &'a Value, set: Option<&str>, keys: &[&str]) -> Option<(&'a Value, String)> {
    match set {
        Some(k) => lookup(row, k).map(|v| (v, k.to_string())),
        None => keys
            .iter()
            .find_map(|k| lookup(row, k).map(|v| (v, k.to_string()))),
    }
}

/// A row's prompt in chat form: a string is one user message; a list of `{role, content}`
/// is kept (a JSON-encoded list, as some exports store it, is decoded).
pub fn messages_of(prompt: &Value) -> Result<Vec<(String, String)>, String> {
    match prompt {
        Value::String(s) => {
            if s.trim_start().starts_with("[{")
                && let Ok(v @ Value::Array(_)) = serde_json::from_str::<Value>(s)
                && let Ok(m) = messages_of(&v)
            {
                return Ok(m);
            }
            Ok(vec![("user".into(), s.clone())])
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = m.get("role").and_then(Value::as_str);
                let content = m.get("content").and_then(Value::as_str);
                match (role, content) {
                    (Some(r), Some(c)) => Ok((r.to_string(), c.to_string())),
                    _ => Err(format!(
                        "prompt message {i} needs string `role` and `content`"
                    )),
                }
            })
            .collect(),
        other => {
            let shown: String = other.to_string().chars().take(120).collect();
            Err(format!(
                "the prompt is neither text nor a list of {{role, content}} messages: {shown}"
            ))
        }
    }
}

/// Whether a row belongs to `split` (its `split` or `extra_info.split` field).
fn in_split(row: &Value, split: &str) -> bool {
    ["split", "extra_info.split"]
        .iter()
        .any(|k| lookup(row, k).and_then(Value::as_str) == Some(split))
}

/// Whether a row passes the filter: each dotted key equals the value (or one of a list).
fn passes(row: &Value, filter: &std::collections::BTreeMap<String, Value>) -> bool {
    filter.iter().all(|(k, want)| {
        let got = lookup(row, k);
        match want {
            Value::Array(options) => got.is_some_and(|g| options.contains(g)),
            w => got == Some(w),
        }
    })
}

/// Turns one raw row into a usable one (`i`: its place among the kept rows, for errors).
pub fn row_of(spec: &DatasetSpec, raw: Value, i: usize) -> Result<Row, DatasetError> {
    let bad = |message: String| DatasetError::Row {
        path: spec.path.clone(),
        row: i,
        message,
    };
    let (prompt, key) = pick(&raw, spec.prompt_key.as_deref(), &PROMPT_KEYS).ok_or_else(|| {
        bad(match &spec.prompt_key {
            Some(k) => format!("no prompt at `{k}` (prompt_key)"),
            None => {
                format!("no prompt under any of {PROMPT_KEYS:?}; set prompt_key (a dotted path)")
            }
        })
    })?;
    let mut messages = messages_of(prompt).map_err(|m| bad(format!("`{key}`: {m}")))?;
    if let Some(s) = &spec.system_prompt
        && !messages.iter().any(|(r, _)| r == "system")
    {
        messages.insert(0, ("system".into(), s.clone()));
    }
    if !messages.iter().any(|(r, _)| r == "user") {
        return Err(bad(format!("the prompt at `{key}` has no user message")));
    }
    let answer = match pick(&raw, spec.answer_key.as_deref(), &ANSWER_KEYS) {
        Some((v, _)) => v.clone(),
        None if spec.answer_key.is_some() => {
            return Err(bad(format!(
                "no answer at `{}` (answer_key)",
                spec.answer_key.as_deref().unwrap_or_default()
            )));
        }
        None => Value::Null,
    };
    Ok(Row {
        messages,
        answer,
        raw,
    })
}

impl Dataset {
    /// Loads a task's dataset; `job_seed` seeds the shuffle unless the spec sets one.
    pub fn load(spec: &DatasetSpec, job_seed: u64) -> Result<Self, DatasetError> {
        let raw = read_rows(&spec.path, spec.format, None)?;
        Self::from_raw(spec, raw, job_seed)
    }

    /// A dataset from rows already read.
    pub fn from_raw(
        spec: &DatasetSpec,
        raw: Vec<Value>,
        job_seed: u64,
    ) -> Result<Self, DatasetError> {
        let mut rows = Vec::new();
        for r in raw {
            if spec.split.as_deref().is_some_and(|s| !in_split(&r, s)) || !passes(&r, &spec.filter)
            {
                continue;
            }
            if spec.limit.is_some_and(|l| rows.len() >= l) {
                break;
            }
            let i = rows.len();
            rows.push(row_of(spec, r, i)?);
        }
        if rows.is_empty() {
            return Err(DatasetError::Empty {
                path: spec.path.clone(),
            });
        }
        Ok(Self {
            rows,
            epochs: u64::from(spec.epochs.max(1)),
            shuffle: spec
                .shuffle
                .then(|| spec.seed.unwrap_or(job_seed ^ 0x0da7_a5e7)),
            perms: Mutex::new(HashMap::new()),
        })
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Positions in all epochs.
    pub fn positions(&self) -> u64 {
        self.rows.len() as u64 * self.epochs
    }

    /// The (epoch, row index) of a position.
    pub fn locate(&self, position: u64) -> (u64, usize) {
        let n = self.rows.len().max(1) as u64;
        let (epoch, slot) = (position / n, (position % n) as usize);
        let Some(seed) = self.shuffle else {
            return (epoch, slot);
        };
        let perm = {
            let mut perms = self.perms.lock().unwrap_or_else(|p| p.into_inner());
            if perms.len() > 4 && !perms.contains_key(&epoch) {
                perms.clear();
            }
            perms
                .entry(epoch)
                .or_insert_with(|| {
                    let mut p: Vec<u32> = (0..n as u32).collect();
                    let mut rng = SmallRng::seed_from_u64(
                        seed ^ epoch.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    );
                    p.shuffle(&mut rng);
                    Arc::new(p)
                })
                .clone()
        };
        (epoch, perm[slot] as usize)
    }

    /// The record an environment gets for a position (see `actors::env::Record`).
    pub fn record(&self, position: u64) -> Value {
        let (epoch, index) = self.locate(position);
        let r = &self.rows[index];
        serde_json::json!({
            "index": index,
            "epoch": epoch,
            "position": position,
            "messages": r.messages.iter().map(|(role, content)| serde_json::json!({"role": role, "content": content})).collect::<Vec<_>>(),
            "answer": r.answer,
            "row": r.raw,
        })
    }
}

/// Checks a dataset spec cheaply (for the spec's validation): the file exists, its format is
/// known, and its first row has a prompt (and the answer when `answer_key` is set).
pub fn check_first_row(spec: &DatasetSpec) -> Result<(), DatasetError> {
    if !Path::new(&spec.path).is_file() {
        return Err(DatasetError::Read {
            path: spec.path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    let rows = read_rows(&spec.path, spec.format, Some(1))?;
    match rows.into_iter().next() {
        None => Err(DatasetError::Empty {
            path: spec.path.clone(),
        }),
        Some(r) => row_of(spec, r, 0).map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(path: &Path) -> DatasetSpec {
        DatasetSpec {
            seed: Some(7),
            ..DatasetSpec::at(&path.to_string_lossy())
        }
    }

    /// A parquet file of `n` rows written with the parquet crate's own writer (snappy):
    /// `data_source`, `prompt` (text), `reward_model.ground_truth` (a nested group).
    fn write_parquet(path: &Path, n: usize) {
        use parquet::basic::Compression;
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let schema = parquet::schema::parser::parse_message_type(
            "message row {
                REQUIRED BYTE_ARRAY data_source (UTF8);
                REQUIRED BYTE_ARRAY prompt (UTF8);
                REQUIRED GROUP reward_model { REQUIRED BYTE_ARRAY ground_truth (UTF8); }
            }",
        )
        .unwrap();
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let columns: [Vec<String>; 3] = [
            (0..n)
                .map(|i| if i % 3 == 0 { "b" } else { "a" }.to_string())
                .collect(),
            (0..n).map(|i| format!("What is {i}+{i}?")).collect(),
            (0..n).map(|i| (2 * i).to_string()).collect(),
        ];
        for col in columns {
            let mut c = rg.next_column().unwrap().unwrap();
            let values: Vec<ByteArray> = col.iter().map(|s| ByteArray::from(s.as_str())).collect();
            c.typed::<ByteArrayType>()
                .write_batch(&values, None, None)
                .unwrap();
            c.close().unwrap();
        }
        rg.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn parquet_rows_from_a_rust_writer_with_nested_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.parquet");
        write_parquet(&path, 10);
        let mut s = spec(&path);
        s.shuffle = false;
        let d = Dataset::load(&s, 0).unwrap();
        assert_eq!(d.len(), 10);
        // The defaults find `prompt` and `reward_model.ground_truth`.
        assert_eq!(
            d.rows[3].messages,
            vec![("user".into(), "What is 3+3?".into())]
        );
        assert_eq!(d.rows[3].answer, Value::from("6"));
        assert_eq!(d.rows[3].raw["data_source"], "b");
        // A filter on a column, a limit and a system prompt.
        s.filter.insert("data_source".into(), Value::from("a"));
        s.limit = Some(4);
        s.system_prompt = Some("Answer with a number.".into());
        let d = Dataset::load(&s, 0).unwrap();
        assert_eq!(d.len(), 4);
        assert_eq!(
            d.rows[0].messages[0],
            ("system".into(), "Answer with a number.".into())
        );
        assert_eq!(d.rows[0].messages[1].1, "What is 1+1?");
        assert_eq!(d.rows[2].messages[1].1, "What is 4+4?");
        // A key that is not there is named.
        s.answer_key = Some("reward_model.missing".into());
        let e = Dataset::load(&s, 0).unwrap_err().to_string();
        assert!(
            e.contains("reward_model.missing") && e.contains("row 0"),
            "{e}"
        );
        assert!(check_first_row(&s).is_err());
    }

    #[test]
    fn jsonl_rows_with_chat_prompts_splits_and_dotted_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rows.jsonl");
        let rows = [
            r#"{"q": {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]}, "gt": [5], "extra_info": {"split": "train"}}"#,
            r#"{"q": {"messages": [{"role": "user", "content": "U2"}]}, "gt": [6], "extra_info": {"split": "test"}}"#,
            "",
            r#"{"q": {"messages": "[{\"role\": \"user\", \"content\": \"U3\"}]"}, "gt": [7], "split": "train"}"#,
        ];
        std::fs::write(&path, rows.join("\n")).unwrap();
        let mut s = spec(&path);
        s.prompt_key = Some("q.messages".into());
        s.answer_key = Some("gt.0".into());
        s.system_prompt = Some("SP".into());
        s.split = Some("train".into());
        s.shuffle = false;
        let d = Dataset::load(&s, 0).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(
            d.rows[0].messages,
            vec![("system".into(), "S".into()), ("user".into(), "U1".into())]
        );
        assert_eq!(d.rows[0].answer, Value::from(5));
        // A list stored as JSON text is decoded; a row without a system message gets the
        // system prompt.
        assert_eq!(
            d.rows[1].messages,
            vec![("system".into(), "SP".into()), ("user".into(), "U3".into())]
        );
        let r = d.record(1);
        assert_eq!(r["messages"][1]["content"], "U3");
        assert_eq!(r["answer"], 7);
        assert_eq!(r["index"], 1);
        // A broken line is named by its number.
        std::fs::write(&path, "{\"prompt\": \"a\"}\n{broken\n").unwrap();
        let e = infra::error_chain(&Dataset::load(&spec(&path), 0).unwrap_err());
        assert!(e.contains("line 2"), "{e}");
        // A prompt that is neither text nor messages.
        std::fs::write(&path, "{\"prompt\": 3}\n").unwrap();
        let e = Dataset::load(&spec(&path), 0).unwrap_err().to_string();
        assert!(e.contains("neither text nor"), "{e}");
        // No row left.
        std::fs::write(&path, "{\"prompt\": \"a\", \"split\": \"test\"}\n").unwrap();
        let mut s = spec(&path);
        s.split = Some("train".into());
        assert!(matches!(
            Dataset::load(&s, 0),
            Err(DatasetError::Empty { .. })
        ));
        let mut s = spec(&dir.path().join("rows.csv"));
        s.path = dir.path().join("rows.csv").to_string_lossy().into_owned();
        std::fs::write(&s.path, "a,b").unwrap();
        assert!(matches!(
            check_first_row(&s),
            Err(DatasetError::UnknownFormat { .. })
        ));
    }

    #[test]
    fn every_row_once_per_epoch_in_a_seeded_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.parquet");
        write_parquet(&path, 17);
        let mut s = spec(&path);
        s.epochs = 3;
        let d = Dataset::load(&s, 0).unwrap();
        assert_eq!(d.positions(), 51);
        let order = |d: &Dataset| -> Vec<(u64, usize)> { (0..51).map(|k| d.locate(k)).collect() };
        let a = order(&d);
        for e in 0..3u64 {
            let mut rows: Vec<usize> = a.iter().filter(|(ep, _)| *ep == e).map(|r| r.1).collect();
            let epoch_order = rows.clone();
            rows.sort_unstable();
            assert_eq!(
                rows,
                (0..17).collect::<Vec<_>>(),
                "epoch {e} uses every row once"
            );
            assert_ne!(
                epoch_order,
                (0..17).collect::<Vec<_>>(),
                "epoch {e} is shuffled"
            );
        }
        // Each epoch has its own order; the same seed gives the same order, another seed
        // another one.
        let epoch = |e: u64| -> Vec<usize> { a.iter().filter(|r| r.0 == e).map(|r| r.1).collect() };
        assert_ne!(epoch(0), epoch(1));
        assert_eq!(order(&Dataset::load(&s, 0).unwrap()), a);
        s.seed = Some(8);
        assert_ne!(order(&Dataset::load(&s, 0).unwrap()), a);
        // Looked up out of order (a re-issued position), the answer is the same.
        assert_eq!(d.locate(3), a[3]);
        assert_eq!(d.locate(40), a[40]);
        assert_eq!(d.locate(3), a[3]);
        // Without shuffling: the file's order.
        s.shuffle = false;
        let d = Dataset::load(&s, 0).unwrap();
        assert_eq!(d.locate(18), (1, 1));
    }
}
