//! `rollarc export`: the policy a checkpoint job trained, from its data directory, as a GGUF
//! file or a Hugging Face directory.

use std::path::{Path, PathBuf};

use actors::model::runtime::{ExportFormat, ExportPolicyError, export_policy};

use job::store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ExportJobError {
    #[error("cannot read the job store")]
    Store(#[from] StoreError),
    #[error("no job {0}")]
    NoJob(String),
    #[error("job {0} does not train a checkpoint model (backend.model.path)")]
    NotACheckpointJob(String),
    #[error("job {job} has no trainer checkpoint{}", .version.map(|v| format!(" of version {v}")).unwrap_or_default())]
    NoCheckpoint { job: String, version: Option<u64> },
    #[error("unknown format {0:?} (gguf, gguf-q8 or hf)")]
    Format(String),
    #[error("cannot export the policy")]
    Export(#[source] Box<ExportPolicyError>),
    #[error("cannot create the output directory {dir}")]
    OutDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Exports job `job`'s policy at `version` (default: its newest checkpoint); returns the
/// version written.
pub fn export_job(
    data_dir: &Path,
    job: &str,
    version: Option<u64>,
    format: &str,
    out: &Path,
) -> Result<u64, ExportJobError> {
    let format = match format {
        "gguf" => ExportFormat::Gguf,
        "gguf-q8" => ExportFormat::GgufQ8,
        "hf" => ExportFormat::Hf,
        other => return Err(ExportJobError::Format(other.into())),
    };
    let store = Store::open(&data_dir.join("rollarc.db"))?;
    let spec = store
        .spec(job)?
        .ok_or_else(|| ExportJobError::NoJob(job.into()))?;
    let not_one = || ExportJobError::NotACheckpointJob(job.into());
    let inputs = job::resolve::resolve_models(&spec, &job::resolve::Host::process())
        .map_err(|_| not_one())?;
    let trainer = job::wiring::plan_trainer(&spec, &inputs).map_err(|_| not_one())?;
    let ck = job::wiring::checkpoint_spec(&trainer)
        .ok_or_else(|| ExportJobError::NotACheckpointJob(job.into()))?;
    let dir = data_dir.join("checkpoints").join(job);
    let (v, path) = newest(&dir, version).ok_or(ExportJobError::NoCheckpoint {
        job: job.into(),
        version,
    })?;
    // `--out DIR/x.gguf` with DIR not there yet: made, as `report --out` does.
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| ExportJobError::OutDir {
            dir: parent.to_path_buf(),
            source,
        })?;
    }
    export_policy(&ck, &path, format, out).map_err(|e| ExportJobError::Export(Box::new(e)))?;
    Ok(v)
}

/// The checkpoint of `version`, or the newest, in `dir`.
fn newest(dir: &Path, version: Option<u64>) -> Option<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let v = name
                .strip_prefix('v')?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()?;
            Some((v, e.path()))
        })
        .filter(|(v, _)| version.is_none_or(|want| *v == want))
        .collect();
    found.sort();
    found.pop()
}
