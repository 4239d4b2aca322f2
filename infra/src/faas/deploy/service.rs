//! The Knative Service of one deployment, and what Knative would reject in it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::faas::config::{DeploymentConfig, Dur};

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
pub(super) fn cluster_knobs(cfg: &DeploymentConfig) -> [(&'static str, String); 3] {
    let s = &cfg.scaling;
    [
        (
            "scale-to-zero-grace-period",
            s.scale_to_zero_grace_period.to_string(),
        ),
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
    put(
        "target-utilization-percentage",
        num(s.target_utilization_percentage),
    );
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
    put(
        "panic-threshold-percentage",
        num(s.panic_threshold_percentage),
    );
    if s.scale_down_delay.0 > Duration::ZERO {
        put("scale-down-delay", s.scale_down_delay.to_string());
    }

    let service_ann: Map<String, Value> = cluster_knobs(cfg)
        .into_iter()
        .map(|(k, v)| (format!("rollarc.dev/{k}"), Value::String(v)))
        .collect();
    let env: Vec<Value> = cfg
        .env
        .iter()
        .filter(|(k, _)| !RESERVED_ENV.contains(&k.as_str()))
        .map(|(k, v)| json!({ "name": k, "value": v }))
        .collect();

    let mut container = json!({
        "image": cfg.image.as_deref().unwrap_or(DEFAULT_IMAGE),
        "args": cfg.args,
        "ports": [{ "containerPort": CONTAINER_PORT }],
        "env": env,
        "readinessProbe": { "httpGet": { "path": cfg.readiness_path } },
    });
    let builtin =
        Path::new(&cfg.command).file_name().and_then(|f| f.to_str()) == Some(BUILTIN_BINARY);
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
    if s.stable_window.0 < WINDOW_MIN
        || s.stable_window.0 > WINDOW_MAX
        || !whole_seconds(s.stable_window)
    {
        bad(
            "stable-window",
            format!(
                "Knative needs whole seconds in [6s, 3600s], got {}",
                s.stable_window
            ),
        );
    }
    if s.scale_down_delay.0 > WINDOW_MAX || !whole_seconds(s.scale_down_delay) {
        bad(
            "scale-down-delay",
            format!(
                "Knative needs whole seconds up to 3600s, got {}",
                s.scale_down_delay
            ),
        );
    }
    if s.scale_to_zero_grace_period.0.is_zero() {
        bad(
            "scale-to-zero-grace-period",
            "Knative needs a positive duration".into(),
        );
    }
    if let Some(t) = s.target
        && t < 0.01
    {
        bad("target", format!("Knative needs at least 0.01, got {t}"));
    }
    if s.target_utilization_percentage < 1.0 {
        bad(
            "target-utilization-percentage",
            format!(
                "Knative needs at least 1, got {}",
                s.target_utilization_percentage
            ),
        );
    }
    if s.activation_scale > 1 && s.min_scale > s.activation_scale {
        bad(
            "activation-scale",
            format!(
                "Knative needs it at least min-scale ({}), got {}",
                s.min_scale, s.activation_scale
            ),
        );
    }
    if s.activation_scale > 1 && s.max_scale > 0 && s.activation_scale > s.max_scale {
        bad(
            "activation-scale",
            format!(
                "Knative needs it at most max-scale ({}), got {}",
                s.max_scale, s.activation_scale
            ),
        );
    }
    if cfg.name == AUTOSCALER_CONFIG_NAME {
        out.push((
            "name".into(),
            format!("{AUTOSCALER_CONFIG_NAME:?} is taken by the autoscaler ConfigMap's manifest"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{annotations, round_trip, tuned};
    use super::*;

    #[test]
    fn every_knob_is_translated() {
        let cfg = tuned();
        assert!(cfg.problems().is_empty() && knative_problems(&cfg).is_empty());
        let svc = round_trip(&knative_service(&cfg));
        assert_eq!(svc["apiVersion"], "serving.knative.dev/v1");
        assert_eq!(svc["kind"], "Service");
        assert_eq!(svc["metadata"]["name"], "math");
        assert_eq!(
            svc["metadata"]["labels"]["app.kubernetes.io/part-of"],
            "rollarc"
        );
        assert_eq!(
            svc["metadata"]["annotations"]["rollarc.dev/scale-to-zero-grace-period"],
            "30s"
        );
        assert_eq!(
            svc["metadata"]["annotations"]["rollarc.dev/max-scale-up-rate"],
            "1000"
        );
        assert_eq!(
            svc["metadata"]["annotations"]["rollarc.dev/max-scale-down-rate"],
            "2"
        );

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
            assert_eq!(
                ann.get(&format!("autoscaling.knative.dev/{k}")),
                Some(&Value::String(v.into())),
                "annotation {k}"
            );
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
        assert!(
            c.get("command").is_none(),
            "rollarc-fn is the image's entrypoint"
        );
        assert_eq!(c["args"], json!(["math"]));
        assert_eq!(c["ports"], json!([{ "containerPort": 8080 }]));
        assert_eq!(
            c["env"],
            json!([{ "name": "A_FIRST", "value": "1" }, { "name": "RUST_LOG", "value": "info" }]),
            "sorted, PORT left to Knative"
        );
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
        assert!(c["readinessProbe"]["httpGet"].get("port").is_none());
        assert!(c.get("resources").is_none());
    }

    #[test]
    fn optional_annotations_only_when_asked_for() {
        let svc = round_trip(&knative_service(&DeploymentConfig::new(
            "plain",
            "rollarc-fn",
            vec!["format".into()],
        )));
        let ann = annotations(&svc);
        for k in [
            "max-scale",
            "scale-down-delay",
            "target",
            "activation-scale",
        ] {
            assert!(
                !ann.contains_key(&format!("autoscaling.knative.dev/{k}")),
                "{k} emitted for a default config"
            );
        }
        assert_eq!(ann["autoscaling.knative.dev/window"], "60s");
        assert_eq!(ann["autoscaling.knative.dev/min-scale"], "0");
        assert_eq!(svc["spec"]["template"]["spec"]["containerConcurrency"], 0);
        assert_eq!(
            svc["spec"]["template"]["spec"]["containers"][0]["env"],
            json!([])
        );

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
    fn what_knative_rejects_is_listed_by_field() {
        let mut d = tuned();
        d.scaling.stable_window = Dur::millis(1500);
        d.scaling.tick_interval = Dur::millis(100);
        d.scaling.scale_down_delay = Dur::millis(2500);
        d.scaling.activation_scale = 9;
        assert!(
            d.problems().is_empty(),
            "the local runtime accepts it: {:?}",
            d.problems()
        );
        let p: Vec<String> = knative_problems(&d).into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            p,
            [
                "scaling.stable-window",
                "scaling.scale-down-delay",
                "scaling.activation-scale"
            ]
        );
    }
}
