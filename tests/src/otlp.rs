//! The trace a job leaves in an OTLP receiver: job → step → episode → turn → {generate,
//! env.step}, at the default log level, with task names, and nothing dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

const STEPS: u64 = 8;

fn job() -> String {
    format!(
        r#"
name = "traced"
seed = 3
[[tasks]]
domain = "frozenlake"
group_size = 4
max_turns = 6
max_tokens_per_turn = 1
constrain_actions = true
env = {{ kind = "frozenlake", size = 4, end_on_invalid = true }}
[[pools]]
name = "cpu"
device = "CPU"
count = 1
backend = {{ kind = "builtin", model = {{ d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 320 }} }}
[trainer]
kind = "builtin"
[rollout]
batch_size = 2
steps = {STEPS}
alpha = 1
"#
    )
}

fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(i) => i.to_string(),
            Value::BoolValue(b) => b.to_string(),
            Value::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
}

/// A real `rollarc serve` exporting to a receiver in this test (OTLP over HTTP, protobuf),
/// with the service's default log level: the receiver must get one job span, one span per
/// step under it, and for every stored trajectory its episode (task by name) under a step with
/// one turn span per turn, each holding its generate and env.step spans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_leaves_a_whole_trace_in_an_otlp_receiver() {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let sink = spans.clone();
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            post(move |body: Bytes| {
                let sink = sink.clone();
                async move {
                    let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut g = sink.lock().unwrap();
                    for rs in req.resource_spans {
                        for ss in rs.scope_spans {
                            g.extend(ss.spans);
                        }
                    }
                    (
                        [("content-type", "application/x-protobuf")],
                        ExportTraceServiceResponse::default().encode_to_vec(),
                    )
                }
            }),
        )
        .route("/v1/metrics", post(|| async { "" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    let mut server = tests::server::ServerProcess::start_env(
        &dir.path().join("data"),
        None,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            // The service's own default, not the harness's `info` for everything.
            ("RUST_LOG", infra::telemetry::DEFAULT_LOG),
        ],
    );
    let c = reqwest::Client::new();
    let id = tests::submit_job(&c, &server.base, job()).await;
    let done = tests::wait_job(&c, &server.base, &id, Duration::from_secs(300), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let mut turns_of: BTreeMap<u64, usize> = BTreeMap::new();
    for r in tests::all_rows(&c, &server.base, &id, 1000).await {
        let tid = r["trajectory"]["id"].as_str().unwrap();
        let e: u64 = tid.rsplit("-e").next().unwrap().parse().unwrap();
        turns_of.insert(e, r["trajectory"]["turns"].as_array().unwrap().len());
    }
    assert!(turns_of.len() >= (STEPS * 2 * 4) as usize);
    // A graceful stop flushes the exporter.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while server.child.try_wait().unwrap().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "serve did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let spans = spans.lock().unwrap().clone();
    let by_id: HashMap<Vec<u8>, &Span> = spans.iter().map(|s| (s.span_id.clone(), s)).collect();
    let named = |n: &'static str| spans.iter().filter(move |s| s.name == n);
    let jobs: Vec<&Span> = named("job")
        .filter(|s| attr(s, "job").as_deref() == Some(id.as_str()))
        .collect();
    assert_eq!(jobs.len(), 1, "one job span");
    let job_span = jobs[0];
    assert_eq!(attr(job_span, "name").as_deref(), Some("traced"));
    let steps: Vec<&Span> = named("step")
        .filter(|s| s.parent_span_id == job_span.span_id)
        .collect();
    let mut step_numbers: Vec<u64> = steps
        .iter()
        .map(|s| attr(s, "step").unwrap().parse().unwrap())
        .collect();
    step_numbers.sort();
    assert_eq!(
        step_numbers,
        (1..=STEPS).collect::<Vec<_>>(),
        "a span per step"
    );
    assert!(
        named("train").all(|t| steps.iter().any(|s| s.span_id == t.parent_span_id)),
        "training spans hang under their step"
    );
    assert_eq!(named("train").count() as u64, STEPS);
    for t in named("train") {
        for k in ["loss", "entropy", "grad_norm", "lr", "response_len_mean"] {
            let v: f64 = attr(t, k)
                .unwrap_or_else(|| panic!("the train span has no {k}"))
                .parse()
                .unwrap();
            assert!(v.is_finite(), "{k} = {v}");
        }
    }
    let mut episodes: HashMap<u64, &Span> = HashMap::new();
    for e in named("episode") {
        let parent = by_id
            .get(&e.parent_span_id)
            .expect("an episode's parent was exported");
        assert_eq!(parent.name, "step", "episodes hang under a step");
        assert_eq!(e.trace_id, job_span.trace_id, "one trace per job");
        assert_eq!(
            attr(e, "task").as_deref(),
            Some("frozenlake"),
            "task by name"
        );
        episodes.insert(attr(e, "episode").unwrap().parse().unwrap(), e);
    }
    let mut children: HashMap<Vec<u8>, Vec<&Span>> = HashMap::new();
    for s in &spans {
        children
            .entry(s.parent_span_id.clone())
            .or_default()
            .push(s);
    }
    let kids = |s: &Span, name: &str| -> usize {
        children
            .get(&s.span_id)
            .map_or(0, |v| v.iter().filter(|c| c.name == name).count())
    };
    for (e, turns) in &turns_of {
        let ep = episodes
            .get(e)
            .unwrap_or_else(|| panic!("episode {e} (stored) has no span: spans were dropped"));
        assert_eq!(attr(ep, "turns").unwrap().parse::<usize>().unwrap(), *turns);
        assert_eq!(kids(ep, "env.reset"), 1);
        assert_eq!(kids(ep, "turn"), *turns, "episode {e}: a span per turn");
        for t in children[&ep.span_id].iter().filter(|c| c.name == "turn") {
            assert_eq!(
                kids(t, "generate"),
                1,
                "episode {e}: a generate span per turn"
            );
            assert_eq!(
                kids(t, "env.step"),
                1,
                "episode {e}: an env.step span per turn"
            );
        }
    }
}
