//! The tokenizer a GGUF file carries, rebuilt as a `tokenizers::Tokenizer`.
//!
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE; the pre-tokenizer regexes are chosen by
//!   `tokenizer.ggml.pre` exactly as llama.cpp chooses them. An unknown `pre` is an error: a wrong
//!   split silently changes every token id.
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE. llama.cpp merges the adjacent pair whose
//!   concatenation has the highest score; that is BPE whose merge ranks follow the scores of the
//!   merged tokens, with byte fallback for characters outside the vocabulary.
//!
//! Invariant: control and user-defined tokens in the text are matched as single tokens (the chat
//! template relies on it); decoding with `skip_special_tokens` drops control tokens. A chat's own
//! strings are the exception: `encode_chat` reads special-token text in them as plain text unless
//! asked not to (`special_text.rs`).

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{Error, Result};
use crate::gguf::{value_as_i64, GgufFile};
use crate::special_text::SpecialText;

// llama.cpp's token types (llama_token_type in gguf).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values specrs understands -> (regexes applied in order, ignore_merges).
fn pre_tokenizer_regexes(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "lfm2" => (vec![LLAMA3_REGEX], true),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" => (vec![QWEN2_REGEX], false),
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" => (vec![GPT2_REGEX], false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![r"\p{N}", GPT2_REGEX], false)
        }
        _ => return None,
    })
}

const SUPPORTED_PRE: &str = "llama3, llama-bpe, qwen2, gpt-2, phi-2, smollm, starcoder (and their llama.cpp aliases)";

/// Token strings that end a turn in common chat formats; llama.cpp stops on them too.
const END_OF_TURN_TEXTS: [&str; 7] =
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>"];

pub struct TextTokenizer {
    inner: Tokenizer,
    bos_token_id: Option<u32>,
    add_bos: bool,
    /// Tokens that end generation.
    eos_token_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    /// The special tokens, to keep their text in a chat's strings plain (`encode_chat`).
    special_text: SpecialText,
    vocab_size: usize,
}

impl TextTokenizer {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let path = gguf.path.display().to_string();
        let model = gguf.get_str("tokenizer.ggml.model")?.to_string();
        let tokens: Vec<String> = gguf
            .get_array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(Error::model_load(format!("{path}: tokenizer.ggml.tokens holds a non-string"))),
            })
            .collect::<Result<_>>()?;
        let vocab_size = tokens.len();
        let token_types: Vec<i64> = match gguf.metadata().get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| value_as_i64(v).unwrap_or(TOKEN_TYPE_NORMAL)).collect(),
            _ => vec![TOKEN_TYPE_NORMAL; vocab_size],
        };
        if token_types.len() != vocab_size {
            return Err(Error::model_load(format!(
                "{path}: {} token types for {vocab_size} tokens; the GGUF is corrupt",
                token_types.len()
            )));
        }
        let special_id = |key: &str| -> Result<Option<u32>> {
            match gguf.opt_usize(key)? {
                Some(id) if id >= vocab_size => Err(Error::model_load(format!(
                    "{path}: {key} = {id} is outside the vocabulary of {vocab_size} tokens"
                ))),
                other => Ok(other.map(|id| id as u32)),
            }
        };
        let bos_token_id = special_id("tokenizer.ggml.bos_token_id")?;
        let eos_token_id = special_id("tokenizer.ggml.eos_token_id")?;
        let unk_token_id = special_id("tokenizer.ggml.unknown_token_id")?;

        let (mut inner, default_add_bos) = match model.as_str() {
            "gpt2" => (Self::byte_level_bpe(gguf, &tokens)?, false),
            "llama" => (Self::sentencepiece_bpe(gguf, &tokens, &token_types, unk_token_id)?, true),
            other => {
                return Err(Error::model_load(format!(
                    "{path}: tokenizer model '{other}' is not supported; specrs reads 'gpt2' (BPE) and \
                     'llama' (SentencePiece) tokenizers"
                )))
            }
        };
        let add_bos = gguf.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);

        // Control tokens are special (matched in text, skipped when decoding); user-defined ones
        // are matched in text but decoded as text.
        let added = |wanted: i64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&token_types)
                .filter(|(_, &t)| t == wanted)
                .map(|(s, _)| AddedToken::from(s.clone(), special))
                .collect()
        };
        inner
            .add_special_tokens(added(TOKEN_TYPE_CONTROL, true))
            .map_err(|e| Error::Internal(format!("adding control tokens: {e}")))?;
        inner
            .add_tokens(added(TOKEN_TYPE_USER_DEFINED, false))
            .map_err(|e| Error::Internal(format!("adding user-defined tokens: {e}")))?;

        let mut eos_token_ids: Vec<u32> = eos_token_id.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eos_token_ids.extend(special_id(key)?);
        }
        for (id, (text, &kind)) in tokens.iter().zip(&token_types).enumerate() {
            if kind == TOKEN_TYPE_CONTROL && END_OF_TURN_TEXTS.contains(&text.as_str()) {
                eos_token_ids.push(id as u32);
            }
        }
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();

        let token_text = |id: Option<u32>| id.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        let chat_template = match gguf.opt_str("tokenizer.chat_template")? {
            Some(source) => Some(ChatTemplate::new(source, token_text(bos_token_id), token_text(eos_token_id))?),
            None => None,
        };
        let special_text = SpecialText::new(&inner)?;
        Ok(Self { inner, bos_token_id, add_bos, eos_token_ids, chat_template, special_text, vocab_size })
    }

    /// The tokenizer of a Hugging Face model directory: `tokenizer.json`, with BOS/EOS and the
    /// chat template from `tokenizer_config.json` (or `chat_template.jinja`) and EOS ids from
    /// `generation_config.json`.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let cannot_read = |e: &dyn std::fmt::Display| {
            Error::model_load(format!(
                "cannot read {} ({e}); a Hugging Face model directory needs tokenizer.json",
                path.display()
            ))
        };
        let bytes = std::fs::read(&path).map_err(|e| cannot_read(&e))?;
        // tokenizers panics on some malformed JSON (its decoder deserializer `expect`s), so only
        // well-formed JSON reaches it.
        serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).map_err(|e| cannot_read(&e))?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| cannot_read(&e))?;
        let vocab_size = inner.get_vocab_size(true);
        let config = crate::model::hf_dir::read_optional_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let generation =
            crate::model::hf_dir::read_optional_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        // A special token is a string or {"content": string}.
        let token_text = |key: &str| -> Option<String> {
            let v = config.get(key)?;
            v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str())).map(str::to_string)
        };
        let ids = |v: Option<&serde_json::Value>| -> Vec<u32> {
            match v {
                Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
                Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                None => Vec::new(),
            }
        };
        let bos_text = token_text("bos_token");
        let eos_text = token_text("eos_token");
        let bos_token_id = bos_text
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| ids(generation.get("bos_token_id")).first().copied());
        let mut eos_token_ids = ids(generation.get("eos_token_id"));
        eos_token_ids.extend(eos_text.as_deref().and_then(|t| inner.token_to_id(t)));
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        // Whether BOS starts every prompt: the config says so, or tokenizer.json's post-processor
        // adds it.
        let add_bos = match config.get("add_bos_token").and_then(|v| v.as_bool()) {
            Some(add) => add,
            None => bos_token_id.is_some_and(|bos| {
                inner.encode_fast("a", true).map(|e| e.get_ids().first() == Some(&bos)).unwrap_or(false)
            }),
        };
        let template_file = dir.join("chat_template.jinja");
        let source = match config.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => std::fs::read_to_string(&template_file).ok(),
        };
        let chat_template = match source {
            Some(source) => {
                Some(ChatTemplate::new(&source, bos_text.unwrap_or_default(), eos_text.unwrap_or_default())?)
            }
            None => None,
        };
        let special_text = SpecialText::new(&inner)?;
        Ok(Self { inner, bos_token_id, add_bos, eos_token_ids, chat_template, special_text, vocab_size })
    }

    /// A GPT-2-style byte-level BPE: the 256 bytes, then `merges` in order (each pair's tokens
    /// written in GPT-2's byte alphabet, e.g. `Ġ` for a space), then the special token `eos`. For
    /// the tests and the fuzz targets that need a real BPE with chosen merges; loaded through
    /// `from_hf_dir` like a model's.
    #[doc(hidden)]
    pub fn gpt2_style_for_tests(merges: &[(&str, &str)], eos: &str) -> Result<Self> {
        // GPT-2's byte alphabet: printable bytes stand for themselves, the rest for 256 + rank.
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let byte_char = |byte: u8| match printable(byte) {
            true => char::from(byte),
            false => char::from_u32(256 + (0..byte).filter(|&b| !printable(b)).count() as u32).unwrap_or('?'),
        };
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_char(b).to_string(), serde_json::json!(vocab.len()));
        }
        for (a, b) in merges {
            vocab.insert(format!("{a}{b}"), serde_json::json!(vocab.len()));
        }
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": vocab.len(), "content": eos, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
                      "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
        });
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("specrs-byte-level-bpe-{}-{n}", std::process::id()));
        let write = |name: &str, text: String| {
            std::fs::write(dir.join(name), text).map_err(|e| Error::Internal(format!("writing {name}: {e}")))
        };
        std::fs::create_dir_all(&dir).map_err(|e| Error::Internal(format!("creating {}: {e}", dir.display())))?;
        write("tokenizer.json", tokenizer.to_string())?;
        write("tokenizer_config.json", serde_json::json!({ "eos_token": eos }).to_string())?;
        let loaded = Self::from_hf_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        loaded
    }

    /// For models without a tokenizer (seeded random weights): token i is the word `t{i}`, and
    /// text is those words separated by spaces. No BOS, EOS or chat template, so generation
    /// always runs to max_tokens.
    pub fn numbered(vocab_size: usize) -> Result<Self> {
        let vocab = (0..vocab_size as u32).map(|i| (format!("t{i}"), i)).collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("t0".into())
            .build()
            .map_err(|e| Error::Internal(format!("building the numbered vocabulary: {e}")))?;
        let mut inner = Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(Whitespace {}));
        let special_text = SpecialText::new(&inner)?;
        Ok(Self {
            inner,
            bos_token_id: None,
            add_bos: false,
            eos_token_ids: Vec::new(),
            chat_template: None,
            special_text,
            vocab_size,
        })
    }

    fn byte_level_bpe(gguf: &GgufFile, tokens: &[String]) -> Result<Tokenizer> {
        let path = gguf.path.display();
        let pre = gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("gpt-2");
        let (regexes, ignore_merges) = pre_tokenizer_regexes(pre).ok_or_else(|| {
            Error::model_load(format!(
                "{path}: unknown pre-tokenizer tokenizer.ggml.pre = '{pre}'; specrs refuses to guess how \
                 to split text. Supported: {SUPPORTED_PRE}"
            ))
        })?;
        let merges = gguf
            .get_array("tokenizer.ggml.merges")?
            .iter()
            .map(|v| match v {
                Value::String(m) => m
                    .split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| Error::model_load(format!("{path}: malformed merge '{m}'"))),
                _ => Err(Error::model_load(format!("{path}: tokenizer.ggml.merges holds a non-string"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| Error::model_load(format!("{path}: cannot build the BPE tokenizer: {e}")))?;
        let mut steps: Vec<PreTokenizerWrapper> = regexes
            .into_iter()
            .map(|re| {
                Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
                    .map(PreTokenizerWrapper::Split)
                    .map_err(|e| Error::Internal(format!("pre-tokenizer regex: {e}")))
            })
            .collect::<Result<_>>()?;
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)));
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(PreTokenizerSequence::new(steps)));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(tokenizer)
    }

    fn sentencepiece_bpe(
        gguf: &GgufFile,
        tokens: &[String],
        token_types: &[i64],
        unk_token_id: Option<u32>,
    ) -> Result<Tokenizer> {
        let path = gguf.path.display();
        let scores: Vec<f32> = match gguf.metadata().get("tokenizer.ggml.scores") {
            Some(Value::Array(a)) => a.iter().map(|v| if let Value::F32(s) = v { *s } else { 0.0 }).collect(),
            _ => vec![0.0; tokens.len()],
        };
        if scores.len() != tokens.len() {
            return Err(Error::model_load(format!(
                "{path}: {} token scores for {} tokens; the GGUF is corrupt",
                scores.len(),
                tokens.len()
            )));
        }
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        // Every split of a mergeable token into two vocabulary tokens is a merge, ranked by the
        // merged token's score (higher first), then by id for a deterministic order.
        let mut ranked: Vec<(f32, u32, String, String)> = Vec::new();
        for (id, token) in tokens.iter().enumerate() {
            if !matches!(token_types[id], TOKEN_TYPE_NORMAL | TOKEN_TYPE_USER_DEFINED) {
                continue;
            }
            for (cut, _) in token.char_indices().skip(1) {
                let (left, right) = token.split_at(cut);
                if vocab.contains_key(left) && vocab.contains_key(right) {
                    ranked.push((scores[id], id as u32, left.to_string(), right.to_string()));
                }
            }
        }
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let merges = ranked.into_iter().map(|(_, _, l, r)| (l, r)).collect();
        let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
        if let Some(unk) = unk_token_id {
            builder = builder.unk_token(tokens[unk as usize].clone());
        }
        let bpe = builder
            .build()
            .map_err(|e| Error::model_load(format!("{path}: cannot build the SentencePiece tokenizer: {e}")))?;
        let add_space_prefix = gguf.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
        if add_space_prefix {
            normalizers.push(Prepend::new("▁".into()).into());
        }
        normalizers.push(Replace::new(" ", "▁").map_err(|e| Error::Internal(format!("normalizer: {e}")))?.into());
        let mut decoders: Vec<DecoderWrapper> = vec![
            DecoderWrapper::Replace(Replace::new("▁", " ").map_err(|e| Error::Internal(format!("decoder: {e}")))?),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if add_space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer
            .with_normalizer(Some(NormalizerSequence::new(normalizers)))
            .map_err(|e| Error::Internal(format!("normalizer: {e}")))?;
        tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
        Ok(tokenizer)
    }

    /// Token ids of `text`; special tokens written in the text are recognized. With
    /// `add_special_tokens`, the BOS token is prepended when the model asks for it and the text
    /// does not already start with it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode_fast(text, false).map_err(|e| Error::Internal(format!("tokenization failed: {e}")))?;
        let ids = encoding.get_ids().to_vec();
        Ok(if add_special_tokens { self.with_bos(ids) } else { ids })
    }

    /// `encode(text, false)` with each token's first byte in `text` (a token of byte fallback
    /// starts where its character does), for re-encoding a text's tail alone.
    pub fn encode_with_starts(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>)> {
        let encoding =
            self.inner.encode(text, false).map_err(|e| Error::Internal(format!("tokenization failed: {e}")))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().iter().map(|&(start, _)| start).collect()))
    }

    /// `ids` with BOS in front when the model asks for it and they do not already start with it.
    pub(crate) fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let (true, Some(bos)) = (self.add_bos, self.bos_token_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// Token ids of chat `messages` (and OpenAI's `tools`, in the template's `tools` variable)
    /// rendered by the model's chat template with the assistant's turn opened, BOS added as
    /// `encode` adds it. Special-token text in the messages' roles and contents and in the tools
    /// is read as plain text (`special_text.rs`), so a user message cannot forge a turn; with
    /// `allow_special_tokens_in_content` it becomes special tokens, as in vLLM and transformers.
    /// A chat without such text gets the same ids either way.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        allow_special_tokens_in_content: bool,
    ) -> Result<Vec<u32>> {
        let template = self.require_chat_template()?;
        if !allow_special_tokens_in_content {
            if let Some((messages, tools)) = self.special_text.escape_chat(messages, tools)? {
                let marked = template.render_with_tools(&messages, true, tools.as_ref())?;
                return Ok(self.with_bos(self.special_text.encode(&self.inner, &marked)?));
            }
        }
        self.encode(&template.render_with_tools(messages, true, tools)?, true)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(Error::config(format!("token id {bad} is outside the vocabulary (size {})", self.vocab_size)));
        }
        self.inner.decode(ids, skip_special_tokens).map_err(|e| Error::Internal(format!("detokenization failed: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The text of `id` when it is an added token (special or user-defined), None otherwise.
    pub fn added_token_text(&self, id: u32) -> Option<String> {
        self.inner.get_added_vocabulary().simple_id_to_token(id)
    }

    /// Adds special tokens after the vocabulary (tests of special-token handling).
    #[cfg(test)]
    pub(crate) fn add_special_tokens(&mut self, texts: &[&str]) {
        let tokens: Vec<AddedToken> = texts.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
        self.inner.add_special_tokens(tokens).expect("the tokenizer takes added special tokens");
        self.vocab_size = self.inner.get_vocab_size(true);
    }

    /// The underlying `tokenizers` tokenizer (constrained decoding reads its vocabulary).
    pub(crate) fn hf_tokenizer(&self) -> &Tokenizer {
        &self.inner
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The chat template, or the error a chat prompt gets for a model without one.
    pub fn require_chat_template(&self) -> Result<&ChatTemplate> {
        self.chat_template.as_ref().ok_or_else(|| {
            Error::config(
                "this model has no chat template (tokenizer.chat_template); pass the prompt as a plain string",
            )
        })
    }

    /// A draft model may propose for this (target) tokenizer only if its vocabulary is the same
    /// or a prefix of it (a target with extra padded entries). `draft_path` names the draft file in
    /// the error.
    pub fn check_draft_compatible(&self, draft: &TextTokenizer, draft_path: &str) -> Result<()> {
        for id in 0..draft.vocab_size as u32 {
            let (target_text, draft_text) = (self.token_text(id), draft.token_text(id));
            if target_text != draft_text {
                let shown = |t: Option<String>| t.map_or_else(|| "<none>".to_string(), |t| format!("{t:?}"));
                return Err(Error::TokenizerMismatch(format!(
                    "the draft model {draft_path} does not share the target's tokenizer: token id {id} is {} \
                     in the draft but {} in the target (draft vocabulary {}, target {}); use a draft from \
                     the target's model family, or a model-free method such as 'ngram' or 'suffix'",
                    shown(draft_text),
                    shown(target_text),
                    draft.vocab_size,
                    self.vocab_size
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    /// A tiny SentencePiece ("llama") vocabulary: control tokens, 256 byte tokens, and pieces.
    fn spm_gguf(dir: &std::path::Path) -> std::path::PathBuf {
        let pieces = [
            ("▁", -1.0),
            ("a", -2.0),
            ("b", -2.5),
            ("c", -3.0),
            ("▁a", -1.5),
            ("ab", -1.2),
            ("▁ab", -0.5),
            ("bc", -0.8),
            ("abc", -0.9),
            ("▁c", -1.1),
        ];
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2i32, 3, 3];
        let mut scores = vec![0f32; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (p, s) in pieces {
            tokens.push(p.into());
            types.push(1);
            scores.push(s);
        }
        let path = dir.join("spm.gguf");
        let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
        let metadata = [
            ("general.architecture", Value::String("llama".into())),
            ("tokenizer.ggml.model", Value::String("llama".into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
            ("tokenizer.ggml.scores", Value::Array(scores.into_iter().map(Value::F32).collect())),
            ("tokenizer.ggml.bos_token_id", Value::U32(1)),
            ("tokenizer.ggml.eos_token_id", Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ];
        let refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let mut file = std::fs::File::create(&path).unwrap();
        gguf_file::write(&mut file, &refs, &[]).unwrap();
        path
    }

    /// llama.cpp's SPM algorithm: repeatedly merge the adjacent pair whose concatenation is the
    /// highest-scoring vocabulary piece (leftmost on ties); leftovers become byte tokens.
    fn reference_spm(text: &str, vocab: &[String], scores: &[f32]) -> Vec<u32> {
        let id = |s: &str| vocab.iter().position(|t| t == s);
        let normalized = format!("▁{}", text.replace(' ', "▁"));
        let mut symbols: Vec<String> = normalized.chars().map(|c| c.to_string()).collect();
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..symbols.len().saturating_sub(1) {
                if let Some(t) = id(&format!("{}{}", symbols[i], symbols[i + 1])) {
                    if best.is_none_or(|(s, _)| scores[t] > s) {
                        best = Some((scores[t], i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        symbols
            .iter()
            .flat_map(|s| match id(s) {
                Some(t) => vec![t as u32],
                None => s.bytes().map(|b| id(&format!("<0x{b:02X}>")).unwrap() as u32).collect(),
            })
            .collect()
    }

    #[test]
    fn sentencepiece_matches_the_reference_algorithm() {
        let dir = std::env::temp_dir().join(format!("specrs-spm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gguf = GgufFile::open(spm_gguf(&dir)).unwrap();
        let tok = TextTokenizer::from_gguf(&gguf).unwrap();
        let vocab: Vec<String> = (0..tok.vocab_size() as u32).map(|i| tok.token_text(i).unwrap()).collect();
        let scores: Vec<f32> = match gguf.metadata().get("tokenizer.ggml.scores") {
            Some(Value::Array(a)) => a.iter().map(|v| v.to_f32().unwrap()).collect(),
            _ => unreachable!(),
        };
        let alphabet = ['a', 'b', 'c', ' ', 'x', 'é'];
        let mut state = 12345u32;
        for _ in 0..300 {
            let len = 1 + (state % 9) as usize;
            let text: String = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    alphabet[(state >> 16) as usize % alphabet.len()]
                })
                .collect();
            let ours = tok.encode(&text, true).unwrap();
            let mut want = vec![1u32]; // BOS: SentencePiece models add it by default
            want.extend(reference_spm(&text, &vocab, &scores));
            assert_eq!(ours, want, "text {text:?}");
            assert_eq!(tok.decode(&ours, true).unwrap(), text, "round trip of {text:?}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: fewer scores than tokens indexed past the scores.
    #[test]
    fn fewer_scores_than_tokens_is_an_error() {
        let dir = std::env::temp_dir().join(format!("specrs-spm-scores-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = spm_gguf(&dir);
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut metadata: Vec<(String, Value)> = content.metadata.into_iter().collect();
        for (key, value) in metadata.iter_mut() {
            if key == "tokenizer.ggml.scores" {
                *value = Value::Array(vec![Value::F32(0.0); 30]);
            }
        }
        let refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();
        let err = TextTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).err().expect("loaded");
        assert!(matches!(err, Error::ModelLoad(_)), "{err:?}");
        assert!(err.to_string().contains("30 token scores for 269 tokens"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    // Found by fuzz/fuzz_targets/hf_dir.rs: the tokenizers crate panicked (an `expect` in its
    // decoder deserializer) on a tokenizer.json that is not valid JSON.
    #[test]
    fn a_malformed_tokenizer_json_is_an_error_not_a_panic() {
        let dir = std::env::temp_dir().join(format!("specrs-bad-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), r#"{"decoder": {"type": }}"#).unwrap();
        let err = TextTokenizer::from_hf_dir(&dir).err().expect("a malformed tokenizer.json loaded");
        assert!(matches!(err, Error::ModelLoad(_)), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn unknown_pre_tokenizer_is_an_error_not_a_guess() {
        assert!(pre_tokenizer_regexes("smollm").is_some());
        assert!(pre_tokenizer_regexes("made-up-pre").is_none());
    }
}
