//! What the commands print: a job's metrics, a scenario run, the report's task table, the
//! devices, and the `status` table and detail.

use lab::report::Summary;
use lab::scenario::RunResult;

use super::progress_msg;

/// A job's latest metrics: time, throughput, bubble, staleness, then per pool and task.
pub(crate) fn print_metrics(m: &serde_json::Value) {
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
                t.get("success_rate")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(0.0),
                t.get("mean_turns").and_then(|v| v.as_f64()).unwrap_or(0.0)
            );
        }
    }
}

/// One line per simulated function deployment: calls, instances, and its GPU time.
pub(super) fn print_functions(
    functions: &std::collections::BTreeMap<String, actors::reward::FunctionUsage>,
) {
    for (name, u) in functions {
        let held = if u.gpus_per_instance > 0 {
            format!(
                "{:.0} GPU-s held ({} per instance), {:.1} % busy, batches of {:.1}",
                u.gpu_s(),
                u.gpus_per_instance,
                100.0 * u.utilisation(),
                u.mean_batch
            )
        } else {
            format!(
                "{:.0} instance-s held, {:.1} % busy",
                u.instance_s,
                100.0 * u.utilisation()
            )
        };
        println!(
            "    function {name}: {} calls, {} cold starts, peak {} instances, {held}",
            u.calls, u.cold_starts, u.peak_instances
        );
    }
}

/// One run of a scenario, as `rollarc scenario` prints it.
pub(crate) fn print_run(r: &RunResult) {
    println!(
        "  {:<28} step {:>9.1} s  bubble {:.3}  trainer busy {:.2}  ({} steps, {:.0} simulated s, {:.2} s wall, {} events)  prefill/decode {:.1}  stale {}/{}  pools {}",
        r.name,
        r.metrics.get("step_s").copied().unwrap_or(0.0),
        r.metrics.get("bubble").copied().unwrap_or(0.0),
        r.metrics.get("trainer_busy").copied().unwrap_or(0.0),
        r.steps,
        r.simulated_s,
        r.wall_s,
        r.events,
        r.prefill_tokens as f64 / r.decode_tokens.max(1) as f64,
        r.stale_aborted,
        r.stale_evicted,
        r.pools
            .iter()
            .map(|(k, v)| format!(
                "{k} {v:.2} ({} groups)",
                r.pool_groups.get(k).copied().unwrap_or(0)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if r.jobs > 1 {
        println!("    {} jobs on one clock (figures are their mean)", r.jobs);
    }
    print_functions(&r.functions);
}

/// The per-task table of a job's report.
pub(crate) fn print_task_table(summary: &Summary) {
    println!(
        "{:<12} {:>14} {:>14} {:>12} {:>10} {:>10}",
        "task", "random policy", "success start", "success end", "≥90% at", "truncated"
    );
    for (name, t) in &summary.tasks {
        let at = t
            .first_step_at_90
            .map(|s| format!("step {s}"))
            .unwrap_or_else(|| "-".into());
        let random = t
            .success_random
            .map(|r| format!("{r:.3}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{name:<12} {random:>14} {:>14.3} {:>12.3} {at:>10} {:>9.1}%",
            t.success_start,
            t.success_end,
            100.0 * t.truncation_rate
        );
    }
    if summary.truncated > 0 {
        println!(
            "{} trajectories ended at their context budget (status truncated)",
            summary.truncated
        );
    }
    if !summary.eval_change.is_empty() {
        println!(
            "{:<16} {:>22} {:>22} {:>10}",
            "held-out task", "pass@1 start (± se)", "pass@1 end (± se)", "change"
        );
        for (name, c) in &summary.eval_change {
            println!(
                "{name:<16} {:>22} {:>22} {:>+9.1}pt",
                format!(
                    "{:.3} ± {:.3} @{}",
                    c.pass_at_1_start, c.stderr_start, c.step_start
                ),
                format!(
                    "{:.3} ± {:.3} @{}",
                    c.pass_at_1_end, c.stderr_end, c.step_end
                ),
                c.change_points
            );
        }
    }
}

/// `rollarc devices`: the GPUs found, with the profile the mapper would use, and the device
/// classes it knows.
pub(crate) fn print_devices() {
    match actors::device::discover_gpus() {
        Ok(gpus) if gpus.is_empty() => println!("no GPU found"),
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "GPU {}: {} (sm_{}{}) — {} SMs, {:.0} GB, {} MHz, mem {} MHz × {} bit → {:.0} TFLOP/s (est.), {:.2} TB/s",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.sms,
                    g.memory_bytes as f64 / 1e9,
                    g.clock_mhz,
                    g.memory_clock_mhz,
                    g.bus_width_bits,
                    g.profile.flops / 1e12,
                    g.profile.bandwidth / 1e12
                );
            }
        }
        Err(e) => println!("{e}"),
    }
    println!("device classes known to the mapper:");
    for n in actors::device::DeviceProfile::BUILTIN_NAMES {
        if let Some(d) = actors::device::DeviceProfile::builtin(n) {
            println!(
                "  {:5} {:8.1} TFLOP/s  {:5.2} TB/s  {:4.0} GB  cost ×{:.2}",
                d.name,
                d.flops / 1e12,
                d.bandwidth / 1e12,
                d.memory / 1e9,
                d.cost
            );
        }
    }
}

/// `rollarc status`: one line per job (id, state, steps, success, name).
pub(crate) fn job_table(jobs: &serde_json::Value) -> String {
    let mut out = format!(
        "{:<10} {:<10} {:>11} {:>8}  {}\n",
        "ID", "STATE", "STEP", "SUCCESS", "NAME"
    );
    for j in jobs.as_array().into_iter().flatten() {
        let u = |k: &str| j.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
        let success = j
            .pointer("/metrics/success_rate")
            .and_then(|s| s.as_f64())
            .map_or("-".to_string(), |s| format!("{s:.2}"));
        out.push_str(&format!(
            "{:<10} {:<10} {:>11} {:>8}  {}\n",
            j["id"].as_str().unwrap_or("?"),
            j["state"].as_str().unwrap_or("?"),
            format!("{}/{}", u("step"), u("steps")),
            success,
            j["name"].as_str().unwrap_or("")
        ));
    }
    out
}

/// `rollarc status ID`: the job's state, progress, error and its tasks' latest numbers.
pub(crate) fn job_detail(j: &serde_json::Value) -> String {
    let u = |k: &str| j.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
    let mut out = format!(
        "{} {} at step {}/{}{}\n",
        j["id"].as_str().unwrap_or("?"),
        j["state"].as_str().unwrap_or("?"),
        u("step"),
        u("steps"),
        j["name"]
            .as_str()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    if let Some(e) = j["error"].as_str() {
        out.push_str(&format!("error: {e}\n"));
    }
    let m = &j["metrics"];
    if m.get("version").is_some() {
        out.push_str(&format!("{}\n", progress_msg(m)));
    }
    if let Some(tasks) = m["tasks"].as_object() {
        out.push_str(&format!(
            "  {:<14} {:>8} {:>8} {:>6}\n",
            "task", "success", "reward", "turns"
        ));
        for (name, t) in tasks {
            let f = |k: &str| t.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
            out.push_str(&format!(
                "  {:<14} {:>8.3} {:>8.3} {:>6.1}\n",
                name,
                f("success_rate"),
                f("mean_reward"),
                f("mean_turns")
            ));
        }
    }
    out
}
