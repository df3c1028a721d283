//! Python classes: `Engine`, `SamplingParams`, `Stream`, `Tokenizer`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{IntoPyArray, PyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList};
use specrs_core::chat_template::ChatMessage;
use specrs_core::constraint::GrammarSpec;
use specrs_core::costs::Spread;
use specrs_core::engine::{Generation, StopReason, TokenLogprobs};
use specrs_core::kv_cache::KvLayout;
use specrs_core::metrics::{
    expected_speedup_refined, expected_speedup_textbook, verify_cost_at, RequestMetrics, SpecDecodeMetrics,
};
use specrs_core::model::llama_config::LlamaConfig;
use specrs_core::model::{LogitRows, SeqRows, Tap};
use specrs_core::proposer::Proposer;
use specrs_core::tokenizer::TextTokenizer;
use specrs_core::{Engine, SamplingParams, Session, Speculation, SpeculativeConfig};

use crate::errors::{catch_panic, guard, lock_recovering, panic_error, run_detached, to_py};
use crate::proposer::PyProposer;
use crate::spec_config::config_arg;
use crate::testing::PyTestingPanickingProposer;

/// A numeric argument as Python passed it (None: left out), checked against its range before it is
/// converted: Python ints are unbounded, and PyO3's own conversion would raise `OverflowError`
/// (a 500 in the server) instead of a `ConfigError` that names the field and its range.
pub struct NumberArg<'py>(Option<Bound<'py, PyAny>>);

impl<'a, 'py> FromPyObject<'a, 'py> for NumberArg<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Some(obj.to_owned())))
    }
}

/// How an out-of-range Python int reads in a message (str() of a huge int itself fails).
fn describe_int(value: &Bound<'_, PyAny>) -> String {
    match value.str() {
        Ok(text) if text.to_string().len() <= 40 => text.to_string(),
        _ => {
            let bits = value.call_method0("bit_length").and_then(|b| b.extract::<u64>()).unwrap_or(0);
            let sign = if value.lt(0).unwrap_or(false) { "-" } else { "" };
            format!("{sign}an integer of {bits} bits")
        }
    }
}

impl NumberArg<'_> {
    /// An integer in `0..=max` (`default` when left out); ints outside it are a ConfigError,
    /// other types PyO3's usual TypeError.
    fn integer(&self, name: &str, default: u64, max: u64, fix: &str) -> PyResult<u64> {
        let Some(value) = &self.0 else { return Ok(default) };
        if value.is_instance_of::<PyInt>() && (value.lt(0)? || value.gt(max)?) {
            return Err(to_py(specrs_core::Error::config(format!(
                "{name} must be an integer in 0..={max} (got {}); {fix}",
                describe_int(value)
            ))));
        }
        value.extract::<u64>()
    }

    /// A number as f32 (`default` when left out); an int too large for a float is a ConfigError
    /// (range checks of the value itself are `SamplingParams::validate`'s).
    fn number(&self, name: &str, default: f32) -> PyResult<f32> {
        let Some(value) = &self.0 else { return Ok(default) };
        match value.extract::<f64>() {
            Ok(v) => Ok(v as f32),
            Err(_) if value.is_instance_of::<PyInt>() => Err(to_py(specrs_core::Error::config(format!(
                "{name} must be a finite number (got {}, too large for a float)",
                describe_int(value)
            )))),
            Err(e) => Err(e),
        }
    }
}

/// The largest max_tokens and top_k accepted (i64::MAX, what the old `i64` arguments took).
const MAX_COUNT_ARG: u64 = i64::MAX as u64;

/// vLLM's `SamplingParams` fields specrs does not have, each with its default (accepted, as it
/// changes nothing) and what to do instead. Any other unknown keyword is Python's TypeError.
const REFUSED_VLLM_FIELDS: [(&str, &str); 8] = [
    ("best_of", "specrs returns the n samples it draws (vLLM V1 dropped best_of too); pass n"),
    ("detokenize", "specrs always decodes the text (stop strings need it); leave detokenize out"),
    (
        "logits_processors",
        "Python logits processors cannot run inside the Rust core; use logit_bias, allowed_token_ids, bad_words, \
         the penalties or a grammar (json_schema, regex, grammar, choice)",
    ),
    ("output_kind", "use Engine.stream for text as it is generated, Engine.generate for the whole output"),
    ("guided_decoding", "pass the grammar itself: json_schema=, json_object=True, regex=, grammar= or choice="),
    ("structured_outputs", "pass the grammar itself: json_schema=, json_object=True, regex=, grammar= or choice="),
    ("extra_args", "specrs has no custom per-request extensions; leave extra_args out"),
    ("prompt_logprobs", "specrs returns the logprobs of generated tokens only (logprobs=); leave prompt_logprobs out"),
];

/// A vLLM field of `REFUSED_VLLM_FIELDS` at its default: None, or `detokenize=True`, or
/// `best_of` equal to 1.
fn is_vllm_default(name: &str, value: &Bound<'_, PyAny>) -> bool {
    value.is_none()
        || (name == "detokenize" && value.is_truthy().unwrap_or(false) && value.is_instance_of::<pyo3::types::PyBool>())
        || (name == "best_of" && value.extract::<u64>().is_ok_and(|n| n == 1))
}

/// Refuses `kwargs` (the keywords `SamplingParams` does not name): a vLLM field specrs does not
/// have is a ConfigError naming it unless it is at vLLM's default; anything else a TypeError.
fn refuse_other_fields(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let Some(kwargs) = kwargs else { return Ok(()) };
    for (key, value) in kwargs.iter() {
        let name: String = key.extract()?;
        match REFUSED_VLLM_FIELDS.iter().find(|(field, _)| *field == name) {
            Some(_) if is_vllm_default(&name, &value) => {}
            Some((field, instead)) => {
                return Err(to_py(specrs_core::Error::config(format!(
                    "SamplingParams field {field} is vLLM's, and specrs does not support it: {instead}"
                ))))
            }
            None => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "SamplingParams() got an unexpected keyword argument '{name}'"
                )))
            }
        }
    }
    Ok(())
}

/// `stop` as vLLM takes it: a string or a list of strings.
fn stop_arg(stop: Option<Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    match stop {
        None => Ok(Vec::new()),
        Some(stop) if stop.is_instance_of::<pyo3::types::PyString>() => Ok(vec![stop.extract()?]),
        Some(stop) => stop.extract::<Vec<String>>().map_err(|_| {
            to_py(specrs_core::Error::config(format!(
                "stop must be a string or a list of strings (got {})",
                stop.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
            )))
        }),
    }
}

/// `truncate_prompt_tokens`: None, an integer >= 1, or -1 (the model's context); the range is
/// `SamplingParams::validate`'s, a Python int past 64 bits is refused here.
fn truncate_arg(value: Option<Bound<'_, PyAny>>) -> PyResult<Option<i64>> {
    let Some(value) = value else { return Ok(None) };
    if value.is_instance_of::<PyInt>() {
        return value.extract::<i64>().map(Some).map_err(|_| {
            to_py(specrs_core::Error::config(format!(
                "truncate_prompt_tokens must be an integer >= 1 or -1 (got {})",
                describe_int(&value)
            )))
        });
    }
    value.extract::<i64>().map(Some)
}

#[pyclass(name = "SamplingParams", module = "specrs._specrs", frozen)]
pub struct PySamplingParams {
    pub(crate) inner: SamplingParams,
}

#[pymethods]
impl PySamplingParams {
    #[new]
    #[pyo3(
        signature = (max_tokens=NumberArg(None), temperature=NumberArg(None), top_k=NumberArg(None),
                     top_p=NumberArg(None), min_p=NumberArg(None), seed=None, ignore_eos=false,
                     presence_penalty=NumberArg(None), frequency_penalty=NumberArg(None),
                     repetition_penalty=NumberArg(None), logit_bias=None, min_tokens=NumberArg(None),
                     stop_token_ids=None, logprobs=None, json_schema=None, json_object=false, regex=None,
                     grammar=None, choice=None, n=NumberArg(None), stop=None, include_stop_str_in_output=false,
                     skip_special_tokens=true, spaces_between_special_tokens=true, truncate_prompt_tokens=None,
                     bad_words=None, allowed_token_ids=None, **kwargs),
        text_signature = "(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, ignore_eos=False, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_tokens=0, stop_token_ids=None, logprobs=None, json_schema=None, json_object=False, regex=None, grammar=None, choice=None, n=1, stop=None, include_stop_str_in_output=False, skip_special_tokens=True, spaces_between_special_tokens=True, truncate_prompt_tokens=None, bad_words=None, allowed_token_ids=None, **kwargs)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_tokens: NumberArg<'_>,
        temperature: NumberArg<'_>,
        top_k: NumberArg<'_>,
        top_p: NumberArg<'_>,
        min_p: NumberArg<'_>,
        seed: Option<NumberArg<'_>>,
        ignore_eos: bool,
        presence_penalty: NumberArg<'_>,
        frequency_penalty: NumberArg<'_>,
        repetition_penalty: NumberArg<'_>,
        logit_bias: Option<Bound<'_, PyDict>>,
        min_tokens: NumberArg<'_>,
        stop_token_ids: Option<Bound<'_, PyAny>>,
        logprobs: Option<NumberArg<'_>>,
        json_schema: Option<Bound<'_, PyAny>>,
        json_object: bool,
        regex: Option<String>,
        grammar: Option<String>,
        choice: Option<Vec<String>>,
        n: NumberArg<'_>,
        stop: Option<Bound<'_, PyAny>>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        truncate_prompt_tokens: Option<Bound<'_, PyAny>>,
        bad_words: Option<Vec<String>>,
        allowed_token_ids: Option<Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        refuse_other_fields(kwargs)?;
        let defaults = SamplingParams::default();
        let seed = match seed {
            Some(seed) => Some(seed.integer("seed", 0, u64::MAX, "pass a seed that fits in 64 bits")?),
            None => None,
        };
        let logit_bias = match logit_bias {
            None => Vec::new(),
            Some(bias) => bias
                .iter()
                .map(|(token, value)| {
                    let token = NumberArg(Some(token)).integer(
                        "logit_bias token id",
                        0,
                        u64::from(u32::MAX),
                        "keys are token ids",
                    )? as u32;
                    Ok((token, NumberArg(Some(value)).number("logit_bias", 0.0)?))
                })
                .collect::<PyResult<Vec<_>>>()?,
        };
        let stop_token_ids = match stop_token_ids {
            None => Vec::new(),
            Some(ids) => token_ids_arg(&ids, "stop_token_ids entry")?,
        };
        let logprobs = match logprobs {
            Some(n) => Some(n.integer("logprobs", 0, MAX_COUNT_ARG, "ask for 0..=20 alternatives")? as usize),
            None => None,
        };
        let inner = SamplingParams {
            max_tokens: max_tokens.integer(
                "max_tokens",
                defaults.max_tokens as u64,
                MAX_COUNT_ARG,
                "pass a positive number of tokens",
            )? as usize,
            temperature: temperature.number("temperature", defaults.temperature)?,
            top_k: top_k_arg(top_k)?,
            top_p: top_p.number("top_p", defaults.top_p)?,
            min_p: min_p.number("min_p", defaults.min_p)?,
            seed,
            ignore_eos,
            presence_penalty: presence_penalty.number("presence_penalty", 0.0)?,
            frequency_penalty: frequency_penalty.number("frequency_penalty", 0.0)?,
            repetition_penalty: repetition_penalty.number("repetition_penalty", 1.0)?,
            logit_bias,
            min_tokens: min_tokens.integer("min_tokens", 0, MAX_COUNT_ARG, "use 0 to disable it")? as usize,
            stop_token_ids,
            logprobs,
            grammar: grammar_arg(py, json_schema, json_object, regex, grammar, choice)?,
            n: n.integer("n", 1, MAX_COUNT_ARG, "ask for 1..=128 samples")? as usize,
            stop: stop_arg(stop)?,
            include_stop_str_in_output,
            skip_special_tokens,
            spaces_between_special_tokens,
            truncate_prompt_tokens: truncate_arg(truncate_prompt_tokens)?,
            bad_words: bad_words.unwrap_or_default(),
            allowed_token_ids: match allowed_token_ids {
                None => None,
                Some(ids) => Some(token_ids_arg(&ids, "allowed_token_ids entry")?),
            },
        };
        guard(|| inner.validate()).map_err(to_py)?;
        Ok(Self { inner })
    }

    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens
    }
    #[getter]
    fn temperature(&self) -> f32 {
        self.inner.temperature
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.inner.top_k
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.inner.top_p
    }
    #[getter]
    fn min_p(&self) -> f32 {
        self.inner.min_p
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.inner.seed
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.inner.ignore_eos
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.inner.presence_penalty
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.inner.frequency_penalty
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.inner.repetition_penalty
    }
    #[getter]
    fn logit_bias(&self) -> Vec<(u32, f32)> {
        self.inner.logit_bias.clone()
    }
    #[getter]
    fn min_tokens(&self) -> usize {
        self.inner.min_tokens
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.inner.stop_token_ids.clone()
    }
    #[getter]
    fn logprobs(&self) -> Option<usize> {
        self.inner.logprobs
    }
    #[getter]
    fn n(&self) -> usize {
        self.inner.n
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.inner.stop.clone()
    }
    #[getter]
    fn include_stop_str_in_output(&self) -> bool {
        self.inner.include_stop_str_in_output
    }
    #[getter]
    fn skip_special_tokens(&self) -> bool {
        self.inner.skip_special_tokens
    }
    #[getter]
    fn spaces_between_special_tokens(&self) -> bool {
        self.inner.spaces_between_special_tokens
    }
    #[getter]
    fn truncate_prompt_tokens(&self) -> Option<i64> {
        self.inner.truncate_prompt_tokens
    }
    #[getter]
    fn bad_words(&self) -> Vec<String> {
        self.inner.bad_words.clone()
    }
    #[getter]
    fn allowed_token_ids(&self) -> Option<Vec<u32>> {
        self.inner.allowed_token_ids.clone()
    }
    /// The grammar as JSON text (`{"json_schema": ...}`, `{"regex": ...}`, ...), or None.
    #[getter]
    fn grammar_json(&self) -> Option<String> {
        self.inner.grammar.as_ref().map(|g| g.to_json().to_string())
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "SamplingParams(max_tokens={}, temperature={}, top_k={}, top_p={}, min_p={}, seed={}, ignore_eos={}{})",
            p.max_tokens,
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
            p.seed.map_or("None".to_string(), |s| s.to_string()),
            if p.ignore_eos { "True" } else { "False" },
            extra_repr(p)
        )
    }
}

/// The settings past the basic ones that differ from their defaults, for `__repr__`.
fn extra_repr(p: &SamplingParams) -> String {
    let d = SamplingParams::default();
    let mut out = String::new();
    for (name, value, default) in [
        ("presence_penalty", p.presence_penalty, d.presence_penalty),
        ("frequency_penalty", p.frequency_penalty, d.frequency_penalty),
        ("repetition_penalty", p.repetition_penalty, d.repetition_penalty),
    ] {
        if value != default {
            out.push_str(&format!(", {name}={value}"));
        }
    }
    if !p.logit_bias.is_empty() {
        let items: Vec<String> = p.logit_bias.iter().map(|(t, b)| format!("{t}: {b}")).collect();
        out.push_str(&format!(", logit_bias={{{}}}", items.join(", ")));
    }
    if p.min_tokens > 0 {
        out.push_str(&format!(", min_tokens={}", p.min_tokens));
    }
    if !p.stop_token_ids.is_empty() {
        out.push_str(&format!(", stop_token_ids={:?}", p.stop_token_ids));
    }
    if let Some(n) = p.logprobs {
        out.push_str(&format!(", logprobs={n}"));
    }
    if p.n != 1 {
        out.push_str(&format!(", n={}", p.n));
    }
    if !p.stop.is_empty() {
        out.push_str(&format!(", stop={:?}", p.stop));
    }
    for (name, value, default) in [
        ("include_stop_str_in_output", p.include_stop_str_in_output, d.include_stop_str_in_output),
        ("skip_special_tokens", p.skip_special_tokens, d.skip_special_tokens),
        ("spaces_between_special_tokens", p.spaces_between_special_tokens, d.spaces_between_special_tokens),
    ] {
        if value != default {
            out.push_str(&format!(", {name}={}", if value { "True" } else { "False" }));
        }
    }
    if let Some(k) = p.truncate_prompt_tokens {
        out.push_str(&format!(", truncate_prompt_tokens={k}"));
    }
    if !p.bad_words.is_empty() {
        out.push_str(&format!(", bad_words={:?}", p.bad_words));
    }
    if let Some(ids) = &p.allowed_token_ids {
        out.push_str(&format!(", allowed_token_ids={ids:?}"));
    }
    if let Some(grammar) = &p.grammar {
        out.push_str(&format!(", grammar={}", grammar.to_json()));
    }
    out
}

/// `top_k`: 0 or vLLM's -1 turn it off; otherwise the number of tokens kept.
fn top_k_arg(top_k: NumberArg<'_>) -> PyResult<usize> {
    if let Some(value) = &top_k.0 {
        if value.is_instance_of::<PyInt>() && value.eq(-1)? {
            return Ok(0);
        }
    }
    Ok(top_k.integer("top_k", 0, MAX_COUNT_ARG, "use 0 or -1 to disable top-k")? as usize)
}

/// The one grammar among `SamplingParams`' grammar arguments (a ConfigError naming them when
/// more than one is given). `json_schema` may be a dict (converted with Python's json module) or
/// a JSON string.
fn grammar_arg(
    py: Python<'_>,
    json_schema: Option<Bound<'_, PyAny>>,
    json_object: bool,
    regex: Option<String>,
    grammar: Option<String>,
    choice: Option<Vec<String>>,
) -> PyResult<Option<GrammarSpec>> {
    let mut given: Vec<(&str, serde_json::Value)> = Vec::new();
    if let Some(schema) = json_schema {
        let text: String = if let Ok(text) = schema.extract::<String>() {
            text
        } else {
            // Python's encoder recurses (with a recursion check) once per level.
            let dumped = py.import("json")?.call_method1("dumps", (schema,)).map_err(|e| {
                if e.is_instance_of::<pyo3::exceptions::PyRecursionError>(py) {
                    let limit = specrs_core::constraint::limits::MAX_JSON_NESTING;
                    to_py(specrs_core::Error::config(format!(
                        "json_schema nests arrays and objects too deeply for Python's JSON encoder, far past \
                         specrs' limit MAX_JSON_NESTING = {limit}; flatten it"
                    )))
                } else {
                    e
                }
            })?;
            dumped.extract()?
        };
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| to_py(specrs_core::Error::config(format!("json_schema is not valid JSON: {e}"))))?;
        given.push(("json_schema", value));
    }
    if json_object {
        given.push(("json_object", serde_json::Value::Bool(true)));
    }
    if let Some(regex) = regex {
        given.push(("regex", regex.into()));
    }
    if let Some(grammar) = grammar {
        given.push(("grammar", grammar.into()));
    }
    if let Some(choice) = choice {
        given.push(("choice", choice.into()));
    }
    match given.len() {
        0 => Ok(None),
        1 => {
            let (key, value) = given.pop().expect("one entry");
            let spec = serde_json::json!({ key: value });
            guard(|| GrammarSpec::from_json(&spec)).map(Some).map_err(to_py)
        }
        _ => {
            let names: Vec<&str> = given.iter().map(|(k, _)| *k).collect();
            Err(to_py(specrs_core::Error::config(format!(
                "give at most one of json_schema, json_object, regex, grammar, choice (got {})",
                names.join(", ")
            ))))
        }
    }
}

#[pyclass(name = "Tokenizer", module = "specrs._specrs", frozen)]
pub struct PyTokenizer {
    inner: Arc<TextTokenizer>,
}

#[pymethods]
impl PyTokenizer {
    /// Token ids of `text`; special tokens written in the text are recognized.
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let tok = self.inner.clone();
        let text = text.to_string();
        run_detached(py, move || tok.encode(&text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn decode(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids_arg(ids, "token id")?;
        let tok = self.inner.clone();
        run_detached(py, move || tok.decode(&ids, skip_special_tokens))
    }

    #[getter]
    fn vocab_size(&self) -> PyResult<usize> {
        guard(|| Ok(self.inner.vocab_size())).map_err(to_py)
    }
    #[getter]
    fn eos_token_ids(&self) -> PyResult<Vec<u32>> {
        guard(|| Ok(self.inner.eos_token_ids().to_vec())).map_err(to_py)
    }
    #[getter]
    fn bos_token_id(&self) -> PyResult<Option<u32>> {
        guard(|| Ok(self.inner.bos_token_id())).map_err(to_py)
    }
}

fn metrics_dict<'py>(py: Python<'py>, m: &RequestMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_prompt_tokens", m.num_prompt_tokens)?;
    d.set_item("num_generated_tokens", m.num_generated_tokens)?;
    d.set_item("num_forward_passes", m.num_forward_passes)?;
    d.set_item("ttft_s", m.ttft_s)?;
    d.set_item("e2e_s", m.e2e_s)?;
    d.set_item("itl_s_mean", m.itl_s_mean)?;
    d.set_item("itl_s_p50", m.itl_s_p50)?;
    d.set_item("itl_s_p99", m.itl_s_p99)?;
    d.set_item("decode_tokens_per_s", m.decode_tokens_per_s)?;
    d.set_item("prefill_tokens_per_s", m.prefill_tokens_per_s)?;
    d.set_item("spec_method", m.spec_method.as_deref())?;
    d.set_item("num_speculative_tokens", m.num_speculative_tokens)?;
    d.set_item("verify_cost_source", m.verify_cost_source)?;
    d.set_item("draft_cost_source", m.draft_cost_source)?;
    d.set_item("idle_reason", m.idle_reason.as_deref())?;
    spec_items(&d, &m.spec)?;
    // "auto": each drafter's drafts, draft tokens and accepted tokens, by name.
    let drafters = PyDict::new(py);
    for counts in &m.drafters {
        let c = PyDict::new(py);
        c.set_item("num_drafts", counts.num_drafts)?;
        c.set_item("num_draft_tokens", counts.num_draft_tokens)?;
        c.set_item("num_accepted_tokens", counts.num_accepted_tokens)?;
        drafters.set_item(counts.name, c)?;
    }
    d.set_item("drafters", drafters)?;
    Ok(d)
}

/// vLLM-named acceptance counters and the decode time split.
fn spec_items(d: &Bound<'_, PyDict>, s: &SpecDecodeMetrics) -> PyResult<()> {
    d.set_item("num_drafts", s.num_drafts)?;
    d.set_item("num_draft_tokens", s.num_draft_tokens)?;
    d.set_item("num_accepted_tokens", s.num_accepted_tokens)?;
    d.set_item("num_accepted_tokens_per_pos", &s.num_accepted_tokens_per_pos)?;
    d.set_item("mean_acceptance_length", s.mean_acceptance_length())?;
    d.set_item("acceptance_rate", s.acceptance_rate())?;
    d.set_item("acceptance_rate_per_pos", s.acceptance_rate_per_pos())?;
    d.set_item("num_decode_steps", s.num_decode_steps)?;
    d.set_item("propose_s", s.propose_s)?;
    d.set_item("forward_s", s.forward_s)?;
    d.set_item("verify_s", s.verify_s)?;
    d.set_item("num_tree_drafts", s.num_tree_drafts)?;
    d.set_item("num_tree_draft_tokens", s.num_tree_draft_tokens)?;
    d.set_item("num_tree_accepted_tokens", s.num_tree_accepted_tokens)?;
    d.set_item("tree_depth_sum", s.tree_depth_sum)?;
    d.set_item("num_grammar_draft_tokens", s.num_grammar_draft_tokens)?;
    d.set_item("num_grammar_accepted_tokens", s.num_grammar_accepted_tokens)?;
    d.set_item("num_grammar_cut_tokens", s.num_grammar_cut_tokens)?;
    // Decode steps with speculation on that verified no draft, and why (`IdleReason`).
    d.set_item("num_idle_steps", s.num_idle_steps())?;
    let idle = PyDict::new(d.py());
    for (reason, count) in s.idle_steps_by_reason() {
        idle.set_item(reason, count)?;
    }
    d.set_item("idle_steps", idle)?;
    Ok(())
}

/// A figure's spread as `{"ratio", "tries"}` (None: not timed).
fn spread_dict<'py>(py: Python<'py>, spread: Option<Spread>) -> PyResult<Option<Bound<'py, PyDict>>> {
    spread
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("ratio", s.ratio)?;
            d.set_item("tries", s.tries)?;
            Ok(d)
        })
        .transpose()
}

/// Tokens' logprobs as `[{"token_id", "logprob", "top_logprobs": [(token_id, logprob), ...]}]`.
pub(crate) fn logprobs_list<'py>(py: Python<'py>, logprobs: &[TokenLogprobs]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for entry in logprobs {
        let d = PyDict::new(py);
        d.set_item("token_id", entry.token_id)?;
        d.set_item("logprob", entry.logprob)?;
        d.set_item("top_logprobs", &entry.top)?;
        list.append(d)?;
    }
    Ok(list)
}

pub(crate) fn generation_dict<'py>(py: Python<'py>, g: &Generation) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("text", &g.text)?;
    d.set_item("token_ids", &g.token_ids)?;
    d.set_item("prompt_token_ids", &g.prompt_token_ids)?;
    match &g.logprobs {
        Some(logprobs) => d.set_item("logprobs", logprobs_list(py, logprobs)?)?,
        None => d.set_item("logprobs", py.None())?,
    }
    d.set_item("finish_reason", g.finish_reason.map(|r| r.as_str()))?;
    match &g.stop_reason {
        Some(StopReason::Text(text)) => d.set_item("stop_reason", text)?,
        Some(StopReason::TokenId(token)) => d.set_item("stop_reason", token)?,
        None => d.set_item("stop_reason", py.None())?,
    }
    d.set_item("metrics", metrics_dict(py, &g.metrics)?)?;
    Ok(d)
}

/// Expected speedup over plain decoding: textbook (1 - a^(k+1)) / ((1 - a)(1 + c)), or the refined
/// form with the verify cost v = t(k+1)/t(1) in place of 1. `verify_cost_ratio` is v itself or the
/// measured curve `[v(1), v(2), ...]`, read at k + 1 (interpolated for a fractional k).
#[pyfunction]
#[pyo3(signature = (acceptance_rate, num_speculative_tokens, draft_cost=0.0, verify_cost_ratio=None))]
pub fn expected_speedup(
    acceptance_rate: f64,
    num_speculative_tokens: f64,
    draft_cost: f64,
    verify_cost_ratio: Option<&Bound<'_, PyAny>>,
) -> PyResult<f64> {
    let bad = |msg: &str| to_py(specrs_core::Error::config(msg.to_string()));
    if !(0.0..=1.0).contains(&acceptance_rate) || num_speculative_tokens < 0.0 || draft_cost < 0.0 {
        return Err(bad(
            "expected_speedup needs 0 <= acceptance_rate <= 1, num_speculative_tokens >= 0 and draft_cost >= 0",
        ));
    }
    let Some(verify) = verify_cost_ratio else {
        return guard(|| Ok(expected_speedup_textbook(acceptance_rate, num_speculative_tokens, draft_cost)))
            .map_err(to_py);
    };
    let v = match verify.extract::<f64>() {
        Ok(v) => v,
        Err(_) => {
            let curve: Vec<f64> = verify
                .extract()
                .map_err(|_| bad("verify_cost_ratio must be a number or a list of numbers [v(1), v(2), ...]"))?;
            if curve.is_empty() {
                return Err(bad("verify_cost_ratio is an empty list; pass the measured curve [v(1), v(2), ...]"));
            }
            guard(|| Ok(verify_cost_at(&curve, num_speculative_tokens))).map_err(to_py)?
        }
    };
    guard(|| Ok(expected_speedup_refined(acceptance_rate, num_speculative_tokens, draft_cost, v))).map_err(to_py)
}

/// Writes the GGUF model `src` requantized to `quantization` ("q4_0", "q2_k", ...) at `dst`;
/// returns `(tensor, from_type, to_type)` for every tensor.
#[pyfunction]
pub fn requantize(
    py: Python<'_>,
    src: String,
    dst: String,
    quantization: String,
) -> PyResult<Vec<(String, String, String)>> {
    let report = run_detached(py, move || {
        let dtype = specrs_core::quantize::parse_quant_type(&quantization)?;
        specrs_core::quantize::requantize_gguf(std::path::Path::new(&src), std::path::Path::new(&dst), dtype)
    })?;
    let name = specrs_core::quantize::quant_type_name;
    Ok(report.into_iter().map(|t| (t.name, name(t.from), name(t.to))).collect())
}

/// Where specrs keeps what it writes for later processes (cost curves, quantized drafts,
/// assembled models): `$SPECRS_CACHE_DIR`, else `$XDG_CACHE_HOME/specrs`, else `~/.cache/specrs`.
#[pyfunction]
pub fn cache_dir() -> String {
    specrs_core::engine::cache_dir().display().to_string()
}

/// The KV layout `kv_layout` stands for on `device`: "auto" is "paged" on CUDA and "contiguous"
/// on the CPU (`KvLayout::resolve_name`); other names as they are.
#[pyfunction]
pub fn resolve_kv_layout(kv_layout: &str, device: &str) -> String {
    KvLayout::resolve_name(kv_layout, device).to_string()
}

/// Bytes read per second on `device`: the best of `repeats` passes of a read-only reduction over
/// `num_bytes` (`bandwidth::read_bandwidth`; a decode step's roof).
#[pyfunction]
#[pyo3(signature = (device="cpu", num_bytes=1 << 30, repeats=10))]
pub fn read_bandwidth(py: Python<'_>, device: &str, num_bytes: usize, repeats: usize) -> PyResult<f64> {
    let device = device.to_string();
    run_detached(py, move || {
        specrs_core::bandwidth::read_bandwidth(&specrs_core::engine::parse_device(&device)?, num_bytes, repeats)
    })
}

/// The candle decoder's own kernels on random inputs on `device` against their CPU references:
/// the fused ops (`model/candle/fused.rs`) and the paged KV write and attention
/// (`model/candle/paged_attention.rs`): {op and dtype: {"max_abs_diff", "tolerance", "ok"}} (the
/// device check's).
#[pyfunction]
#[pyo3(signature = (device="cpu"))]
pub fn check_decoder_kernels<'py>(py: Python<'py>, device: &str) -> PyResult<Bound<'py, PyDict>> {
    let device = device.to_string();
    let report = run_detached(py, move || {
        specrs_core::model::candle::check_kernels_against_references(&specrs_core::engine::parse_device(&device)?)
    })?;
    let d = PyDict::new(py);
    for (name, diff, tolerance) in report {
        let row = PyDict::new(py);
        row.set_item("max_abs_diff", diff)?;
        row.set_item("tolerance", tolerance)?;
        row.set_item("ok", diff <= tolerance)?;
        d.set_item(name, row)?;
    }
    Ok(d)
}

#[pyclass(name = "Engine", module = "specrs._specrs", frozen)]
pub struct PyEngine {
    pub(crate) inner: Arc<Engine>,
}

#[pymethods]
impl PyEngine {
    #[new]
    /// `kv_layout`: "auto" (paged on CUDA, contiguous on the CPU), "contiguous" or "paged" (blocks
    /// of `kv_block_size` positions from a pool of `max_kv_tokens` positions, by default the
    /// model's context; None: `DEFAULT_KV_BLOCK_SIZE`): `KvLayout::named`.
    #[pyo3(signature = (model_path, device="cpu", max_model_len=None, kv_layout="auto", kv_block_size=None, max_kv_tokens=None))]
    fn new(
        py: Python<'_>,
        model_path: String,
        device: &str,
        max_model_len: Option<usize>,
        kv_layout: &str,
        kv_block_size: Option<usize>,
        max_kv_tokens: Option<usize>,
    ) -> PyResult<Self> {
        let (device, kv_layout) = (device.to_string(), kv_layout.to_string());
        let kv_block_size = kv_block_size.unwrap_or(KvLayout::DEFAULT_BLOCK_SIZE);
        let engine = run_detached(py, move || {
            // Named before the weights load, so a bad layout fails fast.
            KvLayout::named(&kv_layout, &device, kv_block_size, max_kv_tokens, 1)?;
            let engine = Engine::load_capped(&model_path, &device, max_model_len)?;
            let context_length = engine.model().info().context_length;
            engine.with_kv_layout(KvLayout::named(&kv_layout, &device, kv_block_size, max_kv_tokens, context_length)?)
        })?;
        Ok(Self { inner: Arc::new(engine) })
    }

    /// A Llama with seeded random weights: `config_json` uses transformers' LlamaConfig names
    /// ("llama3-8b" for Llama 3 8B's shape); dtype "bf16" | "f16" | "f32"; the KV layout as `new`'s.
    #[staticmethod]
    #[pyo3(signature = (config_json, seed=0, dtype="bf16", device="cpu", kv_layout="auto", kv_block_size=None, max_kv_tokens=None))]
    #[allow(clippy::too_many_arguments)] // the model's and the layout's settings, as `new`
    fn random_llama(
        py: Python<'_>,
        config_json: String,
        seed: u64,
        dtype: &str,
        device: &str,
        kv_layout: &str,
        kv_block_size: Option<usize>,
        max_kv_tokens: Option<usize>,
    ) -> PyResult<Self> {
        let (dtype, device, kv_layout) = (dtype.to_string(), device.to_string(), kv_layout.to_string());
        let kv_block_size = kv_block_size.unwrap_or(KvLayout::DEFAULT_BLOCK_SIZE);
        let engine = run_detached(py, move || {
            KvLayout::named(&kv_layout, &device, kv_block_size, max_kv_tokens, 1)?;
            let config = if config_json == "llama3-8b" {
                LlamaConfig::llama3_8b()
            } else {
                LlamaConfig::from_json(&config_json)?
            };
            let engine = Engine::random_llama(config, seed, &dtype, &device)?;
            let context_length = engine.model().info().context_length;
            engine.with_kv_layout(KvLayout::named(&kv_layout, &device, kv_block_size, max_kv_tokens, context_length)?)
        })?;
        Ok(Self { inner: Arc::new(engine) })
    }

    /// The paged KV pool, or None under the contiguous layout: `{"block_size", "num_blocks",
    /// "num_free"}` (blocks no sequence holds).
    #[getter]
    fn kv_pool<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(pool) = self.inner.kv_pool() else { return Ok(None) };
        let dict = PyDict::new(py);
        dict.set_item("block_size", pool.block_size())?;
        dict.set_item("num_blocks", pool.num_blocks())?;
        dict.set_item("num_free", pool.num_free())?;
        Ok(Some(dict))
    }

    #[getter]
    fn tokenizer(&self) -> PyResult<PyTokenizer> {
        guard(|| Ok(PyTokenizer { inner: self.inner.tokenizer().clone() })).map_err(to_py)
    }

    /// Raises ConfigError for what starting a request with `params` would refuse: bad token ids
    /// in logit_bias / stop_token_ids / allowed_token_ids, a bad word that tokenizes to nothing,
    /// or a grammar llguidance cannot compile (its reason).
    fn check_params(&self, py: Python<'_>, params: &PySamplingParams) -> PyResult<()> {
        let engine = self.inner.clone();
        let params = params.inner.clone();
        run_detached(py, move || {
            params.check_token_ids(engine.model().info().vocab_size)?;
            engine.bad_words_token_ids(&params)?;
            engine.check_grammar(&params)
        })
    }

    /// Raises ContextLengthError when a prompt of `prompt_len` tokens leaves no room for an
    /// answer, or (with `max_tokens`) prompt + max_tokens is past the context; `limit_name` is the
    /// field named in the message (`Engine::check_context`).
    #[pyo3(signature = (prompt_len, max_tokens=None, limit_name="max_tokens"))]
    fn check_context(&self, prompt_len: usize, max_tokens: Option<usize>, limit_name: &str) -> PyResult<()> {
        guard(|| self.inner.check_context(prompt_len, max_tokens, limit_name)).map_err(to_py)
    }

    /// The prompt a request with `params` runs on: `prompt_ids` cut to its last
    /// `truncate_prompt_tokens` tokens (-1: the context length), or whole.
    fn request_prompt(&self, prompt_ids: &Bound<'_, PyAny>, params: &PySamplingParams) -> PyResult<Vec<u32>> {
        let prompt_ids = token_ids_arg(prompt_ids, "prompt token id")?;
        guard(|| Ok(self.inner.request_prompt(&prompt_ids, &params.inner).to_vec())).map_err(to_py)
    }

    /// Bytes one single-row decode step reads at `context_len` positions: the weights but the
    /// embedding table, and the KV cache (`CausalLm::step_read_bytes`). Over `read_bandwidth`, the
    /// step's bound.
    fn step_read_bytes(&self, context_len: usize) -> PyResult<usize> {
        guard(|| Ok(self.inner.model().step_read_bytes(context_len))).map_err(to_py)
    }

    /// Model facts: architecture, vocab_size, context_length (after any max_model_len cap),
    /// num_layers, weight_bytes, step_weight_bytes (what one single-row step reads), device,
    /// kernels (the CPU kernel set, or "cuda"), has_chat_template.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (i, weight_bytes, step_weight_bytes, device) = guard(|| {
            let model = self.inner.model();
            let device = format!("{:?}", model.device().location());
            Ok((model.info().clone(), model.weight_bytes(), model.step_weight_bytes(), device))
        })
        .map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("architecture", &i.architecture)?;
        d.set_item("vocab_size", i.vocab_size)?;
        d.set_item("context_length", i.context_length)?;
        d.set_item("num_layers", i.num_layers)?;
        d.set_item("weight_bytes", weight_bytes)?;
        d.set_item("step_weight_bytes", step_weight_bytes)?;
        d.set_item("device", device)?;
        d.set_item("kernels", i.kernels)?;
        d.set_item("has_chat_template", self.inner.tokenizer().chat_template().is_some())?;
        Ok(d)
    }

    /// Prompt text for a list of (role, content) messages, from the model's chat template
    /// (rendered with the GIL released: a long conversation must not hold up other threads).
    #[pyo3(signature = (messages, tools_json=None))]
    fn render_chat(
        &self,
        py: Python<'_>,
        messages: Vec<(String, String)>,
        tools_json: Option<String>,
    ) -> PyResult<String> {
        let (messages, tools) = chat_args(messages, tools_json)?;
        let engine = self.inner.clone();
        run_detached(py, move || engine.render_chat(&messages, tools.as_ref()))
    }

    /// Prompt token ids for a list of (role, content) messages: the chat template's text,
    /// tokenized with special-token text in the messages and tools read as plain text unless
    /// `allow_special_tokens_in_content` (`Engine::chat_prompt_ids`).
    #[pyo3(signature = (messages, tools_json=None, allow_special_tokens_in_content=false))]
    fn chat_prompt_ids(
        &self,
        py: Python<'_>,
        messages: Vec<(String, String)>,
        tools_json: Option<String>,
        allow_special_tokens_in_content: bool,
    ) -> PyResult<Vec<u32>> {
        let (messages, tools) = chat_args(messages, tools_json)?;
        let engine = self.inner.clone();
        run_detached(py, move || engine.chat_prompt_ids(&messages, tools.as_ref(), allow_special_tokens_in_content))
    }

    /// Whether the model's chat template renders a request's tools itself.
    #[getter]
    fn chat_template_renders_tools(&self) -> PyResult<bool> {
        guard(|| self.inner.chat_template_renders_tools()).map_err(to_py)
    }

    /// Every speculative method a config may name.
    #[staticmethod]
    fn speculative_methods() -> Vec<&'static str> {
        specrs_core::spec_config::METHODS.to_vec()
    }

    #[pyo3(signature = (prompt_ids, params, speculative_config=None, proposer=None))]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        prompt_ids: &Bound<'py, PyAny>,
        params: &PySamplingParams,
        speculative_config: Option<&Bound<'py, PyAny>>,
        proposer: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let prompt_ids = token_ids_arg(prompt_ids, "prompt token id")?;
        let config = speculative_config.map(config_arg).transpose()?;
        let speculation = self.speculation(py, config, proposer)?;
        let engine = self.inner.clone();
        let params = params.inner.clone();
        let generation = run_detached(py, move || engine.generate(prompt_ids, params, speculation))?;
        generation_dict(py, &generation)
    }

    #[pyo3(signature = (prompt_ids, params, speculative_config=None, proposer=None, prefill_chunk=None))]
    fn stream(
        &self,
        py: Python<'_>,
        prompt_ids: &Bound<'_, PyAny>,
        params: &PySamplingParams,
        speculative_config: Option<&Bound<'_, PyAny>>,
        proposer: Option<Py<PyAny>>,
        prefill_chunk: Option<usize>,
    ) -> PyResult<PyStream> {
        let prompt_ids = token_ids_arg(prompt_ids, "prompt token id")?;
        let config = speculative_config.map(config_arg).transpose()?;
        let speculation = self.speculation(py, config, proposer)?;
        let engine = self.inner.clone();
        let params = params.inner.clone();
        let session = run_detached(py, move || {
            let mut session = engine.start(prompt_ids, params, speculation)?;
            session.set_prefill_chunk(prefill_chunk)?;
            Ok(session)
        })?;
        Ok(PyStream { state: Mutex::new(StreamState { session, failure: None }) })
    }

    /// Sums over every finished request: vLLM's acceptance counters, TTFT/ITL/tokens/s, the
    /// expected-speedup model on the verification cost curve as it is now (never measured here),
    /// and the grammars compiled and taken from the grammar cache.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.inner.clone();
        let (m, expected) = run_detached(py, move || {
            let m = engine.metrics()?;
            let expected = engine.expected_speedup(&m.spec)?;
            Ok((m, expected))
        })?;
        let d = PyDict::new(py);
        d.set_item("num_requests", m.num_requests)?;
        d.set_item("num_prompt_tokens", m.num_prompt_tokens)?;
        d.set_item("num_generated_tokens", m.num_generated_tokens)?;
        spec_items(&d, &m.spec)?;
        d.set_item("ttft_s_mean", m.ttft_s_mean())?;
        d.set_item("itl_s_mean", m.itl_s_mean())?;
        d.set_item("itl_s_p50", m.itl_s_percentile(0.50))?;
        d.set_item("itl_s_p99", m.itl_s_percentile(0.99))?;
        d.set_item("decode_tokens_per_s", m.decode_tokens_per_s())?;
        d.set_item("num_grammar_compiles", m.num_grammar_compiles)?;
        d.set_item("num_grammar_cache_hits", m.num_grammar_cache_hits)?;
        d.set_item("expected_speedup_textbook", expected.map(|e| e.textbook))?;
        d.set_item("expected_speedup_refined", expected.map(|e| e.refined))?;
        d.set_item("draft_cost", expected.map(|e| e.draft_cost))?;
        d.set_item("verify_cost_ratio", expected.map(|e| e.verify_cost_ratio))?;
        d.set_item("verify_cost_source", expected.map(|e| e.verify_cost_source.as_str()))?;
        Ok(d)
    }

    /// Bytes of target and draft weights, and of the target and draft KV caches of requests in
    /// flight (with the peak since load).
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.inner.clone();
        let m = run_detached(py, move || engine.memory())?;
        let d = PyDict::new(py);
        d.set_item("target_weight_bytes", m.target_weight_bytes)?;
        d.set_item("draft_weight_bytes", m.draft_weight_bytes)?;
        d.set_item("target_kv_bytes", m.target_kv_bytes)?;
        d.set_item("draft_kv_bytes", m.draft_kv_bytes)?;
        d.set_item("peak_target_kv_bytes", m.peak_target_kv_bytes)?;
        d.set_item("peak_draft_kv_bytes", m.peak_draft_kv_bytes)?;
        d.set_item("num_suffix_caches", m.num_suffix_caches)?;
        d.set_item("suffix_cache_bytes", m.suffix_cache_bytes)?;
        Ok(d)
    }

    fn reset_metrics(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.inner.clone();
        run_detached(py, move || engine.reset_metrics())
    }

    /// v(n) = t(n)/t(1) for n = 1..=max_n on a `context_len`-token cache (measured once, cached).
    #[pyo3(signature = (max_n, context_len=512))]
    fn verify_cost_ratios(&self, py: Python<'_>, max_n: usize, context_len: usize) -> PyResult<Vec<f64>> {
        let engine = self.inner.clone();
        let costs = run_detached(py, move || engine.verify_costs(max_n.max(1), context_len))?;
        Ok(costs.iter().map(|t| t / costs[0]).collect())
    }

    /// Loads what `config` (a `SpeculativeConfig` or its JSON text) needs (draft weights) and
    /// queues its adaptive-length costs for the background thread unless known (the disk cache),
    /// so its first request pays for neither: a dict of the costs a request reads now
    /// (`verify_cost_ratios`, `draft_cost` and its unit: per "token" or per "draft"), their
    /// sources and spreads, and `draft_acceptance`: a costly draft's per-token acceptance as this
    /// engine measured it from its first requests (None until then).
    fn prepare<'py>(&self, py: Python<'py>, config: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let config = config_arg(config)?;
        let engine = self.inner.clone();
        let costs = run_detached(py, move || engine.prepare(&config))?;
        let d = PyDict::new(py);
        d.set_item("verify_cost_ratios", costs.verify_cost_ratios)?;
        d.set_item("verify_cost_source", costs.verify_cost_source.as_str())?;
        d.set_item("verify_cost_spread", spread_dict(py, costs.verify_cost_spread)?)?;
        d.set_item("draft_cost", costs.draft_cost.value)?;
        d.set_item("draft_cost_unit", costs.draft_cost.unit.as_str())?;
        d.set_item("draft_cost_source", costs.draft_cost_source.map(|s| s.as_str()))?;
        d.set_item("draft_cost_spread", spread_dict(py, costs.draft_cost_spread)?)?;
        d.set_item("draft_acceptance", costs.draft_acceptance)?;
        Ok(d)
    }

    /// Whether figures nobody measured yet are measured in the background (default true); off,
    /// they stay the nearest figure (an extrapolated curve, a prior draft cost), marked in metrics.
    fn set_measure_on_demand(&self, on: bool) -> PyResult<()> {
        guard(|| {
            self.inner.set_measure_on_demand(on);
            Ok(())
        })
        .map_err(to_py)
    }

    /// Whether the background cost thread writes a stderr line for each figure it measures.
    fn set_log_measurements(&self, on: bool) -> PyResult<()> {
        guard(|| {
            self.inner.set_log_measurements(on);
            Ok(())
        })
        .map_err(to_py)
    }

    /// Captures the target's paged steps as CUDA graphs within `budget_bytes`, or runs them
    /// eagerly (`Engine::set_step_graphs`).
    fn set_step_graphs(&self, enforce_eager: bool, budget_bytes: usize) -> PyResult<()> {
        guard(|| {
            self.inner.set_step_graphs(enforce_eager, budget_bytes);
            Ok(())
        })
        .map_err(to_py)
    }

    /// Where the target's captured steps stand (`GraphStatus`); None for a model that captures
    /// none (the CPU decoder).
    fn step_graph_status<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(status) = guard(|| Ok(self.inner.step_graph_status())).map_err(to_py)? else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("mode", status.mode.label())?;
        d.set_item("budget_bytes", status.budget_bytes)?;
        d.set_item("used_bytes", status.used_bytes)?;
        d.set_item("num_graphs", status.num_graphs)?;
        d.set_item("num_graph_nodes", status.num_graph_nodes)?;
        d.set_item("num_captures", status.num_captures)?;
        d.set_item("num_replays", status.num_replays)?;
        let eager = PyDict::new(py);
        for (reason, n) in &status.num_eager {
            eager.set_item(reason.label(), n)?;
        }
        d.set_item("num_eager", eager)?;
        d.set_item("capture_error", status.capture_error)?;
        Ok(Some(d))
    }

    /// The engine's cost measurements: how many ran in a caller's thread and in the background,
    /// how many failed, what is still queued, and every figure with its source and spread.
    fn cost_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let status = guard(|| Ok(self.inner.cost_status())).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("num_foreground_measurements", status.num_foreground)?;
        d.set_item("num_background_measurements", status.num_background)?;
        d.set_item("num_failed_measurements", status.num_failed)?;
        d.set_item("pending", status.pending)?;
        let figures = PyList::empty(py);
        for (what, source, spread) in status.figures {
            let f = PyDict::new(py);
            f.set_item("what", what)?;
            f.set_item("source", source)?;
            f.set_item("spread", spread_dict(py, spread)?)?;
            figures.append(f)?;
        }
        d.set_item("figures", figures)?;
        Ok(d)
    }

    /// Waits (without the GIL) until the background thread measured everything queued, at most
    /// `timeout_s` seconds (None: no limit); returns whether it did.
    #[pyo3(signature = (timeout_s=None))]
    fn wait_for_costs(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout_s {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(to_py(specrs_core::Error::config(format!(
                    "timeout_s must be a non-negative number of seconds, or None to wait as long as it takes (got {t})"
                ))))
            }
            Some(t) => Some(std::time::Duration::from_secs_f64(t)),
            None => None,
        };
        let engine = self.inner.clone();
        run_detached(py, move || Ok(engine.wait_for_costs(timeout)))
    }

    /// Teacher-forced logits `[len(ids), vocab_size]`: one forward pass, or one forward per entry
    /// of `steps` (token counts summing to len(ids)) over one growing KV cache.
    #[pyo3(signature = (ids, steps=None))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        steps: Option<Vec<usize>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let engine = self.inner.clone();
        let n = ids.len();
        let steps = steps.unwrap_or_else(|| vec![n]);
        let flat = run_detached(py, move || engine.logits_in_steps(&ids, &steps))?;
        let vocab = flat.len().checked_div(n).unwrap_or(0);
        let array = numpy::ndarray::Array2::from_shape_vec((n, vocab), flat)
            .map_err(|e| to_py(specrs_core::Error::Internal(e.to_string())))?;
        Ok(array.into_pyarray(py))
    }

    /// Hidden states of one teacher-forced forward over `ids`: one `[len(ids), hidden_size]`
    /// array per entry of `layers` (an int i: the residual stream after i blocks; "final_norm":
    /// after the final norm).
    #[pyo3(signature = (ids, layers))]
    fn hidden_states<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        layers: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        let taps = taps_arg(&layers)?;
        let engine = self.inner.clone();
        let n = ids.len();
        let width = self.inner.model().info().hidden_size;
        let hidden = run_detached(py, move || engine.hidden_states(&ids, &taps))?;
        hidden.into_iter().map(|rows| array2(py, n, width, rows)).collect()
    }

    /// One forward over several sequences, each `(prefix, tokens, parents, logits)`: `prefix` is
    /// put in the sequence's own fresh cache first, `tokens` are its new rows (a chain, or the
    /// tree `parents` gives: -1 = the prefix, else an earlier token's index), `logits` is "all",
    /// "last" or "none". Returns per sequence its logits `[rows, vocab]` and per layer its hidden
    /// rows `[len(tokens), hidden_size]`.
    #[pyo3(signature = (sequences, layers))]
    #[allow(clippy::type_complexity)]
    fn forward_batch<'py>(
        &self,
        py: Python<'py>,
        sequences: Vec<(Vec<u32>, Vec<u32>, Option<Vec<i32>>, String)>,
        layers: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<(Bound<'py, PyArray2<f32>>, Vec<Bound<'py, PyArray2<f32>>>)>> {
        let taps = taps_arg(&layers)?;
        let mut seqs = Vec::with_capacity(sequences.len());
        for (s, (prefix, tokens, parents, logits)) in sequences.into_iter().enumerate() {
            let which = match logits.as_str() {
                "all" => LogitRows::All,
                "last" => LogitRows::Last,
                "none" => LogitRows::None,
                other => {
                    return Err(to_py(specrs_core::Error::config(format!(
                        "sequence {s}: logits must be 'all', 'last' or 'none' (got '{other}')"
                    ))))
                }
            };
            let mut rows = SeqRows::chain(tokens, which);
            if let Some(parents) = parents {
                rows.parents = parents;
                if which == LogitRows::Last && !rows.tokens.is_empty() {
                    return Err(to_py(specrs_core::Error::config(format!(
                        "sequence {s}: a tree has no last row; ask for logits 'all' or 'none'"
                    ))));
                }
            }
            seqs.push((prefix, rows));
        }
        let lengths: Vec<usize> = seqs.iter().map(|(_, rows)| rows.tokens.len()).collect();
        let engine = self.inner.clone();
        let (vocab, width) = (self.inner.model().info().vocab_size, self.inner.model().info().hidden_size);
        let out = run_detached(py, move || engine.forward_batch(&seqs, &taps))?;
        out.into_iter()
            .zip(lengths)
            .map(|(seq, n)| {
                let logits = array2(py, seq.num_logit_rows, vocab, seq.logits)?;
                let hidden = seq.hidden.into_iter().map(|rows| array2(py, n, width, rows)).collect::<PyResult<_>>()?;
                Ok((logits, hidden))
            })
            .collect()
    }

    /// Median seconds of one forward over n new tokens on top of `context_ids`, for each n.
    #[pyo3(signature = (context_ids, ns, repeats=5))]
    fn forward_cost(
        &self,
        py: Python<'_>,
        context_ids: Vec<u32>,
        ns: Vec<usize>,
        repeats: usize,
    ) -> PyResult<Vec<(usize, f64)>> {
        let engine = self.inner.clone();
        run_detached(py, move || engine.forward_cost(&context_ids, &ns, repeats))
    }

    /// Writes the engine-wide suffix caches to `path` atomically; returns the responses saved.
    fn save_suffix_cache(&self, py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        let engine = self.inner.clone();
        run_detached(py, move || engine.save_suffix_cache(&path))
    }

    /// Replaces the engine-wide suffix caches with those saved in `path` (ConfigError for a
    /// missing, corrupt or truncated file, or one from another model); returns the responses loaded.
    fn load_suffix_cache(&self, py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        let engine = self.inner.clone();
        run_detached(py, move || engine.load_suffix_cache(&path))
    }

    /// Caches finished responses (generated token ids, oldest first) from another engine of this
    /// model in the engine-wide suffix cache of `config` (a `SpeculativeConfig` or its JSON text);
    /// returns how many were added.
    fn add_suffix_responses(
        &self,
        py: Python<'_>,
        config: &Bound<'_, PyAny>,
        responses: Vec<Vec<u32>>,
    ) -> PyResult<usize> {
        let config = config_arg(config)?;
        let engine = self.inner.clone();
        run_detached(py, move || engine.add_suffix_responses(&config, &responses))
    }

    /// Every engine-wide suffix cache as (its config's JSON, its responses oldest first).
    fn suffix_cache_responses(&self, py: Python<'_>) -> PyResult<Vec<(String, Vec<Vec<u32>>)>> {
        let engine = self.inner.clone();
        run_detached(py, move || engine.suffix_cache_responses())
    }
}

impl PyEngine {
    /// The request's speculation from a parsed config (None = off) and an optional Python proposer.
    pub(crate) fn speculation(
        &self,
        py: Python<'_>,
        config: Option<Arc<SpeculativeConfig>>,
        proposer: Option<Py<PyAny>>,
    ) -> PyResult<Option<Speculation>> {
        let Some(config) = config else {
            if proposer.is_some() {
                return Err(to_py(specrs_core::Error::config(
                    "a proposer object needs speculation on: pass speculative_config={\"method\": \"custom\", ...}",
                )));
            }
            return Ok(None);
        };
        let custom: Option<Box<dyn Proposer>> = match proposer {
            // The test-only panicking proposer is a Rust proposer, so its panic is a real Rust
            // panic inside `Session::step` (a Python proposer's exception is a ProposerError).
            Some(object) => match object.bind(py).cast::<PyTestingPanickingProposer>() {
                Ok(testing) => Some(Box::new(testing.get().proposer())),
                Err(_) => Some(Box::new(PyProposer::new(py, object).map_err(to_py)?)),
            },
            None => None,
        };
        let engine = self.inner.clone();
        let speculation = run_detached(py, move || engine.speculation(&config, custom))?;
        Ok(Some(speculation))
    }
}

/// `[rows, cols]` numpy array from row-major values.
fn array2(py: Python<'_>, rows: usize, cols: usize, values: Vec<f32>) -> PyResult<Bound<'_, PyArray2<f32>>> {
    let array = numpy::ndarray::Array2::from_shape_vec((rows, cols), values)
        .map_err(|e| to_py(specrs_core::Error::Internal(e.to_string())))?;
    Ok(array.into_pyarray(py))
}

/// Hidden-state taps from Python: an int i >= 0 (the residual stream after i blocks) or
/// "final_norm". Whether the layer exists is checked against the model by the forward.
fn taps_arg(layers: &[Bound<'_, PyAny>]) -> PyResult<Vec<Tap>> {
    let refuse = |item: &Bound<'_, PyAny>| {
        to_py(specrs_core::Error::config(format!(
            "layers entries are ints >= 0 (the residual stream after that many blocks) or 'final_norm' (got {})",
            item.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        )))
    };
    layers
        .iter()
        .map(|item| {
            if item.is_instance_of::<PyInt>() {
                let layer: i64 = item.extract()?;
                return usize::try_from(layer).map(Tap::Residual).map_err(|_| refuse(item));
            }
            match item.extract::<String>() {
                Ok(name) if name == "final_norm" => Ok(Tap::FinalNorm),
                _ => Err(refuse(item)),
            }
        })
        .collect()
}

/// Chat messages and the tools list (JSON text) as the engine takes them.
fn chat_args(
    messages: Vec<(String, String)>,
    tools_json: Option<String>,
) -> PyResult<(Vec<ChatMessage>, Option<serde_json::Value>)> {
    let messages = messages.into_iter().map(|(role, content)| ChatMessage { role, content }).collect();
    let tools = match tools_json {
        Some(text) => Some(
            serde_json::from_str(&text)
                .map_err(|e| to_py(specrs_core::Error::config(format!("tools is not valid JSON: {e}"))))?,
        ),
        None => None,
    };
    Ok((messages, tools))
}

/// Token ids from a Python list; an int outside 0..2^32 is a ConfigError naming it (PyO3's own
/// conversion would raise OverflowError). Ids past the vocabulary are the engine's to refuse.
pub(crate) fn token_ids_arg(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let error = match value.extract::<Vec<u32>>() {
        Ok(ids) => return Ok(ids),
        Err(error) => error,
    };
    if let Ok(items) = value.extract::<Vec<Bound<'_, PyAny>>>() {
        for item in &items {
            if item.is_instance_of::<PyInt>() && (item.lt(0)? || item.gt(u32::MAX)?) {
                return Err(to_py(specrs_core::Error::config(format!(
                    "{what} {} is outside the vocabulary (ids are integers from 0)",
                    describe_int(item)
                ))));
            }
        }
    }
    Err(error)
}

/// A stream's session, and why it ended early if a step failed.
struct StreamState {
    session: Session,
    /// Set when a step raised or panicked. The session may then be half-updated (say, its cache
    /// ahead of its tokens), so it takes no further step; its caches were freed by an abort.
    failure: Option<String>,
}

impl StreamState {
    /// One decoding step. A step that fails ends the stream for good: the error is returned
    /// once, and every later step refuses with it.
    fn step(&mut self) -> specrs_core::Result<specrs_core::StepOutput> {
        if let Some(failure) = &self.failure {
            return Err(specrs_core::Error::Internal(format!(
                "this stream already ended with an error ({failure}); start a new request"
            )));
        }
        let error = match catch_panic(|| self.session.step()) {
            Ok(Ok(step)) => return Ok(step),
            Ok(Err(error)) => error,
            Err(message) => panic_error(&message),
        };
        self.failure = Some(error.to_string());
        // Frees the caches and ends the session. A panic there (a proposer's finish hook) leaves
        // the session unfinished, but `failure` already keeps it from stepping again.
        let _ = catch_panic(|| self.session.abort());
        Err(error)
    }

    fn is_finished(&self) -> bool {
        self.failure.is_some() || self.session.is_finished()
    }
}

/// An iterator of text chunks; each `next` runs one decoding step with the GIL released.
///
/// Invariant: every method takes the session lock with the GIL released (a step holds the lock
/// while it runs, and a Python proposer needs the GIL during it, so taking the lock while holding
/// the GIL could deadlock), and no panic in a step or hook reaches Python: a step that fails ends
/// the stream with `finish_reason` "error", and `cancel`, `finished`, `result` and `kv_lens` keep
/// working after it.
#[pyclass(name = "Stream", module = "specrs._specrs")]
pub struct PyStream {
    state: Mutex<StreamState>,
}

#[pymethods]
impl PyStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let state = &self.state;
        run_detached(py, move || {
            let mut state = lock_recovering(state);
            // Steps whose tokens complete no character yield no text; keep going until some
            // text or the end (a stream that failed raises again rather than ending quietly).
            while state.failure.is_some() || !state.session.is_finished() {
                let step = state.step()?;
                if !step.text.is_empty() {
                    return Ok(Some(step.text));
                }
            }
            Ok(None)
        })
    }

    /// One decoding step with the GIL released: `(text, new token ids)`, or None once the request
    /// has finished. Unlike iteration, a step whose tokens complete no character returns "" (a
    /// server interleaving requests needs each step to come back). After a step failed, every
    /// later step raises.
    fn step(&self, py: Python<'_>) -> PyResult<Option<(String, Vec<u32>)>> {
        let state = &self.state;
        run_detached(py, move || {
            let mut state = lock_recovering(state);
            if state.failure.is_none() && state.session.is_finished() {
                return Ok(None);
            }
            let step = state.step()?;
            Ok(Some((step.text, step.token_ids)))
        })
    }

    /// Stops generating; `result()` keeps what was produced so far.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        let state = &self.state;
        run_detached(py, move || {
            let mut state = lock_recovering(state);
            if state.failure.is_some() {
                return Ok(());
            }
            // A panic in the abort (a proposer's finish hook) fails the stream like a step's.
            if let Err(message) = catch_panic(|| state.session.abort()) {
                let error = panic_error(&message);
                state.failure = Some(error.to_string());
                return Err(error);
            }
            Ok(())
        })
    }

    /// `(target_kv_positions, draft_kv_positions or None)`: what each cache holds now.
    fn kv_lens(&self, py: Python<'_>) -> PyResult<(usize, Option<usize>)> {
        let state = &self.state;
        run_detached(py, move || Ok(lock_recovering(state).session.kv_lens()))
    }

    #[getter]
    fn finished(&self, py: Python<'_>) -> PyResult<bool> {
        let state = &self.state;
        run_detached(py, move || Ok(lock_recovering(state).is_finished()))
    }

    /// The request so far: text, token ids, finish reason ("error" after a failed step) and
    /// metrics.
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = &self.state;
        let (generation, failed) = run_detached(py, move || {
            let state = lock_recovering(state);
            Ok((state.session.result(), state.failure.is_some()))
        })?;
        let d = generation_dict(py, &generation)?;
        if failed {
            d.set_item("finish_reason", "error")?;
        }
        Ok(d)
    }
}
