//! `--set PATH=VALUE` on `rollarc run` / `submit` / `sim`: one field of a job file changed
//! from the command line, e.g. `rollout.steps=20`, `tasks[0].group_size=4`,
//! `trainer.lr=0.003`, `pools[1].backend.kind=sim`; `--set '~PATH'` removes a field (or an
//! array element), e.g. `~trainer.aggregation` when `trainer.kind=external` no longer has
//! one.

use serde_json::Value;

/// Sets every `PATH=VALUE` of `sets` in `doc` (a job spec as JSON). The value is read as a
/// TOML value (`20`, `0.5`, `true`, `"text"`, `[1, 2]`, `{ a = 1 }`), else taken as a string.
/// Missing tables are created; an index must name an existing array element. `~PATH`
/// removes what `PATH` names, which must exist (a misspelt path is an error, not a no-op).
pub fn apply_overrides(doc: &mut Value, sets: &[String]) -> Result<(), String> {
    for set in sets {
        if let Some(path) = set.trim().strip_prefix('~') {
            remove(doc, path.trim()).map_err(|e| format!("--set {set:?}: {e}"))?;
            continue;
        }
        let (path, raw) = set
            .split_once('=')
            .ok_or_else(|| format!("--set {set:?}: expected PATH=VALUE, e.g. rollout.steps=20"))?;
        let value = parse_value(raw.trim());
        let keys = parse_path(path.trim()).map_err(|e| format!("--set {set:?}: {e}"))?;
        let mut at = &mut *doc;
        for (i, k) in keys.iter().enumerate() {
            let last = i + 1 == keys.len();
            at = match k {
                Key::Field(name) => {
                    if at.is_null() {
                        *at = Value::Object(Default::default());
                    }
                    let Value::Object(map) = at else {
                        return Err(format!(
                            "--set {set:?}: {} is not a table",
                            show(&keys[..i])
                        ));
                    };
                    if last {
                        map.insert(name.clone(), value.clone());
                        break;
                    }
                    map.entry(name.clone()).or_insert(Value::Null)
                }
                Key::Index(n) => {
                    let Value::Array(items) = at else {
                        return Err(format!(
                            "--set {set:?}: {} is not an array",
                            show(&keys[..i])
                        ));
                    };
                    let len = items.len();
                    let Some(item) = items.get_mut(*n) else {
                        return Err(format!(
                            "--set {set:?}: {} has {len} element(s), no [{n}]",
                            show(&keys[..i])
                        ));
                    };
                    if last {
                        *item = value.clone();
                        break;
                    }
                    item
                }
            };
        }
    }
    Ok(())
}

/// Removes the field or array element `path` names.
fn remove(doc: &mut Value, path: &str) -> Result<(), String> {
    let keys = parse_path(path)?;
    let (last, parents) = keys.split_last().ok_or("empty path")?;
    let mut at = &mut *doc;
    for (i, k) in parents.iter().enumerate() {
        let next = match k {
            Key::Field(f) => at.get_mut(f.as_str()),
            Key::Index(n) => at.get_mut(*n),
        };
        at = next.ok_or_else(|| format!("{} is not in the spec", show(&keys[..=i])))?;
    }
    let gone = match (last, at) {
        (Key::Field(f), Value::Object(m)) => m.remove(f.as_str()).is_some(),
        (Key::Index(n), Value::Array(a)) if *n < a.len() => {
            a.remove(*n);
            true
        }
        _ => false,
    };
    if gone {
        Ok(())
    } else {
        Err(format!("{} is not in the spec", show(&keys)))
    }
}

#[derive(Debug, PartialEq)]
enum Key {
    Field(String),
    Index(usize),
}

fn show(keys: &[Key]) -> String {
    if keys.is_empty() {
        return "the spec".into();
    }
    let mut s = String::new();
    for k in keys {
        match k {
            Key::Field(f) if s.is_empty() => s.push_str(f),
            Key::Field(f) => {
                s.push('.');
                s.push_str(f);
            }
            Key::Index(n) => s.push_str(&format!("[{n}]")),
        }
    }
    s
}

fn parse_path(path: &str) -> Result<Vec<Key>, String> {
    let mut keys = Vec::new();
    for part in path.split('.') {
        let (name, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if name.is_empty() && (keys.is_empty() || rest.is_empty()) {
            return Err(format!("empty key in {path:?}"));
        }
        if !name.is_empty() {
            keys.push(Key::Field(name.to_string()));
        }
        while let Some(r) = rest.strip_prefix('[') {
            let (n, after) = r
                .split_once(']')
                .ok_or_else(|| format!("unclosed [ in {path:?}"))?;
            let n = n
                .parse()
                .map_err(|_| format!("{n:?} is not an index in {path:?}"))?;
            keys.push(Key::Index(n));
            rest = after;
        }
        if !rest.is_empty() {
            return Err(format!("unexpected {rest:?} in {path:?}"));
        }
    }
    Ok(keys)
}

fn parse_value(raw: &str) -> Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .and_then(|v| serde_json::to_value(v).ok())
        .unwrap_or_else(|| Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_set_numbers_strings_tables_and_array_elements() {
        let mut doc = serde_json::json!({
            "tasks": [{"domain": "a", "group_size": 8}, {"domain": "b"}],
            "rollout": {"steps": 10}
        });
        apply_overrides(
            &mut doc,
            &[
                "rollout.steps=20".into(),
                "tasks[1].group_size = 4".into(),
                "trainer.lr=0.003".into(),
                "trainer.kind=builtin".into(),
                "tasks[0].env={ kind = \"frozenlake\", size = 4 }".into(),
                "name=\"run 7\"".into(),
            ],
        )
        .unwrap();
        assert_eq!(doc["rollout"]["steps"], 20);
        assert_eq!(doc["tasks"][1]["group_size"], 4);
        assert_eq!(doc["trainer"]["lr"], 0.003);
        assert_eq!(doc["trainer"]["kind"], "builtin");
        assert_eq!(doc["tasks"][0]["env"]["size"], 4);
        assert_eq!(doc["name"], "run 7");
        // Problems name the path.
        for (set, want) in [
            ("tasks[5].x=1", "has 2 element(s), no [5]"),
            ("rollout.steps.x=1", "rollout.steps is not a table"),
            ("rollout[0]=1", "rollout is not an array"),
            ("steps", "expected PATH=VALUE"),
            ("tasks[x].a=1", "is not an index"),
        ] {
            let e = apply_overrides(&mut doc, &[set.into()]).unwrap_err();
            assert!(e.contains(want), "{set}: {e}");
        }
    }

    #[test]
    fn a_tilde_removes_a_field_or_an_element_that_exists() {
        let mut doc = serde_json::json!({
            "tasks": [{"domain": "a"}, {"domain": "b"}],
            "trainer": {"kind": "builtin", "aggregation": "token_mean"}
        });
        apply_overrides(
            &mut doc,
            &[
                "trainer.kind=external".into(),
                "~trainer.aggregation".into(),
                " ~ tasks[0]".into(),
            ],
        )
        .unwrap();
        assert_eq!(doc["trainer"], serde_json::json!({"kind": "external"}));
        assert_eq!(doc["tasks"], serde_json::json!([{"domain": "b"}]));
        for (set, want) in [
            (
                "~trainer.agregation",
                "trainer.agregation is not in the spec",
            ),
            ("~tasks[3]", "tasks[3] is not in the spec"),
            ("~rollout.steps", "rollout is not in the spec"),
        ] {
            let e = apply_overrides(&mut doc, &[set.into()]).unwrap_err();
            assert!(e.contains(want), "{set}: {e}");
        }
    }
}
