//! The line plots of a run: success per task and utilisation of every pool over the steps
//! (and the timeline heat map when the steps recorded one).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::drawing::DrawingAreaErrorKind;
use plotters::prelude::*;

use super::canvas::{PlotError, register_font};
use super::timeline::timeline_plots;
use crate::job::StepMetrics;

type Series = BTreeMap<String, Vec<(f64, f64)>>;

/// What a line plot shows.
struct Lines<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    x_max: f64,
    y_max: f64,
    series: &'a Series,
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
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()
}

fn plot_pair(
    dir: &Path,
    stem: &str,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    y_max: f64,
    series: &Series,
) -> Result<Vec<PathBuf>, PlotError> {
    register_font();
    let x_max = series
        .values()
        .flat_map(|v| v.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let lines = Lines {
        title,
        x_desc,
        y_desc,
        x_max,
        y_max,
        series,
    };
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

/// Draws `success.{png,svg}` (success per task over training steps) and
/// `utilisation.{png,svg}` (busy fraction of every generation pool per step, and the bubble
/// ratio) into `dir`.
pub fn plots(dir: &Path, steps: &[StepMetrics]) -> Result<Vec<PathBuf>, PlotError> {
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
    let mut out = plot_pair(
        dir,
        "success",
        "Success rate per task",
        "training step",
        "success rate",
        1.0,
        &success,
    )?;
    out.extend(plot_pair(
        dir,
        "utilisation",
        "Generation pools: utilisation per step",
        "training step",
        "fraction of time",
        1.0,
        &util,
    )?);
    if steps.iter().any(|m| !m.timeline.is_empty()) {
        out.extend(timeline_plots(dir, steps)?);
    }
    Ok(out)
}
