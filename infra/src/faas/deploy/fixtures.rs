//! Deployments the tests of this module share.

use serde_json::{Map, Value};

use crate::faas::Scaling;
use crate::faas::config::{DeploymentConfig, Dur};

pub(super) fn tuned() -> DeploymentConfig {
    let mut d = DeploymentConfig::new(
        "math",
        "/opt/rollarc/target/release/rollarc-fn",
        vec!["math".into()],
    );
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
pub(super) fn round_trip(v: &Value) -> Value {
    let text = serde_json::to_string_pretty(v).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub(super) fn annotations(svc: &Value) -> &Map<String, Value> {
    svc["spec"]["template"]["metadata"]["annotations"]
        .as_object()
        .unwrap()
}
