//! The kernel over repacked weights (`repack.rs`'s tiles), written once for every instruction set
//! that has 256-bit integer vectors: `packed_tile_kernel!(features, isa)` expands to a module's
//! `groups` (the `PackedKernels::groups` of a set), compiled with `features` and doing its 4-byte
//! dots with `isa`'s functions (`x86_avx512_vnni/packed.rs`: one `vpdpbusd`; `x86_avx2/packed.rs`:
//! `vpmaddubsw` + `vpmaddwd`). One dot multiplies 4 values of 8 weight rows with 4 broadcast int8
//! activation values; lane r of the 8 x i32 result is weight row r.
//!
//! `isa` is a module with:
//! - `dpbusd(acc, u, q)`: acc + the 4-byte dots of unsigned `u` (< 128 unless
//!   `UNSIGNED_BYTES_EXACT`) and signed `q`, per i32 lane;
//! - `UNSIGNED_BYTES_EXACT`: whether `dpbusd` is exact for every u8 (VNNI) or only below 128
//!   (`vpmaddubsw` saturates its i16 pairs); when not, Q8_0's values (u = w + 128) go through
//!   `dot_offset_bytes(acc, u, q)` = acc + the dots of (u - 128) and q, and skip the offset
//!   correction: the same integers, so the same floats;
//! - `add_where_bits(v, bits, x)`: x added to byte i of v where bit i of `bits` is set.
//!
//! Invariant: an output is a function of its weight row and its activation row alone, computed by
//! the same operations in the same order whatever the number of rows or groups in the call, and
//! equal bitwise to `repack::reference_dot` on every set (the integer dots are exact).

/// Expands to the tile kernel compiled with `$features`, its dots from module `$isa` (above).
macro_rules! packed_tile_kernel {
    ($features:literal, $isa:ident) => {
        // What the kernel reads, imported here so a set's module names only its own `$isa`.
        use std::arch::x86_64::*;

        use $crate::model::kernels::format::Format;
        use $crate::model::kernels::repack::{
            offset, scales_at, super_scale_bytes, tile_bytes, tile_index, QuantizedActivations, Repacked,
            PREFETCH_BLOCKS, ROW_GROUP, RUN_GROUPS, SUPER_BLOCKS, TILE_ROWS,
        };

        const Q4_0: u8 = 0;
        const Q4_1: u8 = 1;
        const Q4K: u8 = 4;
        const Q6K: u8 = 5;
        /// Q4_1 and Q4_K: the offset goes through the activation sums.
        const fn asymmetric(f: u8) -> bool {
            f == Q4_1 || f == Q4K
        }
        const Q5_0: u8 = 2;
        const Q8_0: u8 = 3;

        /// Feature groups `first_group..first_group + groups` for all `num_rows` rows.
        ///
        /// # Safety
        /// The CPU has `$features`; `out` holds `[num_rows, w.out_features]`; `acts` holds `num_rows`
        /// rows of `w.in_features`.
        #[target_feature(enable = $features)]
        pub unsafe fn groups(
            w: &Repacked,
            acts: &QuantizedActivations,
            first_group: usize,
            groups: usize,
            num_rows: usize,
            out: *mut f32,
        ) {
            assert!(
                (first_group + groups) * TILE_ROWS <= w.out_features
                    && acts.num_blocks * $crate::model::kernels::format::BLOCK == w.in_features
                    && acts.qs.len() >= num_rows * w.in_features
                    && [acts.d.len(), acts.scaled_sums.len(), acts.sums.len(), acts.low_sums.len()]
                        .iter()
                        .all(|&len| len >= num_rows * acts.num_blocks)
                    && groups <= RUN_GROUPS
                    && (groups == 1 || first_group.is_multiple_of(RUN_GROUPS)),
                "repacked kernel: groups {first_group}+{groups}, {num_rows} rows"
            );
            macro_rules! dispatch {
                ($f:ident) => {
                    unsafe {
                        if num_rows == 1 {
                            match groups {
                                1 => run::<$f, 1, 1>(w, acts, first_group, 0, out),
                                2 => run::<$f, 1, 2>(w, acts, first_group, 0, out),
                                3 => run::<$f, 1, 3>(w, acts, first_group, 0, out),
                                _ => run::<$f, 1, 4>(w, acts, first_group, 0, out),
                            }
                        } else if num_rows > ROW_GROUP {
                            // Each tile unpacked once for up to `PASS_ROWS` rows (verification, prefill).
                            let mut first = 0;
                            while first < num_rows {
                                let rows = (num_rows - first).min(PASS_ROWS);
                                match groups {
                                    1 => run_rows::<$f, 1>(w, acts, first_group, first, rows, out),
                                    2 => run_rows::<$f, 2>(w, acts, first_group, first, rows, out),
                                    3 => run_rows::<$f, 3>(w, acts, first_group, first, rows, out),
                                    _ => run_rows::<$f, 4>(w, acts, first_group, first, rows, out),
                                }
                                first += rows;
                            }
                        } else {
                            let mut first = 0;
                            while first < num_rows {
                                match ((num_rows - first).min(ROW_GROUP), groups) {
                                    (1, 1) => run::<$f, 1, 1>(w, acts, first_group, first, out),
                                    (1, 2) => run::<$f, 1, 2>(w, acts, first_group, first, out),
                                    (1, 3) => run::<$f, 1, 3>(w, acts, first_group, first, out),
                                    (1, _) => run::<$f, 1, 4>(w, acts, first_group, first, out),
                                    (2, 1) => run::<$f, 2, 1>(w, acts, first_group, first, out),
                                    (2, 2) => run::<$f, 2, 2>(w, acts, first_group, first, out),
                                    (2, 3) => run::<$f, 2, 3>(w, acts, first_group, first, out),
                                    (2, _) => run::<$f, 2, 4>(w, acts, first_group, first, out),
                                    (3, 1) => run::<$f, 3, 1>(w, acts, first_group, first, out),
                                    (3, 2) => run::<$f, 3, 2>(w, acts, first_group, first, out),
                                    (3, 3) => run::<$f, 3, 3>(w, acts, first_group, first, out),
                                    (3, _) => run::<$f, 3, 4>(w, acts, first_group, first, out),
                                    (_, 1) => run::<$f, 4, 1>(w, acts, first_group, first, out),
                                    (_, 2) => run::<$f, 4, 2>(w, acts, first_group, first, out),
                                    (_, 3) => run::<$f, 4, 3>(w, acts, first_group, first, out),
                                    (_, _) => run::<$f, 4, 4>(w, acts, first_group, first, out),
                                }
                                first += ROW_GROUP;
                            }
                        }
                    }
                };
            }
            match w.format {
                Format::Q4_0 => dispatch!(Q4_0),
                Format::Q4_1 => dispatch!(Q4_1),
                Format::Q5_0 => dispatch!(Q5_0),
                Format::Q8_0 => dispatch!(Q8_0),
                Format::Q4K => dispatch!(Q4K),
                Format::Q6K => dispatch!(Q6K),
            }
        }

        const fn format_of(f: u8) -> Format {
            match f {
                Q4_0 => Format::Q4_0,
                Q4_1 => Format::Q4_1,
                Q5_0 => Format::Q5_0,
                Q4K => Format::Q4K,
                Q6K => Format::Q6K,
                _ => Format::Q8_0,
            }
        }

        /// One block of one activation row, broadcast for the kernel.
        struct RowBlock {
            /// Bytes 4k..4k+3 of the block in every lane.
            q: [__m256i; 8],
            d: __m256,
            /// c * sum(q) (symmetric formats).
            correction: __m256i,
            /// d * sum(q) (Q4_1, Q4_K).
            scaled_sum: __m256,
            /// 32 * sum(q) over the first and the second 16 values (Q6_K).
            correction_halves: [__m256i; 2],
        }

        impl RowBlock {
            /// # Safety
            /// AVX2; block `at` exists in `acts` (`groups` checked the sizes: no bounds checks here, on
            /// the kernel's hottest path).
            #[inline]
            #[target_feature(enable = "avx2")]
            unsafe fn new(acts: &QuantizedActivations, at: usize, c: i32) -> Self {
                unsafe {
                    let a = acts.qs.as_ptr().add(at * $crate::model::kernels::format::BLOCK);
                    // A broadcast straight from memory (one load, no shuffle): 4 int8 values as one f32.
                    let q = |k: usize| _mm256_castps_si256(_mm256_broadcast_ss(&*(a.add(4 * k) as *const f32)));
                    let (sum, low_sum) = (*acts.sums.get_unchecked(at), *acts.low_sums.get_unchecked(at));
                    RowBlock {
                        q: std::array::from_fn(q),
                        d: _mm256_broadcast_ss(acts.d.get_unchecked(at)),
                        correction: _mm256_set1_epi32(c * sum),
                        scaled_sum: _mm256_broadcast_ss(acts.scaled_sums.get_unchecked(at)),
                        correction_halves: [_mm256_set1_epi32(32 * low_sum), _mm256_set1_epi32(32 * (sum - low_sum))],
                    }
                }
            }
        }

        /// One tile unpacked: 8 rows' values, scales and (Q4_1, Q4_K) offsets.
        struct Tile<const F: u8> {
            v: [__m256i; 8],
            d: __m256,
            m: __m256,
        }

        impl<const F: u8> Tile<F> {
            /// # Safety
            /// The CPU features of `groups`; `tile` points at a whole tile with scales at `s`, and (the
            /// K-quants) `sup` at its group's super-block scales.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load(tile: *const u8, s: usize, sup: *const u8) -> Self {
                unsafe {
                    let v = unpack::<F>(tile);
                    let f16s = |at: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                    if F == Q4K {
                        // d * scale and -(dmin * min): exact products, as `repack::KScales` forms them.
                        let bits = tile.add(s);
                        let low = (bits as *const u64).read_unaligned();
                        let high = (bits.add(8) as *const u32).read_unaligned() as u64;
                        let scales = six_bit_lanes(low);
                        let mins = six_bit_lanes((low >> 48) | (high << 16));
                        let d = _mm256_mul_ps(f16s(sup), scales);
                        let m = _mm256_mul_ps(f16s(sup.add(2 * TILE_ROWS)), mins);
                        return Tile { v, d, m: _mm256_xor_ps(m, _mm256_set1_ps(-0.0)) };
                    }
                    if F == Q6K {
                        let d = f16s(sup);
                        let scales = _mm_loadl_epi64(tile.add(s) as *const __m128i);
                        let second = _mm_loadl_epi64(tile.add(s + TILE_ROWS) as *const __m128i);
                        let lanes = |x: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
                        return Tile { v, d: _mm256_mul_ps(d, lanes(scales)), m: _mm256_mul_ps(d, lanes(second)) };
                    }
                    Tile {
                        v,
                        d: f16s(tile.add(s)),
                        m: if F == Q4_1 { f16s(tile.add(s + 16)) } else { _mm256_setzero_ps() },
                    }
                }
            }

            /// acc += this block of the 8 rows dotted with row `a`: the only arithmetic of the
            /// kernel, the same for every (feature, row) pair.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn accumulate(&self, a: &RowBlock, acc: &mut __m256) {
                if F == Q6K {
                    // The halves have their own scales (d, then m): a chain of four each.
                    let mut halves = [_mm256_setzero_si256(); 2];
                    for (h, half) in halves.iter_mut().enumerate() {
                        for k in 4 * h..4 * h + 4 {
                            *half = $isa::dpbusd(*half, self.v[k], a.q[k]);
                        }
                        *half = _mm256_sub_epi32(*half, a.correction_halves[h]);
                    }
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves[0]), _mm256_mul_ps(self.d, a.d), *acc);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves[1]), _mm256_mul_ps(self.m, a.d), *acc);
                    return;
                }
                // Two chains of four, added.
                let mut even = _mm256_setzero_si256();
                let mut odd = _mm256_setzero_si256();
                let signed_q8 = F == Q8_0 && !$isa::UNSIGNED_BYTES_EXACT;
                for k in (0..8).step_by(2) {
                    if signed_q8 {
                        even = $isa::dot_offset_bytes(even, self.v[k], a.q[k]);
                        odd = $isa::dot_offset_bytes(odd, self.v[k + 1], a.q[k + 1]);
                    } else {
                        even = $isa::dpbusd(even, self.v[k], a.q[k]);
                        odd = $isa::dpbusd(odd, self.v[k + 1], a.q[k + 1]);
                    }
                }
                let mut dot = _mm256_add_epi32(even, odd);
                // Integer sums are exact in any order: (u - c)·q is the same integer either way.
                if !asymmetric(F) && !signed_q8 {
                    dot = _mm256_sub_epi32(dot, a.correction);
                }
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(self.d, a.d), *acc);
                if asymmetric(F) {
                    *acc = _mm256_fmadd_ps(self.m, a.scaled_sum, *acc);
                }
            }
        }

        /// Eight 6-bit fields of `bits` (field r at bit 6r) as f32 lanes, lane r = field r.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn six_bit_lanes(bits: u64) -> __m256 {
            // 64-bit lane k holds fields 2k and 2k + 1 in its low 12 bits; its low dword goes to both of
            // its dword lanes, the odd one shifted by 6 more.
            let pairs = _mm256_srlv_epi64(_mm256_set1_epi64x(bits as i64), _mm256_setr_epi64x(0, 12, 24, 36));
            let dup = _mm256_shuffle_epi32::<0b10_10_00_00>(pairs);
            let fields = _mm256_srlv_epi32(dup, _mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6));
            _mm256_cvtepi32_ps(_mm256_and_si256(fields, _mm256_set1_epi32(0x3F)))
        }

        /// The 8 value vectors of a tile: vector k, byte 4r+i = row r's value 4k+i.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn unpack<const F: u8>(tile: *const u8) -> [__m256i; 8] {
            unsafe {
                if F == Q8_0 {
                    return std::array::from_fn(|k| _mm256_loadu_si256(tile.add(32 * k) as *const __m256i));
                }
                let low = _mm256_set1_epi8(0x0F);
                let mut v = [_mm256_setzero_si256(); 8];
                for j in 0..4 {
                    let packed = _mm256_loadu_si256(tile.add(32 * j) as *const __m256i);
                    v[j] = _mm256_and_si256(packed, low);
                    v[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low);
                }
                if F == Q6K {
                    // Bits 4 and 5: 2 bits per value, vectors k < 4 in the first 32 bytes, at bit 2(k % 4).
                    let high_bits = _mm256_set1_epi8(0x30);
                    for (k, v) in v.iter_mut().enumerate() {
                        let h = _mm256_loadu_si256(tile.add(128 + 32 * (k / 4)) as *const __m256i);
                        // 16-bit shifts: bits crossing into the neighbouring byte are masked away.
                        let at_4 = match k % 4 {
                            0 => _mm256_slli_epi16::<4>(h),
                            1 => _mm256_slli_epi16::<2>(h),
                            2 => h,
                            _ => _mm256_srli_epi16::<2>(h),
                        };
                        *v = _mm256_or_si256(*v, _mm256_and_si256(at_4, high_bits));
                    }
                }
                if F == Q5_0 {
                    let sixteen = _mm256_set1_epi8(16);
                    for (k, v) in v.iter_mut().enumerate() {
                        let fifth = (tile.add(128 + 4 * k) as *const u32).read_unaligned();
                        *v = $isa::add_where_bits(*v, fifth, sixteen);
                    }
                }
                v
            }
        }

        /// Where a task's tiles are: the groups of one run from `first_group`, format `F`.
        struct RunTiles {
            /// Bytes of a tile, where its scales start, blocks per row, the format's offset c.
            tb: usize,
            s: usize,
            nb: usize,
            c: i32,
            first_tile: *const u8,
            /// Consecutive blocks of a group are a run's length of tiles apart; the groups (one
            /// run when decoding) are adjacent.
            block_stride: usize,
            run_len: usize,
            /// The K-quants' super-block scales: the groups' are adjacent too, `ssb` bytes each.
            ssb: usize,
            first_super: *const u8,
        }

        impl RunTiles {
            #[inline]
            fn new<const F: u8>(w: &Repacked, acts: &QuantizedActivations, first_group: usize) -> Self {
                let format = format_of(F);
                let (tb, nb, ssb) = (tile_bytes(format), acts.num_blocks, super_scale_bytes(format));
                let num_groups = w.out_features / TILE_ROWS;
                let run_len = RUN_GROUPS.min(num_groups - first_group / RUN_GROUPS * RUN_GROUPS);
                let super_at = tile_index(num_groups, nb / SUPER_BLOCKS, first_group, 0) * ssb;
                RunTiles {
                    tb,
                    s: scales_at(format),
                    nb,
                    c: offset(format),
                    first_tile: w.tiles.as_ptr().wrapping_add(tile_index(num_groups, nb, first_group, 0) * tb),
                    block_stride: run_len * tb,
                    run_len,
                    ssb,
                    first_super: w.super_scales.as_ptr().wrapping_add(super_at),
                }
            }

            /// Block `b`'s first tile (group `first_group`'s); its run's next groups follow.
            #[inline]
            fn block(&self, b: usize) -> *const u8 {
                self.first_tile.wrapping_add(b * self.block_stride)
            }

            /// The super-block scales of block `b` of the run's group `h`.
            #[inline]
            fn sup(&self, b: usize, h: usize) -> *const u8 {
                self.first_super.wrapping_add((b / SUPER_BLOCKS * self.run_len + h) * self.ssb)
            }

            /// Asks for the `groups` tiles of the block a few blocks ahead of `b`, every cache
            /// line of them (past the end of the tiles the address lies outside the allocation;
            /// a prefetch never faults).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn prefetch(&self, b: usize, groups: usize) {
                for line in (0..groups * self.tb).step_by(64) {
                    let ahead = self.block(b).wrapping_add(PREFETCH_BLOCKS * self.block_stride + line);
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                }
            }
        }

        /// `R` activation rows from `first_row` against `H` feature groups from `first_group`.
        /// Every (feature, row) pair goes through the same operations whatever R and H.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn run<const F: u8, const R: usize, const H: usize>(
            w: &Repacked,
            acts: &QuantizedActivations,
            first_group: usize,
            first_row: usize,
            out: *mut f32,
        ) {
            let t = RunTiles::new::<F>(w, acts, first_group);
            let (tb, s, nb, c) = (t.tb, t.s, t.nb, t.c);
            let mut acc = [[_mm256_setzero_ps(); R]; H];
            for b in 0..nb {
                let block = t.block(b);
                let sup = |h: usize| t.sup(b, h);
                unsafe { t.prefetch(b, H) };
                let row = |r: usize| unsafe { RowBlock::new(acts, (first_row + r) * nb + b, c) };
                if R == 1 {
                    // Decoding: the one row's broadcasts are shared by the H tiles.
                    let a = row(0);
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let tile = unsafe { Tile::<F>::load(block.add(h * tb), s, sup(h)) };
                        unsafe { tile.accumulate(&a, &mut acc[0]) };
                    }
                } else {
                    // H tiles x R rows would not fit the registers: one tile at a time against the rows.
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let tile = unsafe { Tile::<F>::load(block.add(h * tb), s, sup(h)) };
                        for (r, acc) in acc.iter_mut().enumerate() {
                            unsafe { tile.accumulate(&row(r), acc) };
                        }
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                for (r, acc) in acc.iter().enumerate() {
                    let at = (first_row + r) * w.out_features + (first_group + h) * TILE_ROWS;
                    unsafe { _mm256_storeu_ps(out.add(at), *acc) };
                }
            }
        }

        /// Rows one `run_rows` pass dots with each unpacked tile: its accumulators (`PASS_ROWS * H`
        /// vectors, 8 KiB) and the rows' activation blocks stay in L1.
        const PASS_ROWS: usize = 64;

        /// `rows` activation rows from `first_row` against `H` feature groups from `first_group`, each
        /// tile unpacked once for all of them; the accumulators live in memory. Every (feature, row) pair
        /// goes through `Tile::accumulate` block by block, as in `run`: the same values bitwise.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn run_rows<const F: u8, const H: usize>(
            w: &Repacked,
            acts: &QuantizedActivations,
            first_group: usize,
            first_row: usize,
            rows: usize,
            out: *mut f32,
        ) {
            let t = RunTiles::new::<F>(w, acts, first_group);
            let (tb, s, nb, c) = (t.tb, t.s, t.nb, t.c);
            // acc[h * rows + r]: group h, row r.
            let mut acc = vec![_mm256_setzero_ps(); H * rows];
            for b in 0..nb {
                let block = t.block(b);
                unsafe { t.prefetch(b, H) };
                for (h, acc) in acc.chunks_exact_mut(rows).enumerate() {
                    let tile = unsafe { Tile::<F>::load(block.add(h * tb), s, t.sup(b, h)) };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        unsafe { tile.accumulate(&RowBlock::new(acts, (first_row + r) * nb + b, c), acc) };
                    }
                }
            }
            for (h, acc) in acc.chunks_exact(rows).enumerate() {
                for (r, acc) in acc.iter().enumerate() {
                    let at = (first_row + r) * w.out_features + (first_group + h) * TILE_ROWS;
                    unsafe { _mm256_storeu_ps(out.add(at), *acc) };
                }
            }
        }
    };
}

pub(crate) use packed_tile_kernel;
