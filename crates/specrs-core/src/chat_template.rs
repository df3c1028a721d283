//! Renders a model's Jinja chat template (`tokenizer.chat_template`) with minijinja, configured
//! like transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`).
//!
//! Invariant: the template is compiled once at load; a template error at load or render time is
//! reported with the template's own message, never silently replaced by another format. The
//! template comes from the model file, so it is untrusted: a render takes at most `RENDER_FUEL`
//! steps and writes at most `MAX_RENDERED_BYTES`, and a template that exceeds either on a one-message
//! conversation is refused at load.

use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

use crate::error::{Error, Result};

/// Steps one render may take (minijinja's fuel: about one per template instruction). Real
/// templates take a few dozen steps per message (SmolLM2's ChatML: 23, and 38 for a one-message
/// chat), so conversations of hundreds of thousands of messages fit, while a template that loops
/// (`range(10000)` three deep is 10^12 steps) stops after about a second of rendering (measured on
/// a 2-core machine) instead of running for hours while holding a worker.
pub const RENDER_FUEL: u64 = 20_000_000;

/// Bytes one render may write: a prompt this long (about 8M tokens) fits no model's context
/// window, and a template that repeats a message without end must not fill memory. It is well
/// above `specrs serve`'s largest request body (8 MiB by default) rendered once.
pub const MAX_RENDERED_BYTES: usize = 32 << 20;

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template reads a `tools` variable (a tool-calling template).
    renders_tools: bool,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::model_load(format!("the model's chat template does not compile: {e}")))?;
        let renders_tools = source.contains("tools");
        let template = Self { env, bos_token, eos_token, renders_tools };
        // A template that loops or repeats without end on the simplest conversation fails every
        // request: refuse the model now. (Other errors, such as a template's raise_exception on
        // a shape it does not take, stay the request's.)
        let hello = [ChatMessage { role: "user".into(), content: "Hello".into() }];
        if let Err(Rejection::OverLimit(why)) = template.render_bounded(&hello, true, None) {
            return Err(Error::model_load(format!(
                "the model's chat template (tokenizer.chat_template) {why} when rendering one user message \
                 \"Hello\": it loops or repeats without end; fix the template or use another model file"
            )));
        }
        Ok(template)
    }

    /// The prompt text for `messages`, ending with the assistant's turn opener when
    /// `add_generation_prompt` is set.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// Whether the template renders the `tools` of a tool-calling request itself.
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// `render` with OpenAI's `tools` list (`[{"type": "function", "function": {...}}]`) in the
    /// template's `tools` variable, as transformers passes it.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::config("a chat prompt needs at least one message"));
        }
        self.render_bounded(messages, add_generation_prompt, tools).map_err(|rejection| match rejection {
            Rejection::OverLimit(why) => Error::config(format!(
                "the model's chat template {why} for these messages: the template loops or repeats without end \
                 on them (or the conversation is far too long); shorten the conversation, or fix the model's \
                 chat template"
            )),
            Rejection::Template(e) => Error::config(format!("the chat template rejected these messages: {e}")),
            Rejection::Internal(why) => Error::Internal(why),
        })
    }

    /// The rendered text, within `RENDER_FUEL` steps and `MAX_RENDERED_BYTES` bytes.
    fn render_bounded(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> std::result::Result<String, Rejection> {
        let template = self.env.get_template("chat").map_err(|e| Rejection::Internal(e.to_string()))?;
        let mut output = BoundedOutput::default();
        let rendered = template.render_captured_to(
            context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                tools => tools.map(minijinja::Value::from_serialize),
            },
            &mut output,
        );
        match rendered {
            Ok(_) => String::from_utf8(output.bytes).map_err(|e| Rejection::Internal(format!("rendered text: {e}"))),
            Err(_) if output.overflowed => Err(Rejection::OverLimit(format!(
                "wrote more than {MAX_RENDERED_BYTES} bytes (specrs's bound on a rendered prompt)"
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(Rejection::OverLimit(format!(
                "did not finish within {RENDER_FUEL} steps (specrs's bound on rendering a chat template)"
            ))),
            Err(e) => Err(Rejection::Template(e)),
        }
    }
}

/// Why a render failed.
enum Rejection {
    /// It ran past `RENDER_FUEL` or `MAX_RENDERED_BYTES` (what it did, for the message).
    OverLimit(String),
    /// The template's own error (`raise_exception`, an undefined variable, ...).
    Template(minijinja::Error),
    Internal(String),
}

/// A render's output, refused once it would grow past `MAX_RENDERED_BYTES`.
#[derive(Default)]
struct BoundedOutput {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + \
message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn user(content: &str) -> ChatMessage {
        ChatMessage { role: "user".into(), content: content.into() }
    }

    #[test]
    fn renders_chatml_with_default_system_message() {
        let t = ChatTemplate::new(CHATML, String::new(), "<|im_end|>".into()).unwrap();
        let text = t.render(&[user("Hi")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
{{ messages[0].content.strip().upper() }}";
        let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
        assert_eq!(t.render(&[user("  hi ")], false).unwrap(), "HI");
        let err = t.render(&[ChatMessage { role: "system".into(), content: "x".into() }], false).unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
    }

    /// Loops 10^12 times, but only for a message whose content is "loop", so the template loads.
    const LOOPS_ON_REQUEST: &str = "{% for message in messages %}{% if message.content == 'loop' %}\
{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}{{ '' }}{% endfor %}{% endfor %}\
{% endfor %}{% endif %}{{ message.content }}{% endfor %}";

    // Issue 38: such a template held a worker for hours at its first render.
    #[test]
    fn a_looping_template_is_refused_within_its_fuel() {
        let t = ChatTemplate::new(LOOPS_ON_REQUEST, String::new(), String::new()).unwrap();
        assert_eq!(t.render(&[user("hi")], true).unwrap(), "hi");
        let start = std::time::Instant::now();
        let err = t.render(&[user("loop")], true).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        assert!(err.to_string().contains(&format!("did not finish within {RENDER_FUEL} steps")), "{err}");
        // Not a timing comparison: 10^12 steps would take hours, the fuel stops it in about a second.
        assert!(start.elapsed().as_secs() < 120, "took {:?}", start.elapsed());
    }

    #[test]
    fn a_template_that_loops_on_every_conversation_is_a_load_error() {
        let src = LOOPS_ON_REQUEST.replace("message.content == 'loop'", "true");
        let err = ChatTemplate::new(&src, String::new(), String::new()).err().expect("loaded");
        assert!(matches!(err, Error::ModelLoad(_)), "{err:?}");
        assert!(err.to_string().contains("did not finish within") && err.to_string().contains("one user message"));
    }

    #[test]
    fn a_template_that_writes_without_end_is_refused_at_the_byte_bound() {
        // 100000 copies of the message: 100 MB for a 1000-byte one.
        let src = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}";
        let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
        assert_eq!(t.render(&[user("ab")], false).unwrap().len(), 200_000);
        let err = t.render(&[user(&"x".repeat(1000))], false).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        assert!(err.to_string().contains(&format!("wrote more than {MAX_RENDERED_BYTES} bytes")), "{err}");
    }

    #[test]
    fn long_conversations_of_a_real_template_stay_within_the_fuel() {
        // SmolLM2's template (the default model's) on 100000 messages: the bounds leave real
        // templates alone.
        let t = ChatTemplate::new(CHATML, String::new(), "<|im_end|>".into()).unwrap();
        let messages: Vec<ChatMessage> = (0..100_000)
            .map(|i| ChatMessage { role: ["user", "assistant"][i % 2].into(), content: format!("message {i}") })
            .collect();
        let text = t.render(&messages, true).unwrap();
        assert!(text.ends_with(
            "<|im_start|>user\nmessage 99998<|im_end|>\n<|im_start|>assistant\nmessage \
             99999<|im_end|>\n<|im_start|>assistant\n"
        ));
    }

    #[test]
    fn broken_template_is_a_load_error() {
        assert!(matches!(ChatTemplate::new("{% for %}", String::new(), String::new()), Err(Error::ModelLoad(_))));
    }
}
