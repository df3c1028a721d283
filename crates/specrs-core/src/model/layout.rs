//! One description of each family's weights, read by both backends and both file formats: which
//! tensor holds each weight of a block (GGUF names as llama.cpp writes them, Hugging Face names as
//! transformers does) and the family flags that say which of them a model must have.
//!
//! `gguf_layout.rs` checks a GGUF file's shapes against these names, and `block.rs` loads every
//! block by them, for both backends and both formats.
//!
//! Invariant: a weight's name exists here once per format; a backend never spells a tensor name
//! itself, so the two backends cannot read different tensors for one model.

use super::config::DecoderConfig;

/// The two naming schemes specrs reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// GGUF (llama.cpp's `convert_hf_to_gguf.py`): `blk.{i}.attn_q`, ...
    Gguf,
    /// Hugging Face safetensors (transformers): `model.layers.{i}.self_attn.q_proj`, ...
    Hf,
}

/// A weight's role in a decoder block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    AttnNorm,
    /// q, k and v in one matrix (Phi-3).
    Qkv,
    Q,
    K,
    V,
    /// Per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3).
    QNorm,
    KNorm,
    AttnOutput,
    /// The norm after attention, before the residual (Gemma 3's sandwich).
    PostAttnNorm,
    FfnNorm,
    /// Gate and up in one matrix of twice the width (Phi-3).
    GateUp,
    Gate,
    Up,
    Down,
    /// The norm after the MLP, before the residual (Gemma 3's sandwich).
    PostFfnNorm,
}

/// A weight outside the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    Embedding,
    /// The LM head when it is not the embedding.
    Output,
    FinalNorm,
}

/// Family facts beyond the config's sizes: which optional weights a model of the family must
/// hold (without them it would run as another model rather than fail, so they are required, as
/// llama.cpp requires them) and how its graph differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// Qwen2's q/k/v biases.
    pub qkv_bias: bool,
    /// Qwen3's and Gemma 3's per-head q/k norms.
    pub qk_norm: bool,
    /// Gemma 3's norms after attention and after the MLP.
    pub sandwich_norms: bool,
    /// Gemma's HF checkpoints store RMSNorm weights as offsets from 1 (`(1 + w) * x`); its GGUF
    /// files store the sum.
    pub hf_norm_offset: bool,
    /// llama.cpp's graphs scale q before q·k (Gemma 3, Phi-3) rather than the scores; the two round
    /// differently unless the scale is a power of two.
    pub scale_query: bool,
}

impl Family {
    pub fn of(config: &DecoderConfig) -> Self {
        let arch = config.architecture.as_str();
        Self {
            qkv_bias: arch == "qwen2",
            qk_norm: matches!(arch, "qwen3" | "gemma3"),
            sandwich_norms: arch == "gemma3",
            hf_norm_offset: arch == "gemma3",
            scale_query: matches!(arch, "gemma3" | "phi3"),
        }
    }
}

/// The tensor (without `.weight` / `.bias`) that holds `role` of block `layer`.
pub fn block_tensor(naming: Naming, family: &Family, layer: usize, role: Role) -> String {
    let part = match naming {
        Naming::Gguf => match role {
            Role::AttnNorm => "attn_norm",
            Role::Qkv => "attn_qkv",
            Role::Q => "attn_q",
            Role::K => "attn_k",
            Role::V => "attn_v",
            Role::QNorm => "attn_q_norm",
            Role::KNorm => "attn_k_norm",
            Role::AttnOutput => "attn_output",
            Role::PostAttnNorm => "post_attention_norm",
            Role::FfnNorm => "ffn_norm",
            Role::GateUp | Role::Up => "ffn_up",
            Role::Gate => "ffn_gate",
            Role::Down => "ffn_down",
            Role::PostFfnNorm => "post_ffw_norm",
        },
        Naming::Hf => match role {
            Role::AttnNorm => "input_layernorm",
            Role::Qkv => "self_attn.qkv_proj",
            Role::Q => "self_attn.q_proj",
            Role::K => "self_attn.k_proj",
            Role::V => "self_attn.v_proj",
            Role::QNorm => "self_attn.q_norm",
            Role::KNorm => "self_attn.k_norm",
            Role::AttnOutput => "self_attn.o_proj",
            // Gemma 3 has four norms: its post_attention_layernorm follows attention, and its
            // pre_feedforward_layernorm is what the others call post_attention_layernorm.
            Role::PostAttnNorm => "post_attention_layernorm",
            Role::FfnNorm if family.sandwich_norms => "pre_feedforward_layernorm",
            Role::FfnNorm => "post_attention_layernorm",
            Role::GateUp => "mlp.gate_up_proj",
            Role::Gate => "mlp.gate_proj",
            Role::Up => "mlp.up_proj",
            Role::Down => "mlp.down_proj",
            Role::PostFfnNorm => "post_feedforward_layernorm",
        },
    };
    match naming {
        Naming::Gguf => format!("blk.{layer}.{part}"),
        Naming::Hf => format!("model.layers.{layer}.{part}"),
    }
}

/// Where one input's projections are stored: one fused matrix whose output rows are cut into
/// `widths` (Phi-3's q/k/v and gate/up), or one tensor per projection, `widths[i]` rows each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Projection {
    Fused { tensor: String, widths: Vec<usize> },
    Separate { tensors: Vec<String>, widths: Vec<usize> },
}

/// q/k/v and gate/up of block `layer`, fused or separate as the file stores them (`has_weight`
/// says whether it holds a `.weight` tensor).
pub fn projections(
    naming: Naming,
    config: &DecoderConfig,
    layer: usize,
    has_weight: impl Fn(&str) -> bool,
) -> (Projection, Projection) {
    let family = Family::of(config);
    let t = |role| block_tensor(naming, &family, layer, role);
    let has = |role| has_weight(&block_weight(naming, &family, layer, role));
    let (q_width, kv_width) = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim);
    let qkv_widths = vec![q_width, kv_width, kv_width];
    let qkv = if has(Role::Qkv) {
        Projection::Fused { tensor: t(Role::Qkv), widths: qkv_widths }
    } else {
        Projection::Separate { tensors: vec![t(Role::Q), t(Role::K), t(Role::V)], widths: qkv_widths }
    };
    // HF names a fused gate/up `mlp.gate_up_proj`, a name of its own; GGUF names it `ffn_up`, like
    // a separate up, so there a separate gate marks separate projections.
    let fused_gate_up = match naming {
        Naming::Hf => has(Role::GateUp),
        Naming::Gguf => !has(Role::Gate),
    };
    let ffn_widths = vec![config.intermediate_size; 2];
    let gate_up = if fused_gate_up {
        Projection::Fused { tensor: t(Role::GateUp), widths: ffn_widths }
    } else {
        Projection::Separate { tensors: vec![t(Role::Gate), t(Role::Up)], widths: ffn_widths }
    };
    (qkv, gate_up)
}

/// `block_tensor(..).weight`.
pub fn block_weight(naming: Naming, family: &Family, layer: usize, role: Role) -> String {
    format!("{}.weight", block_tensor(naming, family, layer, role))
}

/// The tensor (without `.weight`) of a weight outside the blocks.
pub fn global_tensor(naming: Naming, global: Global) -> &'static str {
    match (naming, global) {
        (Naming::Gguf, Global::Embedding) => "token_embd",
        (Naming::Gguf, Global::Output) => "output",
        (Naming::Gguf, Global::FinalNorm) => "output_norm",
        (Naming::Hf, Global::Embedding) => "model.embed_tokens",
        (Naming::Hf, Global::Output) => "lm_head",
        (Naming::Hf, Global::FinalNorm) => "model.norm",
    }
}

/// `global_tensor(..).weight`.
pub fn global_weight(naming: Naming, global: Global) -> String {
    format!("{}.weight", global_tensor(naming, global))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_each_format_and_gemma_renames_its_norms() {
        let plain = Family {
            qkv_bias: false,
            qk_norm: false,
            sandwich_norms: false,
            hf_norm_offset: false,
            scale_query: false,
        };
        let gemma = Family { sandwich_norms: true, ..plain };
        assert_eq!(block_weight(Naming::Gguf, &plain, 3, Role::Q), "blk.3.attn_q.weight");
        assert_eq!(block_weight(Naming::Hf, &plain, 3, Role::Q), "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(block_tensor(Naming::Hf, &plain, 0, Role::FfnNorm), "model.layers.0.post_attention_layernorm");
        assert_eq!(block_tensor(Naming::Hf, &gemma, 0, Role::FfnNorm), "model.layers.0.pre_feedforward_layernorm");
        assert_eq!(global_weight(Naming::Hf, Global::Embedding), "model.embed_tokens.weight");
    }
}
