//! `load`: a GGUF file to the backend that runs it (`cpu/` on the CPU for every family it runs,
//! `candle/` otherwise), after its family and every tensor shape were checked.
//!
//! Invariant: the one place that picks a backend, so both read the same config and names.

use candle_core::Device;

use super::config::DecoderConfig;
use super::families::{self, SUPPORTED_ARCHITECTURES};
use super::{candle, cpu, CausalLm};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Opens a GGUF file and builds the model its `general.architecture` names.
pub fn load(gguf: &mut GgufFile, device: &Device) -> Result<Box<dyn CausalLm>> {
    load_capped(gguf, device, None)
}

/// `load`, with the context capped at `max_model_len` tokens (`cap_context`).
pub fn load_capped(gguf: &mut GgufFile, device: &Device, max_model_len: Option<usize>) -> Result<Box<dyn CausalLm>> {
    let architecture = gguf.get_str("general.architecture")?.to_string();
    if !families::GGUF_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(Error::model_load(format!(
            "{}: unsupported architecture '{architecture}'; specrs runs {SUPPORTED_ARCHITECTURES}",
            gguf.path.display()
        )));
    }
    let mut config = families::from_gguf(gguf, &architecture)?;
    cap_context(&mut config, max_model_len, &gguf.path.display().to_string())?;
    if device.is_cpu() && cpu::decoder::CpuDecoder::runs(&config) {
        return Ok(Box::new(cpu::decoder::CpuDecoder::load(gguf, config)?));
    }
    Ok(Box::new(candle::decoder::Decoder::from_gguf(gguf, config, device)?))
}

/// Caps the model's context at `max_model_len` tokens (vLLM's `--max-model-len`). Every KV cache,
/// RoPE table and context check reads `config.context_length`, so capping it here bounds them all;
/// a cap above what the model was trained for is refused, as vLLM refuses it.
pub fn cap_context(config: &mut DecoderConfig, max_model_len: Option<usize>, source: &str) -> Result<()> {
    let Some(cap) = max_model_len else { return Ok(()) };
    if cap == 0 {
        return Err(Error::config(
            "max_model_len must be at least 1 token; leave it unset for the model's own context",
        ));
    }
    if cap > config.context_length {
        return Err(Error::config(format!(
            "max_model_len {cap} is larger than the context of {source} ({} tokens); pass at most {}",
            config.context_length, config.context_length
        )));
    }
    config.context_length = cap;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::llama_config::LlamaConfig;

    fn config() -> DecoderConfig {
        DecoderConfig::from_llama(&LlamaConfig { max_position_embeddings: 2048, ..LlamaConfig::llama3_8b() })
    }

    #[test]
    fn a_cap_within_the_context_shortens_it() {
        let mut c = config();
        cap_context(&mut c, Some(512), "m.gguf").unwrap();
        assert_eq!(c.context_length, 512);
        cap_context(&mut c, None, "m.gguf").unwrap();
        assert_eq!(c.context_length, 512);
    }

    #[test]
    fn a_cap_past_the_context_or_zero_is_refused() {
        let err = cap_context(&mut config(), Some(4096), "m.gguf").unwrap_err().to_string();
        assert!(err.contains("max_model_len 4096 is larger than the context of m.gguf (2048 tokens)"), "{err}");
        assert!(cap_context(&mut config(), Some(0), "m.gguf").is_err());
    }
}
