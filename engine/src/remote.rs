//! The client commands of a running service: `submit`, `status`, `cancel`, `watch` and
//! `train` (the built-in trainer as an external process).

use std::process::ExitCode;

use anyhow::bail;
use job::spec::Format;

use crate::spec_file::spec_text;
use crate::{exit_code, runtime};

/// `rollarc submit`: sends a job file to the service and prints its answer.
pub(crate) fn submit(
    client: &reqwest::Client,
    server: &str,
    file: &std::path::Path,
    sets: &[String],
) -> anyhow::Result<ExitCode> {
    let (body, fmt) = spec_text(file, sets)?;
    let ct = match fmt {
        Format::Json => "application/json",
        Format::Toml => "application/toml",
    };
    runtime()?.block_on(async {
        let r = client
            .post(format!("{server}/v1/jobs"))
            .header("content-type", ct)
            .body(body)
            .send()
            .await?;
        let status = r.status();
        let text = r.text().await?;
        if !status.is_success() {
            bail!("{}", refusal(file, status, &text));
        }
        println!("{text}");
        Ok(ExitCode::SUCCESS)
    })
}

/// The service's refusal of a job file, as `run` prints a spec's problems: the message, then
/// one `field: message` line per problem (the raw answer when it is not the API's error
/// shape).
fn refusal(file: &std::path::Path, status: reqwest::StatusCode, text: &str) -> String {
    #[derive(serde::Deserialize)]
    struct Answer {
        error: Detail,
    }
    #[derive(serde::Deserialize)]
    struct Detail {
        code: String,
        message: String,
        #[serde(default)]
        fields: Vec<job::spec::FieldError>,
    }
    match serde_json::from_str::<Answer>(text) {
        Ok(Answer { error: e }) if e.fields.is_empty() => {
            format!(
                "{} was refused ({status}, {}): {}",
                file.display(),
                e.code,
                e.message
            )
        }
        Ok(Answer { error: e }) => format!(
            "{} was refused ({status}, {}): {}\n{}",
            file.display(),
            e.code,
            e.message,
            crate::spec_file::problem_lines(&e.fields)
        ),
        Err(_) => format!("{status}: {text}"),
    }
}

/// `rollarc status`: one job, or every job, as a table or as JSON.
pub(crate) fn status(
    client: &reqwest::Client,
    server: &str,
    id: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let one = id.is_some();
        let url = match id {
            Some(id) => format!("{server}/v1/jobs/{id}"),
            None => format!("{server}/v1/jobs"),
        };
        let r = client.get(url).send().await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await?;
        if json || !status.is_success() {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else if one {
            print!("{}", crate::cli::job_detail(&v));
        } else {
            print!("{}", crate::cli::job_table(&v["jobs"]));
        }
        Ok(exit_code(status.is_success()))
    })
}

/// `rollarc cancel`: cancels a job and prints what the service says it does.
pub(crate) fn cancel(client: &reqwest::Client, server: &str, id: &str) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let r = client
            .post(format!("{server}/v1/jobs/{id}/cancel"))
            .send()
            .await?;
        let status = r.status();
        let body = r.text().await?;
        // The service's sentence (what the cancel does, or why it was refused), else the body.
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        match v
            .pointer("/cancel/message")
            .or_else(|| v.pointer("/error/message"))
            .and_then(|m| m.as_str())
        {
            Some(m) if status.is_success() => println!("{m}"),
            Some(m) => eprintln!("error: {m}"),
            None => println!("{body}"),
        }
        Ok(exit_code(status.is_success()))
    })
}

/// `rollarc watch`: follows a job's events until it ends.
pub(crate) fn watch(client: &reqwest::Client, server: &str, id: &str) -> anyhow::Result<ExitCode> {
    Ok(runtime()?.block_on(crate::cli::watch_remote(client, server, id))?)
}

/// `rollarc train`: trains a job with an external trainer until it ends.
pub(crate) fn train(o: crate::train_client::TrainOptions) -> anyhow::Result<ExitCode> {
    let s = runtime()?.block_on(crate::train_client::train(o))?;
    println!(
        "job ended {}: {} steps trained here, {} batches acknowledged, newest version v{}",
        s.job_state, s.steps, s.acked, s.version
    );
    Ok(exit_code(s.job_state == "succeeded"))
}
