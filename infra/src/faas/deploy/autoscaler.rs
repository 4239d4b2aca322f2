//! The cluster-wide `config-autoscaler` ConfigMap.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{Map, Value, json};

use super::service::{AUTOSCALER_CONFIG_NAME, cluster_knobs};
use crate::faas::config::DeploymentConfig;

/// One cluster-wide knob the deployments disagree on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnobConflict {
    pub knob: &'static str,
    /// Each value asked for, with the deployments asking for it.
    pub wants: Vec<(String, Vec<String>)>,
}

impl fmt::Display for KnobConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "deployments disagree on {}, which Knative sets once per cluster: ",
            self.knob
        )?;
        for (i, (value, names)) in self.wants.iter().enumerate() {
            let sep = if i == 0 { "" } else { " vs " };
            write!(f, "{sep}{value} ({})", names.join(", "))?;
        }
        Ok(())
    }
}

/// The cluster-wide knobs the deployments disagree on (at least one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct KnobConflicts(pub Vec<KnobConflict>);

impl fmt::Display for KnobConflicts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

/// The `config-autoscaler` ConfigMap (namespace `knative-serving`) with the knobs Knative sets
/// only per cluster: `scale-to-zero-grace-period`, `max-scale-up-rate`, `max-scale-down-rate`,
/// and `allow-zero-initial-scale: "true"` when a deployment has `initial-scale` 0 (Knative
/// rejects that annotation otherwise). Every other `config-autoscaler` key only holds defaults
/// that the Services' annotations override, so none is emitted; the local `tick-interval` has
/// no Knative key at all (Knative's tick is a fixed 2 s).
///
/// Since one value serves the whole cluster, the deployments must agree: otherwise the error
/// names each disagreeing knob and which deployments want which value. No deployments: an
/// empty `data` (applying it changes nothing).
///
/// `kubectl apply` of this file merges these keys into Knative's ConfigMap and keeps the
/// others. Where the Knative Operator manages Serving, put the same keys under the
/// `KnativeServing` resource's `spec.config.autoscaler` instead (the operator reverts direct
/// ConfigMap edits).
pub fn knative_autoscaler_config(cfgs: &[DeploymentConfig]) -> Result<Value, KnobConflicts> {
    let mut by_knob: BTreeMap<&'static str, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for cfg in cfgs {
        for (knob, value) in cluster_knobs(cfg) {
            by_knob
                .entry(knob)
                .or_default()
                .entry(value)
                .or_default()
                .push(cfg.name.clone());
        }
    }
    let mut data = Map::new();
    let mut conflicts = Vec::new();
    for (knob, values) in by_knob {
        if values.len() == 1 {
            if let Some((v, _)) = values.into_iter().next() {
                data.insert(knob.into(), Value::String(v));
            }
        } else {
            conflicts.push(KnobConflict {
                knob,
                wants: values.into_iter().collect(),
            });
        }
    }
    if !conflicts.is_empty() {
        return Err(KnobConflicts(conflicts));
    }
    if cfgs.iter().any(|c| c.scaling.initial_scale == 0) {
        data.insert(
            "allow-zero-initial-scale".into(),
            Value::String("true".into()),
        );
    }
    Ok(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": AUTOSCALER_CONFIG_NAME, "namespace": "knative-serving" },
        "data": data,
    }))
}
