//! What the dashboard's trajectory viewer and run comparison read: filtered trajectory
//! pages, a group with its advantages, the spec as sent, tags and TensorBoard run names.

use std::time::Duration;

use serde_json::Value;
use tests::{SpecBuilder, TestServer, wait_job};

fn job(name: &str, tags: &str) -> String {
    let head = format!("name = \"{name}\"\ntags = [{tags}]\n");
    let body = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .multi_turn("lake", "")
        .single_turn("math", "")
        .rollout("batch_size = 2")
        .rollout("steps = 3")
        .toml();
    // A comment and the user's own layout: what "as sent" must keep.
    format!("# my run\n{head}{body}")
}

async fn rows(s: &TestServer, id: &str, q: &str) -> Vec<Value> {
    let r = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/trajectories?limit=1000{q}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{q}");
    r.text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn get(s: &TestServer, path: &str) -> (u16, String, String) {
    let r = s.client.get(s.url(path)).send().await.unwrap();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), ct, r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_groups_specs_as_sent_and_tags() {
    let s = TestServer::start().await;
    let text = job("lr sweep/a", "\"sweep\", \"lr=1e-5\"");
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .header("content-type", "application/toml")
        .body(text.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let other = tests::submit_job(&s.client, &s.url(""), job("other", "\"baseline\"")).await;
    for j in [&id, &other] {
        let done = wait_job(&s.client, &s.url(""), j, Duration::from_secs(60), |v| {
            v["state"] == "succeeded" || v["state"] == "failed"
        })
        .await;
        assert_eq!(done["state"], "succeeded", "{done}");
    }

    // Filters narrow the rows before paging, each alone and together.
    let all = rows(&s, &id, "").await;
    assert!(all.len() >= 24, "{}", all.len());
    let t = |r: &Value| r["trajectory"].clone();
    let lake = rows(&s, &id, "&task=lake").await;
    assert!(!lake.is_empty() && lake.len() < all.len());
    assert!(lake.iter().all(|r| t(r)["task"] == "lake"));
    assert_eq!(
        lake.len(),
        all.iter().filter(|r| t(r)["task"] == "lake").count()
    );
    for ok in [true, false] {
        let got = rows(&s, &id, &format!("&success={ok}")).await;
        let want = all.iter().filter(|r| t(r)["success"] == ok).count();
        assert_eq!(got.len(), want, "success={ok}");
    }
    let high = rows(&s, &id, "&min_reward=0.5").await;
    assert_eq!(
        high.len(),
        all.iter()
            .filter(|r| t(r)["reward"].as_f64().is_some_and(|x| x >= 0.5))
            .count()
    );
    let low = rows(&s, &id, "&max_reward=0.5&task=math").await;
    assert!(
        low.iter()
            .all(|r| t(r)["task"] == "math" && t(r)["reward"].as_f64().is_some_and(|x| x <= 0.5))
    );
    let v0 = rows(&s, &id, "&version=0").await;
    assert_eq!(
        v0.len(),
        all.iter().filter(|r| t(r)["start_version"] == 0).count()
    );
    assert!(!v0.is_empty() && v0.len() < all.len());
    let g = t(&all[0])["group_id"].as_u64().unwrap();
    let members = rows(&s, &id, &format!("&group={g}")).await;
    assert_eq!(
        members.len(),
        all.iter().filter(|r| t(r)["group_id"] == g).count()
    );
    let (status, _, body) = get(&s, &format!("/v1/jobs/{id}/trajectories?min_reward=x")).await;
    assert_eq!(status, 400, "{body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["fields"][0]["field"], "min_reward", "{body}");

    // A group: its members, rewards and the trainer's own advantages.
    let (status, _, body) = get(&s, &format!("/v1/jobs/{id}/groups/{g}")).await;
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["estimator"], "grpo", "{view}");
    let ms = view["members"].as_array().unwrap();
    assert_eq!(ms.len(), members.len());
    let rewards: Vec<f64> = ms.iter().filter_map(|m| m["reward"].as_f64()).collect();
    let want = actors::rl::advantages(actors::rl::AdvantageKind::Grpo, &rewards);
    let got: Vec<f64> = ms.iter().filter_map(|m| m["advantage"].as_f64()).collect();
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12, "{got:?} vs {want:?}");
    }
    let (status, _, _) = get(&s, &format!("/v1/jobs/{id}/groups/999999")).await;
    assert_eq!(status, 404);
    let (status, _, body) = get(&s, &format!("/v1/jobs/{id}/groups/g7")).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("\"field\":\"group\""), "{body}");

    // The spec as sent (comment and all) beside the resolved form.
    let (status, ct, sent) = get(&s, &format!("/v1/jobs/{id}/spec?form=submitted")).await;
    assert_eq!((status, ct.as_str()), (200, "application/toml"));
    assert_eq!(sent, text);
    let (status, ct, resolved) = get(&s, &format!("/v1/jobs/{id}/spec")).await;
    assert_eq!((status, ct.as_str()), (200, "application/json"));
    let resolved: Value = serde_json::from_str(&resolved).unwrap();
    assert_eq!(resolved["tags"], serde_json::json!(["sweep", "lr=1e-5"]));
    let (status, _, body) = get(&s, &format!("/v1/jobs/{id}/spec?form=yaml")).await;
    assert!(status == 400 && body.contains("form"), "{body}");

    // Tags: on the record and as a filter of the list.
    let (_, _, list) = get(&s, "/v1/jobs?tag=sweep").await;
    let list: Value = serde_json::from_str(&list).unwrap();
    let ids: Vec<&str> = list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [id.as_str()]);
    assert_eq!(
        list["jobs"][0]["tags"],
        serde_json::json!(["sweep", "lr=1e-5"])
    );

    // TensorBoard runs are named by job and name.
    let tb = s.dir.path().join("tensorboard");
    let mut runs: Vec<String> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    runs.sort();
    assert_eq!(runs, [format!("{id}-lr-sweep-a"), format!("{other}-other")]);
}

#[tokio::test]
async fn bad_tags_are_refused_naming_the_tag() {
    let s = TestServer::start().await;
    for (tags, field) in [("\"a b\"", "tags[0]"), ("\"ok\", \"\"", "tags[1]")] {
        let r = s
            .client
            .post(s.url("/v1/jobs"))
            .header("content-type", "application/toml")
            .body(job("x", tags))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let body: Value = r.json().await.unwrap();
        let fields: Vec<&str> = body["error"]["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["field"].as_str().unwrap())
            .collect();
        assert_eq!(fields, [field], "{body}");
    }
}
