//! Reading a judge's answer: the last score line, checked, never made up.

use std::sync::LazyLock;

use crate::scorer::ScoreError;
use crate::text::tail_chars;

/// Longest excerpt of the judge's answer kept in error messages.
pub(super) const ERROR_CHARS: usize = 300;

/// A pointwise verdict: `raw` out of `out_of`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    pub raw: f64,
    pub out_of: f64,
}

impl Verdict {
    pub fn normalised(&self) -> f64 {
        self.raw / self.out_of
    }
}

const NUM: &str = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:nan|inf(?:inity)?)";

static SCORE_LINE: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(&format!(
        r"(?i)\bscore\b[*_]*\s*[:=]\s*[*_]*\s*({NUM})(?:\s*/\s*({NUM}))?"
    ))
    .expect("a valid pattern")
});
static SCORES_LINE: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(r"(?i)\bscores\b[*_]*\s*[:=]\s*[*_]*\s*\[([^\[\]]*)\]")
        .expect("a valid pattern")
});

fn unparsable(why: &str, answer: &str) -> ScoreError {
    ScoreError::Failed(format!(
        "judge answer could not be parsed: {why}; the answer ends {:?}",
        tail_chars(answer, ERROR_CHARS)
    ))
}

fn check_range(x: f64, max: f64, what: &str, answer: &str) -> Result<f64, ScoreError> {
    if !x.is_finite() {
        return Err(unparsable(
            &format!("{what} is not a finite number"),
            answer,
        ));
    }
    if !(0.0..=max).contains(&x) {
        return Err(unparsable(
            &format!("{what} {x} is outside [0, {max}]"),
            answer,
        ));
    }
    Ok(x)
}

/// Reads the last `Score: x` (or `Score: x/y`) of a pointwise answer; x must lie in
/// [0, max_score] (or [0, y]).
pub fn parse_pointwise(answer: &str, max_score: f64) -> Result<Verdict, ScoreError> {
    let Some(c) = SCORE_LINE.captures_iter(answer).last() else {
        return Err(unparsable("no \"Score: <number>\" line", answer));
    };
    let num = |i: usize| {
        c.get(i).map(|m| {
            m.as_str()
                .parse::<f64>()
                .map_err(|_| unparsable(&format!("{:?} is not a number", m.as_str()), answer))
        })
    };
    let out_of = match num(2).transpose()? {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(unparsable(
                &format!("the score's scale {d} is not a positive number"),
                answer,
            ));
        }
        Some(d) => d,
        None => max_score,
    };
    let raw = num(1)
        .transpose()?
        .ok_or_else(|| unparsable("no score number", answer))?;
    let raw = check_range(raw, out_of, "the score", answer)?;
    Ok(Verdict { raw, out_of })
}

/// Reads the last `Scores: [a, b, …]` of a group answer: exactly `n` numbers in [0, max_score].
pub fn parse_group(answer: &str, n: usize, max_score: f64) -> Result<Vec<f64>, ScoreError> {
    let Some(c) = SCORES_LINE.captures_iter(answer).last() else {
        return Err(unparsable("no \"Scores: [...]\" line", answer));
    };
    let inner = c.get(1).map(|m| m.as_str()).unwrap_or_default();
    let entries: Vec<&str> = if inner.trim().is_empty() {
        Vec::new()
    } else {
        inner.split(',').map(str::trim).collect()
    };
    if entries.len() != n {
        return Err(unparsable(
            &format!("{} scores for {n} responses", entries.len()),
            answer,
        ));
    }
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let x = e.parse::<f64>().map_err(|_| {
                unparsable(&format!("score {} ({e:?}) is not a number", i + 1), answer)
            })?;
            check_range(x, max_score, &format!("score {}", i + 1), answer)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(e: ScoreError) -> String {
        match e {
            ScoreError::Failed(m) => m,
            other => panic!("a parse failure is a plain scorer failure, got {other:?}"),
        }
    }

    #[test]
    fn pointwise_answers_table() {
        let ok: [(&str, f64, f64); 8] = [
            ("Clear and correct.\nScore: 8", 8.0, 10.0),
            ("score: 3 at first... on reflection\nSCORE: 9.5", 9.5, 10.0),
            ("**Score:** 7/10", 7.0, 10.0),
            ("Final score = 4 / 5.", 4.0, 5.0),
            ("Score: 0", 0.0, 10.0),
            ("Score: 10", 10.0, 10.0),
            ("Score: 1e1", 10.0, 10.0),
            ("Scores: [1, 2]\nScore: 2", 2.0, 10.0),
        ];
        for (answer, raw, out_of) in ok {
            let v = parse_pointwise(answer, 10.0).unwrap_or_else(|e| panic!("{answer:?}: {e}"));
            assert_eq!(v, Verdict { raw, out_of }, "{answer:?}");
        }
        assert_eq!(
            parse_pointwise("Score: 8/10", 10.0).unwrap().normalised(),
            0.8
        );
        let bad: [(&str, &str); 8] = [
            ("I think it is good.", "no \"Score"),
            ("Score: excellent", "no \"Score"),
            ("Score: NaN", "not a finite"),
            ("Score: inf", "not a finite"),
            ("Score: 1e999", "not a finite"),
            ("Score: 11", "outside [0, 10]"),
            ("Score: -1", "outside [0, 10]"),
            ("Score: 6/0", "not a positive"),
        ];
        for (answer, want) in bad {
            let m = msg(parse_pointwise(answer, 10.0).unwrap_err());
            assert!(
                m.starts_with("judge answer could not be parsed: ") && m.contains(want),
                "{answer:?}: {m}"
            );
            assert!(
                m.contains(&format!("{:?}", answer)),
                "the message quotes the answer: {m}"
            );
        }
    }

    #[test]
    fn group_answers_table() {
        assert_eq!(
            parse_group("[1] fine [2] wrong\nScores: [8, 2.5, 10]", 3, 10.0).unwrap(),
            vec![8.0, 2.5, 10.0]
        );
        assert_eq!(
            parse_group("scores: [1,2]\n**Scores:** [3, 4]", 2, 10.0).unwrap(),
            vec![3.0, 4.0],
            "the last list counts"
        );
        let bad: [(&str, usize, &str); 7] = [
            ("all fine", 2, "no \"Scores"),
            ("Scores: [1, 2, 3]", 2, "3 scores for 2 responses"),
            ("Scores: []", 1, "0 scores for 1 responses"),
            ("Scores: [1, NaN]", 2, "score 2 is not a finite"),
            ("Scores: [1, 12]", 2, "score 2 12 is outside"),
            ("Scores: [1, good]", 2, "score 2 (\"good\") is not a number"),
            ("Scores: [1,, 2]", 2, "3 scores for 2"),
        ];
        for (answer, n, want) in bad {
            let m = msg(parse_group(answer, n, 10.0).unwrap_err());
            assert!(
                m.starts_with("judge answer could not be parsed: ") && m.contains(want),
                "{answer:?}: {m}"
            );
        }
    }
}
