//! The catalogue of every [`Knob`](super::knob::Knob) of the spec, as the OpenAPI schema
//! ([`annotate_schema`]) and the job-spec manual ([`markdown_table`], which
//! `docs/job-spec.md` must contain; a test holds it) show them.

use super::knob::KnobInfo;

/// Every declared knob, in the manual's order.
pub fn all() -> Vec<KnobInfo> {
    let mut all = super::task::knobs();
    all.extend(super::env::knobs());
    all.extend(super::pool::knobs());
    all.extend(super::rollout::knobs());
    all.extend(super::trainer::knobs());
    all.extend(super::eval::knobs());
    all
}

/// Writes each knob's bounds, default and description into the OpenAPI document's schemas
/// (`components/schemas/<Schema>/properties/<name>`, or the property of a tagged enum's
/// variant: see [`property`]).
pub fn annotate_schema(doc: &mut serde_json::Value) {
    for k in all() {
        let Some(p) = property(doc, k.schema, k.name) else {
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

/// The schema of `schema`'s property `name`: `Schema`, or `Enum.variant` for a variant of an
/// internally tagged enum (its `oneOf` entry whose `kind` is `variant`).
pub fn property<'a>(
    doc: &'a mut serde_json::Value,
    schema: &str,
    name: &str,
) -> Option<&'a mut serde_json::Map<String, serde_json::Value>> {
    let (schema, variant) = match schema.split_once('.') {
        Some((s, v)) => (s, Some(v)),
        None => (schema, None),
    };
    let mut s = doc.pointer_mut(&format!("/components/schemas/{schema}"))?;
    if let Some(v) = variant {
        s = s.get_mut("oneOf")?.as_array_mut()?.iter_mut().find(|o| {
            o.pointer("/properties/kind/enum")
                .and_then(|e| e.as_array())
                .is_some_and(|e| e.iter().any(|k| k == v))
        })?;
    }
    s.pointer_mut(&format!("/properties/{name}"))?
        .as_object_mut()
}
