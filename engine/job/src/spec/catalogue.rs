//! The catalogue of every [`Knob`](super::knob::Knob) of the spec, as the OpenAPI schema
//! ([`annotate_schema`]) and the job-spec manual ([`markdown_table`], which
//! `docs/job-spec.md` must contain; a test holds it) show them.

use super::knob::KnobInfo;

/// Every declared knob, in the manual's order.
pub fn all() -> Vec<KnobInfo> {
    let mut all = super::task::knobs();
    all.extend(super::pool::knobs());
    all.extend(super::rollout::knobs());
    all.extend(super::trainer::knobs());
    all.extend(super::eval::knobs());
    all
}

/// Writes each knob's bounds, default and description into the OpenAPI document's schemas
/// (`components/schemas/<Schema>/properties/<name>`).
pub fn annotate_schema(doc: &mut serde_json::Value) {
    for k in all() {
        let path = format!("/components/schemas/{}/properties/{}", k.schema, k.name);
        let Some(p) = doc.pointer_mut(&path).and_then(|p| p.as_object_mut()) else {
            continue;
        };
        let num = |x: f64| {
            if x.fract() == 0.0 && x.abs() < 9e15 {
                serde_json::json!(x as i64)
            } else {
                serde_json::json!(x)
            }
        };
        if k.exclusive_min {
            p.insert("exclusiveMinimum".into(), num(k.min));
            p.remove("minimum");
        } else {
            p.insert("minimum".into(), num(k.min));
        }
        p.insert("maximum".into(), num(k.max));
        p.insert("description".into(), k.doc.into());
        if let Some(d) = k.default_json {
            p.insert("default".into(), d);
        }
    }
}

/// The manual's table of knobs (`docs/job-spec.md`, section "Knobs").
pub fn markdown_table() -> String {
    let mut out = String::from("| field | range | default | meaning |\n|---|---|---|---|\n");
    for k in all() {
        let mut default = match (&k.default, k.unit) {
            (Some(d), "") => d.clone(),
            (Some(d), unit) => format!("{d} {unit}"),
            (None, _) => String::new(),
        };
        if !k.default_note.is_empty() {
            if !default.is_empty() {
                default.push_str("; ");
            }
            default.push_str(k.default_note);
        }
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            k.field, k.range, default, k.doc
        ));
    }
    out
}
