//! JSON over HTTP for the server clients: one retry when a pooled connection was closed under
//! the request, 503 as "unavailable" (the engine retries later), and the error message read
//! from whichever shape the server uses (`{"error": {"message"}}`, `{"error": "…"}`,
//! `{"object": "error", "message"}`, `{"message"}`).

use std::time::Duration;

use serde_json::Value;

use super::ServerError;
use super::managed::ManagedServer;
use crate::error::SharedError;

/// The message of an error body.
pub fn error_message(body: &str) -> String {
    let v: Option<Value> = serde_json::from_str(body).ok();
    let m = v.as_ref().and_then(|v| {
        let e = v.get("error").unwrap_or(v);
        e.as_str()
            .map(str::to_string)
            .or_else(|| e.get("message").and_then(Value::as_str).map(str::to_string))
    });
    m.unwrap_or_else(|| body.chars().take(500).collect())
}

/// Sends `method path` with an optional JSON body; the answer's JSON (`null` for an empty
/// or non-JSON 2xx body).
pub async fn call(
    http: &reqwest::Client,
    server: &str,
    url: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Value, ServerError> {
    let send = || {
        let mut r = http
            .request(method.clone(), format!("{url}{path}"))
            .timeout(timeout);
        if let Some(b) = body {
            r = r.json(b);
        }
        r.send()
    };
    let unreachable = |e: reqwest::Error| ServerError::Unreachable {
        server: server.to_string(),
        source: SharedError::new(e),
    };
    let resp = match send().await {
        Ok(r) => r,
        Err(e) if e.is_request() || e.is_connect() => send().await.map_err(unreachable)?,
        Err(e) => return Err(unreachable(e)),
    };
    let status = resp.status();
    let text = resp.text().await.map_err(unreachable)?;
    if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
        return Err(ServerError::Unavailable {
            server: server.to_string(),
            message: error_message(&text),
        });
    }
    if !status.is_success() {
        return Err(ServerError::Status {
            server: server.to_string(),
            path: path.to_string(),
            status: status.as_u16(),
            body: error_message(&text),
        });
    }
    Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `POST path` with `body`.
pub async fn post(
    http: &reqwest::Client,
    server: &str,
    url: &str,
    path: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Value, ServerError> {
    call(
        http,
        server,
        url,
        reqwest::Method::POST,
        path,
        Some(body),
        timeout,
    )
    .await
}

/// `GET path`.
pub async fn get(
    http: &reqwest::Client,
    server: &str,
    url: &str,
    path: &str,
) -> Result<Value, ServerError> {
    call(
        http,
        server,
        url,
        reqwest::Method::GET,
        path,
        None,
        Duration::from_secs(10),
    )
    .await
}

/// `POST path` with `body`, for its status only (control endpoints: pause, resume, …).
pub async fn post_unit(
    http: &reqwest::Client,
    server: &str,
    url: &str,
    path: &str,
    body: Value,
) -> Result<(), ServerError> {
    post(http, server, url, path, &body, Duration::from_secs(60))
        .await
        .map(drop)
}

/// The health check of a server at `url` (`GET path`); a managed one is first started again
/// if its process died (it is unreachable while it comes back), and a healthy answer resets
/// its crash backoff.
pub async fn health(
    http: &reqwest::Client,
    server: &str,
    managed: Option<&std::sync::Arc<ManagedServer>>,
    url: &str,
    path: &str,
) -> Result<(), ServerError> {
    if let Some(s) = managed
        && !s.ensure_running().await
    {
        return Err(ServerError::Unreachable {
            server: server.to_string(),
            source: SharedError::new(std::io::Error::other("the server process is restarting")),
        });
    }
    get(http, server, url, path).await?;
    if let Some(s) = managed {
        s.mark_healthy().await;
    }
    Ok(())
}

/// The exported directory of `version` (servers that load weights from disk).
pub async fn export_for(
    export: Option<&super::WeightsExporter>,
    server: &str,
    version: crate::types::PolicyVersion,
    weights: std::sync::Arc<crate::weights::Weights>,
) -> Result<std::path::PathBuf, ServerError> {
    let Some(export) = export else {
        return Err(ServerError::CannotInstall {
            server: server.to_string(),
            reason: "no exporter: the job has no policy to write".into(),
        });
    };
    export(version, weights).await
}

/// A protocol error at `path`.
pub fn protocol(server: &str, path: &str, detail: impl Into<String>) -> ServerError {
    ServerError::Protocol {
        server: server.to_string(),
        path: path.to_string(),
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_are_read_from_every_shape() {
        for (body, want) in [
            (
                r#"{"error":{"message":"bad","type":"x","code":400}}"#,
                "bad",
            ),
            (r#"{"error":"unknown field `x`"}"#, "unknown field `x`"),
            (r#"{"object":"error","message":"nope","code":400}"#, "nope"),
            ("plain text", "plain text"),
        ] {
            assert_eq!(error_message(body), want);
        }
    }
}
