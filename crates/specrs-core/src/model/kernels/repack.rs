//! Quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) repacked at load into 8-row
//! interleaved tiles of 32 values, multiplied with activation rows quantized to int8 blocks of 32
//! by a kernel set's `PackedKernels` (the AVX-512 VNNI one: `x86_avx512_vnni/packed.rs`);
//! `reference_dot` is their scalar twin.
//!
//! Every format becomes the same thing: an unsigned integer `u` per weight (the nibble, the
//! 5- or 6-bit value, or the Q8_0 byte + 128) with x = d * u + m per 32 values. For the symmetric
//! formats m = -c * d (c = 8, 16, 128, and 32 for Q6_K, whose two 16-value halves have scales of
//! their own) and the offset is taken out of the integer dot exactly (`dot(u, q) - c * sum(q)`);
//! for Q4_1 and Q4_K (d = the sub-block's d * scale, m = -dmin * min) it is one more fused
//! multiply-add with the block's activation sum. A tile holds one block of 8 consecutive weight
//! rows, arranged so that one `vpdpbusd` dots 4 values of all 8 rows with 4 broadcast activation
//! values: lane r of the 8 x i32 result is weight row r. Per block and activation row the work is
//! 8 `vpdpbusd`, one conversion and two float operations for 8 output features, and the unpacked
//! weight tile is reused for up to `ROW_GROUP` activation rows (verification, prefill).
//!
//! Tile layout (bytes):
//! - 4-bit values (Q4_0, Q4_1, Q4_K, and the low bits of Q5_0 and Q6_K): four 32-byte vectors
//!   P_j; byte 4r+i of P_j holds row r's value 4j+i in its low nibble and value 4(j+4)+i in its
//!   high nibble;
//! - Q5_0 then adds eight little-endian u32 masks: bit 4r+i of mask k is the fifth bit of row r's
//!   value 4k+i; Q6_K adds two 32-byte vectors: bits 2(k % 4) of byte 4r+i of vector k / 4 are
//!   bits 4-5 of row r's value 4k+i;
//! - Q8_0: eight 32-byte vectors V_k, byte 4r+i = row r's value 4k+i, plus 128;
//! - then the 8 rows' scales d and (Q4_1) m as f16 (the tile is then exactly the 8 blocks' size);
//!   the K-quants keep their integer sub-block scales instead (Q4_K: scale and min, 6 bits each,
//!   packed little-endian into 12 bytes, the 8 rows' scales first; Q6_K: the two halves' i8 scales,
//!   8 bytes each), and each super-block's f16 d (and Q4_K's dmin) of the 8 rows goes once into
//!   `Repacked::super_scales` (run-major like the tiles, `tile_index` over super-blocks). So a
//!   K-quant weight is exactly its ggml size too, and the kernel multiplies d by the integer scale
//!   in registers: the same exact f32 product the ggml dequantization forms.
//!
//! Invariant: an output is a function of its weight row and its activation row alone, computed
//! by the same operations in the same order whatever the number of rows in the call, the row's
//! position among them, or how many feature groups one pass covers; so a row computes bitwise
//! the same alone, batched, in verification or in prefill.

use half::f16;
use rayon::prelude::*;

use super::format::Format;
use super::kquants;
use super::parallel::{for_each_task, SharedPtr};
use super::PackedKernels;

/// Weight rows interleaved in one tile (the i32 lanes of a 256-bit vector).
pub const TILE_ROWS: usize = 8;
const BLOCK: usize = 32;
/// Activation rows dotted with one unpacked tile before the next tile is read (with a run's 4
/// tiles, 16 accumulators: what the 32 vector registers hold beside a tile).
pub(crate) const ROW_GROUP: usize = 4;
/// Feature groups (of `TILE_ROWS`) stored block-major together and handled by one task: decoding
/// dots them with its single activation row, sharing the activation broadcasts.
pub(crate) const RUN_GROUPS: usize = 4;
/// How many blocks ahead of the one being read the kernel prefetches weights.
pub(crate) const PREFETCH_BLOCKS: usize = 4;

/// Whether `format` has a repacked kernel.
pub fn supports(format: Format) -> bool {
    matches!(format, Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q8_0 | Format::Q4K | Format::Q6K)
}

/// Bytes of one tile: 8 rows x 32 values.
pub(crate) fn tile_bytes(format: Format) -> usize {
    match format {
        // The 8 ggml blocks it replaces.
        Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q8_0 => TILE_ROWS * format.block_bytes(),
        // Nibbles, then the 8 rows' 6-bit scales and mins (12 bytes): with the super-block's
        // d and dmin (4 bytes per row per 8 tiles), 144 bytes per tile, as Q4_K.
        Format::Q4K => 128 + 12,
        // Low nibbles, 2 high bits per value, and the two 16-value halves' i8 scales: with the
        // super-block's d, 210 bytes per tile, as Q6_K.
        Format::Q6K => 128 + 64 + 2 * TILE_ROWS,
    }
}

/// Bytes of one group's super-block scales (`Repacked::super_scales`): the 8 rows' f16 d, then
/// (Q4_K) their f16 dmin; none for the formats without super-blocks.
pub(crate) fn super_scale_bytes(format: Format) -> usize {
    match format {
        Format::Q4K => 2 * 2 * TILE_ROWS,
        Format::Q6K => 2 * TILE_ROWS,
        _ => 0,
    }
}

/// Blocks of 32 values per K-quant super-block.
pub(crate) const SUPER_BLOCKS: usize = 8;

/// Q4_K's 8 rows' 6-bit scales (`scales[r]`) and mins packed little-endian into 12 bytes: bits
/// 6r.. are row r's scale, bits 48 + 6r.. its min.
fn pack_q4k_scales(scales: [u8; TILE_ROWS], mins: [u8; TILE_ROWS]) -> [u8; 12] {
    let field = |v: [u8; TILE_ROWS]| v.iter().enumerate().fold(0u64, |f, (r, &x)| f | ((x as u64 & 0x3F) << (6 * r)));
    let bits = field(scales) as u128 | (field(mins) as u128) << 48;
    bits.to_le_bytes()[..12].try_into().expect("12 bytes")
}

/// `pack_q4k_scales`'s inverse: (scales, mins).
fn unpack_q4k_scales(packed: &[u8]) -> ([u8; TILE_ROWS], [u8; TILE_ROWS]) {
    let mut bytes = [0u8; 16];
    bytes[..12].copy_from_slice(&packed[..12]);
    let bits = u128::from_le_bytes(bytes);
    let field = |at: usize| std::array::from_fn(|r| ((bits >> (at + 6 * r)) & 0x3F) as u8);
    (field(0), field(48))
}

/// Where a tile's scales start.
pub(crate) fn scales_at(format: Format) -> usize {
    match format {
        Format::Q4_0 | Format::Q4_1 | Format::Q4K => 128,
        Format::Q5_0 => 160,
        Format::Q6K => 192,
        _ => 256,
    }
}

/// The unsigned values of 32-value block `b` of a ggml weight row (for Q4_K, sub-block b % 8 of
/// super-block b / 8), with the block's scale d and offset m: x = d * u + m for Q4_1 and Q4_K,
/// x = d * (u - `offset`) for the symmetric formats (m = 0 here), and for Q6_K, whose 16-value
/// halves have scales of their own, x = d * (u - 32) for values 0..16 and m * (u - 32) after.
fn unpack_block(format: Format, row: &[u8], b: usize) -> ([u8; BLOCK], f32, f32) {
    if let Some((u, scales)) = unpack_kquant_block(format, row, b) {
        return (u, scales.d(), scales.m());
    }
    let mut u = [0u8; BLOCK];
    let nibbles = |qs: &[u8], u: &mut [u8; BLOCK]| {
        for j in 0..16 {
            u[j] = qs[j] & 0x0F;
            u[j + 16] = qs[j] >> 4;
        }
    };
    let f16_at = |blk: &[u8], at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
    let bb = format.block_bytes();
    let blk = &row[b * bb..(b + 1) * bb];
    let d = f16_at(blk, 0);
    match format {
        Format::Q4_0 => nibbles(&blk[2..18], &mut u),
        Format::Q4_1 => {
            nibbles(&blk[4..20], &mut u);
            return (u, d, f16_at(blk, 2));
        }
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            nibbles(&blk[6..22], &mut u);
            for (j, v) in u.iter_mut().enumerate() {
                *v |= (((qh >> j) & 1) as u8) << 4;
            }
        }
        Format::Q8_0 => {
            for (v, &q) in u.iter_mut().zip(&blk[2..34]) {
                *v = q ^ 0x80; // q + 128 as an unsigned byte
            }
        }
        Format::Q4K | Format::Q6K => unreachable!("handled above"),
    }
    (u, d, 0.0)
}

/// A K-quant block's scales as stored: the super-block's f16 d and dmin (Q6_K: no dmin) and the
/// block's integer scales (Q4_K: scale and min; Q6_K: the two halves' scales).
#[derive(Clone, Copy)]
struct KScales {
    format: Format,
    d: f16,
    dmin: f16,
    a: i32,
    b: i32,
}

impl KScales {
    /// The block's scale: d * scale (Q6_K: the first half's). Exact in f32: an 11-bit f16
    /// mantissa times an integer of at most 8 bits.
    fn d(self) -> f32 {
        self.d.to_f32() * self.a as f32
    }

    /// The block's offset -dmin * min (Q4_K), or the second half's scale d * scale (Q6_K).
    fn m(self) -> f32 {
        match self.format {
            Format::Q4K => -(self.dmin.to_f32() * self.b as f32),
            _ => self.d.to_f32() * self.b as f32,
        }
    }
}

/// For the K-quants, the unsigned values of sub-block b % 8 of super-block b / 8 and its scales.
fn unpack_kquant_block(format: Format, row: &[u8], b: usize) -> Option<([u8; BLOCK], KScales)> {
    let mut u = [0u8; BLOCK];
    let f16_at = |blk: &[u8], at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]);
    match format {
        Format::Q4K => {
            let blk = &row[b / 8 * kquants::Q4K_BYTES..][..kquants::Q4K_BYTES];
            let (scales, mins) = kquants::q4k_scales_mins(&blk[4..16]);
            let j = b % 8;
            // Sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c+31.
            let qs = &blk[16 + 32 * (j / 2)..][..32];
            for (v, &q) in u.iter_mut().zip(qs) {
                *v = if j.is_multiple_of(2) { q & 0x0F } else { q >> 4 };
            }
            let (a, b) = (scales[j], mins[j]);
            Some((u, KScales { format, d: f16_at(blk, 0), dmin: f16_at(blk, 2), a, b }))
        }
        Format::Q6K => {
            let blk = &row[b / 8 * kquants::Q6K_BYTES..][..kquants::Q6K_BYTES];
            let c = b % 8;
            let (half, k) = (c / 4, c % 4);
            for (i, v) in u.iter_mut().enumerate() {
                let l = blk[64 * half + 32 * (k % 2) + i];
                let low = if k < 2 { l & 0x0F } else { l >> 4 };
                *v = low | (((blk[128 + 32 * half + i] >> (2 * k)) & 3) << 4);
            }
            let scale = |i: usize| blk[192 + 2 * c + i] as i8 as i32;
            Some((u, KScales { format, d: f16_at(blk, 208), dmin: f16::ZERO, a: scale(0), b: scale(1) }))
        }
        _ => None,
    }
}

/// Row `r`'s scale d and offset m in a tile (`sup`: its group's super-block scales, K-quants).
fn tile_scales(format: Format, tile: &[u8], sup: &[u8], r: usize) -> (f32, f32) {
    let s = scales_at(format);
    let at = |bytes: &[u8], i: usize| f16::from_le_bytes([bytes[i], bytes[i + 1]]);
    let (a, b) = match format {
        Format::Q4K => {
            let (scales, mins) = unpack_q4k_scales(&tile[s..]);
            (scales[r] as i32, mins[r] as i32)
        }
        Format::Q6K => (tile[s + r] as i8 as i32, tile[s + TILE_ROWS + r] as i8 as i32),
        _ => {
            let m = if format == Format::Q4_1 { at(tile, s + 16 + 2 * r).to_f32() } else { 0.0 };
            return (at(tile, s + 2 * r).to_f32(), m);
        }
    };
    let dmin = if format == Format::Q4K { at(sup, 2 * TILE_ROWS + 2 * r) } else { f16::ZERO };
    let k = KScales { format, d: at(sup, 2 * r), dmin, a, b };
    (k.d(), k.m())
}

/// Writes row `r`'s scales into `tile` (the formats without super-blocks).
fn set_tile_scales(format: Format, tile: &mut [u8], r: usize, d: f32, m: f32) {
    let s = scales_at(format);
    // d and m came from f16: converting back is exact.
    tile[s + 2 * r..s + 2 * r + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    if format == Format::Q4_1 {
        tile[s + 16 + 2 * r..s + 18 + 2 * r].copy_from_slice(&f16::from_f32(m).to_le_bytes());
    }
}

/// A `[out_features, in_features]` weight in tiles. Feature groups go in runs of
/// `RUN_GROUPS`, block-major within a run (tile (g, b) at `Repacked::tile_index`), so that
/// decoding, which dots one run's groups block by block, reads each thread's weights as one
/// sequential stream.
pub struct Repacked {
    pub(crate) format: Format,
    pub(crate) tiles: Vec<u8>,
    /// The K-quants' per-super-block d (and dmin) of each group's 8 rows, `super_scale_bytes`
    /// each, at `tile_index(num_groups, num_super_blocks, g, s)`; empty for the other formats.
    pub(crate) super_scales: Vec<u8>,
    pub(crate) out_features: usize,
    pub(crate) in_features: usize,
}

impl Repacked {
    /// `data`: the ggml blocks of `format`, row-major; `out_features` a multiple of `TILE_ROWS`
    /// and `in_features` of 32 (checked by the caller, `QLinear::new`).
    pub fn new(format: Format, data: &[u8], out_features: usize, in_features: usize) -> Self {
        assert!(
            supports(format)
                && out_features.is_multiple_of(TILE_ROWS)
                && in_features.is_multiple_of(format.block_len())
        );
        let (tb, num_blocks) = (tile_bytes(format), in_features / BLOCK);
        let row_bytes = in_features / format.block_len() * format.block_bytes();
        assert_eq!(data.len(), out_features * row_bytes, "repack: weight byte count");
        let num_groups = out_features / TILE_ROWS;
        let mut tiles = vec![0u8; num_groups * num_blocks * tb];
        // One run of groups per rayon task: runs are contiguous (`tile_index`).
        tiles.par_chunks_mut(RUN_GROUPS * num_blocks * tb).enumerate().for_each(|(run, run_tiles)| {
            for g in run * RUN_GROUPS..((run + 1) * RUN_GROUPS).min(num_groups) {
                Self::fill_group(
                    format,
                    data,
                    row_bytes,
                    num_groups,
                    num_blocks,
                    g,
                    run_tiles,
                    run * RUN_GROUPS * num_blocks,
                );
            }
        });
        let super_scales = Self::super_scales(format, data, row_bytes, num_groups, num_blocks);
        Repacked { format, tiles, super_scales, out_features, in_features }
    }

    /// The K-quants' `super_scales`, copied from the f16 fields of each row's super-blocks.
    fn super_scales(format: Format, data: &[u8], row_bytes: usize, num_groups: usize, num_blocks: usize) -> Vec<u8> {
        let ssb = super_scale_bytes(format);
        if ssb == 0 {
            return Vec::new();
        }
        let (num_super, super_bytes) = (num_blocks / SUPER_BLOCKS, format.block_bytes());
        // Where d (and Q4_K's dmin) sit in a ggml super-block.
        let fields: &[usize] = if format == Format::Q4K { &[0, 2] } else { &[208] };
        let mut out = vec![0u8; num_groups * num_super * ssb];
        for g in 0..num_groups {
            for s in 0..num_super {
                let at = tile_index(num_groups, num_super, g, s) * ssb;
                for r in 0..TILE_ROWS {
                    let blk = &data[(g * TILE_ROWS + r) * row_bytes + s * super_bytes..][..super_bytes];
                    for (f, &field) in fields.iter().enumerate() {
                        out[at + f * 2 * TILE_ROWS + 2 * r..][..2].copy_from_slice(&blk[field..field + 2]);
                    }
                }
            }
        }
        out
    }

    /// Writes feature group `g`'s tiles into `run_tiles`, the tiles of its run (which start at
    /// tile `first_tile`).
    #[allow(clippy::too_many_arguments)]
    fn fill_group(
        format: Format,
        data: &[u8],
        row_bytes: usize,
        num_groups: usize,
        num_blocks: usize,
        g: usize,
        run_tiles: &mut [u8],
        first_tile: usize,
    ) {
        let tb = tile_bytes(format);
        for b in 0..num_blocks {
            let tile = &mut run_tiles[(tile_index(num_groups, num_blocks, g, b) - first_tile) * tb..][..tb];
            let mut values = [[0u8; BLOCK]; TILE_ROWS];
            let mut kscales = [[0i32; TILE_ROWS]; 2];
            for (r, u) in values.iter_mut().enumerate() {
                let row = &data[(g * TILE_ROWS + r) * row_bytes..][..row_bytes];
                if let Some((unsigned, k)) = unpack_kquant_block(format, row, b) {
                    *u = unsigned;
                    (kscales[0][r], kscales[1][r]) = (k.a, k.b);
                    continue;
                }
                let (unsigned, d, m) = unpack_block(format, row, b);
                *u = unsigned;
                set_tile_scales(format, tile, r, d, m);
            }
            let s = scales_at(format);
            match format {
                Format::Q4K => {
                    let [scales, mins] = kscales.map(|v| v.map(|x| x as u8));
                    tile[s..s + 12].copy_from_slice(&pack_q4k_scales(scales, mins));
                }
                Format::Q6K => {
                    for (half, v) in kscales.iter().enumerate() {
                        for (r, &x) in v.iter().enumerate() {
                            tile[s + half * TILE_ROWS + r] = x as i8 as u8;
                        }
                    }
                }
                _ => {}
            }
            for (r, u) in values.iter().enumerate() {
                for i in 0..4 {
                    if format == Format::Q8_0 {
                        for k in 0..8 {
                            tile[32 * k + 4 * r + i] = u[4 * k + i];
                        }
                        continue;
                    }
                    for j in 0..4 {
                        tile[32 * j + 4 * r + i] = (u[4 * j + i] & 0x0F) | (u[4 * (j + 4) + i] << 4);
                    }
                    if format == Format::Q6K {
                        for k in 0..8 {
                            let bits = (u[4 * k + i] >> 4) & 3;
                            tile[128 + 32 * (k / 4) + 4 * r + i] |= bits << (2 * (k % 4));
                        }
                    }
                    if format == Format::Q5_0 {
                        for k in 0..8 {
                            let bit = (u[4 * k + i] >> 4) & 1;
                            tile[128 + 4 * k + (4 * r + i) / 8] |= bit << ((4 * r + i) % 8);
                        }
                    }
                }
            }
        }
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes held (the tiles and the K-quants' super-block scales): the ggml blocks' size.
    pub fn resident_bytes(&self) -> usize {
        self.tiles.len() + self.super_scales.len()
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Weight row `feature` dequantized (the f32 values the kernel multiplies with).
    pub fn dequantize_row(&self, feature: usize) -> Vec<f32> {
        let (tb, num_blocks, num_groups) =
            (tile_bytes(self.format), self.in_features / BLOCK, self.out_features / TILE_ROWS);
        let (g, r) = (feature / TILE_ROWS, feature % TILE_ROWS);
        let mut out = Vec::with_capacity(self.in_features);
        for b in 0..num_blocks {
            let tile = &self.tiles[tile_index(num_groups, num_blocks, g, b) * tb..][..tb];
            let ssb = super_scale_bytes(self.format);
            let sup = &self.super_scales
                [tile_index(num_groups, num_blocks / SUPER_BLOCKS, g, b / SUPER_BLOCKS) * ssb..][..ssb];
            let (d, m) = tile_scales(self.format, tile, sup, r);
            for e in 0..BLOCK {
                let (k, i) = (e / 4, e % 4);
                let u = match self.format {
                    Format::Q8_0 => tile[32 * k + 4 * r + i],
                    _ => {
                        let byte = tile[32 * (k % 4) + 4 * r + i];
                        let nibble = if k < 4 { byte & 0x0F } else { byte >> 4 };
                        let high = match self.format {
                            Format::Q5_0 => (tile[128 + 4 * k + (4 * r + i) / 8] >> ((4 * r + i) % 8)) & 1,
                            Format::Q6K => (tile[128 + 32 * (k / 4) + 4 * r + i] >> (2 * (k % 4))) & 3,
                            _ => 0,
                        };
                        nibble | high << 4
                    }
                };
                out.push(match self.format {
                    Format::Q4_1 | Format::Q4K => d * u as f32 + m,
                    Format::Q6K if e >= 16 => m * (u as i32 - 32) as f32,
                    _ => d * (u as i32 - offset(self.format)) as f32,
                });
            }
        }
        out
    }

    /// `x`: `[num_rows, in_features]` row-major -> `[num_rows, out_features]`, on `kernels`
    /// (the packed kernels of a set this CPU runs).
    pub fn forward_rows(&self, kernels: &PackedKernels, x: &[f32], num_rows: usize) -> Vec<f32> {
        Self::forward_many(kernels, &[self], x, num_rows).pop().expect("one output per weight")
    }

    /// Several weights of the same input width applied to one input: the activations are
    /// quantized once and all products run in one parallel region (q, k, v; gate, up).
    /// Returns one `[num_rows, out_features]` matrix per weight.
    pub fn forward_many(kernels: &PackedKernels, weights: &[&Repacked], x: &[f32], num_rows: usize) -> Vec<Vec<f32>> {
        let in_features = weights[0].in_features;
        assert!(
            weights.iter().all(|w| w.in_features == in_features) && x.len() == num_rows * in_features,
            "repacked matmul: {} input values for {num_rows} rows",
            x.len()
        );
        let acts = QuantizedActivations::new(x, num_rows, in_features, kernels.quantize_block);
        let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| vec![0f32; num_rows * w.out_features]).collect();
        let out_ptrs: Vec<SharedPtr> = outs.iter_mut().map(|o| SharedPtr(o.as_mut_ptr())).collect();
        // (weight, first group, groups): a task takes one run of groups, whose tiles are one
        // contiguous stream.
        let mut tasks = Vec::new();
        for (i, w) in weights.iter().enumerate() {
            let num_groups = w.out_features / TILE_ROWS;
            for first in (0..num_groups).step_by(RUN_GROUPS) {
                tasks.push((i, first, RUN_GROUPS.min(num_groups - first)));
            }
        }
        for_each_task(tasks.len(), |task| {
            let (i, first_group, groups) = tasks[task];
            // SAFETY: the kernels are a set this CPU runs (the caller's word); tiles, activations
            // and outputs are sized above; each task writes only its own features' columns of
            // its output.
            unsafe { (kernels.groups)(weights[i], &acts, first_group, groups, num_rows, out_ptrs[i].get()) };
        });
        outs
    }
}

/// Where tile (group `g`, block `b`) sits among `num_groups * num_blocks` tiles: runs of
/// `RUN_GROUPS` groups (the last run may be shorter), block-major within a run.
pub(crate) fn tile_index(num_groups: usize, num_blocks: usize, g: usize, b: usize) -> usize {
    let run = g / RUN_GROUPS;
    let run_len = RUN_GROUPS.min(num_groups - run * RUN_GROUPS);
    run * RUN_GROUPS * num_blocks + b * run_len + g % RUN_GROUPS
}

/// The symmetric formats' integer offset c (x = d * (u - c)).
pub(crate) fn offset(format: Format) -> i32 {
    match format {
        Format::Q4_0 => 8,
        Format::Q5_0 => 16,
        Format::Q8_0 => 128,
        Format::Q6K => 32,
        _ => 0,
    }
}

/// Activation rows quantized to int8 blocks of 32: x ~ d * q, d = max|x| / 127, round half to
/// even; `sums[b]` = sum(q) and `scaled_sums[b]` = d * sum(q) per block.
pub struct QuantizedActivations {
    pub(crate) qs: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) sums: Vec<i32>,
    /// sum(q) over each block's first 16 values (Q6_K's halves).
    pub(crate) low_sums: Vec<i32>,
    pub(crate) scaled_sums: Vec<f32>,
    pub(crate) num_blocks: usize,
}

/// One block's int8 quantization (`scalar_quantize` or a set's vectorized twin); returns max|x|.
pub type QuantizeBlock = unsafe fn(&[f32; BLOCK], &mut [i8; BLOCK]) -> f32;

impl QuantizedActivations {
    /// `quantize`: `scalar_quantize` or the quantization of a set this CPU runs.
    pub fn new(x: &[f32], num_rows: usize, in_features: usize, quantize: QuantizeBlock) -> Self {
        /// Blocks one parallel task quantizes: below this a hand-off costs more than it saves.
        const BLOCKS_PER_TASK: usize = 256;
        let num_blocks = in_features / BLOCK;
        let total = num_rows * num_blocks;
        assert_eq!(x.len(), total * BLOCK, "activations: {} values for {num_rows} rows of {in_features}", x.len());
        let mut acts = QuantizedActivations {
            qs: vec![0i8; total * BLOCK],
            d: vec![0f32; total],
            sums: vec![0i32; total],
            low_sums: vec![0i32; total],
            scaled_sums: vec![0f32; total],
            num_blocks,
        };
        let out = BlockOutputs {
            qs: acts.qs.as_mut_ptr(),
            d: acts.d.as_mut_ptr(),
            sums: acts.sums.as_mut_ptr(),
            low_sums: acts.low_sums.as_mut_ptr(),
            scaled_sums: acts.scaled_sums.as_mut_ptr(),
        };
        // SAFETY (both calls): the outputs hold `total` blocks; tasks take disjoint block ranges.
        if total <= BLOCKS_PER_TASK {
            unsafe { out.quantize(x, 0..total, quantize) };
        } else {
            for_each_task(total.div_ceil(BLOCKS_PER_TASK), |task| {
                let blocks = task * BLOCKS_PER_TASK..((task + 1) * BLOCKS_PER_TASK).min(total);
                unsafe { out.quantize(x, blocks, quantize) };
            });
        }
        acts
    }
}

/// Where `QuantizedActivations::new` writes, shared by its tasks (each writes its own blocks).
#[derive(Clone, Copy)]
struct BlockOutputs {
    qs: *mut i8,
    d: *mut f32,
    sums: *mut i32,
    low_sums: *mut i32,
    scaled_sums: *mut f32,
}
// SAFETY: tasks write disjoint block ranges (see `QuantizedActivations::new`).
unsafe impl Send for BlockOutputs {}
unsafe impl Sync for BlockOutputs {}

impl BlockOutputs {
    /// Quantizes `blocks` of `x`: d = max|x| / 127, q = x * (127 / max|x|) rounded half to even.
    ///
    /// # Safety
    /// Every output holds the blocks in `blocks`, and no one else writes them meanwhile; this
    /// CPU runs `quantize`.
    unsafe fn quantize(self, x: &[f32], blocks: std::ops::Range<usize>, quantize: QuantizeBlock) {
        for b in blocks {
            let block: &[f32; BLOCK] = x[b * BLOCK..(b + 1) * BLOCK].try_into().expect("a whole block");
            let q: &mut [i8; BLOCK] = unsafe { &mut *(self.qs.add(b * BLOCK) as *mut [i8; BLOCK]) };
            // SAFETY: the caller's contract.
            let amax = unsafe { quantize(block, q) };
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            let d = amax / 127.0;
            unsafe {
                *self.d.add(b) = d;
                *self.sums.add(b) = sum;
                *self.low_sums.add(b) = q[..16].iter().map(|&v| v as i32).sum();
                *self.scaled_sums.add(b) = d * sum as f32;
            }
        }
    }
}

/// One block's int8 values; returns max|x|. The scalar twin every set's
/// `PackedKernels::quantize_block` is tested against (and the AVX2 set's own).
pub(crate) fn scalar_quantize(block: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> f32 {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(block) {
        // Round half to even by pushing the fraction out of the mantissa (|v * inv| <= 127).
        const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
        *q = ((v * inv + MAGIC) - MAGIC) as i8;
    }
    amax
}

/// The scalar reference of the kernel's arithmetic, read from the original ggml blocks (not the
/// tiles): weight row `ggml_row` (`in_features / 32` blocks of `format`) dotted with activation
/// row `row`, the same float operations in the same order.
pub fn reference_dot(format: Format, ggml_row: &[u8], a: &QuantizedActivations, row: usize) -> f32 {
    let mut acc = 0f32;
    for b in 0..a.num_blocks {
        let (u, d, m) = unpack_block(format, ggml_row, b);
        let at = row * a.num_blocks + b;
        let q = &a.qs[at * BLOCK..(at + 1) * BLOCK];
        let dot = |range: std::ops::Range<usize>| -> i32 {
            range.map(|e| (u[e] as i32 - offset(format)) * q[e] as i32).sum()
        };
        if format == Format::Q6K {
            // Each half with its own scale (m is the second half's).
            acc = (dot(0..16) as f32).mul_add(d * a.d[at], acc);
            acc = (dot(16..32) as f32).mul_add(m * a.d[at], acc);
            continue;
        }
        acc = (dot(0..BLOCK) as f32).mul_add(d * a.d[at], acc);
        if asymmetric(format) {
            acc = m.mul_add(a.scaled_sums[at], acc);
        }
    }
    acc
}

/// Q4_1 and Q4_K: x = d * u + m, the offset through the activation sums.
fn asymmetric(format: Format) -> bool {
    matches!(format, Format::Q4_1 | Format::Q4K)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// `[rows, cols]` of the kernel tests' reproducible values (`kernels::tests::random`).
    fn random(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        crate::model::kernels::tests::random(rows * cols, seed)
    }

    fn repacked(dtype: GgmlDType, format: Format, out_f: usize, in_f: usize) -> (Repacked, QTensor) {
        let w = Tensor::from_vec(random(out_f, in_f, 7), (out_f, in_f), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        (Repacked::new(format, &q.data().unwrap(), out_f, in_f), q)
    }

    /// The packed kernels of every set this CPU runs that has them.
    fn packed_sets() -> Vec<(&'static str, &'static PackedKernels)> {
        let sets = crate::model::kernels::available_sets();
        let packed: Vec<_> = sets.iter().filter_map(|s| s.packed.as_ref().map(|p| (s.name, p))).collect();
        if packed.is_empty() {
            eprintln!("no kernel set with packed weights runs on this CPU");
        }
        packed
    }

    const FORMATS: [(GgmlDType, Format); 6] = [
        (GgmlDType::Q4K, Format::Q4K),
        (GgmlDType::Q6K, Format::Q6K),
        (GgmlDType::Q4_0, Format::Q4_0),
        (GgmlDType::Q4_1, Format::Q4_1),
        (GgmlDType::Q5_0, Format::Q5_0),
        (GgmlDType::Q8_0, Format::Q8_0),
    ];

    /// The vector quantization equals the scalar one (ties included).
    #[test]
    fn vector_quantization_equals_scalar() {
        let mut x = random(64, BLOCK, 3);
        // Exact ties: with max|x| = 127 the scale is 1 and k + 0.5 rounds to the even neighbour.
        x[..BLOCK].copy_from_slice(&std::array::from_fn::<f32, BLOCK, _>(
            |i| {
                if i == 0 {
                    127.0
                } else {
                    i as f32 - 16.5
                }
            },
        ));
        for (name, packed) in packed_sets() {
            for block in x.chunks_exact(BLOCK) {
                let block: &[f32; BLOCK] = block.try_into().unwrap();
                let (mut a, mut b) = ([0i8; BLOCK], [0i8; BLOCK]);
                // SAFETY: the set runs on this CPU.
                let amax = unsafe { (packed.quantize_block)(block, &mut a) };
                assert_eq!(amax, scalar_quantize(block, &mut b), "{name}");
                assert_eq!(a, b, "{name}");
            }
        }
    }

    /// Several weights through one call equal each through its own, bitwise.
    #[test]
    fn forward_many_equals_forward_rows() {
        let (a, _) = repacked(GgmlDType::Q4_1, Format::Q4_1, 40, 512);
        let (b, _) = repacked(GgmlDType::Q8_0, Format::Q8_0, 16, 512);
        for (name, k) in packed_sets() {
            for num_rows in [1, 3, 9] {
                let x = random(num_rows, 512, 5);
                let many = Repacked::forward_many(k, &[&a, &b], &x, num_rows);
                assert_eq!(many, [a.forward_rows(k, &x, num_rows), b.forward_rows(k, &x, num_rows)], "{name}");
            }
        }
    }

    /// A repacked weight holds exactly its ggml blocks' bytes (tiles plus the K-quants' super-block
    /// scales): a step reads no more than the GGUF's own format would.
    #[test]
    fn repacked_weights_are_the_size_of_their_ggml_blocks() {
        for (dtype, format) in FORMATS {
            let (w, q) = repacked(dtype, format, 72, 512);
            assert_eq!(w.resident_bytes(), q.data().unwrap().len(), "{format:?}");
        }
    }

    /// The 6-bit scale packing round-trips every value.
    #[test]
    fn q4k_scales_pack_and_unpack() {
        let scales = std::array::from_fn(|r| (r * 9 % 64) as u8);
        let mins = std::array::from_fn(|r| (63 - r * 5) as u8);
        assert_eq!(unpack_q4k_scales(&pack_q4k_scales(scales, mins)), (scales, mins));
    }

    /// Repacking keeps every weight: the tiles dequantize to ggml's own dequantization.
    #[test]
    fn repacked_rows_dequantize_to_ggml_values() {
        for (dtype, format) in FORMATS {
            let (w, q) = repacked(dtype, format, 24, 512);
            let ggml: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            for f in 0..24 {
                assert_eq!(w.dequantize_row(f), ggml[f * 512..(f + 1) * 512], "{format:?} row {f}");
            }
        }
    }

    /// The kernel equals its scalar reference bitwise, for every row count 1..=17 (and counts
    /// past the VNNI kernel's 64-row pass), and each row is bitwise the row computed alone.
    #[test]
    fn kernel_equals_reference_and_rows_are_invariant() {
        let (out_f, in_f) = (72, 512);
        for ((dtype, format), (name, k)) in
            FORMATS.into_iter().flat_map(|f| packed_sets().into_iter().map(move |s| (f, s)))
        {
            let (w, q) = repacked(dtype, format, out_f, in_f);
            for num_rows in (1..=17).chain([64, 65, 131]) {
                let x = random(num_rows, in_f, 100 + num_rows as u64);
                let out = w.forward_rows(k, &x, num_rows);
                let acts = QuantizedActivations::new(&x, num_rows, in_f, k.quantize_block);
                let ggml = q.data().unwrap();
                let row_bytes = in_f / format.block_len() * format.block_bytes();
                // Against plain f32 arithmetic on the dequantized weights: only the activations'
                // int8 rounding differs (at most half a step, max|x| / 254, per value).
                for (f, weights) in (0..out_f).map(|f| (f, w.dequantize_row(f))) {
                    for row in 0..num_rows {
                        let xs = &x[row * in_f..(row + 1) * in_f];
                        let exact: f64 = weights.iter().zip(xs).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let bound: f64 = weights
                            .iter()
                            .zip(xs.chunks(BLOCK).flat_map(|c| {
                                let step = c.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 254.0;
                                std::iter::repeat_n(step, BLOCK)
                            }))
                            .map(|(&a, step)| a.abs() as f64 * step)
                            .sum();
                        let got = out[row * out_f + f] as f64;
                        assert!((got - exact).abs() <= bound + 1e-4, "{format:?}: {got} vs {exact} (bound {bound})");
                    }
                }
                for row in 0..num_rows {
                    let alone = w.forward_rows(k, &x[row * in_f..(row + 1) * in_f], 1);
                    assert_eq!(alone, out[row * out_f..(row + 1) * out_f], "{name} {format:?} n={num_rows} row {row}");
                    for f in (0..out_f).step_by(5) {
                        let ggml_row = &ggml[f * row_bytes..(f + 1) * row_bytes];
                        assert_eq!(
                            reference_dot(format, ggml_row, &acts, row),
                            out[row * out_f + f],
                            "{format:?} f={f}"
                        );
                    }
                }
            }
        }
    }
}
