//! The end-of-run report of `rollarc run`: `summary.json` with, per task, success at the start
//! and at the end of training, from the step metrics the store kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::job::StepMetrics;

/// Steps averaged for "at the start" and "at the end": a tenth of the run, at least 5.
pub const WINDOW: usize = 5;

fn window(n: usize) -> usize {
    (n / 10).max(WINDOW)
}

#[derive(Debug, Serialize)]
pub struct TaskSummary {
    /// Success over the first tenth (at least `WINDOW`) of the steps that had trajectories of
    /// this task, weighted by trajectories.
    pub success_start: f64,
    /// The same over the last tenth.
    pub success_end: f64,
    /// Success of a uniformly random policy over the task's action alphabet, measured on the
    /// environment itself (built-in games with one-token actions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub success_random: Option<f64>,
    /// Seconds since the start when success first reached 0.9.
    pub wall_s_at_90: Option<f64>,
    pub reward_start: f64,
    pub reward_end: f64,
    /// First step whose success reached 0.9 (none: never).
    pub first_step_at_90: Option<u64>,
    pub steps: usize,
    pub trajectories: usize,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub job: String,
    pub state: String,
    pub steps: u64,
    pub wall_s: f64,
    pub trajectories: usize,
    pub bubble_ratio_mean: f64,
    pub staleness_max: u64,
    pub tasks: BTreeMap<String, TaskSummary>,
}

/// Success rate of a uniformly random policy on a built-in game with one-token actions from
/// its alphabet, over `episodes` episodes (the task's seed range if it has one). `None` for
/// other environments.
pub fn random_policy_success(task: &crate::spec::TaskSpec, episodes: usize, seed: u64) -> Option<f64> {
    use rand::{Rng, SeedableRng};
    if task.max_tokens_per_turn != 1 {
        return None;
    }
    let alphabet: Vec<char> = task.action_alphabet.clone().or_else(|| task.env.action_alphabet().map(str::to_string))?.chars().collect();
    let mut env = crate::envs::builtin(&task.env)?;
    // Its own runtime on its own thread: callers may be inside a runtime already.
    let seeds = task.seeds;
    let max_turns = task.max_turns;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().ok()?;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let mut wins = 0usize;
            rt.block_on(async {
                for e in 0..episodes {
                    let s = match seeds {
                        Some(r) => r.start + e as u64 % r.count.max(1),
                        None => rng.random(),
                    };
                    if env.reset_boxed(s).await.is_err() {
                        continue;
                    }
                    for _ in 0..max_turns {
                        let a = alphabet[rng.random_range(0..alphabet.len())];
                        let Ok(out) = env.step_boxed(&a.to_string(), &[a as u32]).await else { break };
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

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

/// Builds the summary from a job's step metrics.
pub fn summarise(job: &str, state: &str, steps: &[StepMetrics]) -> Summary {
    let mut tasks: BTreeMap<String, Vec<(u64, f64, f64, usize, f64)>> = BTreeMap::new();
    for m in steps {
        for (name, t) in &m.tasks {
            if t.trajectories > 0 {
                tasks.entry(name.clone()).or_default().push((m.step, t.success_rate, t.mean_reward, t.trajectories, m.elapsed_s));
            }
        }
    }
    let weighted = |v: &[(u64, f64, f64, usize, f64)], f: fn(&(u64, f64, f64, usize, f64)) -> f64| {
        let n: usize = v.iter().map(|x| x.3).sum();
        if n == 0 { 0.0 } else { v.iter().map(|x| f(x) * x.3 as f64).sum::<f64>() / n as f64 }
    };
    let tasks = tasks
        .into_iter()
        .map(|(name, v)| {
            let w = window(v.len());
            let head = &v[..v.len().min(w)];
            let tail = &v[v.len().saturating_sub(w)..];
            let s = TaskSummary {
                success_start: weighted(head, |x| x.1),
                success_end: weighted(tail, |x| x.1),
                success_random: None,
                wall_s_at_90: v.iter().find(|x| x.1 >= 0.9).map(|x| x.4),
                reward_start: weighted(head, |x| x.2),
                reward_end: weighted(tail, |x| x.2),
                first_step_at_90: v.iter().find(|x| x.1 >= 0.9).map(|x| x.0),
                steps: v.len(),
                trajectories: v.iter().map(|x| x.3).sum(),
            };
            (name, s)
        })
        .collect();
    Summary {
        job: job.to_string(),
        state: state.to_string(),
        steps: steps.len() as u64,
        wall_s: steps.last().map(|m| m.elapsed_s).unwrap_or(0.0),
        trajectories: steps.iter().map(|m| m.trajectories).sum(),
        bubble_ratio_mean: mean(steps.iter().map(|m| m.bubble_ratio)),
        staleness_max: steps.iter().map(|m| m.staleness_max).max().unwrap_or(0),
        tasks,
    }
}

/// The font PNG text is drawn with (DejaVu Sans, shipped in `assets/fonts` with its licence;
/// SVG text needs no font).
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

pub(crate) fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT).is_err() {
            tracing::warn!("the shipped font could not be loaded; PNG plots will have no text");
        }
    });
}

type Series = BTreeMap<String, Vec<(f64, f64)>>;

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    x_max: f64,
    y_max: f64,
    series: &Series,
) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |x: plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(52)
        .build_cartesian_2d(0f64..x_max.max(1.0), 0f64..y_max)
        .map_err(e)?;
    chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).x_label_formatter(&|x| format!("{x:.0}")).draw().map_err(e)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(e)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart.configure_series_labels().position(SeriesLabelPosition::LowerRight).background_style(WHITE.mix(0.85)).border_style(BLACK).draw().map_err(e)?;
    root.present().map_err(e)
}

fn plot_pair(dir: &Path, stem: &str, title: &str, x_desc: &str, y_desc: &str, y_max: f64, series: &Series) -> Result<Vec<PathBuf>, String> {
    use plotters::prelude::*;
    register_font();
    let x_max = series.values().flat_map(|v| v.iter().map(|p| p.0)).fold(1.0, f64::max);
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    draw(SVGBackend::new(&svg, (900, 520)).into_drawing_area(), title, x_desc, y_desc, x_max, y_max, series)?;
    draw(BitMapBackend::new(&png, (900, 520)).into_drawing_area(), title, x_desc, y_desc, x_max, y_max, series)?;
    Ok(vec![png, svg])
}

/// Draws `success.{png,svg}` (success per task over training steps) and
/// `utilisation.{png,svg}` (busy fraction of every generation pool per step, and the bubble
/// ratio) into `dir`.
pub fn plots(dir: &Path, steps: &[StepMetrics]) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut success: Series = BTreeMap::new();
    let mut util: Series = BTreeMap::new();
    for m in steps {
        for (name, t) in &m.tasks {
            if t.trajectories > 0 {
                success.entry(name.clone()).or_default().push((m.step as f64, t.success_rate));
            }
        }
        for (name, p) in &m.pools {
            util.entry(format!("pool {name} ({})", p.device)).or_default().push((m.step as f64, p.utilisation));
        }
        util.entry("bubble ratio".into()).or_default().push((m.step as f64, m.bubble_ratio));
    }
    let mut out = plot_pair(dir, "success", "Success rate per task", "training step", "success rate", 1.0, &success)?;
    out.extend(plot_pair(dir, "utilisation", "Generation pools: utilisation per step", "training step", "fraction of time", 1.0, &util)?);
    if steps.iter().any(|m| !m.timeline.is_empty()) {
        out.extend(timeline_plots(dir, steps)?);
    }
    Ok(out)
}

/// Rows of the timeline in display order: shards, then environments, then function instances,
/// each in natural order (`env lake/10` after `env lake/9`). Environments never used are left
/// out (a pool sized for the peak has many).
fn timeline_rows(steps: &[StepMetrics]) -> Vec<String> {
    let used = |k: &String| !k.starts_with("env ") || steps.iter().any(|m| m.timeline.get(k).is_some_and(|f| *f > 0.0));
    let mut rows: Vec<String> =
        steps.iter().flat_map(|m| m.timeline.keys().cloned()).filter(used).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let kind = |k: &str| match k.split(' ').next() {
        Some("shard") => 0,
        Some("env") => 1,
        _ => 2,
    };
    let split = |k: &str| {
        let (head, tail) = k.rsplit_once('/').unwrap_or((k, ""));
        (kind(k), head.to_string(), tail.parse::<u64>().unwrap_or(0), tail.to_string())
    };
    rows.sort_by_key(|k| split(k));
    rows
}

/// Height of a row in the timeline: shards and function instances are few and each matters,
/// environments are many.
fn row_weight(row: &str) -> f64 {
    if row.starts_with("env ") { 1.0 } else { 8.0 }
}

fn draw_timeline<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    steps: &[StepMetrics],
    rows: &[String],
) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |x: plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let x_max = steps.last().map_or(1.0, |m| m.elapsed_s).max(1.0);
    // Rows from the top: row i spans [top - (offset_i + weight_i), top - offset_i].
    let mut bounds = Vec::with_capacity(rows.len());
    let mut offset = 0.0;
    for r in rows {
        let w = row_weight(r);
        bounds.push((offset, offset + w));
        offset += w;
    }
    let total = offset.max(1.0);
    let mut chart = ChartBuilder::on(&root)
        .caption("Utilisation timeline: every shard, environment and function instance", ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d(0f64..x_max, 0f64..total)
        .map_err(e)?;
    let names = rows.to_vec();
    let label_bounds = bounds.clone();
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("seconds since start · shards: stepping, environments: held by a trajectory, functions: serving · white idle, dark blue busy, grey not running")
        .y_labels(48)
        .y_label_formatter(&move |y| {
            let from_top = total - y;
            let i = label_bounds.partition_point(|b| b.1 <= from_top);
            names.get(i).cloned().unwrap_or_default()
        })
        .y_label_style(("sans-serif", 11))
        .draw()
        .map_err(e)?;
    for m in steps {
        let x0 = (m.elapsed_s - m.step_s).max(0.0);
        let x1 = m.elapsed_s;
        for (row, &(top, bottom)) in rows.iter().zip(&bounds) {
            let color = match m.timeline.get(row) {
                None => RGBColor(225, 225, 225),
                Some(f) if *f < 0.005 => continue,
                Some(f) => {
                    let f = f.clamp(0.0, 1.0);
                    let mix = |a: f64, b: f64| (a + (b - a) * f) as u8;
                    RGBColor(mix(235.0, 8.0), mix(242.0, 48.0), mix(250.0, 140.0))
                }
            };
            chart.draw_series(std::iter::once(Rectangle::new([(x0, total - bottom), (x1, total - top)], color.filled()))).map_err(e)?;
        }
    }
    root.present().map_err(e)
}

/// Draws `timeline.{png,svg}`: a heat map of the busy fraction of every shard, environment and
/// function instance per training step.
fn timeline_plots(dir: &Path, steps: &[StepMetrics]) -> Result<Vec<PathBuf>, String> {
    use plotters::prelude::*;
    register_font();
    let rows = timeline_rows(steps);
    let units: f64 = rows.iter().map(|r| row_weight(r)).sum();
    let px = (1000.0 / units.max(1.0)).clamp(1.5, 16.0);
    let h = ((units * px) as u32 + 140).max(300);
    let svg = dir.join("timeline.svg");
    let png = dir.join("timeline.png");
    draw_timeline(SVGBackend::new(&svg, (1100, h)).into_drawing_area(), steps, &rows)?;
    draw_timeline(BitMapBackend::new(&png, (1100, h)).into_drawing_area(), steps, &rows)?;
    Ok(vec![png, svg])
}

/// Writes `summary.json` into `dir`; returns its path.
pub fn write(dir: &Path, summary: &Summary) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("summary.json");
    let text = serde_json::to_string_pretty(summary).map_err(std::io::Error::other)?;
    std::fs::write(&path, text + "\n")?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::TaskMetrics;

    fn step(i: u64, lake: f64) -> StepMetrics {
        let mut m = StepMetrics { step: i, elapsed_s: i as f64 * 2.0, trajectories: 8, ..StepMetrics::default() };
        m.tasks.insert("lake".into(), TaskMetrics { trajectories: 8, success_rate: lake, mean_reward: lake, mean_turns: 3.0 });
        m
    }

    #[test]
    fn start_and_end_are_window_means_and_the_90_percent_step_is_found() {
        let steps: Vec<StepMetrics> = (0..20).map(|i| step(i, i as f64 / 19.0)).collect();
        let s = summarise("j", "succeeded", &steps);
        let lake = &s.tasks["lake"];
        assert!((lake.success_start - (0.0 + 1.0 + 2.0 + 3.0 + 4.0) / 19.0 / 5.0).abs() < 1e-12);
        assert!((lake.success_end - (15.0 + 16.0 + 17.0 + 18.0 + 19.0) / 19.0 / 5.0).abs() < 1e-12);
        assert_eq!(lake.first_step_at_90, Some(18));
        assert_eq!((s.steps, s.trajectories, lake.trajectories), (20, 160, 160));
        assert_eq!(s.wall_s, 38.0);
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), &s).unwrap();
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        assert_eq!(back["tasks"]["lake"]["first_step_at_90"], 18);
        // Plots: PNG (with the shipped font) and SVG, one line per task.
        let files = plots(dir.path(), &steps).unwrap();
        assert_eq!(files.len(), 4);
        let svg = std::fs::read_to_string(dir.path().join("success.svg")).unwrap();
        assert!(svg.contains("Success rate per task") && svg.contains("lake"));
        let png = std::fs::read(dir.path().join("success.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 10_000, "an almost empty PNG ({} bytes)", png.len());
    }

    #[test]
    fn random_policy_rates_are_measured_on_the_games_even_inside_a_runtime() {
        let task = |env: &str, alphabet: &str, turns: u32| {
            let t = format!("domain = \"t\"\nmax_turns = {turns}\nmax_tokens_per_turn = 1\naction_alphabet = \"{alphabet}\"\nenv = {env}\n");
            toml::from_str::<crate::spec::TaskSpec>(&t).unwrap()
        };
        // Called from inside a runtime, as `rollarc run` does.
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (lake, sum, sim) = rt.block_on(async {
            (
                random_policy_success(&task("{ kind = \"frozenlake\", size = 4, end_on_invalid = true }", "LDRU", 8), 4000, 1),
                random_policy_success(&task("{ kind = \"arithmetic\", max_operand = 4, ops = \"+\" }", "0123456789", 1), 4000, 1),
                random_policy_success(&task("{ kind = \"sim\" }", "ab", 1), 10, 1),
            )
        });
        // FrozenLake 4×4: a random walk of 8 moves rarely reaches the goal; a sum of two digits
        // 0..=4 is one of 9 answers, a random digit one of 10.
        let (lake, sum) = (lake.unwrap(), sum.unwrap());
        assert!(lake < 0.05, "{lake}");
        assert!((0.07..=0.13).contains(&sum), "{sum}");
        assert_eq!(sim, None, "simulated environments have no random-policy rate");
    }

    #[test]
    fn the_timeline_has_a_row_per_resource_in_kind_order() {
        let mut steps: Vec<StepMetrics> = (1..=4).map(|i| step(i, 0.5)).collect();
        for (i, m) in steps.iter_mut().enumerate() {
            m.step_s = 2.0;
            m.timeline.insert("shard compute/0".into(), 0.25 * i as f64);
            m.timeline.insert("env lake/10".into(), 1.0);
            m.timeline.insert("env lake/9".into(), 0.5);
            m.timeline.insert("env lake/3".into(), 0.0);
            if i >= 2 {
                // A function instance that started late (grey before).
                m.timeline.insert("fn math-1/3".into(), 0.75);
            }
        }
        // Never-used environments are left out.
        assert_eq!(timeline_rows(&steps), ["shard compute/0", "env lake/9", "env lake/10", "fn math-1/3"]);
        let dir = tempfile::tempdir().unwrap();
        let files = plots(dir.path(), &steps).unwrap();
        assert_eq!(files.len(), 6);
        let svg = std::fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
        for row in ["shard compute/0", "env lake/10", "fn math-1/3"] {
            assert!(svg.contains(row), "{row} missing from the timeline");
        }
        // Busy cells are filled in shades of blue, missing ones grey: both kinds appear.
        assert!(svg.contains("#E1E1E1"), "no grey cell for the late instance");
        assert!(svg.contains("#08308C"), "no fully busy cell");
        let png = std::fs::read(dir.path().join("timeline.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
}
