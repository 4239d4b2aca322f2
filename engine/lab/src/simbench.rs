//! `make bench-sim`: runs the scenario files (each in its own `rollarc scenario` process, so
//! each reports its own peak memory; two at a time on two cores), prints one table of every
//! check against the paper, and writes `summary.json` and a plot per scenario.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};

use infra::clock::wall_now;
use plotters::drawing::DrawingAreaErrorKind;

use crate::report::{PlotError, register_font};
use crate::scenario::{ScenarioResult, table};

/// Why one scenario of the benchmark gave no result, or no plot.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioFailure {
    #[error("{}", file.display())]
    Spawn {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", file.display())]
    Wait {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: exited with {status}", file.display())]
    Exit { file: PathBuf, status: ExitStatus },
    #[error("{}", file.display())]
    ReadResult {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", file.display())]
    ParseResult {
        file: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("plot of {name}")]
    Plot {
        name: String,
        #[source]
        source: PlotError,
    },
}

/// Why the benchmark did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SimBenchError {
    #[error("cannot create {}", dir.display())]
    OutDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Summary(#[from] serde_json::Error),
    #[error("cannot write {}", file.display())]
    WriteSummary {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Some scenarios failed (the others' results and the summary were written).
    #[error("{}", Failures(.0))]
    Failed(Vec<ScenarioFailure>),
}

/// Failures one per line, each with its causes.
struct Failures<'a>(&'a [ScenarioFailure]);

impl fmt::Display for Failures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, failure) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{failure}")?;
            let mut cause = std::error::Error::source(failure);
            while let Some(c) = cause {
                write!(f, ": {c}")?;
                cause = c.source();
            }
        }
        Ok(())
    }
}

/// Starts `exe scenario FILE --json-out JSON --quiet`.
fn spawn(exe: &Path, file: &Path, json: &Path) -> std::io::Result<Child> {
    std::process::Command::new(exe)
        .arg("scenario")
        .arg(file)
        .arg("--json-out")
        .arg(json)
        .arg("--quiet")
        .spawn()
}

/// Waits for a scenario's process and reads the results it wrote.
fn collect(
    file: &Path,
    json: &Path,
    child: std::io::Result<Child>,
) -> Result<ScenarioResult, ScenarioFailure> {
    let file = file.to_path_buf();
    let mut child = child.map_err(|source| ScenarioFailure::Spawn {
        file: file.clone(),
        source,
    })?;
    let status = child.wait().map_err(|source| ScenarioFailure::Wait {
        file: file.clone(),
        source,
    })?;
    if !status.success() {
        return Err(ScenarioFailure::Exit { file, status });
    }
    let body = std::fs::read_to_string(json).map_err(|source| ScenarioFailure::ReadResult {
        file: file.clone(),
        source,
    })?;
    serde_json::from_str(&body).map_err(|source| ScenarioFailure::ParseResult { file, source })
}

/// Runs one chunk of scenario files at once; fills `results` by index.
fn run_chunk(
    exe: &Path,
    out: &Path,
    chunk: &[(usize, &PathBuf)],
    results: &mut [Option<ScenarioResult>],
    failures: &mut Vec<ScenarioFailure>,
) {
    let children: Vec<_> = chunk
        .iter()
        .map(|&(i, f)| {
            let json = out.join(format!(
                "{}.json",
                f.file_stem().and_then(|s| s.to_str()).unwrap_or("scenario")
            ));
            println!("running {} …", f.display());
            let child = spawn(exe, f, &json);
            (i, f, json, child)
        })
        .collect();
    for (i, f, json, child) in children {
        match collect(f, &json, child) {
            Ok(r) => {
                println!(
                    "  {}: {} runs, {:.1} s wall, {:.0} MiB peak",
                    r.name,
                    r.runs.len(),
                    r.wall_s,
                    r.peak_rss_mib
                );
                results[i] = Some(r);
            }
            Err(e) => failures.push(e),
        }
    }
}

/// Prints the table, the tally and the simulator's cost; returns (checks, passed).
fn print_results(results: &[ScenarioResult], wall_s: f64) -> (usize, usize) {
    println!();
    print!("{}", table(results));
    let checks: usize = results.iter().map(|r| r.checks.len()).sum();
    let passed: usize = results
        .iter()
        .map(|r| r.checks.iter().filter(|c| c.pass).count())
        .sum();
    println!(
        "\n{passed}/{checks} checks within the paper's band; {wall_s:.1} s wall for {} scenarios",
        results.len()
    );
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
    for r in results {
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
    (checks, passed)
}

/// Runs every scenario file through `exe scenario FILE --json-out …`, `parallel` at a time.
pub fn run_all(
    exe: &Path,
    files: &[PathBuf],
    out: &Path,
    parallel: usize,
) -> Result<Vec<ScenarioResult>, SimBenchError> {
    std::fs::create_dir_all(out).map_err(|source| SimBenchError::OutDir {
        dir: out.to_path_buf(),
        source,
    })?;
    let t = wall_now();
    let mut results: Vec<Option<ScenarioResult>> = vec![None; files.len()];
    let mut failures = Vec::new();
    let indexed: Vec<(usize, &PathBuf)> = files.iter().enumerate().collect();
    for chunk in indexed.chunks(parallel.max(1)) {
        run_chunk(exe, out, chunk, &mut results, &mut failures);
    }
    let results: Vec<ScenarioResult> = results.into_iter().flatten().collect();
    let (checks, passed) = print_results(&results, t.elapsed().as_secs_f64());
    let summary = serde_json::json!({
        "checks": checks,
        "passed": passed,
        "scenarios": results,
    });
    let file = out.join("summary.json");
    std::fs::write(&file, serde_json::to_string_pretty(&summary)? + "\n")
        .map_err(|source| SimBenchError::WriteSummary { file, source })?;
    for r in &results {
        if let Err(source) = plot(out, r) {
            failures.push(ScenarioFailure::Plot {
                name: r.name.clone(),
                source,
            });
        }
    }
    println!(
        "wrote {}/summary.json and a plot per scenario",
        out.display()
    );
    if !failures.is_empty() {
        return Err(SimBenchError::Failed(failures));
    }
    Ok(results)
}

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    r: &ScenarioResult,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    // Ratio checks only (value checks have units of their own).
    let checks: Vec<_> = r
        .checks
        .iter()
        .filter(|c| c.ours.is_some() && c.what.contains(" / "))
        .collect();
    let n = checks.len().max(1);
    let y_max = checks
        .iter()
        .flat_map(|c| [c.ours.unwrap_or(0.0), c.band.map_or(0.0, |b| b[1])])
        .fold(1.0f64, f64::max)
        * 1.15;
    let names: Vec<String> = checks.iter().map(|c| c.name.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{} — {} (ours vs the paper's band)", r.name, r.figure),
            ("sans-serif", 20),
        )
        .margin(14)
        .x_label_area_size(60)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..y_max)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("ratio")
        .draw()?;
    for (i, c) in checks.iter().enumerate() {
        let x = i as f64;
        if let Some([lo, hi]) = c.band {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x - 0.3, lo), (x + 0.3, hi)],
                RGBColor(190, 215, 240).filled(),
            )))?;
        }
        if let Some(v) = c.ours {
            let color = if c.pass {
                RGBColor(20, 120, 40)
            } else {
                RGBColor(200, 30, 30)
            };
            chart.draw_series(std::iter::once(Circle::new((x, v), 6, color.filled())))?;
        }
    }
    root.present()
}

/// `NAME.{png,svg}`: every ratio check of a scenario, ours (green in band, red outside) over the
/// paper's band (blue). Value checks are in the table and `summary.json` only.
pub fn plot(dir: &Path, r: &ScenarioResult) -> Result<Vec<PathBuf>, PlotError> {
    use plotters::prelude::*;
    register_font();
    let svg = dir.join(format!("{}.svg", r.name));
    let png = dir.join(format!("{}.png", r.name));
    draw(SVGBackend::new(&svg, (1000, 520)).into_drawing_area(), r)
        .map_err(|e| PlotError::draw(&svg, e))?;
    draw(BitMapBackend::new(&png, (1000, 520)).into_drawing_area(), r)
        .map_err(|e| PlotError::draw(&png, e))?;
    Ok(vec![png, svg])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_scenarios_name_their_file_and_keep_their_causes() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("no-such-rollarc");
        let files = [PathBuf::from("a.toml"), PathBuf::from("b.toml")];
        let e = run_all(&exe, &files, dir.path(), 2).unwrap_err();
        let SimBenchError::Failed(failures) = &e else {
            panic!("{e:?}");
        };
        assert!(
            matches!(
                &failures[..],
                [ScenarioFailure::Spawn { .. }, ScenarioFailure::Spawn { .. }]
            ),
            "{failures:?}"
        );
        // One line per file, each with its cause (as `rollarc bench-sim` prints them).
        let text = e.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].starts_with("a.toml: ") && lines[0].len() > 8,
            "{text}"
        );
        assert!(lines[1].starts_with("b.toml: "), "{text}");
        // The summary is still written.
        let summary = std::fs::read_to_string(dir.path().join("summary.json")).unwrap();
        assert!(summary.contains("\"scenarios\": []"), "{summary}");
    }
}
