//! The Knative translation of a local function deployment.
//!
//! A [`DeploymentConfig`] uses Knative's knob names, so it translates one to one into a
//! `serving.knative.dev/v1` `Service` ([`knative_service`]), plus the `config-autoscaler`
//! ConfigMap for the few knobs Knative sets once per cluster ([`knative_autoscaler_config`]).
//! [`write_manifests`] writes both as pretty JSON. JSON is valid YAML and `kubectl apply -f`
//! accepts `.json` files, so `kubectl apply -f DIR` applies them as they are.
//!
//! | local (`DeploymentConfig`)          | Knative                                                                  |
//! |-------------------------------------|--------------------------------------------------------------------------|
//! | `name`                              | `metadata.name` (URL `http://NAME.NAMESPACE.svc.cluster.local`)          |
//! | `scaling.container-concurrency`     | `spec.template.spec.containerConcurrency`                                |
//! | `scaling.target`                    | annotation `autoscaling.knative.dev/target` (only when set)              |
//! | `scaling.target-utilization-percentage`, `min-scale`, `initial-scale`, `panic-window-percentage`, `panic-threshold-percentage` | annotation of the same name |
//! | `scaling.max-scale`                 | annotation `max-scale` (only when > 0; 0 = unbounded in both)            |
//! | `scaling.activation-scale`          | annotation `activation-scale` (only when > 1: 1 is Knative's default and Knative rejects an explicit value below 2) |
//! | `scaling.stable-window`             | annotation `autoscaling.knative.dev/window`                              |
//! | `scaling.scale-down-delay`          | annotation `scale-down-delay` (only when non-zero)                       |
//! | `scaling.scale-to-zero-grace-period`, `max-scale-up-rate`, `max-scale-down-rate` | cluster-wide: `config-autoscaler` keys of the same name; recorded on the Service as `rollarc.dev/<knob>` annotations (information only) |
//! | `scaling.tick-interval`             | not configurable in Knative (fixed 2 s); not emitted                     |
//! | `timeout-seconds`                   | `spec.template.spec.timeoutSeconds` (Knative caps it at `max-revision-timeout-seconds`, 600 by default, in `config-defaults`) |
//! | `command`, `args`, `image`          | the one container: see [`knative_service`]                              |
//! | `env`                               | container `env`, sorted, without the variables Knative or the runtime set ([`RESERVED_ENV`]) |
//! | `readiness-path`                    | `readinessProbe.httpGet.path` (no port: Knative probes the serving port) |
//! | `path`                              | not part of the Service: callers post to `URL + path`                    |
//! | `startup-timeout`, `termination-grace`, `activator-capacity` | not translated: Knative derives the termination grace from `timeoutSeconds`, its activator buffer is not per Service, and a slow start is bounded by the revision's progress deadline |
//!
//! No `resources` are emitted: a function that needs a GPU gets
//! `resources.limits["nvidia.com/gpu"]` by editing the generated manifest (or through a future
//! `DeploymentConfig` field).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::config::{DeploymentConfig, Dur};

/// The image of the built-in functions (`infra/deploy/Dockerfile`), used when a deployment
/// names none. Push it to a registry the cluster can pull from, or set `image`.
pub const DEFAULT_IMAGE: &str = "rollarc/rollarc-fn:latest";
/// The built-in function binary: the default image's entrypoint.
pub const BUILTIN_BINARY: &str = "rollarc-fn";
/// The port the container listens on; Knative passes it to the function as `$PORT`.
pub const CONTAINER_PORT: u16 = 8080;
/// Variables left out of the container's `env`: Knative reserves `PORT`, `K_SERVICE`,
/// `K_CONFIGURATION` and `K_REVISION` (and rejects a Service that sets them), and the local
/// runtime overrides `PORT`, `HOST` and `K_SERVICE` itself, so a user value never took effect.
pub const RESERVED_ENV: [&str; 5] = ["PORT", "HOST", "K_SERVICE", "K_CONFIGURATION", "K_REVISION"];
/// The file name (and ConfigMap name) of the cluster-wide autoscaler configuration.
pub const AUTOSCALER_CONFIG_NAME: &str = "config-autoscaler";

const AUTOSCALING: &str = "autoscaling.knative.dev/";
const KPA_CLASS: &str = "kpa.autoscaling.knative.dev";
/// Knative's bounds on `window` (and, for the upper one, `scale-down-delay`).
const WINDOW_MIN: Duration = Duration::from_secs(6);
const WINDOW_MAX: Duration = Duration::from_secs(3600);

/// A number the way Knative parses annotation and ConfigMap values (`60`, `0.5`).
fn num(v: f64) -> String {
    v.to_string()
}

/// The cluster-wide knobs: Knative reads them from `config-autoscaler` only, one value per
/// cluster. Name and value as written there.
fn cluster_knobs(cfg: &DeploymentConfig) -> [(&'static str, String); 3] {
    let s = &cfg.scaling;
    [
        ("scale-to-zero-grace-period", s.scale_to_zero_grace_period.to_string()),
        ("max-scale-up-rate", num(s.max_scale_up_rate)),
        ("max-scale-down-rate", num(s.max_scale_down_rate)),
    ]
}

/// The `serving.knative.dev/v1` `Service` for one deployment.
///
/// Autoscaling knobs become `autoscaling.knative.dev/*` annotations on the revision template,
/// all as strings (Knative requires string annotation values); the class is the KPA and the
/// metric concurrency, as in the local runtime. `scale-to-zero-grace-period`,
/// `max-scale-up-rate` and `max-scale-down-rate` cannot be set per Service in Knative (they are
/// `config-autoscaler` keys, see [`knative_autoscaler_config`]); the Service records the values
/// this deployment asked for as `rollarc.dev/<knob>` annotations on its own metadata (not the
/// template, so they never start a new revision). Knative ignores them.
///
/// The container: `image` is `cfg.image`, or [`DEFAULT_IMAGE`] when unset. When the local
/// command's file name is [`BUILTIN_BINARY`] (e.g. `/…/target/release/rollarc-fn`) the image's
/// entrypoint is that binary, so only `args` are passed; any other command is set as
/// `command: [cfg.command]` and must exist at that path inside the image. It listens on
/// [`CONTAINER_PORT`] (`$PORT`). The readiness probe is an HTTP GET of `readiness-path` without
/// `periodSeconds`, which keeps Knative's aggressive start-up probing (fast cold starts).
///
/// The config is not checked here: see [`knative_problems`] and [`DeploymentConfig::problems`]
/// ([`write_manifests`] checks both).
pub fn knative_service(cfg: &DeploymentConfig) -> Value {
    let s = &cfg.scaling;
    let mut ann: BTreeMap<String, String> = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        ann.insert(format!("{AUTOSCALING}{k}"), v);
    };
    put("class", KPA_CLASS.into());
    put("metric", "concurrency".into());
    if let Some(t) = s.target {
        put("target", num(t));
    }
    put("target-utilization-percentage", num(s.target_utilization_percentage));
    put("min-scale", s.min_scale.to_string());
    if s.max_scale > 0 {
        put("max-scale", s.max_scale.to_string());
    }
    put("initial-scale", s.initial_scale.to_string());
    if s.activation_scale > 1 {
        put("activation-scale", s.activation_scale.to_string());
    }
    put("window", s.stable_window.to_string());
    put("panic-window-percentage", num(s.panic_window_percentage));
    put("panic-threshold-percentage", num(s.panic_threshold_percentage));
    if s.scale_down_delay.0 > Duration::ZERO {
        put("scale-down-delay", s.scale_down_delay.to_string());
    }

    let service_ann: Map<String, Value> = cluster_knobs(cfg).into_iter().map(|(k, v)| (format!("rollarc.dev/{k}"), Value::String(v))).collect();
    let env: Vec<Value> = cfg.env.iter().filter(|(k, _)| !RESERVED_ENV.contains(&k.as_str())).map(|(k, v)| json!({ "name": k, "value": v })).collect();

    let mut container = json!({
        "image": cfg.image.as_deref().unwrap_or(DEFAULT_IMAGE),
        "args": cfg.args,
        "ports": [{ "containerPort": CONTAINER_PORT }],
        "env": env,
        "readinessProbe": { "httpGet": { "path": cfg.readiness_path } },
    });
    let builtin = Path::new(&cfg.command).file_name().and_then(|f| f.to_str()) == Some(BUILTIN_BINARY);
    if !builtin {
        container["command"] = json!([cfg.command]);
    }

    json!({
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": {
            "name": cfg.name,
            "labels": { "app.kubernetes.io/part-of": "rollarc" },
            "annotations": service_ann,
        },
        "spec": {
            "template": {
                "metadata": { "annotations": ann },
                "spec": {
                    "containerConcurrency": s.container_concurrency,
                    "timeoutSeconds": cfg.timeout_seconds,
                    "containers": [container],
                },
            },
        },
    })
}

/// What Knative would reject although the local runtime accepts it, each with its dotted
/// field path (as [`DeploymentConfig::problems`] names them).
pub fn knative_problems(cfg: &DeploymentConfig) -> Vec<(String, String)> {
    let s = &cfg.scaling;
    let mut out = Vec::new();
    let mut bad = |k: &str, m: String| out.push((format!("scaling.{k}"), m));
    let whole_seconds = |d: Dur| d.0.subsec_nanos() == 0;
    if s.stable_window.0 < WINDOW_MIN || s.stable_window.0 > WINDOW_MAX || !whole_seconds(s.stable_window) {
        bad("stable-window", format!("Knative needs whole seconds in [6s, 3600s], got {}", s.stable_window));
    }
    if s.scale_down_delay.0 > WINDOW_MAX || !whole_seconds(s.scale_down_delay) {
        bad("scale-down-delay", format!("Knative needs whole seconds up to 3600s, got {}", s.scale_down_delay));
    }
    if s.scale_to_zero_grace_period.0.is_zero() {
        bad("scale-to-zero-grace-period", "Knative needs a positive duration".into());
    }
    if let Some(t) = s.target
        && t < 0.01
    {
        bad("target", format!("Knative needs at least 0.01, got {t}"));
    }
    if s.target_utilization_percentage < 1.0 {
        bad("target-utilization-percentage", format!("Knative needs at least 1, got {}", s.target_utilization_percentage));
    }
    if s.activation_scale > 1 && s.min_scale > s.activation_scale {
        bad("activation-scale", format!("Knative needs it at least min-scale ({}), got {}", s.min_scale, s.activation_scale));
    }
    if s.activation_scale > 1 && s.max_scale > 0 && s.activation_scale > s.max_scale {
        bad("activation-scale", format!("Knative needs it at most max-scale ({}), got {}", s.max_scale, s.activation_scale));
    }
    if cfg.name == AUTOSCALER_CONFIG_NAME {
        out.push(("name".into(), format!("{AUTOSCALER_CONFIG_NAME:?} is taken by the autoscaler ConfigMap's manifest")));
    }
    out
}

/// The `config-autoscaler` ConfigMap (namespace `knative-serving`) with the knobs Knative sets
/// only per cluster: `scale-to-zero-grace-period`, `max-scale-up-rate`, `max-scale-down-rate`,
/// and `allow-zero-initial-scale: "true"` when a deployment has `initial-scale` 0 (Knative
/// rejects that annotation otherwise). Every other `config-autoscaler` key only holds defaults
/// that the Services' annotations override, so none is emitted; the local `tick-interval` has
/// no Knative key at all (Knative's tick is a fixed 2 s).
///
/// Since one value serves the whole cluster, the deployments must agree: otherwise `Err`
/// names each disagreeing knob and which deployments want which value. No deployments: an
/// empty `data` (applying it changes nothing).
///
/// `kubectl apply` of this file merges these keys into Knative's ConfigMap and keeps the
/// others. Where the Knative Operator manages Serving, put the same keys under the
/// `KnativeServing` resource's `spec.config.autoscaler` instead (the operator reverts direct
/// ConfigMap edits).
pub fn knative_autoscaler_config(cfgs: &[DeploymentConfig]) -> Result<Value, String> {
    let mut by_knob: BTreeMap<&'static str, BTreeMap<String, Vec<&str>>> = BTreeMap::new();
    for cfg in cfgs {
        for (knob, value) in cluster_knobs(cfg) {
            by_knob.entry(knob).or_default().entry(value).or_default().push(&cfg.name);
        }
    }
    let mut data = Map::new();
    let mut errs = Vec::new();
    for (knob, values) in by_knob {
        if values.len() == 1 {
            if let Some((v, _)) = values.into_iter().next() {
                data.insert(knob.into(), Value::String(v));
            }
        } else {
            let wants: Vec<String> = values.iter().map(|(v, names)| format!("{v} ({})", names.join(", "))).collect();
            errs.push(format!("deployments disagree on {knob}, which Knative sets once per cluster: {}", wants.join(" vs ")));
        }
    }
    if !errs.is_empty() {
        return Err(errs.join("; "));
    }
    if cfgs.iter().any(|c| c.scaling.initial_scale == 0) {
        data.insert("allow-zero-initial-scale".into(), Value::String("true".into()));
    }
    Ok(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": AUTOSCALER_CONFIG_NAME, "namespace": "knative-serving" },
        "data": data,
    }))
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
/// name, or when they disagree on a cluster-wide knob: the error (`InvalidInput`) lists all.
pub fn write_manifests(cfgs: &[DeploymentConfig], dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut errs: Vec<String> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for cfg in cfgs {
        for (field, msg) in cfg.problems().into_iter().chain(knative_problems(cfg)) {
            errs.push(format!("{}: {field}: {msg}", cfg.name));
        }
        if !seen.insert(cfg.name.as_str()) {
            errs.push(format!("{}: two deployments have this name", cfg.name));
        }
    }
    let autoscaler = knative_autoscaler_config(cfgs).unwrap_or_else(|e| {
        errs.push(e);
        Value::Null
    });
    if !errs.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, errs.join("; ")));
    }
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::with_capacity(cfgs.len() + 1);
    for cfg in cfgs {
        let p = dir.join(format!("{}.json", cfg.name));
        std::fs::write(&p, pretty(&knative_service(cfg)))?;
        paths.push(p);
    }
    let p = dir.join(format!("{AUTOSCALER_CONFIG_NAME}.json"));
    std::fs::write(&p, pretty(&autoscaler))?;
    paths.push(p);
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{EnvSource, ProcessEnv};
    use crate::faas::Scaling;

    fn tuned() -> DeploymentConfig {
        let mut d = DeploymentConfig::new("math", "/opt/rollarc/target/release/rollarc-fn", vec!["math".into()]);
        d.scaling = Scaling {
            stable_window: Dur::secs(30),
            panic_window_percentage: 20.0,
            panic_threshold_percentage: 300.0,
            target_utilization_percentage: 60.0,
            container_concurrency: 4,
            min_scale: 1,
            max_scale: 8,
            initial_scale: 2,
            activation_scale: 2,
            scale_down_delay: Dur::secs(15),
            ..Scaling::default()
        };
        d.timeout_seconds = 120;
        d.readiness_path = "/ready".into();
        d.env.insert("RUST_LOG".into(), "info".into());
        d.env.insert("A_FIRST".into(), "1".into());
        d.env.insert("PORT".into(), "9999".into());
        d
    }

    /// Through text and back, as `kubectl` would read it.
    fn round_trip(v: &Value) -> Value {
        let text = serde_json::to_string_pretty(v).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn annotations(svc: &Value) -> &Map<String, Value> {
        svc["spec"]["template"]["metadata"]["annotations"].as_object().unwrap()
    }

    #[test]
    fn every_knob_is_translated() {
        let cfg = tuned();
        assert!(cfg.problems().is_empty() && knative_problems(&cfg).is_empty());
        let svc = round_trip(&knative_service(&cfg));
        assert_eq!(svc["apiVersion"], "serving.knative.dev/v1");
        assert_eq!(svc["kind"], "Service");
        assert_eq!(svc["metadata"]["name"], "math");
        assert_eq!(svc["metadata"]["labels"]["app.kubernetes.io/part-of"], "rollarc");
        assert_eq!(svc["metadata"]["annotations"]["rollarc.dev/scale-to-zero-grace-period"], "30s");
        assert_eq!(svc["metadata"]["annotations"]["rollarc.dev/max-scale-up-rate"], "1000");
        assert_eq!(svc["metadata"]["annotations"]["rollarc.dev/max-scale-down-rate"], "2");

        let ann = annotations(&svc);
        let expected = [
            ("class", "kpa.autoscaling.knative.dev"),
            ("metric", "concurrency"),
            ("target-utilization-percentage", "60"),
            ("min-scale", "1"),
            ("max-scale", "8"),
            ("initial-scale", "2"),
            ("activation-scale", "2"),
            ("window", "30s"),
            ("panic-window-percentage", "20"),
            ("panic-threshold-percentage", "300"),
            ("scale-down-delay", "15s"),
        ];
        for (k, v) in expected {
            assert_eq!(ann.get(&format!("autoscaling.knative.dev/{k}")), Some(&Value::String(v.into())), "annotation {k}");
        }
        assert_eq!(ann.len(), expected.len(), "no other annotations: {ann:?}");
        assert!(ann.values().all(Value::is_string));

        let spec = &svc["spec"]["template"]["spec"];
        assert_eq!(spec["containerConcurrency"], 4);
        assert_eq!(spec["timeoutSeconds"], 120);
        let containers = spec["containers"].as_array().unwrap();
        assert_eq!(containers.len(), 1);
        let c = &containers[0];
        assert_eq!(c["image"], DEFAULT_IMAGE);
        assert!(c.get("command").is_none(), "rollarc-fn is the image's entrypoint");
        assert_eq!(c["args"], json!(["math"]));
        assert_eq!(c["ports"], json!([{ "containerPort": 8080 }]));
        assert_eq!(c["env"], json!([{ "name": "A_FIRST", "value": "1" }, { "name": "RUST_LOG", "value": "info" }]), "sorted, PORT left to Knative");
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
        assert!(c["readinessProbe"]["httpGet"].get("port").is_none());
        assert!(c.get("resources").is_none());
    }

    #[test]
    fn optional_annotations_only_when_asked_for() {
        let svc = round_trip(&knative_service(&DeploymentConfig::new("plain", "rollarc-fn", vec!["format".into()])));
        let ann = annotations(&svc);
        for k in ["max-scale", "scale-down-delay", "target", "activation-scale"] {
            assert!(!ann.contains_key(&format!("autoscaling.knative.dev/{k}")), "{k} emitted for a default config");
        }
        assert_eq!(ann["autoscaling.knative.dev/window"], "60s");
        assert_eq!(ann["autoscaling.knative.dev/min-scale"], "0");
        assert_eq!(svc["spec"]["template"]["spec"]["containerConcurrency"], 0);
        assert_eq!(svc["spec"]["template"]["spec"]["containers"][0]["env"], json!([]));

        let mut d = DeploymentConfig::new("custom", "/usr/bin/python3", vec!["serve.py".into()]);
        d.scaling.target = Some(2.5);
        d.image = Some("registry.example/judge:1".into());
        let svc = round_trip(&knative_service(&d));
        assert_eq!(annotations(&svc)["autoscaling.knative.dev/target"], "2.5");
        let c = &svc["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["image"], "registry.example/judge:1");
        assert_eq!(c["command"], json!(["/usr/bin/python3"]));
        assert_eq!(c["args"], json!(["serve.py"]));
    }

    #[test]
    fn cluster_wide_knobs_must_agree() {
        let a = tuned();
        let mut b = DeploymentConfig::new("judge", "rollarc-fn", vec![]);
        b.scaling.scale_to_zero_grace_period = Dur::secs(10);
        let e = knative_autoscaler_config(&[a.clone(), b.clone()]).unwrap_err();
        assert!(e.contains("scale-to-zero-grace-period") && e.contains("math") && e.contains("judge"), "{e}");
        assert!(!e.contains("max-scale-up-rate"), "they agree on that one: {e}");
        let mut dir_err = write_manifests(&[a.clone(), b.clone()], Path::new("/nonexistent/never-written")).unwrap_err();
        assert_eq!(dir_err.kind(), std::io::ErrorKind::InvalidInput);
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
        dir_err = write_manifests(&[tuned(), tuned()], Path::new("/nonexistent/never-written")).unwrap_err();
        assert!(dir_err.to_string().contains("two deployments"), "{dir_err}");
    }

    #[test]
    fn what_knative_rejects_is_reported() {
        let mut d = tuned();
        d.scaling.stable_window = Dur::millis(1500);
        d.scaling.tick_interval = Dur::millis(100);
        d.scaling.scale_down_delay = Dur::millis(2500);
        d.scaling.activation_scale = 9;
        assert!(d.problems().is_empty(), "the local runtime accepts it: {:?}", d.problems());
        let p: Vec<String> = knative_problems(&d).into_iter().map(|(k, _)| k).collect();
        assert_eq!(p, ["scaling.stable-window", "scaling.scale-down-delay", "scaling.activation-scale"]);
        let e = write_manifests(&[d], Path::new("/nonexistent/never-written")).unwrap_err();
        assert!(e.to_string().contains("math: scaling.stable-window"), "{e}");
    }

    #[test]
    fn write_manifests_writes_one_file_per_service_and_the_configmap() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("manifests");
        let cfgs = [tuned(), DeploymentConfig::new("format", "rollarc-fn", vec!["format".into()])];
        let paths = write_manifests(&cfgs, &out).unwrap();
        assert_eq!(paths, [out.join("math.json"), out.join("format.json"), out.join("config-autoscaler.json")]);
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
        let cfgs: Vec<DeploymentConfig> =
            ["math", "format", "env"].into_iter().map(|f| DeploymentConfig::new(f, BUILTIN_BINARY, vec![f.to_string()])).collect();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/manifests");
        if ProcessEnv.var("ROLLARC_BLESS").is_some() {
            write_manifests(&cfgs, &dir).unwrap();
        }
        let fresh = tempfile::tempdir().unwrap();
        for p in write_manifests(&cfgs, fresh.path()).unwrap() {
            let name = p.file_name().unwrap();
            let want: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let have = std::fs::read_to_string(dir.join(name)).map(|t| serde_json::from_str::<Value>(&t).unwrap()).ok();
            assert_eq!(have.as_ref(), Some(&want), "{name:?} is stale: run ROLLARC_BLESS=1 cargo nextest run -p infra checked_in");
        }
    }
}
