//! `rollarc-fn NAME [--config JSON]`: a built-in reward function (`math`, `format`, `env`,
//! `code`, `judge`; see `functions::scorers::builtin` for their configurations) served over
//! HTTP on `$PORT` (default 8080; `0` picks a free port), all interfaces unless `$HOST` says
//! otherwise. Logs `listening on ADDR` on stderr once ready.

use std::sync::Arc;

use infra::env::{EnvSource, ProcessEnv};

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(name) = args.first() else {
        eprintln!("usage: rollarc-fn math|format|env|code|judge [--config JSON]");
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
