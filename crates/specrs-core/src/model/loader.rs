//! `load`: a GGUF file to the backend that runs it (`cpu/` on the CPU for every family it runs,
//! `candle/` otherwise), after its family and every tensor shape were checked.
//!
//! Invariant: the one place that picks a backend, so both read the same config and names.

use candle_core::Device;

use super::families::{self, SUPPORTED_ARCHITECTURES};
use super::{candle, cpu, CausalLm};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Opens a GGUF file and builds the model its `general.architecture` names.
pub fn load(gguf: &mut GgufFile, device: &Device) -> Result<Box<dyn CausalLm>> {
    let architecture = gguf.get_str("general.architecture")?.to_string();
    if !families::GGUF_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(Error::model_load(format!(
            "{}: unsupported architecture '{architecture}'; specrs runs {SUPPORTED_ARCHITECTURES}",
            gguf.path.display()
        )));
    }
    let config = families::from_gguf(gguf, &architecture)?;
    if device.is_cpu() && cpu::decoder::CpuDecoder::runs(&config) {
        return Ok(Box::new(cpu::decoder::CpuDecoder::load(gguf, config)?));
    }
    Ok(Box::new(candle::decoder::Decoder::from_gguf(gguf, config, device)?))
}
