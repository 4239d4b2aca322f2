//! Validation of the `pools[]` section: devices, counts, and each backend's fields.

use actors::device::{DeviceProfile, ModelProfile};

use super::super::{JobSpec, Problems};
use super::{BackendSpec, BuiltinModelSpec, PoolSpec, ServerSpec};

impl PoolSpec {
    /// Checks this pool (at `at`, e.g. `pools[0]`) against the rest of the spec.
    pub(in crate::spec) fn check(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (pl, p) = (self, at);
        if spec.device_profile(&pl.device).is_none() {
            problems.push(
                format!("{p}.device"),
                format!(
                    "unknown device class {:?}, expected one of {} or one under sim.devices",
                    pl.device,
                    DeviceProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        super::POOL_COUNT.check_at(p, Some(pl.count), problems);
        match &pl.backend {
            BackendSpec::Sim { .. } => self.check_sim(at, spec, problems),
            BackendSpec::Builtin { model, max_batch } => {
                check_builtin(at, spec, model, *max_batch, problems)
            }
            BackendSpec::Llamacpp(l) | BackendSpec::Sglang(l) | BackendSpec::Vllm(l) => {
                check_builtin(at, spec, &l.model, 1, problems);
                let llamacpp = matches!(pl.backend, BackendSpec::Llamacpp(_));
                check_server(at, pl.count, l, llamacpp, problems);
            }
        }
    }

    /// Checks a simulated backend: its model and its costs.
    fn check_sim(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (pl, p) = (self, at);
        let BackendSpec::Sim {
            model,
            gpus_per_shard,
            tp_efficiency,
            measured,
            ..
        } = &pl.backend
        else {
            return;
        };
        if let Some(m) = measured {
            for (k, v) in [
                ("step_s", m.step_s),
                ("prefill_s_per_token", m.prefill_s_per_token),
                ("decode_s_per_token", m.decode_s_per_token),
            ] {
                if !(v.is_finite() && (0.0..=3600.0).contains(&v)) {
                    problems.push(
                        format!("{p}.backend.measured.{k}"),
                        format!("must be seconds in [0, 3600], got {v}"),
                    );
                }
            }
        }
        if spec.model_profile(model).is_none() {
            problems.push(
                format!("{p}.backend.model"),
                format!(
                    "unknown model {model:?}, expected one of {} or one under sim.models",
                    ModelProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        if *gpus_per_shard == 0 || *gpus_per_shard > 64 {
            problems.push(
                format!("{p}.backend.gpus_per_shard"),
                format!("must be in 1..=64, got {gpus_per_shard}"),
            );
        }
        if let Some(e) = tp_efficiency
            && !(*e > 0.0 && *e <= 1.0)
        {
            problems.push(
                format!("{p}.backend.tp_efficiency"),
                format!("must be in (0, 1], got {e}"),
            );
        }
        self.check_sim_links(at, spec, problems);
    }

    /// Checks a simulated backend's prefill link and engine knobs.
    fn check_sim_links(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (pl, p) = (self, at);
        let BackendSpec::Sim {
            max_batch,
            mfu,
            mbu,
            weight_sync_gbps,
            hang_probability,
            prefill_pool,
            kv_transfer_gbps,
            kv_return,
            block_tokens,
            ..
        } = &pl.backend
        else {
            return;
        };
        if let Some(pp) = prefill_pool {
            match spec.pools.iter().find(|q| &q.name == pp) {
                None => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    format!("no pool is named {pp:?}"),
                ),
                Some(q) if q.name == pl.name => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    "a pool cannot prefill for itself".into(),
                ),
                Some(q) if !matches!(q.backend, BackendSpec::Sim { .. }) => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    format!("pool {pp:?} must be simulated too"),
                ),
                Some(_) => {}
            }
        }
        if *kv_return && prefill_pool.is_none() {
            problems.push(
                format!("{p}.backend.kv_return"),
                "hands KV back to a prefill pool: set prefill_pool too".into(),
            );
        }
        if *block_tokens == Some(0) {
            problems.push(
                format!("{p}.backend.block_tokens"),
                "must be at least 1".into(),
            );
        }
        if let Some(g) = kv_transfer_gbps
            && !(g.is_finite() && *g > 0.0)
        {
            problems.push(
                format!("{p}.backend.kv_transfer_gbps"),
                format!("must be positive, got {g}"),
            );
        }
        if *max_batch == Some(0) {
            problems.push(
                format!("{p}.backend.max_batch"),
                "must be at least 1".into(),
            );
        }
        for (name, v) in [("mfu", mfu), ("mbu", mbu)] {
            if let Some(v) = v
                && !(*v > 0.0 && *v <= 1.0)
            {
                problems.push(
                    format!("{p}.backend.{name}"),
                    format!("must be in (0, 1], got {v}"),
                );
            }
        }
        if let Some(g) = weight_sync_gbps
            && !(g.is_finite() && *g > 0.0)
        {
            problems.push(
                format!("{p}.backend.weight_sync_gbps"),
                format!("must be positive, got {g}"),
            );
        }
        if !(0.0..=1.0).contains(hang_probability) {
            problems.push(
                format!("{p}.backend.hang_probability"),
                format!("must be a probability in [0, 1], got {hang_probability}"),
            );
        }
    }
}

/// Checks a built-in model backend (at `at`, e.g. `pools[0]`).
fn check_builtin(
    at: &str,
    spec: &JobSpec,
    model: &BuiltinModelSpec,
    max_batch: usize,
    problems: &mut Problems,
) {
    let p = at;
    model.check(&format!("{p}.backend.model"), problems);
    if max_batch == 0 {
        problems.push(
            format!("{p}.backend.max_batch"),
            "must be at least 1".into(),
        );
    }
    let external = matches!(spec.trainer, super::super::TrainerSpec::External(_));
    if !spec.trains_builtin() && !external {
        problems.push(
            format!("{p}.backend"),
            "the built-in model trains only with trainer.kind = \"builtin\" or \"external\"".into(),
        );
    }
    if let Some(first) = spec.pools.iter().find_map(|q| q.backend.real_model())
        && first != model
    {
        problems.push(
            format!("{p}.backend.model"),
            "every built-in or llama.cpp pool must use the same model (they share weights)".into(),
        );
    }
}

/// Checks an inference-server backend (at `at`, e.g. `pools[0]`) of `count` shards.
fn check_server(at: &str, count: usize, l: &ServerSpec, llamacpp: bool, problems: &mut Problems) {
    let p = format!("{at}.backend");
    if l.model.path.is_none() {
        problems.push(
            format!("{p}.model.path"),
            "an inference server serves a checkpoint: give its path (the tiny model is built-in only)".into(),
        );
    }
    if let Some(d) = &l.discover {
        if !l.urls.is_empty() || l.launch.is_some() {
            problems.push(
                format!("{p}.discover"),
                "give urls (attach), launch (managed) or discover, one of them".into(),
            );
        }
        if !d.urls.is_empty() {
            problems.push(
                format!("{p}.discover.urls"),
                "discover follows dns or kubernetes; a fixed list is backend.urls".into(),
            );
        }
        crate::spec::env_pool::check_workers(&format!("{p}.discover"), d, problems);
    }
    if !llamacpp
        && l.urls.is_empty()
        && l.discover.is_none()
        && l.launch.as_ref().is_none_or(|x| x.command.is_empty())
    {
        problems.push(
            format!("{p}.launch.command"),
            "SGLang and vLLM have no default command: give urls (attach) or launch.command".into(),
        );
    }
    super::SERVER_SLOTS.check_at(&p, Some(l.slots), problems);
    if !l.urls.is_empty() {
        if l.launch.is_some() {
            problems.push(
                format!("{p}.urls"),
                "give urls (attach) or launch (managed), not both".into(),
            );
        }
        if l.urls.len() != count {
            problems.push(
                format!("{p}.urls"),
                format!("one URL per shard: count is {count}, {} URLs", l.urls.len()),
            );
        }
        for (i, u) in l.urls.iter().enumerate() {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                problems.push(
                    format!("{p}.urls[{i}]"),
                    format!("expected an http:// or https:// URL, got {u:?}"),
                );
            }
        }
    }
    if let Some(launch) = &l.launch {
        if let Some([lo, hi]) = launch.port_range
            && (lo == 0 || lo > hi)
        {
            problems.push(
                format!("{p}.launch.port_range"),
                format!("expected [low, high] with 0 < low <= high, got [{lo}, {hi}]"),
            );
        }
        if launch.threads == Some(0) || launch.threads.is_some_and(|t| t > 1024) {
            problems.push(format!("{p}.launch.threads"), "must be in 1..=1024".into());
        }
        if let Some(e) = &launch.export
            && e != "f32"
            && e != "q8_0"
        {
            problems.push(
                format!("{p}.launch.export"),
                format!("expected \"f32\" or \"q8_0\", got {e:?}"),
            );
        }
        if launch.gpus_per_shard > 64 {
            problems.push(
                format!("{p}.launch.gpus_per_shard"),
                format!("must be in 0..=64, got {}", launch.gpus_per_shard),
            );
        }
        if launch.command.first().is_some_and(|c| c.is_empty()) {
            problems.push(
                format!("{p}.launch.command[0]"),
                "the program must not be empty".into(),
            );
        }
    }
}
