//! The success rate of a uniformly random policy on a built-in game: the baseline that the
//! dashboard and the end-of-run report put beside a task's learning curve.

/// Success rate of a uniformly random policy on a built-in game with one-token actions from
/// its alphabet, over `episodes` episodes (the task's seed range if it has one). `None` for
/// other environments.
pub fn random_policy_success(
    task: &crate::spec::TaskSpec,
    episodes: usize,
    seed: u64,
) -> Option<f64> {
    use rand::{Rng, SeedableRng};
    if task.max_tokens_per_turn != 1 {
        return None;
    }
    let alphabet: Vec<char> = task
        .action_alphabet
        .clone()
        .or_else(|| task.env.action_alphabet().map(str::to_string))?
        .chars()
        .collect();
    let mut env = crate::wiring::envs::builtin(&task.env)?;
    // Its own runtime on its own thread: callers may be inside a runtime already.
    let seeds = task.seeds;
    let max_turns = task.max_turns;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .ok()?;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let mut wins = 0usize;
            rt.block_on(async {
                for e in 0..episodes {
                    let s = match seeds {
                        Some(r) => r.start + e as u64 % r.count.max(1),
                        None => rng.random(),
                    };
                    if env.reset_boxed(s, None).await.is_err() {
                        continue;
                    }
                    for _ in 0..max_turns {
                        let a = alphabet[rng.random_range(0..alphabet.len())];
                        let Ok(out) = env.step_boxed(&a.to_string(), &vec![a as u32].into()).await
                        else {
                            break;
                        };
                        if out.success {
                            wins += 1;
                            break;
                        }
                        if out.terminated || out.truncated {
                            break;
                        }
                    }
                }
            });
            Some(wins as f64 / episodes.max(1) as f64)
        })
        .join()
        .ok()
        .flatten()
    })
}

#[cfg(test)]
mod tests;
