//! The contract every generation engine and trainer honours, as generic checks run against
//! each implementation (the roofline simulator and the built-in model).

use std::sync::Arc;

use super::{
    FinishReason, GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, SamplingParams,
};
use crate::trainer::Trainer;
use crate::types::{Batch, PolicyVersion};
use crate::weights::Weights;

pub fn request(id: u64, context: Vec<u32>, max_tokens: u32, seed: u64) -> GenRequest {
    GenRequest {
        id,
        session: id,
        context: Arc::new(context.into()),
        params: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens,
            stop_tokens: vec![],
            seed,
            allowed_tokens: None,
            top_k: 0,
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        sim_response_len: Some(max_tokens),
        prefilled: false,
        reusable: None,
        carried: 0,
    }
}

/// Lets an engine whose work runs elsewhere (a server, on real time) get on with it.
pub fn pause_briefly() {
    // Real servers run on the machine's clock; tokio's (paused or not) does not apply.
    #[allow(clippy::disallowed_methods)]
    std::thread::sleep(std::time::Duration::from_millis(1));
}

/// Steps until idle; returns every finished request by id. An engine whose work completes
/// elsewhere (a server) is waited for, up to two minutes.
pub fn drain(e: &mut dyn GenerationEngine) -> Vec<(u64, Result<GenOutput, GenError>)> {
    let mut out = Vec::new();
    let deadline = infra::clock::wall_now() + std::time::Duration::from_secs(120);
    for _ in 0..1_000_000 {
        if e.has_work() {
            out.extend(e.step().finished);
            continue;
        }
        let l = e.load();
        if l.running + l.waiting == 0 || infra::clock::wall_now() > deadline {
            break;
        }
        pause_briefly();
    }
    let l = e.load();
    assert!(
        !e.has_work() && l.running + l.waiting == 0,
        "the engine never became idle: {l:?}"
    );
    out.sort_by_key(|(id, _)| *id);
    out
}

fn tokens_covered(o: &GenOutput) -> bool {
    o.versions.iter().map(|s| s.tokens as usize).sum::<usize>() == o.tokens.len()
        && o.logprobs.len() == o.tokens.len()
}

/// Every added request finishes once, within max_tokens, with a log-probability and a version
/// for every token; an aborted one never finishes.
pub fn check_add_abort(e: &mut dyn GenerationEngine, ctx: Vec<u32>) {
    for id in 0..6 {
        e.add(request(id, ctx.clone(), 3 + id as u32, id));
    }
    assert!(e.abort(2));
    assert!(!e.abort(99));
    let out = drain(e);
    let ids: Vec<u64> = out.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, vec![0, 1, 3, 4, 5]);
    for (id, r) in out {
        let o = r.expect("generation succeeds");
        assert!(!o.tokens.is_empty() && o.tokens.len() as u64 <= 3 + id);
        assert!(o.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        assert!(tokens_covered(&o));
        if o.finish == FinishReason::Length {
            assert_eq!(o.tokens.len() as u64, 3 + id);
        }
    }
}

/// Weights installed mid-generation: under `Abort` every token comes from the new version;
/// under `Recompute` the tokens before the swap keep the old version.
pub fn check_install(
    e: &mut dyn GenerationEngine,
    ctx: Vec<u32>,
    new: &Weights,
    policy: InFlightPolicy,
) {
    install_mid_answer(e, ctx, new, policy, None)
}

/// [`check_install`] for servers that show an answer only when it ends (or is aborted):
/// the install lands once request 7 has run for `running_for`.
pub fn check_install_after(
    e: &mut dyn GenerationEngine,
    ctx: Vec<u32>,
    new: &Weights,
    policy: InFlightPolicy,
    running_for: std::time::Duration,
) {
    install_mid_answer(e, ctx, new, policy, Some(running_for))
}

fn install_mid_answer(
    e: &mut dyn GenerationEngine,
    ctx: Vec<u32>,
    new: &Weights,
    policy: InFlightPolicy,
    running_for: Option<std::time::Duration>,
) {
    let mut r = request(7, ctx, 12, 7);
    r.params.ignore_eos = true;
    e.add(r);
    let mut out = Vec::new();
    // Until a few tokens stand (engines that report progress), or four steps.
    let deadline = infra::clock::wall_now() + std::time::Duration::from_secs(60);
    let mut started = None;
    for i in 0.. {
        match (e.progress(7), running_for) {
            (Some(_), Some(d)) => {
                let t = *started.get_or_insert_with(infra::clock::wall_now);
                if t.elapsed() >= d {
                    break;
                }
                pause_briefly();
            }
            (Some(n), None) if n >= 2 => break,
            (None, None) if i >= 4 => break,
            _ if infra::clock::wall_now() > deadline => panic!("request 7 made no progress"),
            (Some(_), None) => pause_briefly(),
            (None, _) => {}
        }
        if e.has_work() {
            out.extend(e.step().finished);
        }
    }
    e.install(new.version, new, policy).expect("install");
    out.extend(drain(e));
    let o = out
        .into_iter()
        .find(|(id, _)| *id == 7)
        .expect("request 7 finished")
        .1
        .expect("ok");
    assert!(tokens_covered(&o));
    match policy {
        InFlightPolicy::Abort => assert!(
            o.versions.iter().all(|s| s.version == new.version),
            "{:?}",
            o.versions
        ),
        InFlightPolicy::Recompute => {
            assert!(
                o.versions.len() == 2 && o.versions[1].version == new.version,
                "{:?}",
                o.versions
            );
        }
    }
    assert_eq!(e.load().version, new.version);
}

/// A trainer turns a batch into the next version's weights and reports it.
pub fn check_trainer(t: &mut dyn Trainer, batch: &Batch, next: PolicyVersion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    let (stats, w) = rt.block_on(t.train(batch, next)).expect("train");
    assert_eq!(stats.version, next);
    assert_eq!(
        w.expect("an in-process trainer makes weights").version,
        next
    );
    assert_eq!(stats.trajectories as usize, batch.trajectories().count());
    assert!(stats.loss.is_finite());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DeviceProfile, ModelProfile};
    use crate::generation::sim::{SimEngine, SimEngineConfig};
    use crate::model::engine::BuiltinEngine;
    use crate::model::tokenizer::{BOS, SEP};
    use crate::model::transformer::{ModelConfig, Params};
    use candle_core::{DType, Device};

    fn sim() -> SimEngine {
        SimEngine::new(SimEngineConfig::new(
            DeviceProfile::builtin("H20").unwrap(),
            ModelProfile::builtin("qwen3-8b").unwrap(),
        ))
    }

    fn builtin() -> (BuiltinEngine, Params, ModelConfig) {
        let cfg = ModelConfig {
            max_seq: 64,
            ..ModelConfig::default()
        };
        let p = Params::init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        (
            BuiltinEngine::new(cfg, &p.to_weights(0).unwrap(), 8).unwrap(),
            p,
            cfg,
        )
    }

    fn ctx() -> Vec<u32> {
        vec![BOS, 104, 105, SEP]
    }

    #[test]
    fn simulator_honours_the_generation_contract() {
        check_add_abort(&mut sim(), ctx());
        for policy in [InFlightPolicy::Abort, InFlightPolicy::Recompute] {
            check_install(&mut sim(), ctx(), &Weights::simulated(1, 1e9), policy);
        }
    }

    #[test]
    fn builtin_model_honours_the_generation_contract() {
        check_add_abort(&mut builtin().0, ctx());
        for policy in [InFlightPolicy::Abort, InFlightPolicy::Recompute] {
            let (mut e, _, cfg) = builtin();
            let w = Params::init(&cfg, 2, DType::F32, &Device::Cpu)
                .unwrap()
                .to_weights(1)
                .unwrap();
            // A long enough answer that the swap lands mid-generation (EOT may stop it early).
            e.add(request(100, ctx(), 40, 3));
            check_install(&mut e, ctx(), &w, policy);
        }
    }

    fn batch() -> Batch {
        let t = |r: f64, tok: u32| {
            let turn = crate::types::Turn {
                observation_tokens: ctx().into(),
                response_tokens: vec![tok, tok].into(),
                logprobs: vec![-5.0, -5.0].into(),
                ..Default::default()
            };
            crate::types::Trajectory::for_test(&format!("t{tok}"), turn, Some(r))
        };
        Batch {
            step: 0,
            groups: vec![crate::types::Group {
                id: 0,
                task: "t".into(),
                seed: 0,
                start_version: 0,
                masked: 0,
                trajectories: vec![t(1.0, 70), t(0.0, 71)],
            }],
        }
    }

    #[test]
    fn both_trainers_honour_the_trainer_contract() {
        let mut s = crate::trainer::SimTrainer {
            seconds_per_token: 1e-3,
            gpus: 1,
            step_overhead: std::time::Duration::ZERO,
            modelled_weight_bytes: 1.0,
            panic_at_step: None,
            host: None,
        };
        check_trainer(&mut s, &batch(), 1);
        let (_, p, cfg) = builtin();
        let mut b =
            crate::model::trainer::BuiltinTrainer::new(cfg, &p, Default::default()).unwrap();
        check_trainer(&mut b, &batch(), 1);
    }

    /// A simulated trainer on a host shared with generation makes up the cores the engines
    /// took while it trained: busy seconds / cores.
    #[test]
    fn a_trainer_sharing_its_host_loses_what_generation_computes_beside_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        let host = std::sync::Arc::new(crate::trainer::HostCpu::new(2.0));
        let mut s = crate::trainer::SimTrainer {
            seconds_per_token: 1e-3,
            gpus: 1,
            step_overhead: std::time::Duration::from_secs(1),
            modelled_weight_bytes: 1.0,
            panic_at_step: None,
            host: Some(host.clone()),
        };
        let b = batch();
        let alone = 1.0 + 1e-3 * b.tokens() as f64;
        rt.block_on(async {
            // Nothing computes beside it: its own time.
            let (stats, _) = s.train(&b, 1).await.unwrap();
            assert!((stats.seconds - alone).abs() < 1e-9, "{}", stats.seconds);
            // An engine computes 0.6 s while it trains: 0.3 s more on two cores.
            let h = host.clone();
            let beside = tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                h.charge(0.6);
            });
            let t0 = tokio::time::Instant::now();
            let (stats, _) = s.train(&b, 2).await.unwrap();
            beside.await.unwrap();
            assert!(
                (stats.seconds - (alone + 0.3)).abs() < 1e-9,
                "{}",
                stats.seconds
            );
            assert!((t0.elapsed().as_secs_f64() - (alone + 0.3)).abs() < 1e-6);
        });
    }
}
