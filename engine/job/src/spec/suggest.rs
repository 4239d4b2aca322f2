//! Typo suggestions for unknown field and variant names.

/// serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant …") with the
/// closest expected name suggested, when one is close enough to be a typo.
pub(super) fn with_suggestion(message: String) -> String {
    let Some(rest) = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))
    else {
        return message;
    };
    let Some((given, expected)) = rest.split_once('`') else {
        return message;
    };
    let best = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|cand| (edit_distance(given, cand), cand))
        .min();
    match best {
        Some((d, cand)) if d <= 2.max(given.len() / 3) && d < given.len() => {
            format!("{message}; did you mean `{cand}`?")
        }
        _ => message,
    }
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}
