//! The environment protocol: newline-delimited JSON over a program's stdin and stdout. Every
//! message is one line (at most [`MAX_MESSAGE_BYTES`] by default). Version 1:
//!
//! ```text
//! → {"v":1,"op":"reset","seed":7}
//! ← {"v":1,"ok":true,"observation":"P F F F\n…"}
//! → {"v":1,"op":"step","action":"right"}
//! ← {"v":1,"ok":true,"observation":"…","reward":0.0,"terminated":false,"truncated":false,"info":{"success":false,"invalid_action":false}}
//! → {"v":1,"op":"close"}
//! ← {"v":1,"ok":true}
//! ← {"v":1,"ok":false,"error":"what went wrong"}      (any request)
//! ```
//! `info` is free-form; rollarc reads `success` and `invalid_action` from it when present, and
//! on `reset` a `reference` (the task's answer or tests) that it hands to reward functions.
//!
//! Version 2 (a task's `protocol = 2`; both sides say `"v":2`) adds, on top of version 1:
//! - `reset` may carry the task's dataset row: `{"v":2,"op":"reset","seed":7,"record":{…}}`
//!   with `index`, `epoch`, `position`, `messages`, `answer` and the raw `row`;
//! - a `step` reply may carry `info.reference` too (a reference known only at the end);
//! - every reply's `reward` is the reward of that turn (kept per turn in the trajectory).

use serde::{Deserialize, Serialize};

use crate::tokens::Tokens;

pub const PROTOCOL_VERSION: u32 = 1;
/// The newest version: dataset rows on reset, references on step.
pub const PROTOCOL_V2: u32 = 2;
/// Default cap on one message line.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// A request from rollarc to the environment program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Reset {
        v: u32,
        seed: u64,
        /// Version 2: the task's dataset row.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        record: Option<serde_json::Value>,
    },
    Step {
        v: u32,
        action: String,
    },
    Close {
        v: u32,
    },
}

/// A response from the environment program.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    pub v: u32,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminated: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A protocol violation, with the offending line (shortened).
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("message of more than {limit} bytes (starts {start:?})")]
    Oversized { limit: usize, start: String },
    #[error("malformed message {line:?}")]
    Malformed {
        line: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("protocol version {got} is not {want} in {line:?}")]
    Version { got: u32, want: u32, line: String },
}

/// Shortens a line for an error message.
pub fn excerpt(line: &str) -> String {
    const MAX: usize = 200;
    if line.len() <= MAX {
        return line.to_string();
    }
    let mut end = MAX;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &line[..end])
}

/// Parses one response line of a version-1 program.
pub fn parse_response(line: &str) -> Result<Response, ProtocolError> {
    parse_response_v(line, PROTOCOL_VERSION)
}

/// Parses one response line; its `v` must be `want`.
pub fn parse_response_v(line: &str, want: u32) -> Result<Response, ProtocolError> {
    let r: Response =
        serde_json::from_str(line.trim_end()).map_err(|source| ProtocolError::Malformed {
            line: excerpt(line),
            source,
        })?;
    if r.v != want {
        return Err(ProtocolError::Version {
            got: r.v,
            want,
            line: excerpt(line),
        });
    }
    Ok(r)
}

/// The version a request speaks.
pub fn request_version(r: &Request) -> u32 {
    match r {
        Request::Reset { v, .. } | Request::Step { v, .. } | Request::Close { v } => *v,
    }
}

/// Parses one request line (the serving side): version 1 or 2.
pub fn parse_request(line: &str) -> Result<Request, ProtocolError> {
    let r: Request =
        serde_json::from_str(line.trim_end()).map_err(|source| ProtocolError::Malformed {
            line: excerpt(line),
            source,
        })?;
    let v = request_version(&r);
    if v != PROTOCOL_VERSION && v != PROTOCOL_V2 {
        return Err(ProtocolError::Version {
            got: v,
            want: PROTOCOL_V2,
            line: excerpt(line),
        });
    }
    Ok(r)
}

/// Serves `env` over the protocol on `input` / `output` until `close` or end of input. Used by
/// `rollarc env-serve` to expose the built-in environments to any client (and by the tests).
pub async fn serve<R, W>(
    env: &mut dyn super::DynEnvironment,
    input: R,
    mut output: W,
) -> std::io::Result<()>
where
    R: tokio::io::AsyncBufRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut lines = input.lines();
    let mut version = PROTOCOL_VERSION;
    while let Some(line) = lines.next_line().await? {
        if line.trim().is_empty() {
            continue;
        }
        if let Ok(r) = parse_request(&line) {
            version = request_version(&r);
        }
        let fail = |e: String| Response {
            v: version,
            ok: false,
            error: Some(e),
            ..Response::default()
        };
        let (resp, stop) = if line.len() > MAX_MESSAGE_BYTES {
            (
                fail(
                    ProtocolError::Oversized {
                        limit: MAX_MESSAGE_BYTES,
                        start: excerpt(&line),
                    }
                    .to_string(),
                ),
                false,
            )
        } else {
            match parse_request(&line) {
                Err(e) => (fail(infra::error_chain(&e)), false),
                Ok(Request::Reset { seed, record, .. }) => {
                    match env.reset_boxed(seed, record.map(std::sync::Arc::new)).await {
                        Ok(o) => (
                            Response {
                                v: version,
                                ok: true,
                                observation: Some(o.text),
                                info: o.reference.map(|r| serde_json::json!({ "reference": r })),
                                ..Response::default()
                            },
                            false,
                        ),
                        Err(e) => (fail(infra::error_chain(&e)), false),
                    }
                }
                Ok(Request::Step { action, .. }) => {
                    match env.step_boxed(&action, &Tokens::new()).await {
                        Ok(s) => (
                            Response {
                                v: version,
                                ok: true,
                                observation: Some(s.observation.text),
                                reward: Some(s.reward),
                                terminated: Some(s.terminated),
                                truncated: Some(s.truncated),
                                info: Some(
                                    serde_json::json!({ "success": s.success, "invalid_action": s.invalid_action }),
                                ),
                                error: None,
                            },
                            false,
                        ),
                        Err(e) => (fail(infra::error_chain(&e)), false),
                    }
                }
                Ok(Request::Close { .. }) => {
                    env.close_boxed().await;
                    (
                        Response {
                            v: version,
                            ok: true,
                            ..Response::default()
                        },
                        true,
                    )
                }
            }
        };
        let mut out = serde_json::to_string(&resp).map_err(std::io::Error::other)?;
        out.push('\n');
        output.write_all(out.as_bytes()).await?;
        output.flush().await?;
        if stop {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_malformed_lines() {
        let req = Request::Step {
            v: 1,
            action: "left".into(),
        };
        let line = serde_json::to_string(&req).unwrap();
        assert_eq!(line, r#"{"op":"step","v":1,"action":"left"}"#);
        assert_eq!(parse_request(&line).unwrap(), req);
        let ok = parse_response(r#"{"v":1,"ok":true,"observation":"x","reward":1.0,"terminated":true,"truncated":false,"info":{"success":true}}"#).unwrap();
        assert_eq!(ok.reward, Some(1.0));
        let cases: [(&str, &str); 4] = [
            ("not json", "malformed"),
            (r#"{"v":2,"ok":true}"#, "version 2 is not 1"),
            (r#"{"v":1,"ok":true,"surprise":1}"#, "malformed"),
            (r#"{"v":1}"#, "malformed"),
        ];
        for (line, want) in cases {
            let e = infra::error_chain(&parse_response(line).unwrap_err());
            assert!(
                e.contains(want) && e.contains(&format!("{:?}", excerpt(line))),
                "{line}: {e}"
            );
        }
        assert!(parse_request(r#"{"op":"dance","v":1}"#).is_err());
        assert!(parse_request(r#"{"op":"close","v":3}"#).is_err());
        // Version 2: a reset with a record; a version-1 reset has none on the wire.
        let reset = Request::Reset {
            v: 2,
            seed: 4,
            record: Some(serde_json::json!({"index": 1})),
        };
        let line = serde_json::to_string(&reset).unwrap();
        assert_eq!(
            line,
            r#"{"op":"reset","v":2,"seed":4,"record":{"index":1}}"#
        );
        assert_eq!(parse_request(&line).unwrap(), reset);
        let v1 = Request::Reset {
            v: 1,
            seed: 4,
            record: None,
        };
        assert_eq!(
            serde_json::to_string(&v1).unwrap(),
            r#"{"op":"reset","v":1,"seed":4}"#
        );
        assert!(parse_response_v(r#"{"v":2,"ok":true}"#, 2).is_ok());
        assert!(parse_response_v(r#"{"v":1,"ok":true}"#, 2).is_err());
    }
}
