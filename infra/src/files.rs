//! The one way the service opens a file on a user's behalf (a dataset, a tokenizer, an
//! announced weight file): resolved once, opened once with no symlink followed on the way,
//! checked to be a regular file within its kind's size cap, and identified (device, inode,
//! size, modification time) so that a later use can tell whether it is still the same file.
//!
//! The caller checks the *resolved* path against its policy (`readable_paths`) and then
//! reads only through the descriptor returned here: a path replaced by a symlink after the
//! check is refused (`RESOLVE_NO_SYMLINKS`), and one replaced by another file is a different
//! identity. A job that reads its input later reads a copy made through that descriptor
//! (see `job::inputs`), never the path again.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// What a file is opened as; each kind has its own size cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A task's dataset (JSONL or Parquet): read whole into memory by its job.
    Dataset,
    /// A GGUF file read for its tokenizer (the metadata at its start).
    Tokenizer,
    /// An external trainer's announced weights (safetensors, GGUF).
    Weights,
}

impl FileKind {
    /// The largest file of this kind the service opens.
    pub fn cap(self) -> u64 {
        match self {
            Self::Dataset => 1 << 30,
            Self::Tokenizer => 64 << 30,
            Self::Weights => 64 << 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Dataset => "dataset",
            Self::Tokenizer => "tokenizer",
            Self::Weights => "weight file",
        }
    }
}

/// A file's identity: the same path holding another file (replaced, rewritten) differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

impl Identity {
    pub fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// A file opened under the policy.
#[derive(Debug)]
pub struct Opened {
    pub file: File,
    /// The path as resolved (absolute, no `..`, no symlink).
    pub resolved: PathBuf,
    pub identity: Identity,
}

/// Why a file was not opened.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a regular file")]
    NotRegular { path: String },
    #[error("{path} is {size} bytes, over the {cap}-byte cap of a {kind}")]
    TooLarge {
        path: String,
        size: u64,
        cap: u64,
        kind: &'static str,
    },
    #[error("{path} changed after it was checked (now another file, or a symlink)")]
    Changed { path: String },
}

/// Resolves `path` once, without following symlinks of the resolved path again.
pub fn resolve(path: &Path) -> Result<PathBuf, FileError> {
    std::fs::canonicalize(path).map_err(|source| FileError::Open {
        path: path.display().to_string(),
        source,
    })
}

/// Opens the already resolved `resolved` for reading: no component may be a symlink
/// (`openat2` with `RESOLVE_NO_SYMLINKS`; `O_NOFOLLOW` on the last component where the
/// kernel lacks `openat2`), it must be a regular file within `kind`'s cap.
pub fn open_resolved(resolved: &Path, kind: FileKind) -> Result<Opened, FileError> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let shown = || resolved.display().to_string();
    let flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK;
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let file = match nix::fcntl::openat2(nix::fcntl::AT_FDCWD, resolved, how) {
        Ok(fd) => File::from(fd),
        Err(nix::errno::Errno::ENOSYS) => {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NOCTTY | OFlag::O_NONBLOCK).bits())
                .open(resolved)
                .map_err(|source| FileError::Open {
                    path: shown(),
                    source,
                })?
        }
        Err(nix::errno::Errno::ELOOP) => return Err(FileError::Changed { path: shown() }),
        Err(e) => {
            return Err(FileError::Open {
                path: shown(),
                source: e.into(),
            });
        }
    };
    let meta = file.metadata().map_err(|source| FileError::Open {
        path: shown(),
        source,
    })?;
    if !meta.is_file() {
        return Err(FileError::NotRegular { path: shown() });
    }
    if meta.len() > kind.cap() {
        return Err(FileError::TooLarge {
            path: shown(),
            size: meta.len(),
            cap: kind.cap(),
            kind: kind.name(),
        });
    }
    Ok(Opened {
        file,
        resolved: resolved.to_path_buf(),
        identity: Identity::of(&meta),
    })
}

/// [`resolve`], the caller's `allowed` check on the resolved path, then [`open_resolved`].
/// `allowed` answers with a refusal message, or `None` to allow.
pub fn open_checked(
    path: &Path,
    kind: FileKind,
    allowed: impl Fn(&Path) -> Option<String>,
) -> Result<Opened, OpenRefused> {
    let resolved = resolve(path)?;
    if let Some(why) = allowed(&resolved) {
        return Err(OpenRefused::Policy(why));
    }
    Ok(open_resolved(&resolved, kind)?)
}

/// [`open_checked`]'s refusal: the policy's, or the file's.
#[derive(Debug, thiserror::Error)]
pub enum OpenRefused {
    #[error("{0}")]
    Policy(String),
    #[error(transparent)]
    File(#[from] FileError),
}

/// Whether `resolved` still holds the file `identity` names (same device, inode, size and
/// modification time), checked through a fresh no-symlink open.
pub fn still_same(
    resolved: &Path,
    identity: &Identity,
    kind: FileKind,
) -> Result<Opened, FileError> {
    let opened = open_resolved(resolved, kind)?;
    if opened.identity != *identity {
        return Err(FileError::Changed {
            path: resolved.display().to_string(),
        });
    }
    Ok(opened)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_special_files_and_oversized_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("rows.jsonl");
        std::fs::write(&real, "{}\n").unwrap();
        let resolved = resolve(&real).unwrap();
        let opened = open_resolved(&resolved, FileKind::Dataset).unwrap();
        assert_eq!(opened.identity.size, 3);
        // The checked path replaced by a symlink: refused, not followed.
        let other = dir.path().join("other.jsonl");
        std::fs::write(&other, "{\"secret\": 1}\n").unwrap();
        std::fs::remove_file(&real).unwrap();
        std::os::unix::fs::symlink(&other, &real).unwrap();
        assert!(matches!(
            open_resolved(&resolved, FileKind::Dataset),
            Err(FileError::Changed { .. })
        ));
        // A directory in the way replaced by a symlink: refused too.
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("w.bin"), "w").unwrap();
        let inner = resolve(&sub.join("w.bin")).unwrap();
        std::fs::rename(&sub, dir.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("moved"), &sub).unwrap();
        assert!(open_resolved(&inner, FileKind::Weights).is_err());
        // Not a regular file.
        assert!(matches!(
            open_resolved(&resolve(dir.path()).unwrap(), FileKind::Dataset),
            Err(FileError::NotRegular { .. })
        ));
        // Over the cap (a sparse file: no disk used).
        let big = dir.path().join("big.jsonl");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(FileKind::Dataset.cap() + 1).unwrap();
        assert!(matches!(
            open_resolved(&resolve(&big).unwrap(), FileKind::Dataset),
            Err(FileError::TooLarge { .. })
        ));
        // Identity: a rewrite of the same path is another file.
        let w = dir.path().join("w.safetensors");
        std::fs::write(&w, "one").unwrap();
        let first = open_resolved(&resolve(&w).unwrap(), FileKind::Weights).unwrap();
        assert!(still_same(&first.resolved, &first.identity, FileKind::Weights).is_ok());
        std::fs::remove_file(&w).unwrap();
        std::fs::write(&w, "two!").unwrap();
        assert!(matches!(
            still_same(&first.resolved, &first.identity, FileKind::Weights),
            Err(FileError::Changed { .. })
        ));
    }
}
