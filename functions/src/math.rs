//! The `math` reward: extracts the final answer of a response (the last `\boxed{…}`, else the
//! text after "answer is", else the last number) and checks it against the reference for
//! equivalence: integers, decimals, fractions `a/b`, `\frac{a}{b}` (and `\dfrac`, `\tfrac`),
//! with `$`, spaces, `\left`/`\right`, thousands separators and a trailing period ignored.
//! Non-numeric answers compare as normalised text.

/// Result of a check, with what was compared.
#[derive(Clone, Debug, PartialEq)]
pub struct MathCheck {
    pub correct: bool,
    pub extracted: Option<String>,
    pub normalised: Option<String>,
}

/// The content of the last `\boxed{…}` (braces balanced).
pub fn last_boxed(text: &str) -> Option<String> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// The final answer of a response.
pub fn extract_answer(text: &str) -> Option<String> {
    if let Some(b) = last_boxed(text) {
        return Some(b);
    }
    let lower = text.to_ascii_lowercase();
    if let Some(i) = lower.rfind("answer is") {
        let rest = text[i + "answer is".len()..]
            .trim()
            .trim_start_matches(':')
            .trim();
        let end = rest.find('\n').unwrap_or(rest.len());
        let ans = rest[..end].trim().trim_end_matches('.').trim();
        if !ans.is_empty() {
            return Some(ans.to_string());
        }
    }
    last_number(text)
}

fn last_number(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut end = None;
    let mut i = b.len();
    while i > 0 {
        i -= 1;
        if b[i].is_ascii_digit() {
            end = Some(i + 1);
            break;
        }
    }
    let end = end?;
    let mut start = end;
    while start > 0
        && (b[start - 1].is_ascii_digit()
            || b[start - 1] == b'.'
            || b[start - 1] == b'/'
            || b[start - 1] == b',')
    {
        start -= 1;
    }
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    Some(
        text[start..end]
            .trim_matches(|c| c == '.' || c == ',' || c == '/')
            .to_string(),
    )
}

/// Removes formatting that does not change the value.
pub fn normalise(ans: &str) -> String {
    let mut s = ans.trim().to_string();
    for pat in [
        "$",
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\displaystyle",
        " ",
    ] {
        s = s.replace(pat, "");
    }
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac");
    if let Some(inner) = s.strip_prefix("\\text{").and_then(|r| r.strip_suffix('}')) {
        s = inner.to_string();
    }
    let mut s = s.trim_end_matches('.').to_string();
    // A single value in parentheses: "(2)" → "2" (tuples keep theirs).
    while s.len() >= 2 && s.starts_with('(') && s.ends_with(')') && !s.contains(',') {
        s = s[1..s.len() - 1].to_string();
    }
    // Thousands separators: "1,234" → "1234" (only in an otherwise numeric answer).
    if s.chars()
        .all(|c| c.is_ascii_digit() || c == ',' || c == '.' || c == '-')
        && s.contains(',')
    {
        return s.replace(',', "");
    }
    s
}

/// The value of a numeric answer: integer, decimal, `a/b` or `\frac{a}{b}`.
pub fn value(s: &str) -> Option<f64> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix("\\frac{") {
        let close = rest.find('}')?;
        let num = &rest[..close];
        let den = rest[close + 1..].strip_prefix('{')?.strip_suffix('}')?;
        return Some(value(num)? / value(den)?).filter(|v| v.is_finite());
    }
    if let Some(rest) = s.strip_prefix("-\\frac{") {
        return value(&format!("\\frac{{{rest}")).map(|v| -v);
    }
    if let Some((a, b)) = s.split_once('/') {
        return Some(value(a)? / value(b)?).filter(|v| v.is_finite());
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Checks `response` against `reference`.
pub fn check(response: &str, reference: &str) -> MathCheck {
    let Some(extracted) = extract_answer(response) else {
        return MathCheck {
            correct: false,
            extracted: None,
            normalised: None,
        };
    };
    let got = normalise(&extracted);
    // The reference is an answer already (a boxed one is unwrapped).
    let want = normalise(&last_boxed(reference).unwrap_or_else(|| reference.to_string()));
    let correct = match (value(&got), value(&want)) {
        (Some(a), Some(b)) => (a - b).abs() <= 1e-6 * b.abs().max(1.0),
        _ => !got.is_empty() && got == want,
    };
    MathCheck {
        correct,
        extracted: Some(extracted),
        normalised: Some(got),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equivalence_table() {
        let cases = [
            ("7", "7", true),
            ("The answer is 7.", "7", true),
            ("so x = \\boxed{\\frac{1}{2}}", "0.5", true),
            ("\\boxed{\\dfrac{3}{4}}", "3/4", true),
            ("$-2$", "-2", true),
            ("total 1,234 apples", "1234", true),
            ("0.3333333", "1/3", true),
            ("\\boxed{\\left( 2 \\right)}", "(2)", true),
            ("I think 8", "7", false),
            ("no number here", "7", false),
            ("\\boxed{x+1}", "x+1", true),
            ("\\boxed{x+1}", "x+2", false),
            ("3+4=7", "7", true),
            ("1/0", "1", false),
        ];
        for (resp, reference, want) in cases {
            let c = check(resp, reference);
            assert_eq!(c.correct, want, "{resp:?} vs {reference:?}: {c:?}");
        }
    }

    #[test]
    fn boxed_extraction_balances_braces() {
        assert_eq!(
            last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c").as_deref(),
            Some("\\frac{2}{3}")
        );
        assert_eq!(last_boxed("\\boxed{unclosed"), None);
    }
}
