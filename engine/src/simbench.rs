//! `make bench-sim`: runs the scenario files (each in its own `rollarc scenario` process, so
//! each reports its own peak memory; two at a time on two cores), prints one table of every
//! check against the paper, and writes `summary.json` and a plot per scenario.

use std::path::{Path, PathBuf};

use crate::scenario::{ScenarioResult, table};

fn wall_now() -> std::time::Instant {
    #[allow(clippy::disallowed_methods)]
    std::time::Instant::now()
}

/// Runs every scenario file through `exe scenario FILE --json-out …`, `parallel` at a time.
pub fn run_all(exe: &Path, files: &[PathBuf], out: &Path, parallel: usize) -> anyhow::Result<Vec<ScenarioResult>> {
    std::fs::create_dir_all(out)?;
    let t = wall_now();
    let mut results: Vec<Option<ScenarioResult>> = vec![None; files.len()];
    let mut errors = Vec::new();
    for chunk in files.iter().enumerate().collect::<Vec<_>>().chunks(parallel.max(1)) {
        let children: Vec<_> = chunk
            .iter()
            .map(|(i, f)| {
                let json = out.join(format!("{}.json", f.file_stem().and_then(|s| s.to_str()).unwrap_or("scenario")));
                println!("running {} …", f.display());
                let child = std::process::Command::new(exe).arg("scenario").arg(f).arg("--json-out").arg(&json).arg("--quiet").spawn();
                (*i, (*f).clone(), json, child)
            })
            .collect();
        for (i, f, json, child) in children {
            let status = child.and_then(|mut c| c.wait());
            match status {
                Ok(s) if s.success() => {
                    match std::fs::read_to_string(&json).map_err(anyhow::Error::from).and_then(|b| Ok(serde_json::from_str::<ScenarioResult>(&b)?)) {
                        Ok(r) => {
                            println!("  {}: {} runs, {:.1} s wall, {:.0} MiB peak", r.name, r.runs.len(), r.wall_s, r.peak_rss_mib);
                            results[i] = Some(r);
                        }
                        Err(e) => errors.push(format!("{}: {e}", f.display())),
                    }
                }
                Ok(s) => errors.push(format!("{}: exited with {s}", f.display())),
                Err(e) => errors.push(format!("{}: {e}", f.display())),
            }
        }
    }
    let results: Vec<ScenarioResult> = results.into_iter().flatten().collect();
    println!();
    print!("{}", table(&results));
    let checks: usize = results.iter().map(|r| r.checks.len()).sum();
    let passed: usize = results.iter().map(|r| r.checks.iter().filter(|c| c.pass).count()).sum();
    println!("\n{passed}/{checks} checks within the paper's band; {:.1} s wall for {} scenarios", t.elapsed().as_secs_f64(), results.len());
    for r in results.iter().filter(|r| r.checks.iter().any(|c| !c.pass)) {
        if let Some(n) = &r.notes {
            println!("  {} (outside the band, explained): {n}", r.name);
        }
        for c in r.checks.iter().filter(|c| !c.pass) {
            if let Some(n) = &c.note {
                println!("  {} / {}: {n}", r.name, c.name);
            }
        }
    }
    for r in &results {
        let events: u64 = r.runs.iter().map(|x| x.events).sum();
        let wall: f64 = r.runs.iter().map(|x| x.wall_s).sum();
        let sim: f64 = r.runs.iter().map(|x| x.simulated_s).sum();
        println!(
            "  simulator {:<12} {:>4} runs  {:>12.0} simulated s  {:>8.1} s wall  {:>11} events  {:>9.0} events/s  peak {:>6.0} MiB",
            r.name,
            r.runs.len(),
            sim,
            wall,
            events,
            events as f64 / wall.max(1e-9),
            r.peak_rss_mib
        );
    }
    let summary = serde_json::json!({
        "checks": checks,
        "passed": passed,
        "scenarios": results,
    });
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&summary)? + "\n")?;
    for r in &results {
        if let Err(e) = plot(out, r) {
            errors.push(format!("plot of {}: {e}", r.name));
        }
    }
    println!("wrote {}/summary.json and a plot per scenario", out.display());
    if !errors.is_empty() {
        anyhow::bail!("{}", errors.join("\n"));
    }
    Ok(results)
}

fn draw<DB: plotters::prelude::DrawingBackend>(root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>, r: &ScenarioResult) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |x: plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    // Ratio checks only (value checks have units of their own).
    let checks: Vec<_> = r.checks.iter().filter(|c| c.ours.is_some() && c.what.contains(" / ")).collect();
    let n = checks.len().max(1);
    let y_max = checks.iter().flat_map(|c| [c.ours.unwrap_or(0.0), c.band.map_or(0.0, |b| b[1])]).fold(1.0f64, f64::max) * 1.15;
    let names: Vec<String> = checks.iter().map(|c| c.name.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{} — {} (ours vs the paper's band)", r.name, r.figure), ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(60)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 { names.get(i as usize).cloned().unwrap_or_default() } else { String::new() }
        })
        .y_desc("ratio")
        .draw()
        .map_err(e)?;
    for (i, c) in checks.iter().enumerate() {
        let x = i as f64;
        if let Some([lo, hi]) = c.band {
            chart.draw_series(std::iter::once(Rectangle::new([(x - 0.3, lo), (x + 0.3, hi)], RGBColor(190, 215, 240).filled()))).map_err(e)?;
        }
        if let Some(v) = c.ours {
            let color = if c.pass { RGBColor(20, 120, 40) } else { RGBColor(200, 30, 30) };
            chart.draw_series(std::iter::once(Circle::new((x, v), 6, color.filled()))).map_err(e)?;
        }
    }
    root.present().map_err(e)
}

/// `NAME.{png,svg}`: every ratio check of a scenario, ours (green in band, red outside) over the
/// paper's band (blue). Value checks are in the table and `summary.json` only.
pub fn plot(dir: &Path, r: &ScenarioResult) -> Result<Vec<PathBuf>, String> {
    use plotters::prelude::*;
    crate::report::register_font();
    let svg = dir.join(format!("{}.svg", r.name));
    let png = dir.join(format!("{}.png", r.name));
    draw(SVGBackend::new(&svg, (1000, 520)).into_drawing_area(), r)?;
    draw(BitMapBackend::new(&png, (1000, 520)).into_drawing_area(), r)?;
    Ok(vec![png, svg])
}
