//! Memory admission: a job whose estimated peak memory exceeds the service's budget is
//! refused at submit (naming the fields that size it), failed instead of resumed when the
//! budget shrank across a restart, and queued while running jobs leave it no room.

use std::time::Duration;

use job::spec::{Format, parse};
use job::store::{JobState, Store};
use service::admission::estimate;
use service::service::{Service, ServiceConfig};
use tests::{SpecBuilder, TestServer, wait_job, wall_clock_job};

fn big_builtin() -> String {
    SpecBuilder::new()
        .raw_task("[[tasks]]\ndomain = \"lake\"\nenv = { kind = \"frozenlake\" }\n")
        .extra("[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 2\nbackend = { kind = \"builtin\", max_batch = 64, model = { d_model = 1024, n_heads = 8, n_layers = 8, d_ff = 4096, max_seq = 4096 } }\n[trainer]\nkind = \"builtin\"")
        .rollout("batch_size = 2")
        .toml()
}

fn bytes_of(spec: &str) -> u64 {
    estimate(&parse(spec, Format::Toml).expect("valid spec")).total()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_the_budget_is_refused_naming_what_sizes_it() {
    let s = TestServer::start_with_budget(1 << 30).await;
    let spec = big_builtin();
    assert!(bytes_of(&spec) > 1 << 30);
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .body(spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "over_memory_budget", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("budget (max_memory) is 1.0 GiB"), "{msg}");
    assert_eq!(v["error"]["fields"][0]["field"], "pools[0]", "{v}");
    assert!(
        v["error"]["fields"][0]["message"]
            .as_str()
            .unwrap()
            .contains("KV cache"),
        "{v}"
    );
    // Nothing was stored; a small job is accepted.
    assert!(s.service.store.list().unwrap().is_empty());
    let id = tests::submit_job(&s.client, &s.url(""), wall_clock_job(2, 1, 0.01)).await;
    assert!(id.starts_with("job-"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_wait_in_the_queue_while_the_running_ones_leave_no_room() {
    let job = wall_clock_job(1000, 1, 0.05);
    let one = bytes_of(&job);
    // Room for one such job, not two (max_running would allow two).
    let s = TestServer::start_with_budget(one * 3 / 2).await;
    let base = s.url("");
    let first = tests::submit_job(&s.client, &base, job.clone()).await;
    let second = tests::submit_job(&s.client, &base, job).await;
    wait_job(&s.client, &base, &first, Duration::from_secs(30), |v| {
        v["state"] == "running"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let v: serde_json::Value = s
        .client
        .get(s.url(&format!("/v1/jobs/{second}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "queued", "{v}");
    let r = s
        .client
        .post(s.url(&format!("/v1/jobs/{first}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    wait_job(&s.client, &base, &second, Duration::from_secs(30), |v| {
        v["state"] == "running"
    })
    .await;
}

#[test]
fn a_recovered_job_over_a_shrunk_budget_is_failed_not_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let spec = parse(&wall_clock_job(5, 1, 0.01), Format::Toml).unwrap();
    {
        // As a crashed run left it: accepted under a large budget, running.
        let store = Store::open(&dir.path().join("rollarc.db")).unwrap();
        let id = store.create_job(&spec, 5, None).unwrap();
        store.transition(&id, JobState::Running, None).unwrap();
    }
    let service = Service::open(&ServiceConfig {
        data_dir: dir.path().to_path_buf(),
        max_running: 1,
        max_memory: Some(1 << 20),
        test_hooks: false,
    })
    .unwrap();
    assert_eq!(service.recover().unwrap(), 0, "nothing re-queued");
    let job = service.store.get("job-1").unwrap().unwrap();
    assert_eq!(job.state, JobState::Failed);
    let error = job.error.unwrap();
    assert!(
        error.starts_with("not resumed: the job needs an estimated"),
        "{error}"
    );
    assert!(error.contains("max_memory"), "{error}");
}

/// The production-scale scenario's job (`examples/sim/production.toml`): its simulated
/// trajectories count at twice their mean length, so `rollarc run` admits it under the
/// default budget (the longest-trajectory bound asked for 1.5 TiB), and the estimate stays
/// above what the run holds (20 of its steps through `rollarc run`: 0.36 GB peak RSS).
#[test]
fn a_simulated_production_week_is_admitted_at_its_mean_trajectory_length() {
    let path = tests::repo().join("examples/sim/production.toml");
    let sc = lab::scenario::Scenario::load(&path).unwrap();
    let spec = lab::scenario::build_spec(&sc.base, &Default::default()).unwrap();
    let e = estimate(&spec);
    let total = e.total();
    assert!(total < 8 << 30, "{total} {:?}", e.breakdown());
    assert!(total > 400 << 20, "{total} {:?}", e.breakdown());
    assert!(
        total < service::admission::default_budget(),
        "{total} over the default budget"
    );
    // A real environment's trajectories still count at their longest.
    let mut real = spec.clone();
    real.tasks[0].env = serde_json::from_value(serde_json::json!({"kind": "frozenlake"})).unwrap();
    assert!(
        estimate(&real).total() > 10 * total,
        "{:?}",
        estimate(&real).breakdown()
    );
}
