use super::*;
use serde_json::json;

fn weather() -> Vec<ToolSpec> {
    vec![ToolSpec {
        name: "get_weather".into(),
        description: "Weather in a city".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"}
            },
            "required": ["city"],
            "additionalProperties": false
        }),
    }]
}

fn ids(k: usize) -> String {
    format!("call_{k}")
}

#[test]
fn hermes_blocks_become_calls_and_the_text_around_them_content() {
    let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\", \\\"days\\\": 2}\"}</tool_call>";
    let p = parse(ToolFormat::Hermes, text, &weather(), ids);
    assert_eq!(p.invalid, None);
    assert_eq!(p.content, "Let me look.");
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.calls[0].id, "call_0");
    assert_eq!(p.calls[0].arguments, json!({"city": "Paris"}));
    // Arguments written as a JSON string are parsed.
    assert_eq!(p.calls[1].arguments, json!({"city": "Oslo", "days": 2}));
    // A last block left open after whole JSON (the model stopped there) is a call.
    let p = parse(
        ToolFormat::Hermes,
        "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n",
        &weather(),
        ids,
    );
    assert_eq!(p.invalid, None);
    assert_eq!(p.content, "Checking.");
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].arguments, json!({"city": "Rome"}));
    // No block: plain text, nothing invalid.
    let p = parse(ToolFormat::Hermes, "It is sunny.", &weather(), ids);
    assert_eq!(
        (p.content.as_str(), p.calls.len(), p.invalid),
        ("It is sunny.", 0, None)
    );
}

#[test]
fn a_bad_call_makes_the_whole_answer_plain_text_with_the_reason() {
    let cases = [
        (
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>",
            "not JSON",
        ),
        (
            "<tool_call>{\"name\": \"get_weather\"",
            "not closed and not JSON",
        ),
        (
            "<tool_call>{\"name\": \"launch\", \"arguments\": {}}</tool_call>",
            "no tool is named \"launch\"",
        ),
        (
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>",
            "arguments.city is required",
        ),
        (
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": 3}}</tool_call>",
            "arguments.city should be string",
        ),
        (
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\", \"unit\": \"k\"}}</tool_call>",
            "is not one of",
        ),
        (
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\", \"x\": 1}}</tool_call>",
            "arguments.x is not a declared property",
        ),
        (
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "without a \"name\"",
        ),
    ];
    for (text, why) in cases {
        let p = parse(ToolFormat::Hermes, text, &weather(), ids);
        assert!(p.calls.is_empty(), "{text}");
        assert_eq!(
            p.content, text,
            "the answer is returned as it was generated"
        );
        let invalid = p.invalid.unwrap_or_default();
        assert!(invalid.contains(why), "{text}: {invalid}");
    }
    // Without declared tools nothing is a call, and nothing is invalid.
    let p = parse(ToolFormat::Hermes, cases[0].0, &[], ids);
    assert_eq!(p.invalid, None);
}

#[test]
fn llama3_and_mistral_calls_parse() {
    let p = parse(
        ToolFormat::Llama3Json,
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"c\"}}",
        &weather(),
        ids,
    );
    assert_eq!(p.invalid, None);
    assert_eq!(p.calls.len(), 2);
    assert_eq!(
        p.calls[0].arguments,
        json!({"city": "a;b"}),
        "a ';' inside a string stays"
    );
    let p = parse(ToolFormat::Llama3Json, "Sunny today.", &weather(), ids);
    assert!(p.calls.is_empty() && p.invalid.is_none());
    let p = parse(
        ToolFormat::Mistral,
        "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}]",
        &weather(),
        ids,
    );
    assert_eq!((p.calls.len(), p.content.as_str()), (1, ""));
    let p = parse(
        ToolFormat::Mistral,
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"x\"}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"y\"}",
        &weather(),
        ids,
    );
    assert_eq!(p.calls.len(), 2, "{:?}", p.invalid);
    assert_eq!(p.calls[1].arguments, json!({"city": "y"}));
}

#[test]
fn written_calls_parse_back_in_every_format() {
    let calls = vec![ToolCall {
        id: "call_0".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris", "unit": "c"}),
    }];
    for f in [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
    ] {
        let p = parse(f, &f.write(&calls), &weather(), ids);
        assert_eq!(p.calls, calls, "{f:?}");
    }
}

#[test]
fn the_format_follows_the_template_and_the_prompt_lists_every_tool() {
    assert_eq!(ToolFormat::of_template(None), ToolFormat::Hermes);
    assert_eq!(
        ToolFormat::of_template(Some("x [TOOL_CALLS] y")),
        ToolFormat::Mistral
    );
    assert_eq!(
        ToolFormat::of_template(Some("<|python_tag|>")),
        ToolFormat::Llama3Json
    );
    let p = hermes_prompt(&weather(), &ToolChoice::Function("get_weather".into()));
    assert!(
        p.contains(
            "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": "
        ) && p.contains("<tool_call>"),
        "{p}"
    );
    assert!(p.ends_with("Call the function get_weather."));
}
