//! The harness's marker lines, read back.

/// A failure as the harness reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub error: String,
    pub message: String,
}

/// One test's outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum TestOutcome {
    Pass,
    Fail(Failure),
}

/// What the harness reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Markers {
    /// The harness started (before the candidate ran).
    pub ready: bool,
    /// The candidate failed to compile or raised while loading.
    pub load_error: Option<Failure>,
    /// Per test, in order; `None` where nothing was reported.
    pub tests: Vec<Option<TestOutcome>>,
    /// The harness finished every test.
    pub done: bool,
}

/// Reads the marker lines carrying `tag` (anything else is ignored; the first report of a test
/// counts; indices outside `0..total` are ignored).
pub fn parse_markers(stdout: &str, tag: &str, total: usize) -> Markers {
    let mut m = Markers {
        tests: vec![None; total],
        ..Markers::default()
    };
    let failure = |rest: &str| {
        let (error, message) = rest.split_once(' ').unwrap_or((rest, ""));
        Failure {
            error: error.to_string(),
            message: message
                .replace("\\n", "\n")
                .replace("\\r", "\r")
                .replace("\\\\", "\\"),
        }
    };
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix(tag).and_then(|r| r.strip_prefix(' ')) else {
            continue;
        };
        let (kind, rest) = rest.split_once(' ').unwrap_or((rest, ""));
        match kind {
            "READY" => m.ready = true,
            "DONE" => m.done = true,
            "LOAD_FAIL" if m.load_error.is_none() => m.load_error = Some(failure(rest)),
            "TEST" => {
                let (idx, rest) = rest.split_once(' ').unwrap_or((rest, ""));
                let Some(slot) = idx.parse::<usize>().ok().and_then(|i| m.tests.get_mut(i)) else {
                    continue;
                };
                if slot.is_some() {
                    continue;
                }
                let (verdict, rest) = rest.split_once(' ').unwrap_or((rest, ""));
                *slot = match verdict {
                    "PASS" => Some(TestOutcome::Pass),
                    "FAIL" => Some(TestOutcome::Fail(failure(rest))),
                    _ => None,
                };
            }
            _ => {}
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_read_only_with_the_tag() {
        let tag = "__ROLLARC__abc";
        let out = "__ROLLARC__abc READY\n\
                   __ROLLARC__xyz TEST 1 PASS\n\
                   __ROLLARC__abc TEST 0 PASS\n\
                   __ROLLARC__abc TEST 1 FAIL AssertionError line\\nnext \\\\ end\n\
                   __ROLLARC__abc TEST 1 PASS\n\
                   __ROLLARC__abc TEST 7 PASS\n\
                   __ROLLARC__abc TEST x PASS\n\
                   __ROLLARC__abcd TEST 2 PASS\n\
                   garbage\n\
                   __ROLLARC__abc DONE\n";
        let m = parse_markers(out, tag, 3);
        assert!(m.ready && m.done && m.load_error.is_none());
        assert_eq!(m.tests[0], Some(TestOutcome::Pass));
        assert_eq!(
            m.tests[1],
            Some(TestOutcome::Fail(Failure {
                error: "AssertionError".into(),
                message: "line\nnext \\ end".into()
            }))
        );
        assert_eq!(
            m.tests[2], None,
            "another tag or a longer one does not count"
        );
        let m = parse_markers(
            "__ROLLARC__abc READY\n__ROLLARC__abc LOAD_FAIL SyntaxError invalid syntax (<candidate>, line 1)\n",
            tag,
            2,
        );
        assert_eq!(
            m.load_error.map(|f| f.error),
            Some("SyntaxError".to_string())
        );
        assert!(!m.done);
        assert_eq!(
            parse_markers("", tag, 2),
            Markers {
                tests: vec![None, None],
                ..Markers::default()
            }
        );
    }
}
