//! `rollarc-fn NAME [--config JSON]`: a built-in reward function (`math`, `format`, `env`,
//! `code`, `judge`; see `functions::scorers::builtin` for their configurations) served over
//! HTTP on `$PORT` (default 8080; `0` picks a free port), all interfaces unless `$HOST` says
//! otherwise. Logs `listening on ADDR` on stderr once ready.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

use std::sync::Arc;

use infra::env::{EnvSource, ProcessEnv};

const USAGE: &str = "usage: rollarc-fn NAME [--config JSON]

Serves a built-in reward function over HTTP (POST / or /v1/score; GET /healthz) on $PORT
(default 8080; 0 picks a free port), on every interface unless $HOST says otherwise.
Logs `listening on ADDR` on stderr once ready; stops on SIGTERM or Ctrl-C.

NAME:
  math    compare the final number of the response with the reference
  format  score the response's shape (a regular expression, a length limit)
  env     pass the environment's reward through (scale, offset, clamp)
  code    run the response against the reference's tests in a sandbox
  python  call compute_score(row, answer, transcript) from a file, in a sandbox
  tool_use  reward an agent episode's valid tool calls
  judge   ask an OpenAI-compatible chat model to grade the response

--config JSON   the function's settings (see docs/reward-functions.md)";

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return std::process::ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--version" || a == "-V") {
        println!("rollarc-fn {}", env!("CARGO_PKG_VERSION"));
        return std::process::ExitCode::SUCCESS;
    }
    let Some(name) = args.first() else {
        eprintln!("{USAGE}");
        return std::process::ExitCode::from(2);
    };
    let config = args
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    let scorer: Arc<dyn functions::scorers::Scorer> =
        match functions::scorers::builtin(name, config) {
            Ok(s) => Arc::from(s),
            Err(e) => {
                eprintln!("rollarc-fn: {}", infra::error_chain(&e));
                return std::process::ExitCode::from(2);
            }
        };
    let env = ProcessEnv;
    let port = env.var("PORT").unwrap_or_else(|| "8080".into());
    let host = env.var("HOST").unwrap_or_else(|| "0.0.0.0".into());
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rollarc-fn: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async move {
        let signalled = infra::shutdown::signal();
        let listener = tokio::net::TcpListener::bind(format!("{host}:{port}")).await?;
        eprintln!("rollarc-fn {name}: listening on {}", listener.local_addr()?);
        functions::sdk::serve(scorer, listener, signalled).await
    });
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rollarc-fn: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
