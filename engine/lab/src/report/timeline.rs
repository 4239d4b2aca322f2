//! The utilisation timeline: a heat map of the busy fraction of every shard, environment and
//! function instance per training step.

use std::path::{Path, PathBuf};

use plotters::drawing::DrawingAreaErrorKind;
use plotters::prelude::*;

use super::canvas::{PlotError, register_font};
use job::runtime::StepMetrics;

/// Rows of the timeline in display order: shards, then environments, then function instances,
/// each in natural order (`env lake/10` after `env lake/9`). Environments never used are left
/// out (a pool sized for the peak has many).
pub(super) fn timeline_rows(steps: &[StepMetrics]) -> Vec<String> {
    let used = |k: &String| {
        !k.starts_with("env ")
            || steps
                .iter()
                .any(|m| m.timeline.get(k).is_some_and(|f| *f > 0.0))
    };
    let mut rows: Vec<String> = steps
        .iter()
        .flat_map(|m| m.timeline.keys().cloned())
        .filter(used)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let kind = |k: &str| match k.split(' ').next() {
        Some("shard") => 0,
        Some("env") => 1,
        _ => 2,
    };
    let split = |k: &str| {
        let (head, tail) = k.rsplit_once('/').unwrap_or((k, ""));
        (
            kind(k),
            head.to_string(),
            tail.parse::<u64>().unwrap_or(0),
            tail.to_string(),
        )
    };
    rows.sort_by_key(|k| split(k));
    rows
}

/// Height of a row in the timeline: shards and function instances are few and each matters,
/// environments are many.
fn row_weight(row: &str) -> f64 {
    if row.starts_with("env ") { 1.0 } else { 8.0 }
}

/// The colour of a cell: grey where the resource was not running, shades of blue by busy
/// fraction; `None` for an idle cell (left white).
fn cell_color(busy: Option<f64>) -> Option<RGBColor> {
    match busy {
        None => Some(RGBColor(225, 225, 225)),
        Some(f) if f < 0.005 => None,
        Some(f) => {
            let f = f.clamp(0.0, 1.0);
            let mix = |a: f64, b: f64| (a + (b - a) * f) as u8;
            Some(RGBColor(
                mix(235.0, 8.0),
                mix(242.0, 48.0),
                mix(250.0, 140.0),
            ))
        }
    }
}

fn draw_timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    steps: &[StepMetrics],
    rows: &[String],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
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
        .caption(
            "Utilisation timeline: every shard, environment and function instance",
            ("sans-serif", 20),
        )
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d(0f64..x_max, 0f64..total)?;
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
        .draw()?;
    for m in steps {
        let x0 = (m.elapsed_s - m.step_s).max(0.0);
        let x1 = m.elapsed_s;
        for (row, &(top, bottom)) in rows.iter().zip(&bounds) {
            let Some(color) = cell_color(m.timeline.get(row).copied()) else {
                continue;
            };
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x0, total - bottom), (x1, total - top)],
                color.filled(),
            )))?;
        }
    }
    root.present()
}

/// Draws `timeline.{png,svg}`: a heat map of the busy fraction of every shard, environment and
/// function instance per training step.
pub(super) fn timeline_plots(dir: &Path, steps: &[StepMetrics]) -> Result<Vec<PathBuf>, PlotError> {
    register_font();
    let rows = timeline_rows(steps);
    let units: f64 = rows.iter().map(|r| row_weight(r)).sum();
    let px = (1000.0 / units.max(1.0)).clamp(1.5, 16.0);
    let h = ((units * px) as u32 + 140).max(300);
    let svg = dir.join("timeline.svg");
    let png = dir.join("timeline.png");
    draw_timeline(
        SVGBackend::new(&svg, (1100, h)).into_drawing_area(),
        steps,
        &rows,
    )
    .map_err(|e| PlotError::draw(&svg, e))?;
    draw_timeline(
        BitMapBackend::new(&png, (1100, h)).into_drawing_area(),
        steps,
        &rows,
    )
    .map_err(|e| PlotError::draw(&png, e))?;
    Ok(vec![png, svg])
}
