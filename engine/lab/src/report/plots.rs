//! The line plots of a run: success per task and utilisation of every pool over the steps
//! (and the timeline heat map when the steps recorded one).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::drawing::DrawingAreaErrorKind;
use plotters::prelude::*;

use super::canvas::{PlotError, register_font};
use super::timeline::timeline_plots;
use job::runtime::StepMetrics;

type Series = BTreeMap<String, Vec<(f64, f64)>>;

/// What a line plot shows.
struct Lines<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    x_max: f64,
    y_max: f64,
    series: &'a Series,
    /// Draw each series faint with its trailing `WINDOW`-step mean on top.
    smooth: bool,
    /// Per series, a dashed reference level (the random policy's success).
    baselines: &'a BTreeMap<String, f64>,
    /// Measured points (a few evaluations, not a curve): each drawn as a dot, with a ± error
    /// bar where the series has one per point (the standard error).
    points: Option<&'a BTreeMap<String, Vec<f64>>>,
}

/// The trailing mean over `w` points (fewer at the start).
fn trailing_mean(pts: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    (0..pts.len())
        .map(|i| {
            let win = &pts[(i + 1).saturating_sub(w)..=i];
            (
                pts[i].0,
                win.iter().map(|p| p.1).sum::<f64>() / win.len() as f64,
            )
        })
        .collect()
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    l: &Lines<'_>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(l.title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(52)
        .build_cartesian_2d(0f64..l.x_max.max(1.0), 0f64..l.y_max)?;
    chart
        .configure_mesh()
        .x_desc(l.x_desc)
        .y_desc(l.y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (i, (name, pts)) in l.series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let line = if l.smooth {
            chart.draw_series(LineSeries::new(
                pts.iter().copied(),
                color.mix(0.25).stroke_width(1),
            ))?;
            trailing_mean(pts, super::summary::WINDOW)
        } else {
            pts.clone()
        };
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))?
            .label(if l.smooth {
                format!("{name} ({}-step mean)", super::summary::WINDOW)
            } else if l.points.is_some_and(|e| e.contains_key(name)) {
                format!("{name} (± standard error)")
            } else {
                name.clone()
            })
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        if let Some(errors) = l.points {
            chart.draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
            )?;
            if let Some(e) = errors.get(name) {
                let cap = l.x_max.max(1.0) / 150.0;
                for (&(x, y), &e) in pts.iter().zip(e) {
                    let (lo, hi) = ((y - e).max(0.0), (y + e).min(l.y_max));
                    chart.draw_series([
                        PathElement::new(vec![(x, lo), (x, hi)], color.stroke_width(2)),
                        PathElement::new(vec![(x - cap, lo), (x + cap, lo)], color.stroke_width(2)),
                        PathElement::new(vec![(x - cap, hi), (x + cap, hi)], color.stroke_width(2)),
                    ])?;
                }
            }
        }
        if let Some(&b) = l.baselines.get(name) {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(0.0, b), (l.x_max.max(1.0), b)],
                    6,
                    4,
                    color.stroke_width(1),
                ))?
                .label(format!("{name}: random policy"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.mix(0.5).stroke_width(1))
                });
        }
    }
    chart
        .configure_series_labels()
        // Learning curves rise to the right: their legend goes where they start low.
        .position(if l.smooth {
            SeriesLabelPosition::UpperLeft
        } else {
            SeriesLabelPosition::LowerRight
        })
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()
}

fn plot_pair(dir: &Path, stem: &str, mut lines: Lines<'_>) -> Result<Vec<PathBuf>, PlotError> {
    register_font();
    lines.x_max = lines
        .series
        .values()
        .flat_map(|v| v.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    draw(
        SVGBackend::new(&svg, (900, 520)).into_drawing_area(),
        &lines,
    )
    .map_err(|e| PlotError::draw(&svg, e))?;
    draw(
        BitMapBackend::new(&png, (900, 520)).into_drawing_area(),
        &lines,
    )
    .map_err(|e| PlotError::draw(&png, e))?;
    Ok(vec![png, svg])
}

/// Draws `success.{png,svg}` (success per task over training steps: each step faint, the
/// trailing 5-step mean bold, the random policy dashed) and
/// `utilisation.{png,svg}` (busy fraction of every generation pool per step, and the bubble
/// ratio) into `dir`.
/// `random`: the random policy's success per task, drawn as a dashed level.
pub fn plots(
    dir: &Path,
    steps: &[StepMetrics],
    random: &BTreeMap<String, f64>,
) -> Result<Vec<PathBuf>, PlotError> {
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut success: Series = BTreeMap::new();
    let mut util: Series = BTreeMap::new();
    for m in steps {
        for (name, t) in &m.tasks {
            if t.trajectories > 0 {
                success
                    .entry(name.clone())
                    .or_default()
                    .push((m.step as f64, t.success_rate));
            }
        }
        for (name, p) in &m.pools {
            util.entry(format!("pool {name} ({})", p.device))
                .or_default()
                .push((m.step as f64, p.utilisation));
        }
        util.entry("bubble ratio".into())
            .or_default()
            .push((m.step as f64, m.bubble_ratio));
    }
    let no_baselines = BTreeMap::new();
    let mut out = plot_pair(
        dir,
        "success",
        Lines {
            title: "Success rate per task",
            x_desc: "training step",
            y_desc: "success rate",
            x_max: 1.0,
            y_max: 1.0,
            series: &success,
            smooth: true,
            baselines: random,
            points: None,
        },
    )?;
    out.extend(plot_pair(
        dir,
        "utilisation",
        Lines {
            title: "Generation pools: utilisation per step",
            x_desc: "training step",
            y_desc: "fraction of time",
            x_max: 1.0,
            y_max: 1.0,
            series: &util,
            smooth: false,
            baselines: &no_baselines,
            points: None,
        },
    )?);
    // Held-out evaluations: pass@1 and pass@k per task against the step they followed.
    let mut eval: Series = BTreeMap::new();
    let mut stderr: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for e in steps.iter().flat_map(|m| &m.eval) {
        for (name, t) in &e.tasks {
            eval.entry(format!("{name} pass@1"))
                .or_default()
                .push((e.step as f64, t.pass_at_1));
            stderr
                .entry(format!("{name} pass@1"))
                .or_default()
                .push(t.pass_at_1_stderr);
            eval.entry(format!("{name} pass@{}", t.k))
                .or_default()
                .push((e.step as f64, t.pass_at_k));
        }
    }
    if !eval.is_empty() {
        out.extend(plot_pair(
            dir,
            "eval",
            Lines {
                title: "Held-out evaluation",
                x_desc: "training step",
                y_desc: "pass rate",
                x_max: 1.0,
                y_max: 1.0,
                series: &eval,
                smooth: false,
                baselines: &no_baselines,
                points: Some(&stderr),
            },
        )?);
    }
    if steps.iter().any(|m| !m.timeline.is_empty()) {
        out.extend(timeline_plots(dir, steps)?);
    }
    Ok(out)
}
