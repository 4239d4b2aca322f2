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
//!
//! Version 3 (a task's `protocol = 3`, the default of the bridged environments) multiplexes:
//! one program serves many episodes at once, so a task with 32 environment slots runs one
//! process (or `processes = N`), not 32. On top of version 2:
//! - every request carries an `episode` id (a string, unique for the program's lifetime) and
//!   every reply repeats the id of the request it answers;
//! - replies may come in any order (a program may serve episodes concurrently); rollarc sends
//!   at most one request per episode at a time;
//! - `reset` starts the episode (its state is created), `close` ends it (its state is freed)
//!   and the program goes on; rollarc closes every episode it reset;
//! - the program exits at the end of its input.
//!
//! ```text
//! → {"v":3,"op":"reset","episode":"0.1","seed":7,"record":{…}}
//! → {"v":3,"op":"reset","episode":"1.1","seed":8}
//! ← {"v":3,"episode":"1.1","ok":true,"observation":"…"}
//! ← {"v":3,"episode":"0.1","ok":true,"observation":"…"}
//! → {"v":3,"op":"step","episode":"0.1","action":"right"}
//! ← {"v":3,"episode":"0.1","ok":true,"observation":"…","reward":1.0,"terminated":true}
//! → {"v":3,"op":"close","episode":"0.1"}
//! ← {"v":3,"episode":"0.1","ok":true}
//! ```
//! A reply that cannot name its episode (the request was not JSON) says `"ok":false` without
//! one; rollarc treats it, and any line that is not a reply, as a broken stream: the process
//! is killed and the episodes it held fail (an environment failure, masked as usual).

use serde::{Deserialize, Serialize};

use crate::tokens::Tokens;

pub const PROTOCOL_VERSION: u32 = 1;
/// Dataset rows on reset, references on step.
pub const PROTOCOL_V2: u32 = 2;
/// The newest version: many episodes per program, an episode id on every message.
pub const PROTOCOL_V3: u32 = 3;
/// Default cap on one message line.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// A request from rollarc to the environment program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Reset {
        v: u32,
        /// Version 3: the episode this request belongs to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        episode: Option<String>,
        seed: u64,
        /// Version 2: the task's dataset row.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        record: Option<serde_json::Value>,
    },
    Step {
        v: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        episode: Option<String>,
        action: String,
    },
    Close {
        v: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        episode: Option<String>,
    },
}

/// A response from the environment program.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    pub v: u32,
    /// Version 3: the episode of the request this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<String>,
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
    #[error("{problem} in {line:?}")]
    Episode { problem: &'static str, line: String },
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
    // A version-3 failure that could not name its episode (its request was not JSON) is
    // still a reply; the caller decides what it means for the stream.
    if !(want >= PROTOCOL_V3 && r.episode.is_none() && !r.ok) {
        check_episode(want, r.episode.as_deref(), line)?;
    }
    Ok(r)
}

/// The version a request speaks.
pub fn request_version(r: &Request) -> u32 {
    match r {
        Request::Reset { v, .. } | Request::Step { v, .. } | Request::Close { v, .. } => *v,
    }
}

/// The episode a request names (version 3).
pub fn request_episode(r: &Request) -> Option<&str> {
    match r {
        Request::Reset { episode, .. }
        | Request::Step { episode, .. }
        | Request::Close { episode, .. } => episode.as_deref(),
    }
}

/// Checks that a message of version `v` names an episode exactly when it must (version 3).
fn check_episode(v: u32, episode: Option<&str>, line: &str) -> Result<(), ProtocolError> {
    let problem = match (v >= PROTOCOL_V3, episode) {
        (true, None) => "a version-3 message without an episode",
        (true, Some("")) => "an empty episode id",
        (false, Some(_)) => "an episode id in a version-1 or 2 message",
        _ => return Ok(()),
    };
    Err(ProtocolError::Episode {
        problem,
        line: excerpt(line),
    })
}

/// Parses one request line (the serving side): version 1, 2 or 3.
pub fn parse_request(line: &str) -> Result<Request, ProtocolError> {
    let r: Request =
        serde_json::from_str(line.trim_end()).map_err(|source| ProtocolError::Malformed {
            line: excerpt(line),
            source,
        })?;
    let v = request_version(&r);
    if !(PROTOCOL_VERSION..=PROTOCOL_V3).contains(&v) {
        return Err(ProtocolError::Version {
            got: v,
            want: PROTOCOL_V3,
            line: excerpt(line),
        });
    }
    check_episode(v, request_episode(&r), line)?;
    Ok(r)
}

/// Most episodes a version-3 [`serve`] keeps open at once; a `reset` of one more is refused.
pub const MAX_OPEN_EPISODES: usize = 4096;

/// Serves environments made by `make` over the protocol on `input` / `output` until end of
/// input (or a version-1/2 `close`). Versions 1 and 2 drive one environment; version 3 one per
/// episode id, created at its `reset` (reusing a closed episode's environment) and freed at
/// its `close`, answered in the order asked. Used by `rollarc env-serve` to expose the built-in
/// environments to any client (and by the tests).
pub async fn serve<R, W>(
    make: &(dyn Fn() -> Box<dyn super::DynEnvironment> + Sync),
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
    let mut single: Option<Box<dyn super::DynEnvironment>> = None;
    let mut episodes = Episodes {
        make,
        open: std::collections::HashMap::new(),
        spare: Vec::new(),
    };
    while let Some(line) = lines.next_line().await? {
        if line.trim().is_empty() {
            continue;
        }
        let parsed = if line.len() > MAX_MESSAGE_BYTES {
            Err(ProtocolError::Oversized {
                limit: MAX_MESSAGE_BYTES,
                start: excerpt(&line),
            })
        } else {
            parse_request(&line)
        };
        let (resp, stop) = match parsed {
            Err(e) => (unreadable(&line, &mut version, &e), false),
            Ok(req) => {
                version = request_version(&req);
                match request_episode(&req).map(str::to_string) {
                    None => {
                        let stop = matches!(req, Request::Close { .. });
                        let env = single.get_or_insert_with(make);
                        (answer(env.as_mut(), req, version, None).await, stop)
                    }
                    Some(id) => (episodes.handle(id, req, version).await, false),
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
    for (_, mut env) in episodes.open.drain() {
        env.close_boxed().await;
    }
    Ok(())
}

/// The reply to a request that could not be read: in the version (and, for version 3, the
/// episode) the line claims, if it claims one.
fn unreadable(line: &str, version: &mut u32, e: &ProtocolError) -> Response {
    let loose: Option<serde_json::Value> = serde_json::from_str(line).ok();
    let claimed = loose.as_ref().and_then(|l| l.get("v")?.as_u64());
    if let Some(v) = claimed.filter(|v| (1..=3).contains(v)) {
        *version = v as u32;
    }
    Response {
        v: *version,
        episode: loose
            .as_ref()
            .and_then(|l| Some(l.get("episode")?.as_str()?.to_string())),
        ok: false,
        error: Some(infra::error_chain(e)),
        ..Response::default()
    }
}

/// The open episodes of a version-3 [`serve`], by id, and environments to reuse.
struct Episodes<'a> {
    make: &'a (dyn Fn() -> Box<dyn super::DynEnvironment> + Sync),
    open: std::collections::HashMap<String, Box<dyn super::DynEnvironment>>,
    spare: Vec<Box<dyn super::DynEnvironment>>,
}

impl Episodes<'_> {
    async fn handle(&mut self, id: String, req: Request, v: u32) -> Response {
        let refuse = |id: String, error: String| Response {
            v,
            episode: Some(id),
            ok: false,
            error: Some(error),
            ..Response::default()
        };
        match req {
            Request::Close { .. } => {
                if let Some(mut env) = self.open.remove(&id) {
                    env.close_boxed().await;
                    self.spare.push(env);
                }
                Response {
                    v,
                    episode: Some(id),
                    ok: true,
                    ..Response::default()
                }
            }
            Request::Reset { .. }
                if !self.open.contains_key(&id) && self.open.len() >= MAX_OPEN_EPISODES =>
            {
                refuse(
                    id,
                    format!("{MAX_OPEN_EPISODES} episodes are open; close one first"),
                )
            }
            Request::Reset { .. } => {
                let (spare, make) = (&mut self.spare, self.make);
                let env = self
                    .open
                    .entry(id.clone())
                    .or_insert_with(|| spare.pop().unwrap_or_else(make));
                answer(env.as_mut(), req, v, Some(id)).await
            }
            Request::Step { .. } => match self.open.get_mut(&id) {
                Some(env) => answer(env.as_mut(), req, v, Some(id)).await,
                None => {
                    let e = format!("episode {id:?} is not open: reset it first");
                    refuse(id, e)
                }
            },
        }
    }
}

/// Runs one request on `env` and builds its reply: what an environment program would say
/// (a step's `info` carries the flags, a reference known only at the end, and the rest of
/// what the environment said). Used by [`serve`] and by `rollarc env-worker`.
pub async fn answer(
    env: &mut dyn super::DynEnvironment,
    req: Request,
    v: u32,
    episode: Option<String>,
) -> Response {
    let base = Response {
        v,
        episode,
        ok: true,
        ..Response::default()
    };
    let fail = |base: Response, e: String| Response {
        ok: false,
        error: Some(e),
        ..base
    };
    match req {
        Request::Reset { seed, record, .. } => {
            match env.reset_boxed(seed, record.map(std::sync::Arc::new)).await {
                Ok(o) => Response {
                    observation: Some(o.text),
                    info: o.reference.map(|r| serde_json::json!({ "reference": r })),
                    ..base
                },
                Err(e) => fail(base, infra::error_chain(&e)),
            }
        }
        Request::Step { action, .. } => match env.step_boxed(&action, &Tokens::new()).await {
            Ok(s) => {
                let mut info = match s.info {
                    Some(serde_json::Value::Object(m)) => m,
                    _ => serde_json::Map::new(),
                };
                info.insert("success".into(), s.success.into());
                info.insert("invalid_action".into(), s.invalid_action.into());
                if let Some(r) = s.observation.reference {
                    info.insert("reference".into(), r);
                }
                Response {
                    observation: Some(s.observation.text),
                    reward: Some(s.reward),
                    terminated: Some(s.terminated),
                    truncated: Some(s.truncated),
                    info: Some(serde_json::Value::Object(info)),
                    ..base
                }
            }
            Err(e) => fail(base, infra::error_chain(&e)),
        },
        Request::Close { .. } => {
            env.close_boxed().await;
            base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_malformed_lines() {
        let req = Request::Step {
            v: 1,
            episode: None,
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
            episode: None,
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
            episode: None,
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

    #[test]
    fn version_3_messages_name_their_episode() {
        let step = r#"{"op":"step","v":3,"episode":"4.1","action":"left"}"#;
        assert_eq!(request_episode(&parse_request(step).unwrap()), Some("4.1"));
        for (line, want) in [
            (
                r#"{"op":"step","v":3,"action":"left"}"#,
                "without an episode",
            ),
            (r#"{"op":"close","v":3,"episode":""}"#, "empty episode"),
            (
                r#"{"op":"close","v":2,"episode":"1"}"#,
                "version-1 or 2 message",
            ),
        ] {
            let e = infra::error_chain(&parse_request(line).unwrap_err());
            assert!(e.contains(want) && e.contains("op"), "{line}: {e}");
        }
        let r = parse_response_v(r#"{"v":3,"episode":"a","ok":true}"#, 3).unwrap();
        assert_eq!(r.episode.as_deref(), Some("a"));
        assert!(parse_response_v(r#"{"v":3,"ok":true}"#, 3).is_err());
        // A failure that cannot name its episode is still a reply (the caller judges it).
        assert!(parse_response_v(r#"{"v":3,"ok":false,"error":"x"}"#, 3).is_ok());
    }

    #[tokio::test]
    async fn serve_keeps_one_environment_per_open_episode() {
        use crate::env::builtin::frozenlake::{FrozenLake, FrozenLakeConfig};
        let make = || -> Box<dyn crate::env::DynEnvironment> {
            Box::new(FrozenLake::new(FrozenLakeConfig::default()))
        };
        let input = [
            r#"{"v":3,"op":"reset","episode":"a","seed":1}"#,
            r#"{"v":3,"op":"reset","episode":"b","seed":2}"#,
            r#"{"v":3,"op":"step","episode":"a","action":"down"}"#,
            r#"{"v":3,"op":"close","episode":"a"}"#,
            r#"{"v":3,"op":"step","episode":"a","action":"down"}"#,
            r#"{"v":3,"op":"step","episode":"b","action":"right"}"#,
            r#"{"v":3,"op":"step","action":"right"}"#,
            r#"not json"#,
        ]
        .join("\n");
        let mut out = Vec::new();
        serve(&make, input.as_bytes(), &mut out).await.unwrap();
        let replies: Vec<Response> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let summary: Vec<(Option<&str>, bool)> = replies
            .iter()
            .map(|r| (r.episode.as_deref(), r.ok))
            .collect();
        assert_eq!(
            summary,
            [
                (Some("a"), true),
                (Some("b"), true),
                (Some("a"), true),
                (Some("a"), true),
                (Some("a"), false),
                (Some("b"), true),
                (None, false),
                (None, false),
            ]
        );
        assert!(replies[4].error.as_deref().unwrap().contains("not open"));
        assert!(
            replies[6]
                .error
                .as_deref()
                .unwrap()
                .contains("without an episode")
        );
        assert!(replies.iter().all(|r| r.v == 3));
        // Each episode moved its own player: b's first step is its first move.
        let mut lake = make();
        lake.reset_boxed(2, None).await.unwrap();
        let b = lake.step_boxed("right", &Tokens::new()).await.unwrap();
        assert_eq!(
            replies[5].observation.as_deref(),
            Some(b.observation.text.as_str())
        );
    }
}
