//! Writing the manifests: one Service per deployment and the autoscaler ConfigMap.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::autoscaler::{KnobConflicts, knative_autoscaler_config};
use super::service::{AUTOSCALER_CONFIG_NAME, knative_problems, knative_service};
use crate::faas::config::DeploymentConfig;

/// One reason the manifests cannot be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ManifestProblem {
    /// A field the local runtime or Knative rejects.
    Field {
        deployment: String,
        field: String,
        message: String,
    },
    /// Two deployments share this name.
    DuplicateName(String),
    /// The deployments disagree on cluster-wide knobs.
    Conflicts(KnobConflicts),
}

impl fmt::Display for ManifestProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Field {
                deployment,
                field,
                message,
            } => write!(f, "{deployment}: {field}: {message}"),
            Self::DuplicateName(name) => write!(f, "{name}: two deployments have this name"),
            Self::Conflicts(c) => write!(f, "{c}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Nothing was written: every problem found.
    #[error("{}", join(problems))]
    Invalid { problems: Vec<ManifestProblem> },
    #[error("cannot write {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn join(problems: &[ManifestProblem]) -> String {
    problems
        .iter()
        .map(ManifestProblem::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Pretty JSON with a final newline (objects are sorted by key, so the output is stable).
fn pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s
}

/// Writes `<name>.json` (the Knative Service) for each deployment and `config-autoscaler.json`
/// into `dir` (created if missing), and returns the paths in that order. The files are pretty
/// JSON, which is valid YAML: `kubectl apply -f DIR` applies them.
///
/// Nothing is written when a config has problems ([`DeploymentConfig::problems`], which also
/// keeps names safe as file names, or [`knative_problems`]), when two deployments share a
/// name, or when they disagree on a cluster-wide knob: [`ManifestError::Invalid`] lists all.
pub fn write_manifests(
    cfgs: &[DeploymentConfig],
    dir: &Path,
) -> Result<Vec<PathBuf>, ManifestError> {
    let mut problems = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for cfg in cfgs {
        for (field, message) in cfg.problems().into_iter().chain(knative_problems(cfg)) {
            problems.push(ManifestProblem::Field {
                deployment: cfg.name.clone(),
                field,
                message,
            });
        }
        if !seen.insert(cfg.name.as_str()) {
            problems.push(ManifestProblem::DuplicateName(cfg.name.clone()));
        }
    }
    let autoscaler = knative_autoscaler_config(cfgs).unwrap_or_else(|c| {
        problems.push(ManifestProblem::Conflicts(c));
        Value::Null
    });
    if !problems.is_empty() {
        return Err(ManifestError::Invalid { problems });
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ManifestError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut paths = Vec::with_capacity(cfgs.len() + 1);
    for cfg in cfgs {
        let p = dir.join(format!("{}.json", cfg.name));
        std::fs::write(&p, pretty(&knative_service(cfg))).map_err(io(&p))?;
        paths.push(p);
    }
    let p = dir.join(format!("{AUTOSCALER_CONFIG_NAME}.json"));
    std::fs::write(&p, pretty(&autoscaler)).map_err(io(&p))?;
    paths.push(p);
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{round_trip, tuned};
    use super::super::service::BUILTIN_BINARY;
    use super::*;
    use crate::env::{EnvSource, ProcessEnv};
    use crate::faas::config::Dur;
    use serde_json::json;

    #[test]
    fn cluster_wide_knobs_must_agree() {
        let a = tuned();
        let mut b = DeploymentConfig::new("judge", "rollarc-fn", vec![]);
        b.scaling.scale_to_zero_grace_period = Dur::secs(10);
        let e = knative_autoscaler_config(&[a.clone(), b.clone()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("scale-to-zero-grace-period") && e.contains("math") && e.contains("judge"),
            "{e}"
        );
        assert!(
            !e.contains("max-scale-up-rate"),
            "they agree on that one: {e}"
        );
        let mut dir_err = write_manifests(
            &[a.clone(), b.clone()],
            Path::new("/nonexistent/never-written"),
        )
        .unwrap_err();
        assert!(
            matches!(dir_err, ManifestError::Invalid { .. }),
            "{dir_err:?}"
        );
        assert!(dir_err.to_string().contains("judge"));

        b.scaling.scale_to_zero_grace_period = Dur::secs(30);
        b.scaling.initial_scale = 0;
        let cm = round_trip(&knative_autoscaler_config(&[a, b]).unwrap());
        assert_eq!(cm["apiVersion"], "v1");
        assert_eq!(cm["kind"], "ConfigMap");
        assert_eq!(cm["metadata"]["name"], "config-autoscaler");
        assert_eq!(cm["metadata"]["namespace"], "knative-serving");
        assert_eq!(
            cm["data"],
            json!({
                "scale-to-zero-grace-period": "30s",
                "max-scale-up-rate": "1000",
                "max-scale-down-rate": "2",
                "allow-zero-initial-scale": "true",
            })
        );
        dir_err = write_manifests(&[tuned(), tuned()], Path::new("/nonexistent/never-written"))
            .unwrap_err();
        assert!(dir_err.to_string().contains("two deployments"), "{dir_err}");
    }

    #[test]
    fn what_knative_rejects_is_not_written() {
        let mut d = tuned();
        d.scaling.stable_window = Dur::millis(1500);
        d.scaling.tick_interval = Dur::millis(100);
        let e = write_manifests(&[d], Path::new("/nonexistent/never-written")).unwrap_err();
        assert!(e.to_string().contains("math: scaling.stable-window"), "{e}");
        match e {
            ManifestError::Invalid { problems } => assert!(matches!(
                &problems[..],
                [ManifestProblem::Field { field, .. }] if field == "scaling.stable-window"
            )),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn write_manifests_writes_one_file_per_service_and_the_configmap() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("manifests");
        let cfgs = [
            tuned(),
            DeploymentConfig::new("format", "rollarc-fn", vec!["format".into()]),
        ];
        let paths = write_manifests(&cfgs, &out).unwrap();
        assert_eq!(
            paths,
            [
                out.join("math.json"),
                out.join("format.json"),
                out.join("config-autoscaler.json")
            ]
        );
        for (p, cfg) in paths.iter().zip(&cfgs) {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            assert_eq!(v, knative_service(cfg));
        }
        let cm: Value = serde_json::from_str(&std::fs::read_to_string(&paths[2]).unwrap()).unwrap();
        assert_eq!(cm, knative_autoscaler_config(&cfgs).unwrap());
        assert!(std::fs::read_to_string(&paths[0]).unwrap().ends_with("}\n"));
    }

    /// The manifests under `infra/deploy/manifests` for the built-in functions with default
    /// knobs. `ROLLARC_BLESS=1 cargo nextest run -p infra checked_in` regenerates them.
    #[test]
    fn checked_in_manifests_are_current() {
        let cfgs: Vec<DeploymentConfig> = ["math", "format", "env"]
            .into_iter()
            .map(|f| DeploymentConfig::new(f, BUILTIN_BINARY, vec![f.to_string()]))
            .collect();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/manifests");
        if ProcessEnv.var("ROLLARC_BLESS").is_some() {
            write_manifests(&cfgs, &dir).unwrap();
        }
        let fresh = tempfile::tempdir().unwrap();
        for p in write_manifests(&cfgs, fresh.path()).unwrap() {
            let name = p.file_name().unwrap();
            let want: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let have = std::fs::read_to_string(dir.join(name))
                .map(|t| serde_json::from_str::<Value>(&t).unwrap())
                .ok();
            assert_eq!(
                have.as_ref(),
                Some(&want),
                "{name:?} is stale: run ROLLARC_BLESS=1 cargo nextest run -p infra checked_in"
            );
        }
    }
}
