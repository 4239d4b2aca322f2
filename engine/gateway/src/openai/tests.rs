use super::*;
use crate::wire::{Finish, TokenInfo};
use actors::agent::ToolChoice;

fn body() -> Value {
    json!({
        "model": "policy",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0.7, "top_p": 0.9, "max_completion_tokens": 40, "max_tokens": 10,
        "stop": "END", "seed": 7, "logprobs": true, "top_logprobs": 2,
        "stream": true, "stream_options": {"include_usage": true}, "n": 1
    })
}

#[test]
fn a_full_request_parses_into_the_call() {
    let c = parse(&body()).unwrap();
    assert_eq!(c.model, "policy");
    let m = &c.conv.messages;
    assert_eq!(
        (m[0].role, m[0].content.as_str()),
        (Role::System, "Be brief.")
    );
    assert_eq!(m[1].content, "Weather in Paris?");
    assert_eq!(m[2].tool_calls[0].arguments, json!({"city": "Paris"}));
    assert_eq!(m[3].tool_call_id.as_deref(), Some("c1"));
    assert_eq!(
        c.conv.tool_choice,
        ToolChoice::Function("get_weather".into())
    );
    assert_eq!(
        c.sampling.max_tokens,
        Some(40),
        "max_completion_tokens wins"
    );
    assert_eq!(
        (c.sampling.temperature, c.sampling.top_p),
        (Some(0.7), Some(0.9))
    );
    assert_eq!(
        (c.sampling.stop.clone(), c.sampling.seed),
        (vec!["END".to_string()], Some(7))
    );
    assert_eq!(
        (c.stream, c.include_usage, c.logprobs),
        (true, true, Some(2))
    );
}

#[test]
fn bad_and_unsupported_requests_are_refused_naming_the_field() {
    let cases: [(&str, Value, &str); 10] = [
        ("n", json!(2), "n"),
        ("audio", json!({"voice": "x"}), "audio"),
        ("messages", json!("hi"), "messages"),
        (
            "messages",
            json!([{"role": "robot", "content": "x"}]),
            "messages[0].role",
        ),
        (
            "messages",
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0]",
        ),
        (
            "messages",
            json!([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "1"}]),
            "messages[1].tool_call_id",
        ),
        ("temperature", json!(3.5), "temperature"),
        ("max_tokens", json!(0), "max_tokens"),
        (
            "response_format",
            json!({"type": "json_object"}),
            "response_format",
        ),
        ("tool_choice", json!("sometimes"), "tool_choice"),
    ];
    for (key, value, param) in cases {
        let mut b = body();
        b[key] = value;
        b.as_object_mut().unwrap().remove("max_completion_tokens");
        let e = parse(&b).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{key}: {e:?}");
        assert_eq!(e.status(), 400);
        let shaped = serde_json::to_value(error(&e)).unwrap();
        assert_eq!(shaped["error"]["type"], "invalid_request_error");
        assert!(
            shaped["error"]["message"].as_str().unwrap().contains(param),
            "{shaped}"
        );
    }
    assert_eq!(
        parse(&json!([1])).unwrap_err().param.as_deref(),
        Some("body")
    );
}

fn answer() -> Answer {
    Answer {
        id: "chatcmpl-1".into(),
        model: "policy".into(),
        created: 1,
        content: "Checking.".into(),
        tool_calls: vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo"}),
        }],
        finish: Finish::ToolCalls,
        stop_sequence: None,
        prompt_tokens: 30,
        completion_tokens: 12,
        tokens: vec![TokenInfo {
            text: "Check".into(),
            logprob: -0.25,
        }],
    }
}

#[test]
fn the_completion_and_its_stream_say_the_same() {
    let a = answer();
    let c = completion(&a, true);
    assert_eq!(c["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        c["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Oslo\"}"
    );
    assert_eq!(c["usage"]["total_tokens"], 42);
    assert_eq!(c["choices"][0]["logprobs"]["content"][0]["logprob"], -0.25);
    let events = chunks(&a, false, true);
    assert_eq!(events.last().unwrap(), "data: [DONE]\n\n");
    let parsed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap().trim()).unwrap())
        .collect();
    // Rebuild the message from the deltas, as the SDK's stream helpers do.
    let (mut content, mut args, mut name, mut finish) =
        (String::new(), String::new(), String::new(), None);
    for p in &parsed[..parsed.len() - 1] {
        let d = &p["choices"][0]["delta"];
        content.push_str(d["content"].as_str().unwrap_or_default());
        if let Some(tc) = d["tool_calls"].get(0) {
            name.push_str(tc["function"]["name"].as_str().unwrap_or_default());
            args.push_str(tc["function"]["arguments"].as_str().unwrap_or_default());
        }
        if let Some(f) = p["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(
        (content.as_str(), name.as_str(), finish.as_deref()),
        ("Checking.", "get_weather", Some("tool_calls"))
    );
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Oslo"})
    );
    let last = parsed.last().unwrap();
    assert_eq!(
        (
            last["choices"].as_array().unwrap().len(),
            &last["usage"]["completion_tokens"]
        ),
        (0, &json!(12))
    );
}
