//! Reading heads as the field publishes them, into the modules of this folder.
//!
//! - EAGLE-1 (`"eagle"`): the EAGLE repository's directory (Llama `config.json`, `fc` with or
//!   without bias, `layers.0.*` without an input norm), or an old `speculators` one
//!   (`speculators_model_type: "eagle"`, `fusion_fc`, `transformer.*`).
//! - EAGLE-3 (`"eagle3"`): the EAGLE repository's and SpecForge's directories (`midlayer.*`,
//!   top-level `draft_vocab_size`, `target_hidden_size`, `eagle_config`), and `speculators`'
//!   (`speculators_model_type: "eagle3"`, `transformer_layer_config`,
//!   `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, `fc_norm`, `norm_before_fc`,
//!   `norm_output`, `layers.0.*`).
//! - MTP (`"mtp"`): layers inside a checkpoint, DeepSeek-V3 / GLM-4.5 style
//!   (`model.layers.{num_hidden_layers + k}.{enorm,hnorm,eh_proj,shared_head.*}` plus the block) or
//!   MiMo's (`model.mtp_layers.{k}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`),
//!   with `num_nextn_predict_layers`; or a GGUF's `blk.N.nextn.*` tensors.
//! - MLP speculator (`"mlp_speculator"`): IBM's `config.json` (`model_type: mlp_speculator`,
//!   `emb_dim`, `inner_dim`, `n_predict`, `tie_weights`, `scale_input`) with `emb.i`, `proj.i`,
//!   `ln.i`, `head.i` (a `speculator.` prefix is dropped).
//! - Medusa (`"medusa"`): FasterDecoding's heads (`medusa_num_heads`, `medusa_num_layers`;
//!   `{i}.{j}.linear.*` and `{i}.{num_layers}.weight`, saved as safetensors) or vLLM's
//!   (`num_heads`, `num_hidden_layers`, `blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`,
//!   `original_lm_head`, `truncated_vocab_size` with `token_map`).
//! - DFlash (`"dflash"`): PyPI `dflash` 0.1.0's `DFlashDraftModel` directory (a Qwen3
//!   `config.json` with `num_target_layers` and `dflash_config`: `target_layer_ids`, `block_size`,
//!   `mask_token_id`, `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`, each
//!   also read at the top level as the reference does; `layers.{i}.*`, `fc`, `hidden_norm`, `norm`).
//!   Its `DFlash2DraftModel` variant (dynamic convolutions and a candidate selector) is refused by
//!   name.
//! - DSpark (`"dspark"`): mlx-dspark's standalone config (Qwen3 family; `load_dspark` lists what
//!   it reads), the DFlash tensors plus `markov_head.*`, `confidence_head.*` and, when shipped,
//!   `embed_tokens`, `lm_head` and `d2t`.
//!
//! Invariant: a head is built only when it fits the target: hidden size, vocabulary and tap layers
//! are checked against the target and every tensor against the head's config before a request
//! runs; a mismatch is a `ModelLoadError` naming both values and the fix, and an option the head
//! carries that specrs cannot honour is a `ConfigError` naming it.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;
use serde_json::Value;

use super::dflash::{DFlashHead, DFlashLayer};
use super::dspark::{ConfidenceHead, MarkovHead};
use super::eagle::{EagleHead, EagleVersion};
use super::layer::{HeadLayer, LayerNames, LayerShape};
use super::medusa::MedusaHead;
use super::mlp_speculator::{MlpSpeculator, SubHead};
use super::mtp::{MtpHead, MtpLayer};
use super::weights::HeadWeights;
use super::Head;
use crate::error::{Error, Result};
use crate::gguf::{open_with_integer_tensors, value_as_i64, GgufFile};
use crate::model::hf_dir::read_optional_json;
use crate::model::rope::Pairing;
use crate::model::{CausalLm, Tap};
use crate::spec_config::HeadMethod;

/// `speculators_model_type` values specrs reads, and the method each is.
const SPECULATORS_TYPES: [(&str, HeadMethod); 3] =
    [("eagle", HeadMethod::Eagle), ("eagle3", HeadMethod::Eagle3), ("mtp", HeadMethod::Mtp)];

/// Loads the `method` head at `path` (a directory with `config.json`, or a `.gguf` file) for
/// `target`.
pub fn load(
    method: HeadMethod,
    path: &Path,
    target: Arc<dyn CausalLm>,
    quantization: Option<GgmlDType>,
) -> Result<LoadedHead> {
    if !path.exists() {
        return Err(Error::model_load(format!(
            "the {} head '{}' does not exist; set \"model\" to the head's directory (config.json + \
             *.safetensors) or .gguf file",
            method.name(),
            path.display()
        )));
    }
    if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
        let (gguf, integers) = open_with_integer_tensors(path)?;
        let arch = gguf.get_str("general.architecture")?.to_string();
        let mut w = HeadWeights::gguf(gguf, integers, target.device());
        w.quantize_linears(quantization);
        let head = match (method, arch.as_str()) {
            (HeadMethod::Eagle3, "eagle3") => load_eagle3_gguf(&mut w, target)?,
            (HeadMethod::Mtp, arch) if arch != "eagle3" => load_mtp_gguf(&mut w, target)?,
            (_, "eagle3") => {
                return Err(Error::config(format!("{} is an eagle3 head; set \"method\": \"eagle3\"", path.display())))
            }
            _ => {
                return Err(Error::config(format!(
                    "{}: specrs reads {} heads from a directory (config.json + *.safetensors); from GGUF it reads \
                     llama.cpp's eagle3 heads and MTP (nextn) layers. Point \"model\" at the head's directory",
                    path.display(),
                    method.name()
                )))
            }
        };
        return Ok(LoadedHead { head, weight_bytes: w.num_bytes });
    }
    let dir = if path.is_dir() { path } else { path.parent().unwrap_or(path) };
    let config = read_optional_json(&dir.join("config.json"))?.ok_or_else(|| {
        Error::model_load(format!(
            "{} has no config.json; a {} head directory needs the config.json it was published with",
            dir.display(),
            method.name()
        ))
    })?;
    let config = Config { value: config, file: dir.join("config.json").display().to_string() };
    if let Some(kind) = config.str("speculators_model_type") {
        match SPECULATORS_TYPES.iter().find(|(name, _)| *name == kind) {
            None => {
                return Err(Error::model_load(format!(
                    "{}: speculators_model_type '{kind}' is not a head specrs reads (it reads {}); use a head of \
                     one of those types",
                    config.file,
                    SPECULATORS_TYPES.map(|(name, _)| name).join(", ")
                )))
            }
            Some((_, m)) if *m != method => {
                return Err(Error::config(format!(
                    "{} is a speculators '{kind}' head; set \"method\": \"{}\"",
                    config.file,
                    m.name()
                )))
            }
            Some(_) => {}
        }
    }
    let mut w = HeadWeights::safetensors(path, target.device())?;
    w.quantize_linears(quantization);
    let head = match method {
        HeadMethod::Eagle | HeadMethod::Eagle3 => load_eagle(method, &config, &mut w, target),
        HeadMethod::Mtp => load_mtp_dir(&config, &mut w, target),
        HeadMethod::MlpSpeculator => load_mlp_speculator(&config, &mut w, target),
        HeadMethod::Medusa => load_medusa(&config, &mut w, target),
        HeadMethod::DFlash => load_dflash(&config, &mut w, target),
        HeadMethod::DSpark => load_dspark(&config, &mut w, target),
    }?;
    Ok(LoadedHead { head, weight_bytes: w.num_bytes })
}

/// A head and the bytes of the weights it holds (weights it shares with the target not counted).
#[derive(Clone)]
pub struct LoadedHead {
    pub head: Head,
    pub weight_bytes: usize,
}

/// A head's `config.json` (or a nested object of it), read with errors naming the file and key.
struct Config {
    value: Value,
    file: String,
}

impl Config {
    fn nested(&self, key: &str) -> Option<Config> {
        self.value
            .get(key)
            .filter(|v| v.is_object())
            .map(|v| Config { value: v.clone(), file: format!("{} ({key})", self.file) })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.value.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                Error::model_load(format!("{}: '{key}' must be a non-negative integer (got {v})", self.file))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| {
            Error::model_load(format!("{}: '{key}' is missing; the head's config.json must give it", self.file))
        })
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Error::model_load(format!("{}: '{key}' must be a number (got {v})", self.file))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Error::model_load(format!("{}: '{key}' must be true or false (got {v})", self.file))),
        }
    }

    fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        Error::model_load(format!("{}: '{key}' must list layer numbers (got {v})", self.file))
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(Error::model_load(format!("{}: '{key}' must be a list (got {v})", self.file))),
        }
    }

    /// The decoder layer's sizes, from a Llama-style config.
    fn layer_shape(&self, attn_input_size: usize, target: &dyn CausalLm, pairing: Pairing) -> Result<LayerShape> {
        if let Some(scaling) = self.get("rope_scaling").filter(|v| {
            v.get("rope_type").or_else(|| v.get("type")).and_then(Value::as_str).is_some_and(|t| t != "default")
        }) {
            return Err(Error::config(format!(
                "{}: rope_scaling {scaling} is not supported for heads; specrs runs heads with plain RoPE",
                self.file
            )));
        }
        let hidden_size = self.usize("hidden_size")?;
        let num_heads = self.usize("num_attention_heads")?;
        let rope_theta = match self.opt_f64("rope_theta")? {
            Some(theta) => theta,
            None => self.nested("rope_parameters").map_or(Ok(None), |p| p.opt_f64("rope_theta"))?.unwrap_or(10_000.0),
        };
        Ok(LayerShape {
            hidden_size,
            attn_input_size,
            intermediate_size: self.usize("intermediate_size")?,
            num_heads,
            num_kv_heads: self.opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim: self.opt_usize("head_dim")?.unwrap_or(hidden_size / num_heads.max(1)),
            rms_eps: self.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            rope_pairing: pairing,
            max_positions: target.info().context_length,
        })
    }
}

/// The head's hidden size must be the target's (it reads the target's embedding and hidden states).
fn check_hidden(what: &str, head: usize, target: &dyn CausalLm, file: &str) -> Result<()> {
    let want = target.info().hidden_size;
    if head != want {
        return Err(Error::model_load(format!(
            "{file}: the head's {what} is {head} but the target's hidden size is {want}; this head was trained \
             for another model: use a head trained for this target"
        )));
    }
    Ok(())
}

fn check_vocab(head_vocab: usize, target: &dyn CausalLm, file: &str) -> Result<()> {
    let want = target.info().vocab_size;
    if head_vocab != want {
        return Err(Error::model_load(format!(
            "{file}: the head's vocab_size is {head_vocab} but the target's vocabulary has {want} tokens; \
             this head was trained for another tokenizer: use a head trained for this target"
        )));
    }
    Ok(())
}

/// Target ids of a draft vocabulary, `[draft_vocab]` u32, each checked to be a target token.
fn draft_ids(ids: Vec<i64>, target_vocab: usize, name: &str, file: &str) -> Result<Vec<u32>> {
    ids.into_iter()
        .enumerate()
        .map(|(i, id)| {
            u32::try_from(id).ok().filter(|&t| (t as usize) < target_vocab).ok_or_else(|| {
                Error::model_load(format!(
                    "{file}: '{name}' maps draft token {i} to {id}, outside the target's vocabulary \
                     ({target_vocab} tokens); the head belongs to another target"
                ))
            })
        })
        .collect()
}

fn load_eagle(method: HeadMethod, config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    let speculators_type = config.str("speculators_model_type");
    let is_eagle3_checkpoint = speculators_type == Some("eagle3")
        || w.has("midlayer.hidden_norm.weight")
        || w.has("layers.0.hidden_norm.weight");
    match (method, is_eagle3_checkpoint) {
        (HeadMethod::Eagle, true) => {
            return Err(Error::config(format!(
                "{file} is an EAGLE-3 head; set \"method\": \"eagle3\""
            )))
        }
        (HeadMethod::Eagle3, false) => {
            return Err(Error::config(format!(
                "{file} is not an EAGLE-3 head (no hidden_norm, no draft vocabulary); for an EAGLE-1/2 head set \"method\": \"eagle\""
            )))
        }
        _ => {}
    }
    // speculators nests the layer's Llama config; the EAGLE repository and SpecForge do not.
    let layer_config = config
        .nested("transformer_layer_config")
        .unwrap_or_else(|| Config { value: config.value.clone(), file: file.clone() });
    let target_info = target.info().clone();
    let head_vocab =
        layer_config.opt_usize("vocab_size")?.or(config.opt_usize("vocab_size")?).unwrap_or(target_info.vocab_size);
    check_vocab(head_vocab, target.as_ref(), &file)?;
    let hidden = layer_config.usize("hidden_size")?;
    let eps = layer_config.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32;
    // vLLM merges speculators' layer config into the top level, so the key may sit in either.
    let logit_scale = match config.opt_f64("logit_scale")? {
        Some(scale) => scale,
        None => layer_config.opt_f64("logit_scale")?.unwrap_or(1.0),
    };
    let embed = w.optional(
        w.first_of(&["embed_tokens.weight", "model.embed_tokens.weight"]).unwrap_or("embed_tokens.weight"),
        &[head_vocab, hidden],
    )?;

    if method == HeadMethod::Eagle {
        if layer_config.bool_or("layernorms", false)? || config.bool_or("layernorms", false)? {
            return Err(Error::config(format!(
                "{file}: 'layernorms' (HASS's extra norms) is set, which specrs does not run; use a head without it"
            )));
        }
        check_hidden("hidden_size", hidden, target.as_ref(), &file)?;
        let (fc, prefix) =
            if speculators_type == Some("eagle") { ("fusion_fc", "transformer") } else { ("fc", "layers.0") };
        let shape = layer_config.layer_shape(hidden, target.as_ref(), Pairing::Halves)?;
        let layer = HeadLayer::load(w, &LayerNames::hf(prefix), shape)?;
        return Ok(Head::Recurrent(Arc::new(EagleHead {
            version: EagleVersion::One,
            taps: vec![Tap::FinalNorm],
            fc: w.linear(fc, hidden, 2 * hidden)?,
            fc_norms: Vec::new(),
            fc_input_norm: None,
            norm_output: false,
            input_norm: None,
            hidden_norm: None,
            norm_before_residual: false,
            layer,
            final_norm: None,
            lm_head: None,
            draft_to_target: None,
            embed,
            target,
            rms_eps: eps,
            logit_scale,
        })));
    }

    // EAGLE-3.
    let target_hidden = config.opt_usize("target_hidden_size")?.unwrap_or(target_info.hidden_size);
    check_hidden("target_hidden_size", target_hidden, target.as_ref(), &file)?;
    let num_layers = target_info.num_layers;
    let eagle_config = config.nested("eagle_config");
    let layer_ids = match config.usize_list("eagle_aux_hidden_state_layer_ids")? {
        Some(ids) => ids,
        None => match &eagle_config {
            Some(e) => e.usize_list("eagle_aux_hidden_state_layer_ids")?,
            None => None,
        }
        .unwrap_or_else(|| vec![2, num_layers / 2, num_layers.saturating_sub(3)]),
    };
    check_taps(&layer_ids, w.dims("fc.weight"), target_hidden, num_layers, &file, "eagle_aux_hidden_state_layer_ids")?;
    let num_taps = layer_ids.len();
    let norm_before_fc = config.bool_or("norm_before_fc", false)?;
    let fc_norm = config.bool_or("fc_norm", false)?;
    // vLLM reads speculators' configs with norm_before_residual true unless given.
    let norm_before_residual = config.bool_or("norm_before_residual", speculators_type.is_some())?;
    let norm_output = config.bool_or("norm_output", false)?;
    let draft_vocab = config.opt_usize("draft_vocab_size")?.unwrap_or(head_vocab);
    let prefix = if w.has("midlayer.hidden_norm.weight") { "midlayer" } else { "layers.0" };
    let shape = layer_config.layer_shape(2 * hidden, target.as_ref(), Pairing::Halves)?;
    let layer = HeadLayer::load(w, &LayerNames::hf(prefix), shape)?;
    let draft_to_target = if w.has("d2t") {
        let offsets = w.ids("d2t", draft_vocab)?;
        let ids: Vec<i64> = offsets.iter().enumerate().map(|(i, &d)| i as i64 + d).collect();
        Some(Tensor::new(draft_ids(ids, target_info.vocab_size, "d2t", &file)?, target.device())?)
    } else if draft_vocab != target_info.vocab_size {
        return Err(Error::model_load(format!(
            "{file}: draft_vocab_size is {draft_vocab} but the head has no 'd2t' tensor mapping draft ids to the \
             target's {} tokens; add the d2t tensor the head was trained with",
            target_info.vocab_size
        )));
    } else {
        None
    };
    let lm_head = if w.has("lm_head.weight") || draft_vocab != target_info.vocab_size {
        Some(w.linear("lm_head", draft_vocab, hidden)?)
    } else {
        None
    };
    let fc_norms = if fc_norm {
        (0..num_taps).map(|k| w.tensor(&format!("fc_norm.{k}.weight"), &[target_hidden])).collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let fc_input_norm =
        if norm_before_fc { Some(w.tensor("input_norm.weight", &[num_taps * target_hidden])?) } else { None };
    Ok(Head::Recurrent(Arc::new(EagleHead {
        version: EagleVersion::Three,
        taps: layer_ids.iter().map(|&id| Tap::Residual(id)).collect(),
        fc: w.linear("fc", hidden, num_taps * target_hidden)?,
        fc_norms,
        fc_input_norm,
        norm_output,
        input_norm: Some(w.tensor(&format!("{prefix}.input_layernorm.weight"), &[hidden])?),
        hidden_norm: Some(w.tensor(&format!("{prefix}.hidden_norm.weight"), &[hidden])?),
        norm_before_residual,
        layer,
        final_norm: Some(w.tensor("norm.weight", &[hidden])?),
        lm_head,
        draft_to_target,
        embed,
        target,
        rms_eps: eps,
        logit_scale,
    })))
}

/// Where one MTP layer's tensors live in a checkpoint.
struct MtpNames {
    enorm: String,
    hnorm: String,
    eh_proj: String,
    hidden_first: bool,
    input_norm: String,
    block: LayerNames,
    final_norm: String,
    norm_inside: bool,
    head: String,
    /// The layer's own embedding table, where the format stores one (else the target's is read).
    embed: Option<String>,
}

fn load_mtp_dir(config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    if w.has("mtp.fc.weight") {
        return Err(Error::config(format!(
            "{file}: Qwen3-Next's MTP layers (gated attention, zero-centred norms) are not supported; use another method"
        )));
    }
    // speculators nests the block's config; checkpoints with MTP layers inside do not.
    let layer_config = config.nested("transformer_layer_config");
    let layer_config = layer_config.as_ref().unwrap_or(config);
    let num_mtp = match config.opt_usize("num_nextn_predict_layers")? {
        Some(n) => n,
        None => layer_config.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
    };
    if num_mtp == 0 {
        return Err(Error::model_load(format!(
            "{file}: this model has no MTP layers (num_nextn_predict_layers is 0 or missing); method \"mtp\" needs a \
             model trained with them (DeepSeek-V3, GLM-4.5, MiMo); use \"eagle3\" or \"draft_model\" instead"
        )));
    }
    let num_layers = layer_config.usize("num_hidden_layers")?;
    let names: Vec<MtpNames> = (0..num_mtp)
        .map(|k| {
            let deepseek = format!("model.layers.{}", num_layers + k);
            let mimo = format!("model.mtp_layers.{k}");
            let speculators = format!("mtp_layers.{k}");
            if w.has(&format!("{speculators}.input_proj.weight")) {
                // speculators' MTP: MiMo's names, the embedding first.
                let n = |s: &str| format!("{speculators}.{s}");
                Ok(MtpNames {
                    enorm: n("token_layernorm.weight"),
                    hnorm: n("hidden_layernorm.weight"),
                    eh_proj: n("input_proj"),
                    hidden_first: false,
                    input_norm: n("input_layernorm.weight"),
                    block: LayerNames::hf(&speculators),
                    final_norm: n("final_layernorm.weight"),
                    norm_inside: true,
                    head: "lm_head".into(),
                    embed: None,
                })
            } else if w.has(&format!("{deepseek}.eh_proj.weight")) {
                let n = |s: &str| format!("{deepseek}.{s}");
                Ok(MtpNames {
                    enorm: n("enorm.weight"),
                    hnorm: n("hnorm.weight"),
                    eh_proj: n("eh_proj"),
                    hidden_first: false,
                    input_norm: n("input_layernorm.weight"),
                    block: LayerNames::hf(&deepseek),
                    final_norm: n("shared_head.norm.weight"),
                    norm_inside: false,
                    head: n("shared_head.head"),
                    embed: Some(n("embed_tokens.weight")),
                })
            } else if w.has(&format!("{mimo}.input_proj.weight")) {
                let n = |s: &str| format!("{mimo}.{s}");
                Ok(MtpNames {
                    enorm: n("token_layernorm.weight"),
                    hnorm: n("hidden_layernorm.weight"),
                    eh_proj: n("input_proj"),
                    hidden_first: true,
                    input_norm: n("input_layernorm.weight"),
                    block: LayerNames::hf(&mimo),
                    final_norm: n("final_layernorm.weight"),
                    norm_inside: true,
                    head: "lm_head".into(),
                    embed: None,
                })
            } else {
                Err(Error::model_load(format!(
                    "{}: num_nextn_predict_layers is {num_mtp} but MTP layer {k} is missing (looked for \
                     '{deepseek}.eh_proj.weight' and '{mimo}.input_proj.weight'); the checkpoint was saved without its \
                     MTP weights: use one that keeps them",
                    w.path().display()
                )))
            }
        })
        .collect::<Result<_>>()?;
    if w.has(&format!("model.layers.{num_layers}.self_attn.q_a_proj.weight"))
        || w.has(&format!("model.layers.{num_layers}.mlp.experts.0.gate_proj.weight"))
    {
        return Err(Error::config(format!(
            "{file}: the MTP block uses multi-head latent attention or experts (DeepSeek-V3 / GLM-4.5 MoE), which \
             specrs does not run; MTP works with dense Llama/Qwen-style blocks"
        )));
    }
    let shape = layer_config.layer_shape(layer_config.usize("hidden_size")?, target.as_ref(), Pairing::Halves)?;
    check_hidden("hidden_size", shape.hidden_size, target.as_ref(), &file)?;
    check_vocab(layer_config.opt_usize("vocab_size")?.unwrap_or(target.info().vocab_size), target.as_ref(), &file)?;
    // vLLM zeroes the embedding at position 0 for DeepSeek-style and MiMo layers; speculators'
    // MTP does not.
    let speculators = names.first().is_some_and(|n| n.eh_proj.starts_with("mtp_layers."));
    build_mtp(names, shape, w, target, !speculators)
}

fn build_mtp(
    names: Vec<MtpNames>,
    shape: LayerShape,
    w: &mut HeadWeights,
    target: Arc<dyn CausalLm>,
    mask_position_zero: bool,
) -> Result<Head> {
    let (hidden, vocab) = (shape.hidden_size, target.info().vocab_size);
    let embed = match names.first().and_then(|n| n.embed.as_deref()) {
        Some(name) => w.optional(name, &[vocab, hidden])?,
        None => None,
    };
    let eps = shape.rms_eps;
    let layers = names
        .iter()
        .map(|n| {
            let head =
                if w.has(&format!("{}.weight", n.head)) { Some(w.linear(&n.head, vocab, hidden)?) } else { None };
            Ok(MtpLayer {
                enorm: w.tensor(&n.enorm, &[hidden])?,
                hnorm: w.tensor(&n.hnorm, &[hidden])?,
                eh_proj: w.linear(&n.eh_proj, hidden, 2 * hidden)?,
                hidden_first: n.hidden_first,
                input_norm: w.tensor(&n.input_norm, &[hidden])?,
                block: HeadLayer::load(w, &n.block, shape.clone())?,
                final_norm: w.tensor(&n.final_norm, &[hidden])?,
                norm_inside: n.norm_inside,
                head,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Head::Recurrent(Arc::new(MtpHead { layers, embed, mask_position_zero, target, rms_eps: eps })))
}

/// The decoder layer's sizes from a GGUF file's `{arch}.*` keys.
fn gguf_layer_shape(gguf: &GgufFile, arch: &str, attn_input_size: usize, target: &dyn CausalLm) -> Result<LayerShape> {
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = gguf.get_usize(&key("embedding_length"))?;
    let num_heads = gguf.get_usize(&key("attention.head_count"))?;
    Ok(LayerShape {
        hidden_size: hidden,
        attn_input_size: if attn_input_size == 0 { hidden } else { attn_input_size },
        intermediate_size: gguf.get_usize(&key("feed_forward_length"))?,
        num_heads,
        num_kv_heads: gguf.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads),
        head_dim: gguf.opt_usize(&key("attention.key_length"))?.unwrap_or(hidden / num_heads.max(1)),
        rms_eps: gguf.opt_f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        rope_theta: gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        // llama.cpp's converter permutes llama-style q/k rows for interleaved pairs (eagle3 heads
        // are Llama layers); other families keep the halves.
        rope_pairing: if matches!(arch, "llama" | "eagle3") { Pairing::Interleaved } else { Pairing::Halves },
        max_positions: target.info().context_length,
    })
}

/// llama.cpp's eagle3 GGUF: `eagle3.extract_layers`, `eagle3.target_hidden_size`,
/// `eagle3.norm_before_residual`; `fc`, `d2t` (I64, absolute target ids), `output_norm`,
/// `output` (optional: the target's), `token_embd` (optional: the target's) and `blk.0.*` with
/// `attn_norm` (the embedding's norm) and `attn_norm_2` (the hidden state's).
fn load_eagle3_gguf(w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let gguf = w.gguf_file().expect("opened from a GGUF file");
    let file = gguf.path.display().to_string();
    let info = target.info().clone();
    let layer_ids: Vec<usize> = gguf
        .get_array("eagle3.extract_layers")?
        .iter()
        .map(|v| value_as_i64(v).and_then(|i| usize::try_from(i).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| Error::model_load(format!("{file}: eagle3.extract_layers must list layer numbers")))?;
    let target_hidden = gguf.get_usize("eagle3.target_hidden_size")?;
    let norm_before_residual = gguf.opt_bool("eagle3.norm_before_residual")?.unwrap_or(false);
    let hidden = gguf.get_usize("eagle3.embedding_length")?;
    let shape = gguf_layer_shape(gguf, "eagle3", 2 * hidden, target.as_ref())?;
    check_hidden("eagle3.target_hidden_size", target_hidden, target.as_ref(), &file)?;
    check_taps(&layer_ids, w.dims("fc.weight"), target_hidden, info.num_layers, &file, "eagle3.extract_layers")?;
    let num_taps = layer_ids.len();
    let draft_vocab = w.integer_len("d2t").unwrap_or(info.vocab_size);
    let draft_to_target = if w.integer_len("d2t").is_some() {
        // Absolute target ids, unlike the offsets safetensors heads store.
        Some(Tensor::new(draft_ids(w.ids("d2t", draft_vocab)?, info.vocab_size, "d2t", &file)?, target.device())?)
    } else {
        None
    };
    let embed = w.optional("token_embd.weight", &[info.vocab_size, hidden])?;
    let lm_head = if w.has("output.weight") { Some(w.linear("output", draft_vocab, hidden)?) } else { None };
    let hidden_norm =
        w.first_of(&["blk.0.attn_norm_2.weight", "blk.0.hidden_norm.weight"]).unwrap_or("blk.0.attn_norm_2.weight");
    Ok(Head::Recurrent(Arc::new(EagleHead {
        version: EagleVersion::Three,
        taps: layer_ids.iter().map(|&id| Tap::Residual(id)).collect(),
        fc: w.linear("fc", hidden, num_taps * target_hidden)?,
        fc_norms: Vec::new(),
        fc_input_norm: None,
        norm_output: false,
        input_norm: Some(w.tensor("blk.0.attn_norm.weight", &[hidden])?),
        hidden_norm: Some(w.tensor(hidden_norm, &[hidden])?),
        norm_before_residual,
        layer: HeadLayer::load(w, &LayerNames::gguf("blk.0"), shape.clone())?,
        final_norm: Some(w.tensor("output_norm.weight", &[hidden])?),
        lm_head,
        draft_to_target,
        embed,
        target,
        rms_eps: shape.rms_eps,
        logit_scale: 1.0,
    })))
}

/// The tapped layers must exist in the target and match `fc`'s input width.
fn check_taps(
    layer_ids: &[usize],
    fc_dims: Option<Vec<usize>>,
    target_hidden: usize,
    num_layers: usize,
    file: &str,
    key: &str,
) -> Result<()> {
    if let Some(&bad) = layer_ids.iter().find(|&&id| id > num_layers) {
        return Err(Error::model_load(format!(
            "{file}: {key} {layer_ids:?} names layer {bad}, but the target has {num_layers} layers; this head was \
             trained for a deeper target"
        )));
    }
    let fc_dims = fc_dims.unwrap_or_default();
    let num_taps = fc_dims.get(1).map_or(layer_ids.len(), |&width| width / target_hidden.max(1));
    if num_taps != layer_ids.len() || fc_dims.get(1).is_some_and(|&width| width % target_hidden != 0) {
        return Err(Error::model_load(format!(
            "{file}: fc.weight is {fc_dims:?}, which reads {num_taps} tapped hidden states of width {target_hidden}, \
             but {key} taps {} layers ({layer_ids:?}); give it {num_taps} layer ids",
            layer_ids.len()
        )));
    }
    Ok(())
}

/// MTP layers in a GGUF file (llama.cpp's `blk.N.nextn.*` beside the block's own tensors).
fn load_mtp_gguf(w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let gguf = w.gguf_file().expect("opened from a GGUF file");
    let file = gguf.path.display().to_string();
    let arch = gguf.get_str("general.architecture")?.to_string();
    let mut blocks: Vec<usize> = gguf
        .tensor_names()
        .iter()
        .filter_map(|n| n.strip_prefix("blk.")?.strip_suffix(".nextn.eh_proj.weight")?.parse().ok())
        .collect();
    blocks.sort_unstable();
    if blocks.is_empty() {
        return Err(Error::model_load(format!(
            "{file}: this model has no MTP layers (no blk.N.nextn.* tensors); method \"mtp\" needs a model \
             converted with its nextn layers; use \"eagle3\" or \"draft_model\" instead"
        )));
    }
    let shape = gguf_layer_shape(gguf, &arch, 0, target.as_ref())?;
    check_hidden("embedding_length", shape.hidden_size, target.as_ref(), &file)?;
    let names = blocks
        .iter()
        .map(|b| {
            let n = |s: &str| format!("blk.{b}.nextn.{s}");
            MtpNames {
                enorm: n("enorm.weight"),
                hnorm: n("hnorm.weight"),
                eh_proj: n("eh_proj"),
                hidden_first: false,
                input_norm: format!("blk.{b}.attn_norm.weight"),
                block: LayerNames::gguf(&format!("blk.{b}")),
                final_norm: n("shared_head_norm.weight"),
                norm_inside: false,
                head: n("shared_head_head"),
                embed: Some(n("embed_tokens.weight")),
            }
        })
        .collect();
    build_mtp(names, shape, w, target, true)
}

fn load_mlp_speculator(config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    if let Some(t) = config.str("model_type").filter(|t| *t != "mlp_speculator") {
        return Err(Error::model_load(format!(
            "{file}: model_type is '{t}', not 'mlp_speculator'; point \"model\" at an MLP speculator's directory"
        )));
    }
    let emb_dim = config.usize("emb_dim")?;
    check_hidden("emb_dim", emb_dim, target.as_ref(), &file)?;
    let inner = match config.opt_usize("inner_dim")? {
        Some(0) | None => emb_dim,
        Some(d) => d,
    };
    let vocab = config.usize("vocab_size")?;
    check_vocab(vocab, target.as_ref(), &file)?;
    let n_predict = config.usize("n_predict")?;
    if n_predict == 0 {
        return Err(Error::model_load(format!("{file}: n_predict is 0; the speculator has no heads")));
    }
    let tie = config.bool_or("tie_weights", false)?;
    let prefix = if w.has("speculator.emb.0.weight") { "speculator." } else { "" };
    // With tie_weights the checkpoint may store only the shared tensors.
    let name = |w: &HeadWeights, kind: &str, i: usize, suffix: &str| -> String {
        let own = format!("{prefix}{kind}.{i}.{suffix}");
        if w.has(&own) || !tie {
            return own;
        }
        let shared = if kind == "proj" { i.min(1) } else { 0 };
        format!("{prefix}{kind}.{shared}.{suffix}")
    };
    let heads = (0..n_predict)
        .map(|i| {
            let proj_in = if i == 0 { emb_dim } else { inner };
            let proj = name(w, "proj", i, "weight");
            Ok(SubHead {
                emb: w.tensor(&name(w, "emb", i, "weight"), &[vocab, inner])?,
                proj: w.linear(proj.trim_end_matches(".weight"), inner, proj_in)?,
                ln_weight: w.tensor(&name(w, "ln", i, "weight"), &[inner])?,
                ln_bias: w.tensor(&name(w, "ln", i, "bias"), &[inner])?,
                head: w.linear(name(w, "head", i, "weight").trim_end_matches(".weight"), vocab, inner)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (state_weight, emb_weight) = MlpSpeculator::weights(n_predict, inner);
    Ok(Head::Parallel(Arc::new(MlpSpeculator {
        heads,
        scale_input: config.bool_or("scale_input", false)?,
        state_weight,
        emb_weight,
    })))
}

fn load_medusa(config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    let target_vocab = target.info().vocab_size;
    let hidden = config.opt_usize("hidden_size")?.unwrap_or(target.info().hidden_size);
    check_hidden("hidden_size", hidden, target.as_ref(), &file)?;
    let vllm_format = w.has("lm_heads.0.weight") || w.has("medusa_heads.lm_heads.0.weight");
    let (num_heads, num_layers) = if vllm_format {
        (config.usize("num_heads")?, config.opt_usize("num_hidden_layers")?.unwrap_or(1))
    } else {
        (config.usize("medusa_num_heads")?, config.opt_usize("medusa_num_layers")?.unwrap_or(1))
    };
    if num_heads == 0 {
        return Err(Error::model_load(format!("{file}: the config gives 0 Medusa heads")));
    }
    let vocab = config.opt_usize("vocab_size")?.unwrap_or(target_vocab);
    let truncated = config.opt_usize("truncated_vocab_size")?.filter(|&t| t < vocab);
    if truncated.is_none() {
        check_vocab(vocab, target.as_ref(), &file)?;
    }
    let head_vocab = truncated.unwrap_or(vocab);
    let (blocks, lm_heads) = if vllm_format {
        let p = if w.has("medusa_heads.lm_heads.0.weight") { "medusa_heads." } else { "" };
        let blocks = (0..num_heads)
            .map(|i| (0..num_layers).map(|j| w.linear(&format!("{p}blocks.{i}.layers.{j}"), hidden, hidden)).collect())
            .collect::<Result<Vec<Vec<_>>>>()?;
        let shared = config.bool_or("original_lm_head", false)?;
        let lm_heads = (0..if shared { 1 } else { num_heads })
            .map(|i| w.linear(&format!("{p}lm_heads.{i}"), head_vocab, hidden))
            .collect::<Result<Vec<_>>>()?;
        (blocks, lm_heads)
    } else {
        let p = if w.has("medusa_head.0.0.linear.weight") { "medusa_head." } else { "" };
        let blocks = (0..num_heads)
            .map(|i| (0..num_layers).map(|j| w.linear(&format!("{p}{i}.{j}.linear"), hidden, hidden)).collect())
            .collect::<Result<Vec<Vec<_>>>>()?;
        let lm_heads = (0..num_heads)
            .map(|i| w.linear(&format!("{p}{i}.{num_layers}"), head_vocab, hidden))
            .collect::<Result<Vec<_>>>()?;
        (blocks, lm_heads)
    };
    let token_map = match truncated {
        None => None,
        Some(t) => {
            let ids = draft_ids(w.ids("token_map", t)?, target_vocab, "token_map", &file)?;
            Some(Tensor::new(ids, target.device())?)
        }
    };
    let logit_scale = config.opt_f64("logit_scale")?.unwrap_or(1.0);
    Ok(Head::Parallel(Arc::new(MedusaHead { blocks, lm_heads, token_map, target_vocab, logit_scale })))
}

/// dflash's `build_target_layer_ids`: the layers whose outputs a drafter of `num_draft_layers`
/// layers reads when its config names none, spread from layer 1 to layer `num_target_layers - 3`.
fn dflash_default_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers == 1 {
        return vec![num_target_layers / 2];
    }
    let (start, end) = (1.0, num_target_layers as f64 - 3.0);
    // Python's round() rounds halves to even.
    let round_half_even = |x: f64| {
        let r = x.round();
        if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
            r - x.signum()
        } else {
            r
        }
    };
    (0..num_draft_layers)
        .map(|i| round_half_even(start + i as f64 * (end - start) / (num_draft_layers - 1) as f64).max(0.0) as usize)
        .collect()
}

/// What a DFlash-style block drafter's config says, however its format spells it.
struct BlockDrafterOptions {
    /// The target layers whose outputs it reads (dflash's `target_layer_ids`).
    layer_ids: Vec<usize>,
    /// The drafter's decoder layers (`num_hidden_layers`): each one's tensors must be there.
    num_layers: usize,
    block_size: usize,
    first_drafting_row: usize,
    mask_token_id: usize,
    input_embedding_scale: f64,
    output_multiplier: f64,
    final_logit_softcapping: Option<f64>,
    causal: bool,
    shape: LayerShape,
}

/// The block drafter both formats share: taps checked against the target, `fc`, `hidden_norm`,
/// `layers.{i}.*` (Qwen3 blocks), `norm`; DSpark's own parts are filled in by its reader.
fn block_drafter(
    o: BlockDrafterOptions,
    w: &mut HeadWeights,
    target: Arc<dyn CausalLm>,
    file: &str,
) -> Result<DFlashHead> {
    let info = target.info().clone();
    let hidden = o.shape.hidden_size;
    check_hidden("hidden_size", hidden, target.as_ref(), file)?;
    if let Some(&bad) = o.layer_ids.iter().find(|&&id| id >= info.num_layers) {
        return Err(Error::model_load(format!(
            "{file}: target_layer_ids {:?} names layer {bad}, but the target has {} layers (0..{}); this drafter \
             was trained for a deeper target: use a drafter trained for this one",
            o.layer_ids,
            info.num_layers,
            info.num_layers - 1
        )));
    }
    // The drafter taps hidden_states[id + 1], the output of layer id; transformers' last entry is
    // after the final norm.
    let hidden_state_ids: Vec<usize> = o.layer_ids.iter().map(|id| id + 1).collect();
    check_taps(&hidden_state_ids, w.dims("fc.weight"), hidden, info.num_layers, file, "target_layer_ids")?;
    if o.block_size <= o.first_drafting_row {
        return Err(Error::model_load(format!(
            "{file}: block_size is {}; a block holds the newest token and at least one draft",
            o.block_size
        )));
    }
    if o.mask_token_id >= info.vocab_size {
        return Err(Error::model_load(format!(
            "{file}: mask_token_id {} is outside the target's vocabulary ({} tokens); this drafter belongs to \
             another target",
            o.mask_token_id, info.vocab_size
        )));
    }
    if o.num_layers == 0 {
        return Err(Error::model_load(format!("{file}: num_hidden_layers is 0; a drafter has at least one layer")));
    }
    let layers = (0..o.num_layers)
        .map(|i| {
            Ok(DFlashLayer {
                input_norm: w.tensor(&format!("layers.{i}.input_layernorm.weight"), &[hidden])?,
                layer: HeadLayer::load(w, &LayerNames::hf(&format!("layers.{i}")), o.shape.clone())?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(DFlashHead {
        taps: hidden_state_ids
            .iter()
            .map(|&i| if i == info.num_layers { Tap::FinalNorm } else { Tap::Residual(i) })
            .collect(),
        fc: w.linear("fc", hidden, o.layer_ids.len() * hidden)?,
        hidden_norm: w.tensor("hidden_norm.weight", &[hidden])?,
        layers,
        norm: w.tensor("norm.weight", &[hidden])?,
        block_size: o.block_size,
        first_drafting_row: o.first_drafting_row,
        mask_token_id: o.mask_token_id as u32,
        embed: None,
        input_embedding_scale: o.input_embedding_scale,
        lm_head: None,
        draft_to_target: None,
        output_multiplier: o.output_multiplier,
        final_logit_softcapping: o.final_logit_softcapping.filter(|&c| c > 0.0),
        causal: o.causal,
        markov: None,
        confidence: None,
        target,
        rms_eps: o.shape.rms_eps,
    })
}

fn load_dflash(config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    let info = target.info().clone();
    if w.has("candidate_selector.hidden_projection.weight")
        || config.get("conv_kernel_size").is_some()
        || config.nested("dflash_config").is_some_and(|d| d.get("selector_rank").is_some())
    {
        return Err(Error::config(format!(
            "{file} is a DFlash2 drafter (dynamic convolutions and a candidate selector); specrs reads DFlash \
             drafters (DFlashDraftModel) only: use one of those"
        )));
    }
    if w.has("markov_head.markov_w1.weight") {
        return Err(Error::config(format!(
            "{file} is a DSpark drafter (it has a Markov head); set \"method\": \"dspark\""
        )));
    }
    // dflash reads each option from `dflash_config` first, then from the config itself.
    let dflash_config = config.nested("dflash_config");
    let option = |key: &str| -> &Config {
        match &dflash_config {
            Some(d) if d.get(key).is_some() => d,
            _ => config,
        }
    };
    if let Some(vocab) = config.opt_usize("vocab_size")? {
        check_vocab(vocab, target.as_ref(), &file)?;
    }
    if let Some(layer_types) = config.get("layer_types").and_then(Value::as_array) {
        if layer_types.iter().any(|t| t.as_str() != Some("full_attention")) {
            return Err(Error::config(format!(
                "{file}: layer_types {} has sliding-window layers; specrs runs DFlash drafters whose layers all \
                 attend to the whole context (\"full_attention\")",
                Value::Array(layer_types.clone())
            )));
        }
    }
    let num_layers = config.usize("num_hidden_layers")?;
    let num_target_layers = config.opt_usize("num_target_layers")?;
    let explicit_ids = option("target_layer_ids").usize_list("target_layer_ids")?;
    if let Some(n) = num_target_layers.filter(|&n| n != info.num_layers && explicit_ids.is_none()) {
        return Err(Error::model_load(format!(
            "{file}: num_target_layers is {n} but the target has {} layers; this drafter was trained for another \
             target: use a drafter trained for this one",
            info.num_layers
        )));
    }
    let mask_token_id = option("mask_token_id").opt_usize("mask_token_id")?.ok_or_else(|| {
        Error::model_load(format!(
            "{file}: mask_token_id is missing (in dflash_config or at the top level); a DFlash drafter fills its \
             block with the mask token it was trained with"
        ))
    })?;
    let options = BlockDrafterOptions {
        layer_ids: explicit_ids.unwrap_or_else(|| dflash_default_layer_ids(info.num_layers, num_layers.max(1))),
        num_layers,
        block_size: option("block_size").opt_usize("block_size")?.unwrap_or(16),
        first_drafting_row: 1,
        mask_token_id,
        input_embedding_scale: option("input_embedding_scale").opt_f64("input_embedding_scale")?.unwrap_or(1.0),
        output_multiplier: option("output_multiplier").opt_f64("output_multiplier")?.unwrap_or(1.0),
        final_logit_softcapping: option("final_logit_softcapping").opt_f64("final_logit_softcapping")?,
        causal: config.bool_or("is_causal", false)?,
        shape: config.layer_shape(config.usize("hidden_size")?, target.as_ref(), Pairing::Halves)?,
    };
    Ok(Head::Block(Arc::new(block_drafter(options, w, target, &file)?)))
}

/// mlx-dspark's standalone DSpark config (Qwen3 family): the DFlash drafter's keys at the top
/// level (SpecForge's packaging nests `target_layer_ids` and `mask_token_id` in `dflash_config`),
/// plus `logits_start`, `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`,
/// `draft_vocab_size` (with `d2t`), and its own `embed_tokens` / `lm_head` when it ships them.
/// What mlx-dspark reads but specrs does not run is refused by name.
fn load_dspark(config: &Config, w: &mut HeadWeights, target: Arc<dyn CausalLm>) -> Result<Head> {
    let file = config.file.clone();
    let info = target.info().clone();
    let model_type = config.str("model_type").unwrap_or("");
    if !model_type.contains("qwen3") || model_type == "qwen3_5" {
        return Err(Error::config(format!(
            "{file}: model_type '{model_type}'; specrs reads Qwen3-family DSpark drafters (model_type qwen3); Gemma 4 \
             drafters (RoPE and taps defined in mlx-vlm) and qwen3_5's gated, offset-norm layers are not read"
        )));
    }
    for key in ["log_snr_conditioning", "attention_sink_bias", "enable_qwen35_gated_q_proj"] {
        if config.bool_or(key, false)? {
            return Err(Error::config(format!("{file}: {key} is true; specrs does not run that DSpark option")));
        }
    }
    if config.get("rope_is_neox_style").is_some_and(|v| v == &Value::Bool(false))
        || config.get("sliding_window").is_some()
    {
        return Err(Error::config(format!(
            "{file}: interleaved RoPE (rope_is_neox_style false) and sliding windows are DSpark options specrs \
             does not run"
        )));
    }
    check_vocab(config.usize("vocab_size")?, target.as_ref(), &file)?;
    let nested = config.nested("dflash_config");
    let option = |key: &str| -> &Config {
        match &nested {
            Some(d) if config.get(key).is_none() && d.get(key).is_some() => d,
            _ => config,
        }
    };
    let layer_ids = option("target_layer_ids").usize_list("target_layer_ids")?.ok_or_else(|| {
        Error::model_load(format!("{file}: target_layer_ids is missing; a DSpark config names the layers it taps"))
    })?;
    let first_drafting_row = match (config.opt_usize("logits_start")?, config.get("sample_from_anchor")) {
        (Some(start), _) => start,
        (None, Some(Value::Bool(false))) => 1,
        (None, _) => 0,
    };
    let hidden = config.usize("hidden_size")?;
    let num_heads = config.usize("num_attention_heads")?;
    // DSpark's defaults, where they differ from a Llama config's.
    let mut shape = config.layer_shape(hidden, target.as_ref(), Pairing::Halves)?;
    shape.num_kv_heads = config.opt_usize("num_key_value_heads")?.unwrap_or(8.min(num_heads));
    if config.get("rope_theta").is_none() && config.nested("rope_parameters").is_none() {
        shape.rope_theta = 1e6;
    }
    let causal = config.bool_or("dflash_query_causal", false)?
        || nested.as_ref().map_or(Ok(false), |d| d.bool_or("causal", false))?;
    let options = BlockDrafterOptions {
        layer_ids,
        num_layers: config.usize("num_hidden_layers")?,
        block_size: option("block_size").usize("block_size")?,
        first_drafting_row,
        mask_token_id: option("mask_token_id").usize("mask_token_id")?,
        input_embedding_scale: info.embed_scale.map_or(1.0, f64::from),
        output_multiplier: 1.0,
        final_logit_softcapping: config.opt_f64("final_logit_softcapping")?,
        causal,
        shape,
    };
    let mut head = block_drafter(options, w, target, &file)?;
    let out_vocab = match config.opt_usize("draft_vocab_size")? {
        Some(v) if v != info.vocab_size => {
            if !w.has("d2t") {
                return Err(Error::model_load(format!(
                    "{file}: draft_vocab_size is {v} but there is no 'd2t' tensor mapping the draft vocabulary to the \
                     target's; add the d2t tensor the drafter was trained with"
                )));
            }
            let offsets: Vec<i64> = w.ids("d2t", v)?.into_iter().enumerate().map(|(i, d)| i as i64 + d).collect();
            let ids = draft_ids(offsets, info.vocab_size, "d2t", &file)?;
            head.draft_to_target = Some(Tensor::new(ids, head.norm.device())?);
            v
        }
        _ => info.vocab_size,
    };
    if w.has("embed_tokens.weight") {
        // Its own table, unscaled for the Qwen3 family (mlx-dspark scales Gemma 4's only); a head
        // reusing the target's embeds as the target does (`input_embedding_scale` above).
        head.embed = Some(w.tensor("embed_tokens.weight", &[info.vocab_size, hidden])?);
        head.input_embedding_scale = 1.0;
    }
    if w.has("lm_head.weight") || out_vocab != info.vocab_size {
        head.lm_head = Some(w.linear("lm_head", out_vocab, hidden)?);
    }
    let rank = config.opt_usize("markov_rank")?.unwrap_or(256);
    if rank > 0 {
        head.markov = Some(MarkovHead {
            w1: w.tensor("markov_head.markov_w1.weight", &[info.vocab_size, rank])?,
            w2: w.linear("markov_head.markov_w2", out_vocab, rank)?,
        });
    }
    if config.bool_or("enable_confidence_head", true)? {
        let with_markov = config.bool_or("confidence_head_with_markov", true)? && head.markov.is_some();
        head.confidence = Some(ConfidenceHead {
            proj: w.linear("confidence_head.proj", 1, hidden + if with_markov { rank } else { 0 })?,
            with_markov,
        });
    }
    Ok(Head::Block(Arc::new(head)))
}
