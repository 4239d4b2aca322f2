//! A job's `tags`: labels to find and compare runs by.

use super::Problems;

/// Most tags a job may carry.
pub const MAX_TAGS: usize = 16;

/// Whether `t` may be a tag: 1 to 64 characters of letters, digits and `_ . : / = + -`.
pub fn valid_tag(t: &str) -> bool {
    (1..=64).contains(&t.len())
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.:/=+-".contains(c))
}

/// Reports too many tags, and each malformed one by its index.
pub(super) fn check(tags: &[String], problems: &mut Problems) {
    if tags.len() > MAX_TAGS {
        problems.push(
            "tags".into(),
            format!("{} tags, at most {MAX_TAGS}", tags.len()),
        );
    }
    for (i, t) in tags.iter().enumerate() {
        if !valid_tag(t) {
            problems.push(
                format!("tags[{i}]"),
                format!("{t:?}: a tag is 1 to 64 characters of letters, digits and _ . : / = + -"),
            );
        }
    }
}
