//! The chat-completions URL of a judge endpoint.

/// Why an endpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {endpoint:?} is not a URL")]
    NotAUrl {
        endpoint: String,
        #[source]
        source: <reqwest::Url as std::str::FromStr>::Err,
    },
    #[error(
        "endpoint {endpoint:?}: https needs TLS, which this build lacks; use an http:// endpoint (e.g. a local proxy)"
    )]
    NeedsTls { endpoint: String },
    #[error("endpoint {endpoint:?} must be an http:// URL, not {scheme}:")]
    Scheme { endpoint: String, scheme: String },
    #[error("endpoint {endpoint:?} has no host")]
    NoHost { endpoint: String },
    #[error("endpoint {endpoint:?} must not carry a query or fragment")]
    QueryOrFragment { endpoint: String },
}

/// The chat-completions URL of an endpoint: `{endpoint}/v1/chat/completions`, unless the
/// endpoint already ends in `/v1` or `/chat/completions`.
pub fn chat_url(endpoint: &str) -> Result<String, EndpointError> {
    let u = reqwest::Url::parse(endpoint.trim()).map_err(|source| EndpointError::NotAUrl {
        endpoint: endpoint.to_string(),
        source,
    })?;
    let endpoint = endpoint.to_string();
    match u.scheme() {
        "http" => {}
        "https" => return Err(EndpointError::NeedsTls { endpoint }),
        s => {
            return Err(EndpointError::Scheme {
                endpoint,
                scheme: s.to_string(),
            });
        }
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(EndpointError::NoHost { endpoint });
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(EndpointError::QueryOrFragment { endpoint });
    }
    let base = u.as_str().trim_end_matches('/').to_string();
    Ok(if base.ends_with("/chat/completions") {
        base
    } else if base.ends_with("/v1") {
        format!("{base}/chat/completions")
    } else {
        format!("{base}/v1/chat/completions")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_and_completed() {
        assert_eq!(
            chat_url("http://127.0.0.1:8000").unwrap(),
            "http://127.0.0.1:8000/v1/chat/completions"
        );
        assert_eq!(
            chat_url("http://judge:8000/v1/").unwrap(),
            "http://judge:8000/v1/chat/completions"
        );
        assert_eq!(
            chat_url("http://judge/openai/v1/chat/completions").unwrap(),
            "http://judge/openai/v1/chat/completions"
        );
        for (bad, want) in [
            ("localhost:8000", "http://"),
            ("https://api.example.com", "TLS"),
            ("ftp://x", "http://"),
            ("not a url", "not a URL"),
            ("http://x/?a=1", "query"),
        ] {
            let e = chat_url(bad).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
