//! The `code` and `judge` reward functions as real `rollarc-fn` processes: `code` runs Python
//! in the bubblewrap sandbox; `judge` talks to a fake OpenAI-compatible endpoint served here
//! (a stand-in for the LLM, which is another part of the system).

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use functions::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoreResponse, ScoredItem};

use tests::{FunctionProcess as Function, fn_bin};

fn start(name: &str, config: &str, env: &[(&str, &str)]) -> Function {
    tests::start_function(name, Some(config), env)
}

/// Runs `rollarc-fn NAME --config CONFIG`, expecting it to refuse to start: its stderr.
fn refused(name: &str, config: &str) -> String {
    let out = Command::new(fn_bin())
        .arg(name)
        .args(["--config", config])
        .env("PORT", "0")
        .env("HOST", "127.0.0.1")
        .output()
        .expect("rollarc-fn runs");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{name} {config} should be refused"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn request(reward: &str, items: &[&str], reference: Option<serde_json::Value>) -> ScoreRequest {
    ScoreRequest {
        protocol: PROTOCOL_VERSION.into(),
        idempotency_key: format!("g/{reward}"),
        reward: reward.into(),
        reference,
        deadline_ms: 60_000,
        items: items
            .iter()
            .enumerate()
            .map(|(i, t)| ScoredItem {
                trajectory_id: format!("t{i}"),
                text: t.to_string(),
                token_ids: vec![],
                env_reward: 0.0,
                transcript: None,
                calls: None,
                row: None,
            })
            .collect(),
    }
}

async fn score(c: &reqwest::Client, f: &Function, req: &ScoreRequest) -> ScoreResponse {
    let r = c.post(&f.base).json(req).send().await.unwrap();
    let status = r.status();
    let body = r.text().await.unwrap();
    assert_eq!(status, 200, "{body}");
    let resp: ScoreResponse = serde_json::from_str(&body).unwrap();
    resp.validate(req, 0.0, 1.0).unwrap();
    resp
}

#[tokio::test]
async fn the_code_function_runs_a_group_in_the_sandbox() {
    infra::sandbox::check_sandbox()
        .expect("make setup installs bubblewrap; the sandbox must work here");
    let f = start("code", r#"{"timeout_s": 2}"#, &[]);
    let c = reqwest::Client::new();
    let health: serde_json::Value = c
        .get(format!("{}/healthz", f.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["function"], "code");
    let tests = serde_json::json!({ "tests": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"] });
    let items = [
        "Here is my solution:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds.",
        "def add(a, b):\n    return a + b if a > 0 else 1\n",
        "```python\ndef add(a, b)\n    return a + b\n```",
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",
        "```python\nprint('thinking')\ndef add(a, b):\n    return abs(a) + b\n```",
    ];
    let req = request("code@1", &items, Some(tests));
    let started = tokio::time::Instant::now();
    let resp = score(&c, &f, &req).await;
    let scores: Vec<f64> = resp.scores.iter().map(|s| s.score).collect();
    assert_eq!(scores, vec![1.0, 0.5, 0.0, 0.0, 0.5]);
    let d = |i: usize| &resp.scores[i].details;
    assert_eq!(
        (
            d(0)["passed"].as_u64(),
            d(0)["total"].as_u64(),
            d(0)["fenced_code_block"].as_bool()
        ),
        (Some(2), Some(2), Some(true))
    );
    assert_eq!(d(1)["tests"][1]["error"], "AssertionError", "{}", d(1));
    assert_eq!(d(2)["load_error"]["error"], "SyntaxError", "{}", d(2));
    assert_eq!(
        (d(3)["timed_out"].as_bool(), d(3)["passed"].as_u64()),
        (Some(true), Some(0)),
        "{}",
        d(3)
    );
    for i in [0, 1, 2, 4] {
        assert_eq!(d(i)["timed_out"], false);
    }
    assert!(
        d(4)["stderr"].as_str().unwrap().contains("thinking"),
        "the candidate's prints land in the stderr excerpt: {}",
        d(4)
    );
    // Items run concurrently: the 2 s timeout is paid once, not per item.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // Tests in the other two shapes: a list, and one string.
    let one = score(
        &c,
        &f,
        &request(
            "code@1",
            &["def sq(x):\n    return x * x\n"],
            Some(serde_json::json!("assert sq(3) == 9\nassert sq(-2) == 4")),
        ),
    )
    .await;
    assert_eq!(
        (one.scores[0].score, one.scores[0].details["total"].as_u64()),
        (1.0, Some(1))
    );
    let list = score(
        &c,
        &f,
        &request(
            "code@1",
            &["def sq(x):\n    return 9\n"],
            Some(serde_json::json!([
                "assert sq(3) == 9",
                "assert sq(2) == 4"
            ])),
        ),
    )
    .await;
    assert_eq!(list.scores[0].score, 0.5);
    // A reference that carries no tests is the caller's error.
    let r = c
        .post(&f.base)
        .json(&request(
            "code@1",
            &["x = 1"],
            Some(serde_json::json!({ "answer": 3 })),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: serde_json::Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"tests\""),
        "{e}"
    );
}

#[tokio::test]
async fn sandboxed_code_cannot_read_secrets_or_reach_the_network() {
    infra::sandbox::check_sandbox().expect("the sandbox must work here");
    // A listener on the host's loopback, reachable from outside the sandbox only.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let program = format!(
        "import socket\n\ndef secret():\n    with open('/etc/shadow') as f:\n        return f.read()\n\ndef ping():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n    return True\n\ndef add(a, b):\n    return a + b\n"
    );
    let tests = serde_json::json!({ "tests": ["assert secret()", "assert ping()", "assert add(2, 2) == 4"] });
    let req = request("code@1", &[&program], Some(tests));
    let c = reqwest::Client::new();
    let f = start("code", r#"{"timeout_s": 5}"#, &[]);
    let resp = score(&c, &f, &req).await;
    let d = &resp.scores[0].details;
    assert_eq!(resp.scores[0].score, 1.0 / 3.0, "{d}");
    assert_eq!(d["tests"][0]["error"], "PermissionError", "{d}");
    assert_eq!(d["tests"][1]["passed"], false, "{d}");
    assert!(
        d["tests"][1]["error"].as_str().unwrap().contains("Error"),
        "{d}"
    );
    assert_eq!(d["tests"][2]["passed"], true, "{d}");
    // The same program without the sandbox reaches the network (and reads the secret where
    // this test may): the checks above can fail.
    let bare = start("code", r#"{"sandbox": "none", "timeout_s": 5}"#, &[]);
    let resp = score(&c, &bare, &req).await;
    let d = &resp.scores[0].details;
    assert_eq!(
        (
            d["tests"][1]["passed"].as_bool(),
            d["tests"][2]["passed"].as_bool()
        ),
        (Some(true), Some(true)),
        "{d}"
    );
    assert_eq!(
        d["tests"][0]["passed"].as_bool(),
        Some(std::fs::read("/etc/shadow").is_ok_and(|s| !s.is_empty())),
        "{d}"
    );
    drop(listener);
    // Bad configurations stop the function before it listens.
    assert!(refused("code", r#"{"sandbox": "docker"}"#).contains("code config"));
    assert!(refused("code", r#"{"timeout_s": 0}"#).contains("timeout_s"));
    assert!(refused("code", r#"{"bogus": 1}"#).contains("unknown field"));
    assert!(
        refused("code", r#"{"python": "/nonexistent/python3"}"#)
            .contains("does not run in the sandbox")
    );
}

/// What the fake LLM saw.
#[derive(Default)]
struct Seen {
    bodies: Vec<serde_json::Value>,
    auth: Vec<Option<String>>,
}

/// A fake OpenAI-compatible chat endpoint. Responses say `quality=N`; the fake grades each by
/// its N, in the order they appear in the prompt. A prompt containing `GARBLE` gets an answer
/// with no score line, one containing `OVERLOAD` a 503.
async fn fake_chat(
    State(seen): State<Arc<Mutex<Seen>>>,
    headers: HeaderMap,
    body: axum::Json<serde_json::Value>,
) -> (StatusCode, axum::Json<serde_json::Value>) {
    let prompt = body["messages"][1]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    {
        let mut s = seen.lock().unwrap();
        s.bodies.push(body.0.clone());
        s.auth.push(
            headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
        );
    }
    if prompt.contains("OVERLOAD") {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "error": { "message": "overloaded" } })),
        );
    }
    let qualities: Vec<String> = prompt
        .split("quality=")
        .skip(1)
        .map(|s| s.chars().take_while(|c| c.is_ascii_digit()).collect())
        .collect();
    let answer = if prompt.contains("GARBLE") {
        "This one is rather nice, I would say.".to_string()
    } else if prompt.contains("Scores: [") {
        format!("[1] looks fine.\nScores: [{}]", qualities.join(", "))
    } else {
        format!(
            "The response is adequate.\nScore: {}",
            qualities.first().cloned().unwrap_or_default()
        )
    };
    (
        StatusCode::OK,
        axum::Json(
            serde_json::json!({ "id": "x", "object": "chat.completion", "choices": [{ "index": 0, "message": { "role": "assistant", "content": answer }, "finish_reason": "stop" }] }),
        ),
    )
}

async fn fake_llm() -> (String, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(fake_chat))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test]
async fn the_judge_function_grades_pointwise_and_by_group() {
    let (endpoint, seen) = fake_llm().await;
    let c = reqwest::Client::new();
    let pointwise = serde_json::json!({
        "endpoint": endpoint, "model": "judge-7b", "rubric": "Reward correct, concise answers.", "max_score": 10, "temperature": 0.0,
        "timeout_s": 10, "api_key_env": "ROLLARC_TEST_JUDGE_KEY",
    })
    .to_string();
    let f = start(
        "judge",
        &pointwise,
        &[("ROLLARC_TEST_JUDGE_KEY", "sk-test")],
    );
    let req = request(
        "judge@1",
        &[
            "The answer is 4. quality=8",
            "Maybe 5? quality=3",
            "quality=10",
        ],
        Some(serde_json::json!("4")),
    );
    let resp = score(&c, &f, &req).await;
    assert_eq!(
        resp.scores.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![0.8, 0.3, 1.0]
    );
    assert_eq!(resp.scores[0].details["raw_score"], 8.0);
    assert!(
        resp.scores[1].details["judge"]
            .as_str()
            .unwrap()
            .ends_with("Score: 3")
    );
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.bodies.len(), 3, "one chat call per item");
        assert!(
            s.auth
                .iter()
                .all(|a| a.as_deref() == Some("Bearer sk-test")),
            "{:?}",
            s.auth
        );
        let b = &s.bodies[0];
        assert_eq!(
            (
                b["model"].as_str(),
                b["temperature"].as_f64(),
                b["messages"][0]["role"].as_str()
            ),
            (Some("judge-7b"), Some(0.0), Some("system"))
        );
        let prompt = s
            .bodies
            .iter()
            .map(|b| b["messages"][1]["content"].as_str().unwrap())
            .find(|p| p.contains("quality=8"))
            .unwrap();
        assert!(
            prompt.contains("Reward correct, concise answers.")
                && prompt.contains("Reference answer")
                && prompt.contains("Score: <"),
            "{prompt}"
        );
    }
    // An answer with no score line, and an endpoint error: 500 JSON from the function, no score.
    for (text, want) in [
        ("GARBLE quality=5", "could not be parsed"),
        ("OVERLOAD", "503"),
    ] {
        let r = c
            .post(&f.base)
            .json(&request("judge@1", &["quality=7", text], None))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 500);
        let e: serde_json::Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "scorer_failed", "{e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(want),
            "{e}"
        );
    }

    let group =
        serde_json::json!({ "endpoint": format!("{endpoint}/v1"), "model": "judge-7b", "rubric": "Rank helpfulness.", "mode": "group", "max_score": 5 })
            .to_string();
    let g = start("judge", &group, &[]);
    let before = seen.lock().unwrap().bodies.len();
    let req = request(
        "judge@1",
        &[
            "first quality=5",
            "second quality=1",
            "third quality=4",
            "fourth quality=0",
        ],
        None,
    );
    let resp = score(&c, &g, &req).await;
    assert_eq!(
        resp.scores.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![1.0, 0.2, 0.8, 0.0]
    );
    assert_eq!(resp.scores[2].details["position"], 3);
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.bodies.len(), before + 1, "one chat call for the group");
        let prompt = s.bodies[before]["messages"][1]["content"].as_str().unwrap();
        assert!(
            prompt.contains("[1]\n<<<RESPONSE\nfirst quality=5")
                && prompt.contains("[4]\n<<<RESPONSE\nfourth quality=0"),
            "{prompt}"
        );
        assert_eq!(s.auth[before], None, "no key configured, none sent");
    }
    // Scores out of range for the scale (quality 7 > max_score 5), and no list at all.
    for text in ["quality=7", "GARBLE"] {
        let r = c
            .post(&g.base)
            .json(&request("judge@1", &["quality=2", text], None))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 500);
        let e: serde_json::Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "scorer_failed", "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("could not be parsed"),
            "{e}"
        );
    }
    // Configurations the judge refuses at start.
    assert!(
        refused(
            "judge",
            r#"{"endpoint": "https://api.example.com", "model": "m", "rubric": "r"}"#
        )
        .contains("endpoint")
    );
    assert!(
        refused(
            "judge",
            r#"{"endpoint": "judge:8000", "model": "m", "rubric": "r"}"#
        )
        .contains("endpoint")
    );
    assert!(
        refused("judge", &format!(r#"{{"endpoint": "{endpoint}", "model": "m", "rubric": "r", "api_key_env": "ROLLARC_TEST_UNSET_KEY"}}"#))
            .contains("api_key_env")
    );
}
