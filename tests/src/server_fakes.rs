//! The SGLang and vLLM adapters against faithful fakes of their servers (`tests::fakes`):
//! the generation contract (add/abort, installs under abort and recompute), and their
//! failure modes — aborted answers carry partial tokens, vLLM's 503 while paused is retried,
//! a weight version that does not follow the install fails the request, a server that is
//! never healthy fails its requests instead of hanging them.

use std::sync::Arc;
use std::time::Duration;

use actors::generation::contract::{self, drain, request};
use actors::generation::remote::sglang::Sglang;
use actors::generation::remote::vllm::Vllm;
use actors::generation::remote::{
    RemoteConfig, RemoteEngine, ServerClient, ServerError, WeightsExporter,
};
use actors::generation::{GenerationEngine, InFlightPolicy};
use actors::weights::Weights;
use tests::fakes::{self, Fake, FakeConfig, Kind};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Names a directory per version without writing one (the fakes load nothing).
fn exporter() -> WeightsExporter {
    Arc::new(|v, _w| Box::pin(async move { Ok::<_, ServerError>(format!("/exports/v{v}").into()) }))
}

fn client(kind: Kind, fake: &Fake) -> Arc<dyn ServerClient> {
    let http = reqwest::Client::new();
    match kind {
        Kind::Sglang => Arc::new(Sglang::new(http, &fake.url, Some(exporter()))),
        Kind::Vllm => Arc::new(Vllm::new(http, &fake.url, 4, Some(exporter()))),
    }
}

fn engine(rt: &tokio::runtime::Runtime, kind: Kind, cfg: FakeConfig) -> (RemoteEngine, Fake) {
    engine_with(
        rt,
        kind,
        cfg,
        RemoteConfig {
            probe_every: Duration::from_millis(20),
            ..Default::default()
        },
    )
}

fn engine_with(
    rt: &tokio::runtime::Runtime,
    kind: Kind,
    cfg: FakeConfig,
    rc: RemoteConfig,
) -> (RemoteEngine, Fake) {
    let fake = rt.block_on(fakes::start(kind, cfg));
    let rc_ready = rc.ready_within.min(Duration::from_secs(30));
    let mut e = RemoteEngine::start(client(kind, &fake), rt.handle().clone(), rc);
    let deadline = infra::clock::wall_now() + rc_ready;
    while e.info().is_none() && infra::clock::wall_now() < deadline {
        if e.has_work() {
            e.step();
        }
        contract::pause_briefly();
    }
    (e, fake)
}

fn ctx() -> Vec<u32> {
    vec![11, 12, 13, 14]
}

#[test]
fn sglang_and_vllm_adapters_honour_the_generation_contract_on_their_fakes() {
    let rt = runtime();
    for kind in [Kind::Sglang, Kind::Vllm] {
        let (mut e, fake) = engine(&rt, kind, FakeConfig::default());
        assert_eq!(e.info().unwrap().context, 512);
        contract::check_add_abort(&mut e, ctx());
        assert!(
            !fake.aborts().is_empty(),
            "{kind:?}: the abort reached the server"
        );
        for policy in [InFlightPolicy::Abort, InFlightPolicy::Recompute] {
            // 12 tokens at 20 ms: the install lands after about five.
            let (mut e, fake) = engine(
                &rt,
                kind,
                FakeConfig {
                    token_ms: 20,
                    ..Default::default()
                },
            );
            contract::check_install_after(
                &mut e,
                ctx(),
                &Weights::simulated(1, 1.0),
                policy,
                Duration::from_millis(100),
            );
            assert_eq!(fake.installs(), vec!["/exports/v1".to_string()], "{kind:?}");
        }
    }
}

#[test]
fn requests_carry_the_sampling_parameters_in_each_servers_names() {
    let rt = runtime();
    for kind in [Kind::Sglang, Kind::Vllm] {
        let (mut e, fake) = engine(&rt, kind, FakeConfig::default());
        let mut r = request(1, ctx(), 6, 42);
        r.params.stop_tokens = vec![999];
        r.params.top_k = 5;
        r.params.temperature = 0.7;
        e.add(r);
        let out = drain(&mut e).remove(0).1.unwrap();
        assert_eq!(out.tokens.len(), out.logprobs.len());
        let body = fake.requests().pop().unwrap();
        match kind {
            Kind::Sglang => {
                assert_eq!(body["input_ids"], serde_json::json!([11, 12, 13, 14]));
                let sp = &body["sampling_params"];
                assert_eq!(sp["max_new_tokens"], 6);
                assert_eq!(sp["top_k"], 5);
                assert_eq!(sp["stop_token_ids"], serde_json::json!([999]));
                assert_eq!(sp["sampling_seed"], 42);
                assert_eq!(body["return_logprob"], true);
            }
            Kind::Vllm => {
                assert_eq!(body["prompt"], serde_json::json!([11, 12, 13, 14]));
                assert_eq!(body["model"], "fake-model");
                assert_eq!(body["max_tokens"], 6);
                assert_eq!(body["top_k"], 5);
                assert_eq!(body["stop_token_ids"], serde_json::json!([999]));
                assert_eq!(body["return_token_ids"], true);
            }
        }
        // Answers as the fake's model gives them.
        let base: u32 = ctx().iter().sum();
        assert_eq!(out.tokens[0], base % 1000);
        assert!((out.logprobs[1] - (-0.35)).abs() < 1e-6);
    }
}

#[test]
fn a_paused_vllm_answers_503_and_the_request_runs_once_it_resumes() {
    let rt = runtime();
    let (mut e, fake) = engine(&rt, Kind::Vllm, FakeConfig::default());
    // Someone else paused it (mode=abort): vLLM refuses new requests with 503.
    let http = reqwest::Client::new();
    rt.block_on(http.post(format!("{}/pause?mode=abort", fake.url)).send())
        .unwrap();
    e.add(request(1, ctx(), 4, 1));
    for _ in 0..50 {
        if e.has_work() {
            e.step();
        }
        contract::pause_briefly();
    }
    assert!(
        !fake.requests().is_empty(),
        "the request was tried while paused"
    );
    assert_eq!(
        e.load().running + e.load().waiting,
        1,
        "and kept, not failed"
    );
    rt.block_on(http.post(format!("{}/resume", fake.url)).send())
        .unwrap();
    let out = drain(&mut e).remove(0).1.unwrap();
    assert_eq!(out.tokens.len(), 4);
}

#[test]
fn a_suspended_shard_pauses_sglang_and_resuming_continues_it() {
    let rt = runtime();
    let (mut e, fake) = engine(&rt, Kind::Sglang, FakeConfig::default());
    e.suspend();
    let deadline = infra::clock::wall_now() + Duration::from_secs(10);
    while !fake.paused() {
        assert!(
            infra::clock::wall_now() < deadline,
            "pause_generation never arrived"
        );
        contract::pause_briefly();
    }
    e.add(request(1, ctx(), 3, 1));
    assert_eq!(e.load().waiting, 1, "nothing is admitted while suspended");
    e.resume();
    let out = drain(&mut e).remove(0).1.unwrap();
    assert_eq!(out.tokens.len(), 3);
    assert!(!fake.paused());
}

#[test]
fn an_sglang_answer_from_another_weight_version_fails_the_request() {
    let rt = runtime();
    let (mut e, _fake) = engine(
        &rt,
        Kind::Sglang,
        FakeConfig {
            stuck_version: Some("0".into()),
            ..Default::default()
        },
    );
    e.install(1, &Weights::simulated(1, 1.0), InFlightPolicy::Abort)
        .unwrap();
    e.add(request(1, ctx(), 3, 1));
    let err = drain(&mut e).remove(0).1.unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(
        chain.contains("weight version 0, but 1 is installed"),
        "{chain}"
    );
}

#[test]
fn a_server_that_never_becomes_healthy_fails_its_requests() {
    let rt = runtime();
    let (mut e, _fake) = engine_with(
        &rt,
        Kind::Vllm,
        FakeConfig {
            health_delay: Duration::from_secs(30),
            ..Default::default()
        },
        RemoteConfig {
            ready_within: Duration::from_millis(300),
            ..Default::default()
        },
    );
    e.add(request(1, ctx(), 3, 1));
    let err = drain(&mut e).remove(0).1.unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(chain.contains("was not healthy"), "{chain}");
}

/// Where `make setup` puts SmolLM2.
fn smollm2() -> std::path::PathBuf {
    actors::model::llm::smollm2_path()
}

#[test]
fn a_job_on_an_attached_sglang_server_installs_each_version_from_disk() {
    let rt = runtime();
    let fake = rt.block_on(fakes::start(Kind::Sglang, FakeConfig::default()));
    let dir = tempfile::tempdir().unwrap();
    let spec = tests::SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 6\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .extra(&format!(
            "[[pools]]\nname = \"sg\"\ndevice = \"CPU\"\ncount = 1\nbackend = {{ kind = \"sglang\", urls = [{:?}], model = {{ path = {:?}, max_seq = 512 }} }}",
            fake.url,
            smollm2().display().to_string()
        ))
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001\nlora = { rank = 2, alpha = 4, targets = [\"attn_q\"] }")
        .build();
    let log = Arc::new(tests::BatchLog::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(actors::buffer::MemorySink::default()),
        log.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 2);
    // Every version the job served went to the server as a Hugging Face directory.
    let installs = fake.installs();
    assert!(installs.len() >= 2, "{installs:?}");
    for (v, path) in installs.iter().enumerate() {
        assert!(path.ends_with(&format!("served/hf/v{v}")), "{path}");
    }
    // The newest one is still on disk, whole.
    let newest = std::path::Path::new(installs.last().unwrap());
    assert!(newest.join("config.json").is_file() && newest.join("model.safetensors").is_file());
    // Each request went to the server as token ids, and each turn's versions cover it.
    assert!(fake.requests().iter().all(|r| r["input_ids"].is_array()));
    for (_, b) in log.batches.lock().unwrap().iter() {
        for t in b.trajectories() {
            for u in &t.turns {
                let covered: u32 = u.versions.iter().map(|v| v.tokens).sum();
                assert_eq!(covered as usize, u.response_tokens.len());
                assert!(u.versions.iter().all(|v| v.version <= b.step));
            }
        }
    }
}

#[test]
fn the_load_report_counts_what_other_clients_run_on_the_server() {
    let rt = runtime();
    for kind in [Kind::Sglang, Kind::Vllm] {
        let (mut e, fake) = engine(
            &rt,
            kind,
            FakeConfig {
                token_ms: 50,
                ..Default::default()
            },
        );
        // Another client starts a long request straight on the server.
        let (url, http) = (fake.url.clone(), reqwest::Client::new());
        let other = rt.spawn(async move {
            let (path, body) = match kind {
                Kind::Sglang => ("/generate", serde_json::json!({"input_ids": [1, 2], "rid": "other", "sampling_params": {"max_new_tokens": 20}})),
                Kind::Vllm => ("/v1/completions", serde_json::json!({"model": "fake-model", "prompt": [1, 2], "max_tokens": 20, "request_id": "other"})),
            };
            http.post(format!("{url}{path}")).json(&body).send().await
        });
        let deadline = infra::clock::wall_now() + Duration::from_secs(10);
        loop {
            if e.has_work() {
                e.step();
            }
            if e.load().external == 1 {
                break;
            }
            assert!(
                infra::clock::wall_now() < deadline,
                "{kind:?}: the server's own load never showed"
            );
            contract::pause_briefly();
        }
        rt.block_on(other).unwrap().unwrap();
    }
}

#[test]
fn trajectories_go_to_the_server_other_clients_do_not_load() {
    let rt = runtime();
    let busy = rt.block_on(fakes::start(
        Kind::Sglang,
        FakeConfig {
            token_ms: 10,
            background: 32,
            ..Default::default()
        },
    ));
    let idle = rt.block_on(fakes::start(
        Kind::Sglang,
        FakeConfig {
            token_ms: 10,
            ..Default::default()
        },
    ));
    let spec = tests::SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 6\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 4")
        .rollout("steps = 1")
        .rollout("alpha = 1")
        .extra(&format!(
            "[[pools]]\nname = \"sg\"\ndevice = \"CPU\"\ncount = 2\nbackend = {{ kind = \"sglang\", urls = [{:?}, {:?}], model = {{ path = {:?}, max_seq = 512 }} }}",
            busy.url,
            idle.url,
            smollm2().display().to_string()
        ))
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001\nlora = { rank = 2, alpha = 4, targets = [\"attn_q\"] }")
        .build();
    let dir = tempfile::tempdir().unwrap();
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(actors::buffer::MemorySink::default()),
        Arc::new(tests::BatchLog::default()),
        Some(dir.path().to_path_buf()),
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 1);
    // The shards' first load reports arrive while the job starts (the initial install waits
    // for the servers); from then on the shard whose server carries 32 requests of other
    // clients gets nothing while the other has fewer.
    let (b, i) = (busy.requests().len(), idle.requests().len());
    eprintln!("requests: busy server {b}, idle server {i}");
    assert!(b + i >= 4, "busy {b}, idle {i}");
    assert!(3 * b < b + i, "busy server got {b} of {} requests", b + i);
}

#[test]
fn prompt_logprobs_come_back_for_every_token_after_the_first() {
    let rt = runtime();
    let tokens: std::sync::Arc<[u32]> = vec![5, 17, 3, 250, 9].into();
    for kind in [Kind::Sglang, Kind::Vllm] {
        let fake = rt.block_on(fakes::start(kind, FakeConfig::default()));
        let c = client(kind, &fake);
        rt.block_on(c.info()).unwrap();
        let lps = rt.block_on(c.prompt_logprobs(tokens.clone())).unwrap();
        let want: Vec<f32> = tokens[1..]
            .iter()
            .map(|&t| fakes::prompt_logprob(u64::from(t)) as f32)
            .collect();
        assert_eq!(lps, want, "{kind:?}");
        // The request asked for the input's log-probabilities in each server's names.
        let r = fake.requests().last().cloned().unwrap();
        match kind {
            Kind::Sglang => {
                assert_eq!(r["logprob_start_len"], 0);
                assert_eq!(r["return_logprob"], true);
            }
            Kind::Vllm => assert_eq!(r["prompt_logprobs"], 0),
        }
    }
}
