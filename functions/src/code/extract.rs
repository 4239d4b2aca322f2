//! What a request carries: the candidate program (a response's last Python code block) and
//! the tests (in the reference).

use crate::scorer::ScoreError;

/// The candidate program in a response: the last fenced code block that is Python or
/// unlabelled (an unclosed last block runs to the end), else the whole text. The flag says
/// whether a block was found. Blocks indented as a whole (e.g. inside a list) are dedented.
pub fn extract_code(text: &str) -> (String, bool) {
    let mut last: Option<String> = None;
    let mut open: Option<(usize, bool, Vec<&str>)> = None; // (indent, is python, lines)
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let lang = info
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .to_ascii_lowercase();
                    let python = matches!(lang.as_str(), "" | "python" | "py" | "python3" | "py3");
                    open = Some((indent, python, Vec::new()));
                }
            }
            Some((ind, python, mut lines)) => {
                if trimmed.starts_with("```") && trimmed.trim_end().chars().all(|c| c == '`') {
                    if python {
                        last = Some(dedent(&lines, ind));
                    }
                } else {
                    lines.push(line);
                    open = Some((ind, python, lines));
                }
            }
        }
    }
    if let Some((ind, true, lines)) = open {
        last = Some(dedent(&lines, ind));
    }
    match last {
        Some(code) => (code, true),
        None => (text.to_string(), false),
    }
}

/// Removes up to `indent` leading spaces (the fence's own indentation) from every line.
fn dedent(lines: &[&str], indent: usize) -> String {
    let mut s = String::new();
    for l in lines {
        let strip = l.bytes().take(indent).take_while(|b| *b == b' ').count();
        s.push_str(&l[strip..]);
        s.push('\n');
    }
    s
}

/// The tests a request carries in its reference: `{"tests": ["assert …", …]}`, a list of test
/// strings, or one string of test code (one test).
pub fn tests_from_reference(
    reference: Option<&serde_json::Value>,
) -> Result<Vec<String>, ScoreError> {
    const EXPECTED: &str = "code needs tests in the reference: {\"tests\": [\"assert …\", …]}, a list of test strings, or one string of test code";
    let strings = |v: &serde_json::Value| -> Option<Vec<String>> {
        v.as_array()?
            .iter()
            .map(|t| t.as_str().map(str::to_string))
            .collect()
    };
    let tests = match reference {
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(v @ serde_json::Value::Array(_)) => strings(v).ok_or_else(|| {
            ScoreError::BadRequest(format!("{EXPECTED}; the list holds a non-string"))
        })?,
        Some(serde_json::Value::Object(o)) => match o.get("tests") {
            Some(v) => strings(v).ok_or_else(|| {
                ScoreError::BadRequest(format!("{EXPECTED}; \"tests\" is not a list of strings"))
            })?,
            None => {
                return Err(ScoreError::BadRequest(format!(
                    "{EXPECTED}; the object has no \"tests\""
                )));
            }
        },
        Some(other) => {
            return Err(ScoreError::BadRequest(format!(
                "{EXPECTED}; got {}",
                json_kind(other)
            )));
        }
        None => return Err(ScoreError::BadRequest(format!("{EXPECTED}; got none"))),
    };
    if tests.is_empty() || tests.iter().all(|t| t.trim().is_empty()) {
        return Err(ScoreError::BadRequest(format!("{EXPECTED}; got no tests")));
    }
    Ok(tests)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_python_or_plain_block_is_the_program() {
        let cases: [(&str, &str, bool); 8] = [
            (
                "def f(x):\n    return x\n",
                "def f(x):\n    return x\n",
                false,
            ),
            (
                "Here:\n```python\ndef f(): return 1\n```\nDone.",
                "def f(): return 1\n",
                true,
            ),
            (
                "```\nx = 1\n```\nthen\n```py\nx = 2\n```\n",
                "x = 2\n",
                true,
            ),
            (
                "```python\nx = 1\n```\n```bash\nrm -rf /\n```\n",
                "x = 1\n",
                true,
            ),
            (
                "1. step\n   ```python\n   def f():\n       return 3\n   ```\n",
                "def f():\n    return 3\n",
                true,
            ),
            (
                "```python\ndef f():\n    return 4",
                "def f():\n    return 4\n",
                true,
            ),
            ("```bash\nls\n```", "```bash\nls\n```", false),
            ("", "", false),
        ];
        for (text, want, fenced) in cases {
            assert_eq!(extract_code(text), (want.to_string(), fenced), "{text:?}");
        }
    }

    #[test]
    fn references_carry_tests_in_three_shapes() {
        let j = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert_eq!(
            tests_from_reference(Some(&j(r#"{"tests": ["assert 1", "assert 2"]}"#))).unwrap(),
            vec!["assert 1", "assert 2"]
        );
        assert_eq!(
            tests_from_reference(Some(&j(r#"["assert 1"]"#))).unwrap(),
            vec!["assert 1"]
        );
        assert_eq!(
            tests_from_reference(Some(&j(r#""assert f(1) == 2\nassert f(2) == 3""#)))
                .unwrap()
                .len(),
            1
        );
        for bad in [
            r#"{"answer": 1}"#,
            r#"{"tests": "assert 1"}"#,
            "[1, 2]",
            "[]",
            "3",
            "null",
            r#""  ""#,
        ] {
            let e = tests_from_reference(Some(&j(bad))).unwrap_err();
            assert!(
                matches!(&e, ScoreError::BadRequest(m) if m.contains("code needs tests")),
                "{bad}: {e}"
            );
        }
        assert!(tests_from_reference(None).is_err());
    }
}
