//! The Python harness that runs a candidate and its tests, and the per-run tag its markers
//! carry.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh unguessable tag: 128 bits from the standard library's hasher, whose keys are random
/// per process (and advance with every use).
pub(super) fn nonce() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let part = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        h.finish()
    };
    format!("{:016x}{:016x}", part(1), part(2))
}

/// The harness for one item: Python source, fed to `python -I -B -`. Strings go in as JSON
/// literals, which are valid Python string literals.
pub fn harness(tag: &str, source: &str, tests: &[String]) -> String {
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let tests_lit = format!(
        "[{}]",
        tests.iter().map(|t| lit(t)).collect::<Vec<_>>().join(", ")
    );
    format!(
        "{HARNESS}\n__rollarc_harness({}, {}, {})\n",
        lit(tag),
        lit(source),
        tests_lit
    )
}

const HARNESS: &str = r#"import os, sys, types

def __rollarc_harness(tag, src, tests):
    # Our own references, taken before the candidate can patch builtins.
    _exec, _compile, _BE, _type, _str, _enum, _exit = exec, compile, BaseException, type, str, enumerate, os._exit
    out = sys.stdout
    write, flush = out.write, out.flush

    def emit(line):
        write(tag + " " + line + "\n")
        flush()

    def describe(e):
        name = _type(e).__name__.replace(" ", "_") or "Exception"
        try:
            m = _str(e)
        except _BE:
            m = "<unprintable>"
        m = m[:300].replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return name + " " + m

    def finish():
        emit("DONE")
        try:
            sys.__stderr__.flush()
        except _BE:
            pass
        _exit(0)

    emit("READY")
    sys.stdout = sys.stderr
    mod = types.ModuleType("solution")
    sys.modules["solution"] = mod
    ns = mod.__dict__
    try:
        _exec(_compile(src, "<candidate>", "exec"), ns)
    except _BE as e:
        emit("LOAD_FAIL " + describe(e))
        finish()
    for i, t in _enum(tests):
        try:
            _exec(_compile(t, "<test %d>" % i, "exec"), ns)
        except _BE as e:
            emit("TEST %d FAIL " % i + describe(e))
        else:
            emit("TEST %d PASS" % i)
    finish()
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_harness_embeds_arbitrary_text_as_literals() {
        let h = harness(
            "__ROLLARC__t",
            "s = \"\"\"'\\\0\u{1F600}\"\"\"\n",
            &["assert '\\n' != \"\\t\"".to_string()],
        );
        assert!(h.contains(r#"__rollarc_harness("__ROLLARC__t", "s = \"\"\"'\\\u0000😀\"\"\"\n", ["assert '\\n' != \"\\t\""])"#), "{h}");
    }

    #[test]
    fn tags_differ() {
        assert_ne!(nonce(), nonce());
        assert_eq!(nonce().len(), 32);
    }
}
