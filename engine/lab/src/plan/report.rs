//! The planner's outputs: the table as printed, and the recommended spec.

use serde_json::Value;

use super::Plan;
use crate::scenario::Scenario;

/// The recommended configuration's job spec: the best candidate's, with the base's own run
/// length and injected faults (the planner simulates a few steps without faults).
pub fn recommended_spec(sc: &Scenario, p: &Plan) -> Value {
    let mut v = p.best.spec.clone();
    for path in ["/rollout/steps", "/sim/faults"] {
        let (parent, key) = path.rsplit_once('/').unwrap_or_default();
        match (sc.base.pointer(path), v.pointer_mut(parent)) {
            (Some(x), Some(Value::Object(o))) => {
                o.insert(key.to_string(), x.clone());
            }
            (None, Some(Value::Object(o))) => {
                o.remove(key);
            }
            _ => {}
        }
    }
    v
}

/// The planner's report, as printed.
pub fn render(p: &Plan) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{} candidates{}, cheapest per step first (prices per hour, H20 GPU-hour = 1):\n",
        p.candidates.len(),
        p.budget
            .map(|b| format!(" under a GPU budget of {b:.0}"))
            .unwrap_or_default()
    ));
    out.push_str(&format!(
        "  {:>7} {:<22} {:<30} {:>8} {:>9} {:>10}  {:<12} pool utilisation\n",
        "trainer", "rollout GPUs", "resources", "per hour", "step s", "per step", "bottleneck"
    ));
    for c in p.candidates.iter().take(16) {
        let roll: Vec<String> = c
            .rollout_gpus
            .iter()
            .map(|(d, g)| format!("{g} {d}"))
            .collect();
        let util: Vec<String> = c
            .pool_utilisation
            .iter()
            .map(|(k, u)| format!("{k} {:.0}%", u * 100.0))
            .collect();
        let res = c.resources.label();
        out.push_str(&format!(
            "  {:>7} {:<22} {:<30} {:>8.1} {:>9.2} {:>10.4}  {:<12} {}\n",
            c.trainer_gpus,
            roll.join(" + "),
            if res.is_empty() {
                "as in the spec"
            } else {
                &res
            },
            c.hourly,
            c.step_s,
            c.cost_per_step,
            c.bottleneck,
            util.join(", ")
        ));
    }
    let b = &p.best;
    let roll: Vec<String> = b
        .rollout_gpus
        .iter()
        .map(|(d, g)| format!("{g} × {d}"))
        .collect();
    let res = b.resources.label();
    out.push_str(&format!(
        "recommended: trainer {} GPUs, rollout {}{} ({:.1} an hour): predicted step {:.2} s, {:.4} per step; the trainer trains {:.0}% of each step; bottleneck: {}\n",
        b.trainer_gpus,
        roll.join(" + "),
        if res.is_empty() { String::new() } else { format!(", {res}") },
        b.hourly,
        b.step_s,
        b.cost_per_step,
        b.trainer_busy * 100.0,
        b.bottleneck,
    ));
    out
}
