//! Command-line helpers: progress display, the `sim` comparison and the scheduler benchmark.

use std::collections::BTreeMap;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::broadcast;

use crate::job::JobSummary;
use crate::service::JobEvent;
use crate::spec::{self, JobSpec, Preset};

fn bar(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    pb.set_style(ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb
}

fn progress_msg(m: &serde_json::Value) -> String {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    format!(
        "v{} success {:.2} traj/s {:.1} bubble {:.2} staleness {:.2}",
        f("/version"),
        f("/success_rate"),
        f("/trajectories_per_s"),
        f("/bubble_ratio"),
        f("/staleness_mean")
    )
}

fn progress_msg_full(m: &serde_json::Value, extra: &str) -> String {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    let step_s = f("/step_s").max(1e-9);
    format!(
        "v{} · {:.0} tok/s · bubble {:.2} · staleness {:.2}{extra}",
        f("/version"),
        (f("/prefill_tokens") + f("/decode_tokens")) / step_s,
        f("/bubble_ratio"),
        f("/staleness_mean")
    )
}

/// One bar per task: success as the bar, trajectories/s and turns in the message.
fn task_bar(mp: &indicatif::MultiProgress, name: &str) -> ProgressBar {
    let pb = mp.add(ProgressBar::new(100));
    pb.set_style(ProgressStyle::with_template("  {prefix:<12} [{bar:30}] {pos:>3}% success {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb.set_prefix(name.to_string());
    pb
}

/// Shows an in-process job's events until it ends; returns the last event.
pub async fn watch_events(rx: broadcast::Receiver<JobEvent>, first: Option<JobEvent>) -> Option<JobEvent> {
    watch_events_with(rx, first, String::new).await
}

/// Like [`watch_events`], with a bar per task (success, trajectories/s, turns) and `extra()`
/// appended to the job bar's message at every step (e.g. function instances).
pub async fn watch_events_with(mut rx: broadcast::Receiver<JobEvent>, first: Option<JobEvent>, extra: impl Fn() -> String) -> Option<JobEvent> {
    let mp = indicatif::MultiProgress::new();
    let mut tasks: BTreeMap<String, ProgressBar> = BTreeMap::new();
    let mut pb: Option<ProgressBar> = None;
    let mut last = first.clone();
    if let Some(JobEvent::State { state, .. }) = &first
        && state.is_terminal()
    {
        return first;
    }
    loop {
        match rx.recv().await {
            Ok(e) => {
                match &e {
                    JobEvent::Progress { step, steps, metrics, .. } => {
                        let b = pb.get_or_insert_with(|| mp.add(bar(*steps)));
                        b.set_position(*step);
                        b.set_message(progress_msg_full(metrics, &extra()));
                        let step_s = metrics.pointer("/step_s").and_then(|v| v.as_f64()).unwrap_or(0.0).max(1e-9);
                        if let Some(ts) = metrics.get("tasks").and_then(|t| t.as_object()) {
                            for (name, t) in ts {
                                let g = |k: &str| t.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
                                if g("trajectories") == 0.0 {
                                    continue;
                                }
                                let tb = tasks.entry(name.clone()).or_insert_with(|| task_bar(&mp, name));
                                tb.set_position((g("success_rate") * 100.0).round() as u64);
                                tb.set_message(format!("· {:.1} traj/s · {:.1} turns", g("trajectories") / step_s, g("mean_turns")));
                            }
                        }
                    }
                    JobEvent::State { id, state, .. } => {
                        let b = pb.get_or_insert_with(|| mp.add(bar(0)));
                        b.set_prefix(format!("{id} {}", state.as_str()));
                    }
                }
                let end = matches!(&e, JobEvent::State { state, .. } if state.is_terminal());
                last = Some(e);
                if end {
                    break;
                }
            }
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => break,
        }
    }
    if let Some(b) = pb {
        b.finish();
    }
    for t in tasks.values() {
        // Keep the last success rate on screen (finish() would fill the bar).
        t.abandon();
    }
    last
}

/// Follows a remote job's server-sent events.
pub async fn watch_remote(server: &str, id: &str) -> anyhow::Result<std::process::ExitCode> {
    use futures::StreamExt;
    let r = reqwest::get(format!("{server}/v1/jobs/{id}/events")).await?;
    if !r.status().is_success() {
        anyhow::bail!("{}: {}", r.status(), r.text().await?);
    }
    let mut stream = r.bytes_stream();
    let mut buf = String::new();
    let mut pb: Option<ProgressBar> = None;
    let mut ok = false;
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find('\n') {
            let line: String = buf.drain(..=pos).collect();
            let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data.trim()) else { continue };
            match v.get("type").and_then(|t| t.as_str()) {
                Some("progress") => {
                    let steps = v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0);
                    let b = pb.get_or_insert_with(|| bar(steps));
                    b.set_length(steps);
                    b.set_position(v.get("step").and_then(|s| s.as_u64()).unwrap_or(0));
                    b.set_message(progress_msg(v.get("metrics").unwrap_or(&serde_json::Value::Null)));
                }
                Some("state") => {
                    let state = v.get("state").and_then(|s| s.as_str()).unwrap_or("");
                    let b = pb.get_or_insert_with(|| bar(v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0)));
                    b.set_prefix(format!("{id} {state}"));
                    ok = state == "succeeded";
                }
                _ => {}
            }
        }
    }
    if let Some(b) = pb {
        b.finish();
    }
    Ok(if ok { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE })
}

pub fn print_metrics(m: &serde_json::Value) {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    println!(
        "time {:.1} s · trajectories/s {:.2} · bubble ratio {:.3} · staleness mean {:.2} max {}",
        f("/elapsed_s"),
        f("/trajectories_per_s"),
        f("/bubble_ratio"),
        f("/staleness_mean"),
        f("/staleness_max")
    );
    if let Some(pools) = m.get("pools").and_then(|p| p.as_object()) {
        for (name, p) in pools {
            println!(
                "  pool {name:8} {:5} ×{}  utilisation {:.3}  groups {}",
                p.get("device").and_then(|v| v.as_str()).unwrap_or(""),
                p.get("shards").and_then(|v| v.as_u64()).unwrap_or(0),
                p.get("utilisation").and_then(|v| v.as_f64()).unwrap_or(0.0),
                p.get("groups").and_then(|v| v.as_u64()).unwrap_or(0)
            );
        }
    }
    if let Some(tasks) = m.get("tasks").and_then(|p| p.as_object()) {
        for (name, t) in tasks {
            println!(
                "  task {name:12} success {:.3}  mean turns {:.1}",
                t.get("success_rate").and_then(|v| v.as_f64()).unwrap_or(0.0),
                t.get("mean_turns").and_then(|v| v.as_f64()).unwrap_or(0.0)
            );
        }
    }
}

fn summary_line(label: &str, s: &JobSummary, wall: Duration) {
    let steps = s.steps_done.max(1) as f64;
    println!(
        "{label:10} virtual {:9.1} s  steps/min {:7.3}  traj/s {:7.2}  bubble {:.3}  wall {:.2} s",
        s.elapsed_s,
        steps / (s.elapsed_s / 60.0).max(1e-9),
        s.trajectories_committed as f64 / s.elapsed_s.max(1e-9),
        s.bubble_ratio,
        wall.as_secs_f64()
    );
}

/// Wall time of a host-side measurement (simulations report virtual time separately).
#[allow(clippy::disallowed_methods)]
fn wall_now() -> std::time::Instant {
    std::time::Instant::now()
}

/// `rollarc sim`: runs the spec (optionally under several presets) in virtual time.
pub fn sim(spec: JobSpec, preset: Option<&str>, compare: &[String]) -> anyhow::Result<()> {
    let parse = |p: &str| Preset::parse(p).ok_or_else(|| anyhow::anyhow!("unknown preset {p:?}, expected one of sync, sync_plus, one_off, areal, rollarc"));
    let base = match preset {
        Some(p) => spec.with_preset(parse(p)?),
        None => spec,
    };
    if compare.is_empty() {
        let t = wall_now();
        let s = crate::simrun::run_virtual(base)?;
        summary_line(s.steps.last().map_or("run", |_| "run"), &s, t.elapsed());
        if let Some(last) = s.steps.last() {
            print_metrics(&serde_json::to_value(last)?);
        }
        return Ok(());
    }
    let mut results = Vec::new();
    for name in compare {
        let p = parse(name)?;
        let t = wall_now();
        let s = crate::simrun::run_virtual(base.with_preset(p))?;
        summary_line(p.name(), &s, t.elapsed());
        results.push((p, s));
    }
    if let Some((first, fs)) = results.first() {
        for (p, s) in &results[1..] {
            println!(
                "{} is {:.2}× faster than {} (virtual time for the same {} steps)",
                first.name(),
                s.elapsed_s / fs.elapsed_s.max(1e-9),
                p.name(),
                fs.steps_done
            );
        }
    }
    Ok(())
}

fn peak_rss_kib() -> u64 {
    (crate::scenario::peak_rss_mib() * 1024.0) as u64
}

/// The scheduler-overhead benchmark: zero-latency environments and an ideal (infinitely fast)
/// device, so all wall time is orchestration: actors, messages, buffer, scheduler.
pub fn bench(episodes: usize) -> anyhow::Result<()> {
    let groups = (episodes / 8).max(1);
    let turns = 5;
    let body = format!(
        r#"
seed = 1
[[tasks]]
domain = "bench"
group_size = 8
max_turns = {turns}
max_tokens_per_turn = 8
envs = {episodes}
[tasks.env]
kind = "sim"
turns = {{ constant = {turns} }}
observation_tokens = {{ constant = 8 }}
response_tokens = {{ constant = 8 }}
[[pools]]
name = "ideal"
device = "IDEAL"
count = 8
backend = {{ kind = "sim", model = "tiny", max_batch = 100000 }}
[rollout]
barrier = "none"
alpha = 0
overlap_training = false
batch_size = {groups}
steps = 3
max_concurrent_episodes = {episodes}
[trainer]
kind = "sim"
seconds_per_token = 0.0
"#
    );
    let spec = spec::parse(&body, spec::Format::Toml).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rss0 = peak_rss_kib();
    let t = wall_now();
    let s = crate::simrun::run_virtual(spec)?;
    let wall = t.elapsed().as_secs_f64();
    let rss1 = peak_rss_kib();
    let trajs = s.trajectories_committed.max(1);
    let steps = trajs * turns;
    let peak = s.steps.iter().map(|m| m.scheduler.peak_active_episodes).max().unwrap_or(0).max(1);
    println!("scheduler overhead benchmark: {episodes} concurrent episodes, {turns} turns each, zero-latency backends");
    println!("  trajectories {trajs}  env steps {steps}  wall {wall:.2} s");
    println!("  per env step     {:8.2} µs (generate + env.step + bookkeeping)", wall * 1e6 / steps as f64);
    println!("  per trajectory   {:8.2} µs", wall * 1e6 / trajs as f64);
    println!(
        "  peak in flight   {peak} episodes; peak RSS {:.1} MiB (+{:.1} MiB during the run)",
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0)) as f64 / 1024.0
    );
    println!("  memory per in-flight trajectory ≈ {:.1} KiB (RSS growth / peak episodes)", (rss1.saturating_sub(rss0)) as f64 / peak as f64);
    Ok(())
}

/// Measured peak of this machine: dense f32 matmul FLOP/s (candle, all cores) and memory
/// copy bandwidth. The roofline the built-in model is reported against.
fn machine_roofline() -> anyhow::Result<(f64, f64)> {
    use candle_core::{Device, Tensor};
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let _ = a.matmul(&b)?;
    let t = wall_now();
    let reps = 5;
    for _ in 0..reps {
        let _ = a.matmul(&b)?;
    }
    let flops = 2.0 * (n * n * n) as f64 * reps as f64 / t.elapsed().as_secs_f64();
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let t = wall_now();
    for _ in 0..4 {
        dst.copy_from_slice(&src);
    }
    // A copy reads and writes every byte.
    let bw = 2.0 * 4.0 * src.len() as f64 / t.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    Ok((flops, bw))
}

/// The built-in model's benchmark: prefill and decode throughput, decode scaling with the
/// number of concurrent sequences, trainer throughput, peak memory, against the roofline.
pub fn bench_model() -> anyhow::Result<()> {
    use actors::generation::{GenRequest, GenerationEngine, SamplingParams};
    use actors::model::engine::BuiltinEngine;
    use actors::model::tokenizer::{BOS, SEP};
    use actors::model::trainer::{BuiltinTrainer, TrainerConfig};
    use actors::model::transformer::{ModelConfig, Params};
    use candle_core::{DType, Device};
    use std::sync::Arc;

    let cfg = ModelConfig::default();
    let init = Params::init(&cfg, 1, DType::F32, &Device::Cpu)?;
    let w = init.to_weights(0)?;
    let (peak_flops, peak_bw) = machine_roofline()?;
    let d = cfg.d_model as f64;
    let dense = (cfg.params() - cfg.vocab * cfg.d_model - cfg.max_seq * cfg.d_model) as f64;
    println!(
        "built-in model: d_model {} layers {} heads {} d_ff {} max_seq {} — {} parameters ({:.1} MiB f32)",
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_ff,
        cfg.max_seq,
        cfg.params(),
        cfg.params() as f64 * 4.0 / 1048576.0
    );
    println!("machine roofline (measured): {:.1} GFLOP/s f32 matmul, {:.1} GB/s memory copy", peak_flops / 1e9, peak_bw / 1e9);
    let req = |id: u64, ctx_len: usize, max_tokens: u32| GenRequest {
        id,
        session: id,
        context: Arc::new(
            std::iter::once(BOS).chain((0..ctx_len.saturating_sub(2)).map(|i| 97 + (i as u32 + id as u32) % 26)).chain(std::iter::once(SEP)).collect(),
        ),
        params: SamplingParams { temperature: 1.0, top_p: 1.0, max_tokens, stop_tokens: vec![], seed: id, allowed_tokens: None },
        sim_response_len: None,
        prefilled: false,
    };
    // Prefill: 32 sequences of 256 tokens, one new token each (so decode is negligible).
    let mut e = BuiltinEngine::new(cfg, &w, 32)?;
    for i in 0..32 {
        e.add(req(i, 256, 1));
    }
    while e.has_work() {
        e.step();
    }
    let pf_tok_s = e.times.prefill_tokens as f64 / e.times.prefill.as_secs_f64();
    // FLOPs per prefilled token: 2 × dense params + attention (≈ 2 × 2 × context × d per layer).
    let pf_flops = pf_tok_s * (2.0 * dense + 4.0 * 128.0 * d * cfg.n_layers as f64);
    println!("prefill: {:.0} tokens/s = {:.2} GFLOP/s ({:.1}% of the matmul peak)", pf_tok_s, pf_flops / 1e9, 100.0 * pf_flops / peak_flops);
    println!("decode throughput by concurrent sequences (context 32, 64 new tokens each):");
    for c in [1usize, 8, 32, 128] {
        let mut e = BuiltinEngine::new(cfg, &w, c)?;
        for i in 0..c as u64 {
            e.add(req(i, 32, 64));
        }
        while e.has_work() {
            e.step();
        }
        let tok_s = e.times.decode_tokens as f64 / e.times.decode.as_secs_f64().max(1e-9);
        // Bytes per decode step: all weights once, plus each sequence's KV (≈ 64 tokens avg).
        let step_bytes = cfg.params() as f64 * 4.0 + c as f64 * 64.0 * 2.0 * d * cfg.n_layers as f64 * 4.0;
        let steps_s = tok_s / c as f64;
        println!(
            "  {c:4} sequences: {tok_s:9.0} tokens/s  ({:.2} GB/s of weights+KV = {:.1}% of copy bandwidth)",
            steps_s * step_bytes / 1e9,
            100.0 * steps_s * step_bytes / peak_bw
        );
    }
    // Trainer: 64 sequences of 128 tokens (64 generated).
    let mut tr = BuiltinTrainer::new(cfg, &init, TrainerConfig::default())?;
    let traj = |k: u64| actors::types::Trajectory {
        id: format!("b{k}"),
        group_id: k / 8,
        task: "bench".into(),
        seed: k,
        start_version: 0,
        pool: "cpu".into(),
        shard: 0,
        turns: vec![actors::types::Turn {
            observation_tokens: (0..64).map(|i| 97 + ((i + k) % 26) as u32).collect(),
            response_tokens: (0..64).map(|i| 97 + ((i * 7 + k) % 26) as u32).collect(),
            logprobs: vec![-5.5; 64],
            ..Default::default()
        }],
        reward: Some((k % 3) as f64),
        success: false,
        invalid_actions: 0,
        failure: None,
        reference: None,
        final_text: String::new(),
        allowed_tokens: None,
        timings: Default::default(),
    };
    let groups = (0..8u64)
        .map(|g| actors::types::Group {
            id: g,
            task: "bench".into(),
            seed: g,
            start_version: 0,
            masked: 0,
            trajectories: (0..8).map(|i| traj(g * 8 + i)).collect(),
        })
        .collect();
    let batch = actors::types::Batch { step: 0, groups };
    tr.step(&batch)?;
    let t = wall_now();
    let steps = 3;
    for _ in 0..steps {
        tr.step(&batch)?;
    }
    let per = t.elapsed().as_secs_f64() / steps as f64;
    let tokens = 64.0 * 128.0;
    println!(
        "trainer: {:.3} s per step of 64 × 128 tokens = {:.0} tokens/s (forward + backward + AdamW ≈ {:.2} GFLOP/s, {:.1}% of peak)",
        per,
        tokens / per,
        6.0 * dense * tokens / per / 1e9,
        100.0 * 6.0 * dense * tokens / per / peak_flops
    );
    println!("peak RSS: {:.1} MiB", peak_rss_kib() as f64 / 1024.0);
    Ok(())
}

/// Environment benchmark: steps per second through an environment actor for a built-in game
/// and for the external protocol (bare and sandboxed), the per-step overhead of protocol and
/// sandbox, and sandbox start time.
pub fn bench_env() -> anyhow::Result<()> {
    use actors::env::external::{ExternalConfig, ExternalEnv};
    use actors::env::{EnvActor, EnvArgs, EnvCounters, EnvFactory, EnvMsg};
    use ractor::Actor;
    use std::sync::Arc;

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let exe = std::env::current_exe()?.display().to_string();
    let serve = vec![exe.clone(), "env-serve".to_string(), r#"{"kind":"frozenlake","size":4}"#.to_string()];
    let external = |cmd: Vec<String>| -> EnvFactory {
        Arc::new(move |_| {
            Box::new(ExternalEnv::new(ExternalConfig {
                command: cmd.clone(),
                call_timeout: Duration::from_secs(30),
                max_message_bytes: 1 << 20,
                workdir: None,
            }))
        })
    };
    let spec: crate::spec::EnvSpec = serde_json::from_str(r#"{"kind":"frozenlake","size":4}"#)?;
    let builtin: EnvFactory = Arc::new(move |_| crate::envs::builtin(&spec).unwrap_or_else(|| unreachable_env()));
    let sandbox_ok = crate::envs::check_sandbox().is_ok();
    let mut cases: Vec<(&str, EnvFactory, usize)> = vec![("built-in FrozenLake", builtin, 50_000), ("external (protocol)", external(serve.clone()), 10_000)];
    if sandbox_ok {
        cases.push(("external, sandboxed", external(crate::envs::sandboxed(&serve, &[])), 10_000));
    }
    println!("environment benchmark (FrozenLake 4×4 through an environment actor):");
    let mut per_step = Vec::new();
    for (name, factory, n) in cases {
        let us = rt.block_on(async {
            let args = EnvArgs { task: "bench".into(), index: 0, slot: 0, factory, counters: Arc::new(EnvCounters::default()) };
            let (a, _) = Actor::spawn(None, EnvActor, args).await?;
            ractor::call_t!(a, |p| EnvMsg::Reset(0, p), 30_000)?.map_err(|e| anyhow::anyhow!("{e}"))?;
            let t = wall_now();
            for _ in 0..n {
                // "up" at the start keeps the agent in place: the episode never ends.
                ractor::call_t!(a, |p| EnvMsg::Step("up".into(), Vec::new(), p), 30_000)?.map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            let el = t.elapsed().as_secs_f64();
            a.stop(None);
            anyhow::Ok(el * 1e6 / n as f64)
        })?;
        println!("  {name:22} {:9.0} steps/s  {us:7.1} µs per step", 1e6 / us);
        per_step.push(us);
    }
    if per_step.len() >= 2 {
        println!("  protocol overhead per step: {:.1} µs over the built-in", per_step[1] - per_step[0]);
    }
    if per_step.len() >= 3 {
        println!("  sandbox overhead per step:  {:.1} µs over the bare protocol", per_step[2] - per_step[1]);
    }
    for (name, cmd) in [("bare", serve.clone()), ("sandboxed", crate::envs::sandboxed(&serve, &[]))] {
        if name == "sandboxed" && !sandbox_ok {
            println!("  sandbox start: skipped (bubblewrap unavailable)");
            continue;
        }
        let n = 30;
        let ms = rt.block_on(async {
            let t = wall_now();
            for i in 0..n {
                let mut e =
                    ExternalEnv::new(ExternalConfig { command: cmd.clone(), call_timeout: Duration::from_secs(30), max_message_bytes: 1 << 20, workdir: None });
                actors::env::Environment::reset(&mut e, i).await.map_err(|e| anyhow::anyhow!("{e}"))?;
                actors::env::Environment::close(&mut e).await;
            }
            anyhow::Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
        })?;
        println!("  start + first reset + close, {name:9}: {ms:6.1} ms");
    }
    Ok(())
}

fn unreachable_env() -> Box<dyn actors::env::DynEnvironment> {
    Box::new(actors::env::builtin::frozenlake::FrozenLake::new(Default::default()))
}

/// `rollarc bench --what functions`: router overhead against a direct call, burst from zero,
/// overload absorb, and retry amplification under instance kills, on real `rollarc-fn`
/// processes of the local runtime.
pub fn bench_functions() -> anyhow::Result<()> {
    use functions::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoredItem};
    use infra::faas::{DeploymentConfig, Dur, FunctionRuntime, Scaling};
    use infra::router::{Call, Router, RouterConfig, Target};
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::time::Instant;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let bin = crate::functions::default_fn_bin().to_string_lossy().into_owned();
        let runtime = FunctionRuntime::new();
        let body = |k: &str| {
            let req = ScoreRequest {
                protocol: PROTOCOL_VERSION.into(),
                idempotency_key: k.into(),
                reward: "bench@1".into(),
                reference: Some(serde_json::json!("42")),
                deadline_ms: 30_000,
                items: vec![ScoredItem { trajectory_id: k.into(), text: "the answer is 42".into(), token_ids: vec![], env_reward: 0.0 }],
            };
            bytes::Bytes::from(serde_json::to_vec(&req).unwrap_or_default())
        };
        let call = |k: String| Call { body: body(&k), key: k, deadline: Instant::now() + Duration::from_secs(60) };
        let pct = |v: &mut Vec<f64>, p: f64| {
            v.sort_by(f64::total_cmp);
            v[((v.len() as f64 - 1.0) * p).round() as usize]
        };
        let wait_ready = |d: Arc<infra::faas::Deployment>, n: u32| async move {
            let t = Instant::now();
            while d.status().ready < n && t.elapsed() < Duration::from_secs(30) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        println!("functions benchmark (release, real rollarc-fn processes, 2 cores)");

        // 1. Router overhead at a fixed rate: 200 calls/s, 1,000 calls, one warm instance.
        let mut cfg = DeploymentConfig::new("bench-direct", bin.clone(), vec!["math".into()]);
        cfg.scaling = Scaling { min_scale: 1, initial_scale: 1, ..Scaling::default() };
        let dep = runtime.deploy(cfg)?;
        wait_ready(dep.clone(), 1).await;
        let url = dep.endpoints().borrow().first().map(|e| e.url.clone()).unwrap_or_default();
        let router = Router::new("bench-direct", Target::Local(dep.clone()), RouterConfig::default());
        let client = reqwest::Client::new();
        let (mut direct, mut routed) = (Vec::new(), Vec::new());
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        for i in 0..1000 {
            tick.tick().await;
            let t = Instant::now();
            client.post(&url).body(body(&format!("d{i}"))).send().await?.bytes().await?;
            direct.push(t.elapsed().as_secs_f64() * 1e3);
            tick.tick().await;
            let t = Instant::now();
            router.call(call(format!("r{i}"))).await?;
            routed.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let (d50, d99, r50, r99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99), pct(&mut routed, 0.5), pct(&mut routed, 0.99));
        println!("  router overhead @200/s: direct p50 {d50:.3} ms p99 {d99:.3} ms; routed p50 {r50:.3} ms p99 {r99:.3} ms; Δp50 {:.3} ms Δp99 {:.3} ms", r50 - d50, r99 - d99);

        // 2. Burst from zero: 200 simultaneous calls to a deployment at zero.
        let mut cfg = DeploymentConfig::new("bench-burst", bin.clone(), vec!["math".into()]);
        cfg.scaling = Scaling { initial_scale: 0, container_concurrency: 8, tick_interval: Dur::millis(500), ..Scaling::default() };
        let dep = runtime.deploy(cfg)?;
        let router = Router::new("bench-burst", Target::Local(dep.clone()), RouterConfig { container_concurrency: 8, ..RouterConfig::default() });
        let t0 = Instant::now();
        let hs: Vec<_> = (0..200)
            .map(|i| {
                let (r, c) = (router.clone(), call(format!("b{i}")));
                tokio::spawn(async move {
                    let t = Instant::now();
                    (r.call(c).await.is_ok(), t.elapsed().as_secs_f64())
                })
            })
            .collect();
        let (mut errors, mut max_lat, mut first) = (0, 0.0f64, f64::MAX);
        for h in hs {
            let (ok, lat) = h.await?;
            errors += usize::from(!ok);
            max_lat = max_lat.max(lat);
            first = first.min(lat);
        }
        let st = dep.status();
        println!(
            "  burst from zero: 200 calls, errors {errors}, first answer {first:.3} s (cold start), max latency {max_lat:.3} s, all done {:.3} s, instances started {}",
            t0.elapsed().as_secs_f64(),
            st.instances_started
        );

        // 3. Overload absorb: one instance, container concurrency 1, 1,000 simultaneous calls.
        let mut cfg = DeploymentConfig::new("bench-absorb", bin.clone(), vec!["math".into()]);
        cfg.scaling = Scaling { min_scale: 1, max_scale: 1, initial_scale: 1, container_concurrency: 1, ..Scaling::default() };
        let dep = runtime.deploy(cfg)?;
        wait_ready(dep.clone(), 1).await;
        let router = Router::new("bench-absorb", Target::Local(dep.clone()), RouterConfig { container_concurrency: 1, ..RouterConfig::default() });
        let t0 = Instant::now();
        let hs: Vec<_> = (0..1000)
            .map(|i| {
                let (r, c) = (router.clone(), call(format!("a{i}")));
                tokio::spawn(async move { r.call(c).await.is_ok() })
            })
            .collect();
        let mut ok = 0;
        for h in hs {
            ok += usize::from(h.await?);
        }
        println!(
            "  overload absorb: 1 instance, concurrency 1, 1,000 simultaneous: {ok}/1000 succeeded in {:.3} s, peak queue {}",
            t0.elapsed().as_secs_f64(),
            router.stats().snapshot().peak_queued
        );

        // 4. Retry amplification: 3 instances, SIGKILL of a random one every 500 ms, open-loop load.
        let mut cfg = DeploymentConfig::new("bench-kill", bin.clone(), vec!["math".into()]);
        cfg.scaling = Scaling { min_scale: 3, initial_scale: 3, container_concurrency: 4, ..Scaling::default() };
        let dep = runtime.deploy(cfg)?;
        wait_ready(dep.clone(), 3).await;
        let router = Router::new("bench-kill", Target::Local(dep.clone()), RouterConfig { container_concurrency: 4, ..RouterConfig::default() });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let killer = {
            let (dep, stop) = (dep.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
                let mut kills = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let pids = dep.ready_pids();
                    if let Some(&p) = pids.get(rng.random_range(0..pids.len().max(1))) {
                        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::Signal::SIGKILL);
                        kills += 1;
                    }
                }
                kills
            })
        };
        // Open loop: 400 calls/s for 10 s.
        let t0 = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_micros(2500));
        let mut hs = Vec::with_capacity(4000);
        for i in 0..4000 {
            tick.tick().await;
            let (r, c) = (router.clone(), call(format!("k{i}")));
            hs.push(tokio::spawn(async move { r.call(c).await.is_ok() }));
        }
        let mut ok = 0;
        for h in hs {
            ok += usize::from(h.await?);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let kills = killer.await?;
        let st = router.stats().snapshot();
        println!(
            "  kills under load: 4,000 calls at 400/s in {:.2} s, {kills} SIGKILLs, success {:.3}%, tries/calls {:.3}, retries {}, budget exhausted {}",
            t0.elapsed().as_secs_f64(),
            100.0 * ok as f64 / 4000.0,
            st.tries as f64 / st.calls.max(1) as f64,
            st.retries,
            st.budget_exhausted
        );
        runtime.shutdown().await;
        anyhow::Ok(())
    })
}

/// `rollarc bench --what presets`: the quickstart job under `sync`, `sync_plus`, `one_off` and
/// `rollarc` for the same number of steps, with the built-in environments as they are and with
/// environment latency injected (per-turn Normal(μ, σ), heavy-tailed resets; scaled down so
/// the runs stay short); wall time, steps/min, final success per task, bubble ratio, and the
/// ratio of `rollarc` against each baseline measured in the same run.
pub fn bench_presets(file: &std::path::Path, steps: u64) -> anyhow::Result<()> {
    use crate::spec::{InjectLatency, Preset};
    use actors::dist::Dist;
    use std::sync::Arc;
    let base = crate::spec::parse(&std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?, crate::spec::Format::Toml)
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let presets = [Preset::Sync, Preset::SyncPlus, Preset::OneOff, Preset::Rollarc];
    println!("preset benchmark: {} × {steps} steps per run (release, 2 cores)", file.display());
    for injected in [false, true] {
        let label =
            if injected { "injected env latency: step Normal(0.3 s, σ 0.15 s), reset LogNormal(μ −2, σ 1)" } else { "built-in environments as they are" };
        println!("  {label}");
        println!("    {:<10} {:>9} {:>10} {:>8}  final success per task", "preset", "wall s", "steps/min", "bubble");
        let mut walls = BTreeMap::new();
        for p in presets {
            let mut spec = base.with_preset(p);
            spec.rollout.steps = Some(steps);
            if injected {
                for t in &mut spec.tasks {
                    t.inject_latency =
                        Some(InjectLatency { reset_s: Some(Dist::Lognormal { mu: -2.0, sigma: 1.0 }), step_s: Some(Dist::Normal { mean: 0.3, std: 0.15 }) });
                }
            }
            let s = crate::simrun::run_blocking(spec, 0, 0, Arc::new(actors::buffer::CountingSink::default()), Arc::new(crate::job::NoObserver), None)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.name()))?;
            let tail = &s.steps[s.steps.len().saturating_sub(3)..];
            let mut per_task: BTreeMap<String, (f64, usize)> = BTreeMap::new();
            for m in tail {
                for (k, t) in &m.tasks {
                    let e = per_task.entry(k.clone()).or_default();
                    e.0 += t.success_rate * t.trajectories as f64;
                    e.1 += t.trajectories;
                }
            }
            let succ: Vec<String> = per_task.iter().map(|(k, (s, n))| format!("{k} {:.2}", s / (*n).max(1) as f64)).collect();
            println!(
                "    {:<10} {:>9.1} {:>10.2} {:>8.3}  {}",
                p.name(),
                s.elapsed_s,
                s.steps_done as f64 / (s.elapsed_s / 60.0).max(1e-9),
                s.bubble_ratio,
                succ.join(", ")
            );
            walls.insert(p.name(), s.elapsed_s);
        }
        let r = walls.get("rollarc").copied().unwrap_or(f64::NAN);
        let ratios: Vec<String> =
            ["sync", "sync_plus", "one_off"].iter().map(|b| format!("{:.2}× {b}", walls.get(b).copied().unwrap_or(f64::NAN) / r)).collect();
        println!("    rollarc is {}", ratios.join(", "));
    }
    Ok(())
}
