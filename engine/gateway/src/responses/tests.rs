use super::*;

fn body() -> Value {
    json!({
        "model": "policy",
        "instructions": "Use the tools.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Lyon\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "20 C"}
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "previous_response_id": "resp_7",
        "max_output_tokens": 32, "stream": true
    })
}

#[test]
fn items_become_one_answer_with_its_calls_then_the_results() {
    let (c, previous) = parse(&body()).unwrap();
    assert_eq!(previous.as_deref(), Some("resp_7"));
    let m = &c.conv.messages;
    let roles: Vec<Role> = m.iter().map(|x| x.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Tool
        ]
    );
    assert_eq!(m[2].content, "Looking.");
    assert_eq!(m[2].tool_calls.len(), 2, "consecutive calls are one answer");
    assert_eq!(m[4].tool_call_id.as_deref(), Some("call_2"));
    assert_eq!((c.sampling.max_tokens, c.stream), (Some(32), true));
    let (c, _) = parse(&json!({"input": "hi"})).unwrap();
    assert_eq!(c.conv.messages, [Message::new(Role::User, "hi")]);
}

#[test]
fn bad_items_and_unsupported_fields_name_the_field() {
    for (key, value, param) in [
        ("input", json!(3), "input"),
        (
            "input",
            json!([{"type": "web_search_call"}]),
            "input[0].type",
        ),
        (
            "input",
            json!([{"role": "critic", "content": "x"}]),
            "input[0].role",
        ),
        (
            "input",
            json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
            "input[0].arguments",
        ),
        ("background", json!(true), "background"),
        (
            "text",
            json!({"format": {"type": "json_schema"}}),
            "text.format",
        ),
        ("max_output_tokens", json!(0), "max_output_tokens"),
    ] {
        let mut b = body();
        b[key] = value;
        let e = parse(&b).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{key}: {e:?}");
    }
}

#[test]
fn the_stream_ends_with_the_whole_response_and_numbers_its_events() {
    let (call, _) = parse(&body()).unwrap();
    let a = Answer {
        id: "resp_8".into(),
        model: "policy".into(),
        created: 5,
        content: String::new(),
        tool_calls: vec![ToolCall {
            id: "call_3".into(),
            name: "get_weather".into(),
            arguments: json!({"city": "Nice"}),
        }],
        finish: Finish::ToolCalls,
        stop_sequence: None,
        prompt_tokens: 20,
        completion_tokens: 8,
        tokens: Vec::new(),
    };
    let whole = response(&a, &call, Some("resp_7"));
    assert_eq!(whole["output"][0]["type"], "function_call");
    assert_eq!(whole["output"][0]["arguments"], "{\"city\":\"Nice\"}");
    assert_eq!(whole["instructions"], "Use the tools.");
    let ev: Vec<Value> = events(&a, &call, Some("resp_7"))
        .iter()
        .map(|e| {
            serde_json::from_str(e.lines().nth(1).unwrap().trim_start_matches("data: ")).unwrap()
        })
        .collect();
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    let seqs: Vec<u64> = ev
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..7).collect::<Vec<_>>());
    assert_eq!(ev[6]["response"], whole);
    // At the token budget the response is incomplete.
    let short = Answer {
        finish: Finish::Length,
        ..a
    };
    assert_eq!(
        response(&short, &call, None)["incomplete_details"]["reason"],
        "max_output_tokens"
    );
}
