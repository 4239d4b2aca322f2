//! Access control at the HTTP edge: tokens and roles, job owners, rate limits, the program
//! policy, and `serve` refusing a public address without tokens.

use std::time::Duration;

use reqwest::StatusCode;
use service::access::{
    Access, AccessConfig, ProgramPolicy, RateLimit, Role, TokenEntry, hash_token,
};
use tests::{TestServer, wall_clock_job};

fn token(name: &str, role: Role, secret: &str) -> TokenEntry {
    TokenEntry {
        name: name.into(),
        role,
        sha256: hash_token(secret),
    }
}

fn guarded(rate_limit: Option<RateLimit>, policy: ProgramPolicy) -> Access {
    let cfg = AccessConfig {
        tokens: vec![
            token("alice", Role::Submit, "alice-secret"),
            token("alice", Role::Read, "alice-dashboard"),
            token("bob", Role::Submit, "bob-secret"),
            token("ops", Role::Admin, "ops-secret"),
            token("viewer", Role::Read, "viewer-secret"),
        ],
        rate_limit,
        ..AccessConfig::default()
    };
    Access::new(&cfg, policy).expect("access config")
}

async fn call(
    s: &TestServer,
    method: reqwest::Method,
    path: &str,
    secret: Option<&str>,
    body: Option<String>,
) -> (StatusCode, serde_json::Value) {
    let mut r = s.client.request(method, s.url(path));
    if let Some(t) = secret {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.header("content-type", "application/toml").body(b);
    }
    let resp = r.send().await.expect("request");
    let status = resp.status();
    if status == StatusCode::UNAUTHORIZED {
        assert!(
            resp.headers().contains_key("www-authenticate"),
            "401 without WWW-Authenticate"
        );
    }
    let text = resp.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_roles_and_owners_are_enforced() {
    use reqwest::Method as M;
    let s = TestServer::start_with_access(guarded(None, ProgramPolicy::default())).await;
    let job = wall_clock_job(1000, 1, 0.05);

    // Open routes stay open; everything else needs a valid token.
    for path in ["/healthz", "/readyz", "/openapi.json"] {
        assert_eq!(call(&s, M::GET, path, None, None).await.0, 200, "{path}");
    }
    for (method, path) in [
        (M::GET, "/v1/jobs"),
        (M::POST, "/v1/jobs"),
        (M::GET, "/v1/cluster"),
        (M::GET, "/metrics"),
        (M::GET, "/v1/jobs/job-1"),
    ] {
        for secret in [None, Some("wrong")] {
            let (st, v) = call(&s, method.clone(), path, secret, Some(job.clone())).await;
            assert_eq!(st, 401, "{method} {path} with {secret:?}: {v}");
            assert_eq!(v["error"]["code"], "unauthorized");
        }
    }
    // A read token may not submit.
    let (st, v) = call(
        &s,
        M::POST,
        "/v1/jobs",
        Some("viewer-secret"),
        Some(job.clone()),
    )
    .await;
    assert_eq!(st, 403, "{v}");
    assert_eq!(v["error"]["code"], "forbidden");

    let (st, v) = call(
        &s,
        M::POST,
        "/v1/jobs",
        Some("alice-secret"),
        Some(job.clone()),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    let alice_job = v["id"].as_str().unwrap().to_string();
    let (st, v) = call(
        &s,
        M::POST,
        "/v1/jobs",
        Some("bob-secret"),
        Some(job.clone()),
    )
    .await;
    assert_eq!(st, 201, "{v}");
    let bob_job = v["id"].as_str().unwrap().to_string();

    // Each owner lists only its own jobs; the admin sees all; owners are recorded.
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, v) = call(&s, M::GET, "/v1/jobs", Some("alice-secret"), None).await;
    assert_eq!(ids(&v), std::slice::from_ref(&alice_job));
    assert_eq!(v["jobs"][0]["owner"], "alice");
    // Another token of the same owner sees the same jobs.
    let (_, v) = call(&s, M::GET, "/v1/jobs", Some("alice-dashboard"), None).await;
    assert_eq!(ids(&v), std::slice::from_ref(&alice_job));
    let (_, v) = call(&s, M::GET, "/v1/jobs", Some("viewer-secret"), None).await;
    assert_eq!(ids(&v), Vec::<String>::new());
    let (_, v) = call(&s, M::GET, "/v1/jobs", Some("ops-secret"), None).await;
    assert_eq!(ids(&v), [alice_job.clone(), bob_job.clone()]);

    // Another owner's job is not found, whatever the operation.
    for path in [
        format!("/v1/jobs/{bob_job}"),
        format!("/v1/jobs/{bob_job}/trajectories"),
        format!("/v1/jobs/{bob_job}/events"),
    ] {
        let (st, v) = call(&s, M::GET, &path, Some("alice-secret"), None).await;
        assert_eq!(st, 404, "{path}: {v}");
        assert_eq!(v["error"]["code"], "not_found");
    }
    let cancel_bob = format!("/v1/jobs/{bob_job}/cancel");
    assert_eq!(
        call(&s, M::POST, &cancel_bob, Some("alice-secret"), None)
            .await
            .0,
        404
    );
    // Alice's read token sees her job but may not cancel it.
    let cancel_alice = format!("/v1/jobs/{alice_job}/cancel");
    assert_eq!(
        call(
            &s,
            M::GET,
            &format!("/v1/jobs/{alice_job}"),
            Some("alice-dashboard"),
            None
        )
        .await
        .0,
        200
    );
    assert_eq!(
        call(&s, M::POST, &cancel_alice, Some("alice-dashboard"), None)
            .await
            .0,
        403
    );
    assert_eq!(
        call(&s, M::POST, &cancel_alice, Some("alice-secret"), None)
            .await
            .0,
        202
    );
    // The admin cancels anyone's job; bob's job was untouched until then.
    let (_, v) = call(
        &s,
        M::GET,
        &format!("/v1/jobs/{bob_job}"),
        Some("bob-secret"),
        None,
    )
    .await;
    assert_ne!(v["state"], "cancelled");
    assert_eq!(
        call(&s, M::POST, &cancel_bob, Some("ops-secret"), None)
            .await
            .0,
        202
    );
    // Metrics need an admin token here (the default `metrics = "token"`): the series name
    // every owner's jobs, tasks, losses and success rates (#35: a read token of another
    // owner used to see them all).
    for (secret, status) in [
        ("viewer-secret", 403),
        ("alice-secret", 403),
        ("ops-secret", 200),
    ] {
        assert_eq!(
            call(&s, M::GET, "/metrics", Some(secret), None).await.0,
            status,
            "{secret}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_has_its_own_rate_limit() {
    let limit = RateLimit {
        per_second: 0.01,
        burst: 5,
    };
    let s = TestServer::start_with_access(guarded(Some(limit), ProgramPolicy::default())).await;
    for i in 0..5 {
        let (st, _) = call(
            &s,
            reqwest::Method::GET,
            "/v1/jobs",
            Some("bob-secret"),
            None,
        )
        .await;
        assert_eq!(st, 200, "request {i}");
    }
    let r = s
        .client
        .get(s.url("/v1/jobs"))
        .bearer_auth("bob-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1, "Retry-After {retry}");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limited");
    // Another token is not throttled by bob's traffic; open routes are not limited.
    let (st, _) = call(
        &s,
        reqwest::Method::GET,
        "/v1/jobs",
        Some("ops-secret"),
        None,
    )
    .await;
    assert_eq!(st, 200);
    let (st, _) = call(&s, reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(st, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disallowed_program_kinds_are_403_with_the_field_path() {
    let external = |program: &str, sandbox: &str| {
        tests::SpecBuilder::new()
            .pool("p", "H800", 1, "")
            .raw_task(&format!(
                "[[tasks]]\ndomain = \"ext\"\nenv = {{ kind = \"external\", command = [\"{program}\", \"env.py\"], sandbox = \"{sandbox}\" }}\n"
            ))
            .rollout("batch_size = 1")
            .rollout("steps = 1")
            .toml()
    };
    let policy = ProgramPolicy {
        executables: Some(vec!["python3".into()]),
        ..ProgramPolicy::default()
    };
    let s = TestServer::start_with_access(guarded(None, policy)).await;
    let post = |body: String| {
        call(
            &s,
            reqwest::Method::POST,
            "/v1/jobs",
            Some("alice-secret"),
            Some(body),
        )
    };
    let (st, v) = post(external("/bin/sh", "bwrap")).await;
    assert_eq!(st, 403, "{v}");
    assert_eq!(v["error"]["code"], "forbidden");
    assert_eq!(v["error"]["fields"][0]["field"], "tasks[0].env.command");
    assert!(
        v["error"]["fields"][0]["message"]
            .as_str()
            .unwrap()
            .contains("/bin/sh")
    );
    let (st, v) = post(external("python3", "none")).await;
    assert_eq!(st, 403, "{v}");
    assert_eq!(v["error"]["fields"][0]["field"], "tasks[0].env.sandbox");
    assert_eq!(v["error"]["fields"].as_array().unwrap().len(), 1);
    // Nothing was stored for the refused specs.
    let (_, v) = call(
        &s,
        reqwest::Method::GET,
        "/v1/jobs",
        Some("ops-secret"),
        None,
    )
    .await;
    assert_eq!(v["jobs"].as_array().unwrap().len(), 0, "{v}");
}

/// `rollarc serve` on a non-loopback address without tokens exits with a clear error; with
/// `--insecure-public` it serves.
#[test]
fn serve_refuses_a_public_address_without_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(tests::rollarc_bin())
        .args(["serve", "--addr", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("run rollarc serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refusing to listen on 0.0.0.0:0"), "{err}");
    assert!(err.contains("--insecure-public"), "{err}");

    let mut child = std::process::Command::new(tests::rollarc_bin())
        .args([
            "serve",
            "--addr",
            "0.0.0.0:0",
            "--insecure-public",
            "--data-dir",
        ])
        .arg(dir.path())
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("rollarc serving") {
                let _ = tx.send(());
            }
        }
    });
    let served = rx.recv_timeout(Duration::from_secs(30)).is_ok();
    let _ = child.kill();
    let _ = child.wait();
    assert!(served, "--insecure-public did not serve");
}

/// Event streams hold a connection each for as long as their job runs, so they are capped:
/// per owner and per client address. Round 2 (#35): a capped owner used to answer 429 to
/// every new stream, so one client holding 32 locked every dashboard out. Now a new stream is
/// always served and the oldest stream of the same address ends (an `evicted` event): one
/// address keeps at most `MAX_STREAMS_PER_ADDRESS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holds_a_bounded_number_of_event_streams_and_never_locks_others_out() {
    use service::access::MAX_STREAMS_PER_ADDRESS;
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), wall_clock_job(100_000, 1, 0.05)).await;
    let url = s.url(&format!("/v1/jobs/{id}/events"));
    let extra = 4;
    let mut open = Vec::new();
    for i in 0..MAX_STREAMS_PER_ADDRESS + extra {
        let r = reqwest::Client::new().get(&url).send().await.unwrap();
        assert_eq!(r.status(), 200, "stream {i}");
        open.push(r);
    }
    /// The stream's text until it ends or `wait` passes.
    async fn read_for(r: &mut reqwest::Response, wait: Duration) -> String {
        let mut text = String::new();
        let _ = tokio::time::timeout(wait, async {
            while let Ok(Some(c)) = r.chunk().await {
                text.push_str(&String::from_utf8_lossy(&c));
            }
        })
        .await;
        text
    }
    for (i, r) in open.iter_mut().enumerate() {
        let text = read_for(r, Duration::from_millis(if i < extra { 5000 } else { 300 })).await;
        assert_eq!(
            text.contains("event: evicted"),
            i < extra,
            "stream {i}: {text}"
        );
    }
    drop(open);
    let _ = s
        .client
        .post(s.url(&format!("/v1/jobs/{id}/cancel")))
        .send()
        .await;
}

/// Requests with an unknown token are limited per client address (they used to be answered
/// 401 without limit: 1,500 in 1.5 s): after a burst, 429 with `Retry-After`, while a valid
/// token from the same address is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tokens_are_rate_limited_per_address() {
    let s = TestServer::start_with_access(guarded(None, ProgramPolicy::default())).await;
    let mut codes = Vec::new();
    for i in 0..60 {
        let r = s
            .client
            .get(s.url("/v1/jobs"))
            .bearer_auth(format!("guess-{i}"))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            assert!(r.headers().contains_key("retry-after"));
        }
        codes.push(r.status().as_u16());
    }
    let limited = codes.iter().filter(|c| **c == 429).count();
    assert!(codes[..20].iter().all(|c| *c == 401), "{codes:?}");
    assert!(limited >= 30, "{codes:?}");
    let r = s
        .client
        .get(s.url("/v1/jobs"))
        .bearer_auth("viewer-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
