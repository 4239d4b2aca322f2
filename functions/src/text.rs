//! Text helpers shared by the scorers: bounded excerpts of program output and model answers.

/// The last `max` characters of `s`, marked when cut.
pub fn tail_chars(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - max).collect();
    format!("…{tail}")
}

/// The first `max` characters of `s`, marked when cut.
pub fn head_chars(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_are_bounded_and_marked() {
        assert_eq!(tail_chars("abcdef", 3), "…def");
        assert_eq!(tail_chars("äöü", 5), "äöü");
        assert_eq!(head_chars("abcdef", 3), "abc…");
        assert_eq!(head_chars("äöü", 3), "äöü");
    }
}
