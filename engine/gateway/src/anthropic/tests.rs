use super::*;
use crate::wire::Finish;

fn body() -> Value {
    json!({
        "model": "policy",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You check the weather."}],
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And Oslo?"}]}
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["###"], "temperature": 0.5, "stream": true
    })
}

#[test]
fn blocks_become_messages_tool_calls_and_results() {
    let c = parse(&body()).unwrap();
    let m = &c.conv.messages;
    let roles: Vec<Role> = m.iter().map(|x| x.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::User
        ]
    );
    assert_eq!(m[2].content, "Looking.");
    assert_eq!(m[2].tool_calls[0].arguments, json!({"city": "Paris"}));
    assert_eq!(
        (m[3].tool_call_id.as_deref(), m[3].content.as_str()),
        (Some("toolu_1"), "18 C")
    );
    assert_eq!(m[4].content, "And Oslo?");
    assert_eq!(c.conv.tool_choice, ToolChoice::Required);
    assert_eq!(c.conv.tools[0].parameters, json!({"type": "object"}));
    assert_eq!(
        (c.sampling.max_tokens, c.sampling.stop.len(), c.stream),
        (Some(64), 1, true)
    );
}

#[test]
fn bad_requests_name_the_field_in_anthropics_shape() {
    for (key, value, param) in [
        ("max_tokens", Value::Null, "max_tokens"),
        (
            "messages",
            json!([{"role": "system", "content": "x"}]),
            "messages[0].role",
        ),
        (
            "messages",
            json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            "messages[0].content[0]",
        ),
        (
            "messages",
            json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "1"}]}]),
            "messages",
        ),
        ("temperature", json!(1.5), "temperature"),
        (
            "thinking",
            json!({"type": "enabled", "budget_tokens": 1024}),
            "thinking",
        ),
        ("tool_choice", json!({"type": "tool"}), "tool_choice.name"),
    ] {
        let mut b = body();
        b[key] = value;
        let e = parse(&b).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{key}: {e:?}");
        let shaped = serde_json::to_value(error(&e)).unwrap();
        assert_eq!(
            (shaped["type"].as_str(), shaped["error"]["type"].as_str()),
            (Some("error"), Some("invalid_request_error"))
        );
    }
}

#[test]
fn the_stream_rebuilds_the_message() {
    let a = Answer {
        id: "msg_1".into(),
        model: "policy".into(),
        created: 0,
        content: "Looking.".into(),
        tool_calls: vec![ToolCall {
            id: "toolu_2".into(),
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo"}),
        }],
        finish: Finish::ToolCalls,
        stop_sequence: None,
        prompt_tokens: 9,
        completion_tokens: 5,
        tokens: Vec::new(),
    };
    let whole = message(&a);
    assert_eq!(whole["stop_reason"], "tool_use");
    let names: Vec<String> = events(&a)
        .iter()
        .map(|e| {
            e.lines()
                .next()
                .unwrap()
                .trim_start_matches("event: ")
                .to_string()
        })
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    // Accumulate as the SDK does: text deltas into text, input_json_delta into the input.
    let mut blocks: Vec<Value> = Vec::new();
    for e in events(&a) {
        let data: Value =
            serde_json::from_str(e.lines().nth(1).unwrap().trim_start_matches("data: ")).unwrap();
        match data["type"].as_str().unwrap() {
            "content_block_start" => blocks.push(data["content_block"].clone()),
            "content_block_delta" => {
                let b = blocks.last_mut().unwrap();
                match data["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        b["text"] = json!(format!(
                            "{}{}",
                            b["text"].as_str().unwrap(),
                            data["delta"]["text"].as_str().unwrap()
                        ))
                    }
                    _ => {
                        b["input"] =
                            serde_json::from_str(data["delta"]["partial_json"].as_str().unwrap())
                                .unwrap()
                    }
                }
            }
            _ => {}
        }
    }
    assert_eq!(Value::Array(blocks), whole["content"]);
}
