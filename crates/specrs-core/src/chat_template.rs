//! Renders a model's Jinja chat template (`tokenizer.chat_template`) with minijinja, configured
//! like transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`).
//!
//! Invariant: the template is compiled once at load; a template error at load or render time is
//! reported with the template's own message, never silently replaced by another format.

use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

use crate::error::{Error, Result};

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
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::model_load(format!("the model's chat template does not compile: {e}")))?;
        let renders_tools = source.contains("tools");
        Ok(Self { env, bos_token, eos_token, renders_tools })
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
        let template = self.env.get_template("chat").map_err(|e| Error::Internal(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                tools => tools.map(minijinja::Value::from_serialize),
            })
            .map_err(|e| Error::config(format!("the chat template rejected these messages: {e}")))
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

    #[test]
    fn broken_template_is_a_load_error() {
        assert!(matches!(ChatTemplate::new("{% for %}", String::new(), String::new()), Err(Error::ModelLoad(_))));
    }
}
