//! A job's input files, staged at submission: each dataset is opened once under the path
//! policy ([`infra::files`]) and copied through that descriptor into the service's data
//! directory, named by its content's SHA-256. The stored spec names the copy, so the job
//! (and every resumed run of it) reads what was checked at submit: a dataset replaced or
//! turned into a symlink while its job waits in the queue changes nothing, and the
//! original may be moved or deleted.
//!
//! Copies are shared between jobs with the same content and kept with the data directory.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use infra::files::{FileKind, OpenRefused};

use crate::spec::{FieldError, JobSpec};

/// A staging problem: `policy` when the service's policy refused the file (403), else the
/// file itself is the problem (400).
#[derive(Debug)]
pub struct StageProblem {
    pub error: FieldError,
    pub policy: bool,
}

/// Stages every dataset of `spec` (tasks and evaluation tasks) under `dir`, rewriting its
/// `path` to the copy (and fixing its `format`, which a content-named copy cannot tell by
/// its extension). `allowed` is the policy on a resolved path (a refusal message, or none).
/// Every problem, with its field path; the spec is unchanged where one occurred.
pub fn stage_datasets(
    spec: &mut JobSpec,
    dir: &Path,
    allowed: &dyn Fn(&Path) -> Option<String>,
) -> Vec<StageProblem> {
    let mut problems = Vec::new();
    let mut staged = Vec::new();
    let eval_tasks = spec.eval.as_ref().map_or(0, |e| e.tasks.len());
    let slots: Vec<(String, bool, usize)> = (0..spec.tasks.len())
        .map(|i| (format!("tasks[{i}].dataset"), false, i))
        .chain((0..eval_tasks).map(|i| (format!("eval.tasks[{i}].dataset"), true, i)))
        .collect();
    for (field, eval, i) in slots {
        let task = if eval {
            spec.eval.as_ref().map(|e| &e.tasks[i])
        } else {
            spec.tasks.get(i)
        };
        let Some(d) = task.and_then(|t| t.dataset.as_ref()) else {
            continue;
        };
        if d.path.trim().is_empty() || is_staged(Path::new(&d.path), dir) {
            // Empty: validation's business. Already staged: a resumed or re-submitted spec.
            continue;
        }
        let Some(format) = crate::dataset::format_of(&d.path, d.format) else {
            continue; // reported by the dataset check, with the field
        };
        match stage_one(Path::new(&d.path), format, dir, allowed) {
            Ok(copy) => staged.push((eval, i, copy, format)),
            Err(StageError::Refused(OpenRefused::Policy(why))) => problems.push(StageProblem {
                error: FieldError {
                    field: format!("{field}.path"),
                    message: why,
                },
                policy: true,
            }),
            Err(e) => problems.push(StageProblem {
                error: FieldError {
                    field: format!("{field}.path"),
                    message: infra::error_chain(&e),
                },
                policy: false,
            }),
        }
    }
    if problems.is_empty() {
        for (eval, i, copy, format) in staged {
            let task = if eval {
                spec.eval.as_mut().map(|e| &mut e.tasks[i])
            } else {
                spec.tasks.get_mut(i)
            };
            if let Some(d) = task.and_then(|t| t.dataset.as_mut()) {
                d.path = copy.display().to_string();
                d.format = Some(format);
            }
        }
    }
    problems
}

/// Whether `path` is a copy this staging made: a content-named file directly in `dir`
/// (resolved: `dir/../x` or a symlink into the data directory is not one).
fn is_staged(path: &Path, dir: &Path) -> bool {
    let (Ok(p), Ok(d)) = (std::fs::canonicalize(path), std::fs::canonicalize(dir)) else {
        return false;
    };
    let named = p
        .file_stem()
        .and_then(|s| s.to_str())
        .is_some_and(|s| s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    p.parent() == Some(d.as_path()) && named && p.is_file()
}

/// A problem found in a staged copy, told in terms of the user's own paths (the data
/// directory's layout is not theirs to see): `paths` are (copy, original).
pub fn in_terms_of(mut e: FieldError, paths: &[(String, String)]) -> FieldError {
    for (copy, original) in paths {
        e.message = e.message.replace(copy.as_str(), original);
    }
    e
}

/// A JSONL file's first line is within [`crate::dataset::MAX_ROW_BYTES`]: checked before
/// anything is copied (a large file of one line is refused at once, not copied first).
fn first_line_fits(opened: &infra::files::Opened) -> Result<(), StageError> {
    use std::io::BufRead;
    let mut head = std::io::BufReader::new(&opened.file).take(crate::dataset::MAX_ROW_BYTES + 1);
    let mut line = Vec::new();
    head.read_until(b'\n', &mut line)
        .map_err(|source| StageError::Read { source })?;
    if line.len() as u64 > crate::dataset::MAX_ROW_BYTES {
        return Err(StageError::LongLine);
    }
    // Back to the start for the copy.
    use std::io::Seek;
    (&opened.file)
        .seek(std::io::SeekFrom::Start(0))
        .map_err(|source| StageError::Read { source })?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum StageError {
    #[error("cannot read the dataset")]
    Read {
        #[source]
        source: std::io::Error,
    },
    #[error(
        "its first line is over {} bytes: not a JSONL dataset",
        crate::dataset::MAX_ROW_BYTES
    )]
    LongLine,
    #[error(transparent)]
    Refused(#[from] OpenRefused),
    #[error("cannot copy the dataset into the data directory {dir}")]
    Copy {
        dir: String,
        #[source]
        source: std::io::Error,
    },
}

/// Opens `path` under the policy and copies it (through the descriptor) to
/// `dir/<sha256>.<ext>`; the copy's path.
fn stage_one(
    path: &Path,
    format: crate::spec::DatasetFormat,
    dir: &Path,
    allowed: &dyn Fn(&Path) -> Option<String>,
) -> Result<PathBuf, StageError> {
    let opened = infra::files::open_checked(path, FileKind::Dataset, allowed)?;
    if format == crate::spec::DatasetFormat::Jsonl {
        first_line_fits(&opened)?;
    }
    let copy_err = |source| StageError::Copy {
        dir: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(copy_err)?;
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(copy_err)?;
    let mut out = std::io::BufWriter::new(tmp);
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    // The cap once more, on what is read: a file that grows after its size was checked
    // stops there.
    let mut src = (&opened.file).take(FileKind::Dataset.cap());
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = src.read(&mut buf).map_err(copy_err)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(copy_err)?;
    }
    let tmp = out.into_inner().map_err(|e| copy_err(e.into_error()))?;
    let digest: String = hash
        .finish()
        .as_ref()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let ext = match format {
        crate::spec::DatasetFormat::Jsonl => "jsonl",
        crate::spec::DatasetFormat::Parquet => "parquet",
    };
    let copy = dir.join(format!("{digest}.{ext}"));
    tmp.persist(&copy).map_err(|e| copy_err(e.error))?;
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with(path: &Path) -> JobSpec {
        crate::spec::parse(
            &format!(
                r#"
[[tasks]]
domain = "rows"
env = {{ kind = "prompt" }}
dataset = {{ path = "{}" }}
[[pools]]
name = "p"
device = "H800"
backend = {{ kind = "sim" }}
"#,
                path.display()
            ),
            crate::spec::Format::Toml,
        )
        .unwrap()
    }

    /// The copy is what the job reads: a file swapped for a symlink after submission feeds
    /// nothing of the link's target into the job (it used to, 12 rows of a file outside the
    /// policy), and a policy refusal names the field.
    #[test]
    fn a_staged_dataset_is_the_file_checked_at_submit() {
        let user = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let rows = user.path().join("rows.jsonl");
        std::fs::write(&rows, "{\"prompt\": \"1+1?\", \"answer\": \"2\"}\n").unwrap();
        let mut spec = spec_with(&rows);
        let allow_all = |_: &Path| None;
        assert!(stage_datasets(&mut spec, data.path(), &allow_all).is_empty());
        let staged = spec.tasks[0].dataset.as_ref().unwrap().path.clone();
        assert!(
            staged.starts_with(&data.path().display().to_string()),
            "{staged}"
        );
        // The original replaced by a symlink to a private file: the job reads the copy.
        let private = tempfile::tempdir().unwrap();
        let secret = private.path().join("secret.jsonl");
        std::fs::write(&secret, "{\"prompt\": \"SECRET\"}\n").unwrap();
        std::fs::remove_file(&rows).unwrap();
        std::os::unix::fs::symlink(&secret, &rows).unwrap();
        let loaded =
            crate::dataset::Dataset::load(spec.tasks[0].dataset.as_ref().unwrap(), 1).unwrap();
        assert_eq!(loaded.len(), 1);
        assert!(!loaded.record(0).to_string().contains("SECRET"));
        // Staged again (a resumed spec): unchanged.
        assert!(stage_datasets(&mut spec, data.path(), &allow_all).is_empty());
        assert_eq!(spec.tasks[0].dataset.as_ref().unwrap().path, staged);
        // Only a content-named file directly in the staging directory is a copy: one
        // reached through `..` from there (e.g. the store beside it) is checked like any
        // other path.
        assert!(is_staged(Path::new(&staged), data.path()));
        let beside = data
            .path()
            .parent()
            .unwrap()
            .join("0123456789abcdef0123456789abcdef.jsonl");
        std::fs::write(&beside, "{}").unwrap();
        let through = data.path().join("..").join(beside.file_name().unwrap());
        assert!(!is_staged(&through, data.path()));
        std::fs::remove_file(&beside).unwrap();
        // The symlink now resolves outside the allowed directory: refused by the policy.
        let mut spec = spec_with(&rows);
        let user_dir = std::fs::canonicalize(user.path()).unwrap();
        let only_user = move |p: &Path| {
            (!p.starts_with(&user_dir)).then(|| format!("{} is not readable", p.display()))
        };
        let problems = stage_datasets(&mut spec, data.path(), &only_user);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].policy);
        assert_eq!(problems[0].error.field, "tasks[0].dataset.path");
        assert_eq!(
            spec.tasks[0].dataset.as_ref().unwrap().path,
            rows.display().to_string(),
            "unchanged on a refusal"
        );
        // Over the size cap (sparse): refused before anything is read.
        let big = user.path().join("big.jsonl");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(FileKind::Dataset.cap() + 1)
            .unwrap();
        let mut spec = spec_with(&big);
        let problems = stage_datasets(&mut spec, data.path(), &allow_all);
        assert_eq!(problems.len(), 1);
        assert!(!problems[0].policy);
        assert!(
            problems[0].error.message.contains("cap"),
            "{:?}",
            problems[0].error
        );
        // Under the cap but one long line (the 1 GiB sparse file of round 2): refused
        // before it is copied, and nothing is left in the data directory.
        std::fs::File::create(&big)
            .unwrap()
            .set_len(FileKind::Dataset.cap() / 2)
            .unwrap();
        let before = std::fs::read_dir(data.path()).unwrap().count();
        let mut spec = spec_with(&big);
        let problems = stage_datasets(&mut spec, data.path(), &allow_all);
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].error.message.contains("first line"),
            "{:?}",
            problems[0].error
        );
        assert_eq!(std::fs::read_dir(data.path()).unwrap().count(), before);
    }
}

/// Where model names are looked up: `ROLLARC_MODELS`, else `~/.cache/rollarc/models` (what
/// `make setup` fills).
pub fn model_dirs() -> Vec<PathBuf> {
    if let Some(d) = std::env::var_os("ROLLARC_MODELS") {
        return std::env::split_paths(&d).collect();
    }
    std::env::var_os("HOME")
        .map(|h| vec![PathBuf::from(h).join(".cache/rollarc/models")])
        .unwrap_or_default()
}

/// A model given by name (`path = "SmolLM2-135M-Instruct.Q4_1.gguf"`): a relative path that
/// does not exist from the working directory is looked up in `dirs` and their
/// subdirectories (one level: `models/<package>/<file>`), and replaced by the file found.
/// Returns the (field, name, path) of each one resolved.
pub fn find_models(spec: &mut JobSpec, dirs: &[PathBuf]) -> Vec<(String, String, PathBuf)> {
    let mut found = Vec::new();
    for (i, pool) in spec.pools.iter_mut().enumerate() {
        let model = match &mut pool.backend {
            crate::spec::BackendSpec::Builtin { model, .. } => model,
            crate::spec::BackendSpec::Llamacpp(l)
            | crate::spec::BackendSpec::Sglang(l)
            | crate::spec::BackendSpec::Vllm(l) => &mut l.model,
            crate::spec::BackendSpec::Sim { .. } => continue,
        };
        let Some(name) = model.path.clone() else {
            continue;
        };
        if Path::new(&name).is_absolute() || Path::new(&name).exists() {
            continue;
        }
        if let Some(p) = lookup(&name, dirs) {
            model.path = Some(p.display().to_string());
            found.push((format!("pools[{i}].backend.model.path"), name, p));
        }
    }
    found
}

/// `name` under one of `dirs`, directly or one directory down.
fn lookup(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    for d in dirs {
        let direct = d.join(name);
        if direct.exists() {
            return Some(direct);
        }
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        let mut subs: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        subs.sort();
        if let Some(p) = subs.iter().map(|s| s.join(name)).find(|p| p.exists()) {
            return Some(p);
        }
    }
    None
}

#[cfg(test)]
mod model_tests {
    use super::*;

    #[test]
    fn a_model_name_resolves_from_the_model_cache() {
        let cache = tempfile::tempdir().unwrap();
        std::fs::create_dir(cache.path().join("llm_pkg")).unwrap();
        let file = cache.path().join("llm_pkg").join("Model-Q4.gguf");
        std::fs::write(&file, "GGUF").unwrap();
        let text = |path: &str| {
            format!(
                "[[tasks]]\ndomain = \"d\"\nenv = {{ kind = \"arithmetic\" }}\n[[pools]]\nname = \"p\"\ndevice = \"CPU\"\nbackend = {{ kind = \"builtin\", model = {{ path = \"{path}\" }} }}\n[trainer]\nkind = \"external\"\n"
            )
        };
        let mut spec =
            crate::spec::parse(&text("Model-Q4.gguf"), crate::spec::Format::Toml).unwrap();
        let found = find_models(&mut spec, &[cache.path().to_path_buf()]);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, "pools[0].backend.model.path");
        assert_eq!(
            spec.pools[0].backend.real_model().unwrap().path.as_deref(),
            Some(file.display().to_string().as_str())
        );
        // An unknown name stays as written (the checkpoint check names it).
        let mut spec = crate::spec::parse(&text("Nope.gguf"), crate::spec::Format::Toml).unwrap();
        assert!(find_models(&mut spec, &[cache.path().to_path_buf()]).is_empty());
        assert_eq!(
            spec.pools[0].backend.real_model().unwrap().path.as_deref(),
            Some("Nope.gguf")
        );
    }
}
