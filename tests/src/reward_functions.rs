//! The built-in reward functions as real processes under the runtime contract.

use std::time::Duration;

use functions::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoreResponse, ScoredItem};

fn start(name: &str, config: Option<&str>) -> tests::FunctionProcess {
    tests::start_function(name, config, &[])
}

fn request(items: &[&str], reference: &str) -> ScoreRequest {
    ScoreRequest {
        protocol: PROTOCOL_VERSION.into(),
        idempotency_key: "t/math@1".into(),
        reward: "math@1".into(),
        reference: Some(serde_json::json!(reference)),
        deadline_ms: 5000,
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

#[tokio::test]
async fn the_math_function_scores_a_group_and_rejects_bad_requests() {
    let f = start("math", None);
    let c = reqwest::Client::new();
    let health: serde_json::Value = c
        .get(format!("{}/healthz", f.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["function"], "math");
    let req = request(&["\\boxed{42}", "41", "the answer is 42."], "42");
    let r = c.post(&f.base).json(&req).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let resp: ScoreResponse = r.json().await.unwrap();
    resp.validate(&req, 0.0, 1.0).unwrap();
    assert_eq!(
        resp.scores.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![1.0, 0.0, 1.0]
    );
    // Bad input: 4xx JSON, never a crash.
    for (body, status) in [
        ("{}".to_string(), 400),
        ("not json".to_string(), 400),
        (serde_json::to_string(&request(&[], "1")).unwrap(), 400),
    ] {
        let r = c.post(&f.base).body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        assert!(r.json::<serde_json::Value>().await.unwrap()["error"]["code"].is_string());
    }
    let mut wrong = request(&["1"], "1");
    wrong.protocol = "rollarc.reward/v0".into();
    assert_eq!(
        c.post(&f.base).json(&wrong).send().await.unwrap().status(),
        400
    );
    // Oversized: 413 JSON and `Connection: close`, on a connection of its own (the server stops reading the body).
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let r = fresh
        .post(&f.base)
        .body("x".repeat(9 << 20))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    assert_eq!(
        r.headers().get("connection").map(|v| v.as_bytes()),
        Some(&b"close"[..])
    );
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "body_too_large"
    );
}

#[tokio::test]
async fn sigterm_ends_the_function_cleanly() {
    let mut f = start("env", None);
    let pid = nix::unistd::Pid::from_raw(f.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = f.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the function did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
