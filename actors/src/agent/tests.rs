//! Rendering and sessions against SmolLM2's real tokenizer and chat template (which has no
//! tool syntax: the Hermes-style fallback), and a tool-calling template of the Qwen kind.

use std::sync::{Arc, OnceLock};

use serde_json::json;

use super::*;
use crate::generation::{FinishReason, GenOutput};
use crate::model::llm::{Checkpoint, LlmTokenizer};
use crate::types::VersionSpan;

fn smollm2() -> Arc<LlmTokenizer> {
    static TOK: OnceLock<Arc<LlmTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let ck = Checkpoint::open_gguf(&crate::model::llm::tests::smollm2_path()).expect("gguf");
        Arc::new(LlmTokenizer::from_gguf(&ck).expect("tokenizer"))
    })
    .clone()
}

fn weather() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: "Weather in a city".into(),
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    }
}

/// An answer as an engine returns it: `ids`, one logprob each, under version `v`.
fn answer(ids: Vec<u32>, v: u64) -> GenOutput {
    GenOutput {
        logprobs: vec![-0.5; ids.len()].into(),
        versions: vec![VersionSpan {
            version: v,
            tokens: ids.len() as u32,
            precision: None,
        }],
        tokens: ids.into(),
        finish: FinishReason::Stop,
        prefill_tokens: 0,
    }
}

/// Ids of `text` one character at a time: a valid tokenisation that re-encoding the text
/// would never give (what a sampled answer often is).
fn odd_ids(tok: &LlmTokenizer, text: &str) -> Vec<u32> {
    let mut v = Vec::new();
    for c in text.chars() {
        v.extend(tok.encode(&c.to_string(), false).unwrap());
    }
    v
}

#[test]
fn without_tool_syntax_the_fallback_declares_tools_and_wraps_results() {
    let tok = smollm2();
    let r = Renderer::new(tok.clone(), None);
    assert!(!r.native_tools());
    assert_eq!(r.format, ToolFormat::Hermes);
    let mut asked = Message::new(Role::Assistant, "");
    asked.tool_calls.push(ToolCall {
        id: "c1".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris"}),
    });
    let conv = Conversation {
        messages: vec![
            Message::new(Role::User, "Weather in Paris?"),
            asked,
            Message::tool("c1", "18 C"),
        ],
        tools: vec![weather()],
        tool_choice: ToolChoice::Auto,
    };
    let ids = r.ids(&conv, &[]).unwrap();
    let text = tok.decode(&ids).unwrap();
    assert!(text.starts_with("<|im_start|>system\n# Tools"), "{text}");
    assert!(text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\""), "{text}");
    assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call><|im_end|>"), "{text}");
    assert!(
        text.contains("<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>"),
        "{text}"
    );
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    // tool_choice = none: no tools in the prompt (SmolLM2's default system prompt instead).
    let none = Conversation {
        tool_choice: ToolChoice::None,
        messages: vec![Message::new(Role::User, "hi")],
        ..conv
    };
    let text = tok.decode(&r.ids(&none, &[]).unwrap()).unwrap();
    assert!(
        !text.contains("<tools>") && text.contains("SmolLM"),
        "{text}"
    );
}

#[test]
fn generated_answers_keep_their_ids_and_the_context_only_grows() {
    let tok = smollm2();
    let r = Arc::new(Renderer::new(tok.clone(), None));
    let mut s = Session::new(r);
    let mut conv = Conversation {
        messages: vec![
            Message::new(Role::System, "You check the weather."),
            Message::new(Role::User, "Weather in Paris?"),
        ],
        tools: vec![weather()],
        tool_choice: ToolChoice::Auto,
    };
    let end = tok.stop_ids[..]
        .iter()
        .copied()
        .find(|&i| tok.decode(&[i]).unwrap() == "<|im_end|>")
        .unwrap();
    let mut all_answers = Vec::new();
    for turn in 0..5u64 {
        let p = s.prepare(&conv).unwrap();
        assert!(!p.restart, "turn {turn}");
        if turn == 0 {
            assert_eq!(p.observation, p.context[..]);
        } else {
            // Only the tool result and the generation prompt are new.
            let new = tok.decode(&p.observation).unwrap();
            assert!(
                new.starts_with("\n<|im_start|>user\n<tool_response>"),
                "{new:?}"
            );
            assert!(new.ends_with("<|im_start|>assistant\n"), "{new:?}");
            assert_eq!(&p.context[..s.context().len()], s.context());
        }
        // The policy writes a call with its own spacing, one character per id.
        let text = format!(
            "<tool_call>\n{{\"name\": \"get_weather\",  \"arguments\": {{\"city\": \"City{turn}\"}}}}\n</tool_call>"
        );
        let mut ids = odd_ids(&tok, &text);
        ids.push(end);
        assert_ne!(
            tok.encode(&text, true).unwrap(),
            ids[..ids.len() - 1],
            "not the canonical ids"
        );
        let out = answer(ids.clone(), turn);
        s.check_versions(&out).unwrap();
        let parsed = tools::parse(r_format(&s), &text, &conv.tools, |k| {
            format!("call_{turn}_{k}")
        });
        assert_eq!(parsed.calls.len(), 1, "{:?}", parsed.invalid);
        let mut msg = Message::new(Role::Assistant, parsed.content.clone());
        msg.tool_calls = parsed.calls.clone();
        s.commit(&p, &out, msg.clone());
        all_answers.push(ids);
        // The agent sends its history back (arguments re-serialised as it likes) with the result.
        conv.messages.push(msg);
        conv.messages.push(Message::tool(
            &format!("call_{turn}_0"),
            format!("{turn}0 C"),
        ));
    }
    assert_eq!(s.segments(), 1);
    // Every answer's ids appear verbatim, in order, in the final context.
    let p = s.prepare(&conv).unwrap();
    let mut at = 0;
    for a in &all_answers {
        let found = p.context[at..].windows(a.len()).position(|w| w == &a[..]);
        at += found.expect("answer ids in the context") + a.len();
    }
    // The template's `<|im_end|>` after an answer that ended on it is not written twice.
    let text = tok.decode(&p.context).unwrap();
    assert!(!text.contains("<|im_end|><|im_end|>"), "{text}");
}

fn r_format(s: &Session) -> ToolFormat {
    s.renderer().format
}

#[test]
fn an_edited_history_starts_a_new_segment_that_still_holds_the_generated_ids() {
    let tok = smollm2();
    let mut s = Session::new(Arc::new(Renderer::new(tok.clone(), None)));
    let mut conv = Conversation {
        messages: vec![Message::new(Role::User, "Say hi.")],
        ..Conversation::default()
    };
    let p = s.prepare(&conv).unwrap();
    let hi = odd_ids(&tok, "Hi there!");
    s.commit(
        &p,
        &answer(hi.clone(), 3),
        Message::new(Role::Assistant, "Hi there!"),
    );
    conv.messages
        .push(Message::new(Role::Assistant, "Hi there!"));
    conv.messages.push(Message::new(Role::User, "Again."));
    let p = s.prepare(&conv).unwrap();
    assert!(!p.restart);
    // The agent rewrites its first message (a summary): a new segment.
    conv.messages[0].content = "Say hello.".into();
    let p = s.prepare(&conv).unwrap();
    assert!(p.restart);
    assert_eq!(
        p.observation,
        p.context[..],
        "a new segment's observation is its whole context"
    );
    assert!(
        p.context.windows(hi.len()).any(|w| w == &hi[..]),
        "the answer's ids, not its text's"
    );
    s.commit(
        &p,
        &answer(vec![1, 2], 4),
        Message::new(Role::Assistant, "x"),
    );
    assert_eq!(s.segments(), 2);
    // Versions never go backwards: an answer from version 3 after version 4 is refused.
    let e = s.check_versions(&answer(vec![5], 3)).unwrap_err();
    assert_eq!((e.got, e.floor), (3, 4));
    // Content holding the reserved marker character is refused, naming the message.
    conv.messages[1].content = "\u{F8FF}".into();
    assert!(matches!(s.prepare(&conv), Err(RenderError::Reserved(1))));
}

#[test]
fn a_template_with_tool_syntax_renders_tools_and_calls_itself() {
    let base = smollm2();
    let template = "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}\
        {%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}\
        {%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}\
        <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let tok = Arc::new(LlmTokenizer::from_parts(
        base.inner().clone(),
        base.bos_id,
        base.eos_id,
        Some(template.into()),
    ));
    let r = Renderer::new(tok.clone(), None);
    assert!(r.native_tools());
    let mut asked = Message::new(Role::Assistant, " ");
    asked.tool_calls.push(ToolCall {
        id: "c1".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Oslo"}),
    });
    let conv = Conversation {
        messages: vec![
            Message::new(Role::User, "  Oslo?  "),
            asked,
            Message::tool("c1", "cold"),
        ],
        tools: vec![weather()],
        tool_choice: ToolChoice::Auto,
    };
    let text = tok.decode(&r.ids(&conv, &[]).unwrap()).unwrap();
    assert!(
        text.starts_with(
            "<|im_start|>system\n{\"description\":\"Weather in a city\",\"name\":\"get_weather\""
        ),
        "{text}"
    );
    assert!(
        text.contains("<|im_start|>user\nOslo?<|im_end|>"),
        "the template's own trim: {text}"
    );
    assert!(
        text.contains("<tool_call>get_weather {\"city\":\"Oslo\"}</tool_call>"),
        "{text}"
    );
    assert!(text.contains("<|im_start|>tool\ncold<|im_end|>"), "{text}");
}
