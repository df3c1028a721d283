//! The on-disk form of the engine-wide suffix caches (`specrs serve --suffix-cache PATH`), so a
//! restarted server keeps the responses it learned from its traffic.
//!
//! What is stored is what rebuilds the caches exactly: per cache, its speculative config (the
//! engine's key, which also gives the tree depth and the response limit) and its responses' token
//! ids, oldest first. Re-inserting them into an empty cache gives the same nodes with the same
//! counts (the tree's invariant, see suffix.rs), hence the same drafts. The trees themselves are
//! not stored: they are up to `max_tree_depth` times larger than the responses, and their arena
//! layout is history nobody needs.
//!
//! Format (little-endian):
//! ```text
//! header   magic "SPRSSUFX" (8 bytes) | format version u32 (1) | payload length u64 |
//!          FNV-1a 64 of the payload u64
//! payload  model: vocabulary size u64 | tokenizer fingerprint u64 | description str
//!          caches u32, least recently used first, each:
//!              key str (the speculative config JSON) | responses u32, oldest first, each:
//!                  tokens u32 | token ids u32 * tokens
//! str      byte length u32 | UTF-8
//! ```
//!
//! Invariant: a file is either refused with an `Error::Config` that names its path and what to do,
//! or yields caches that hold only token ids of this model and respect every bound a running engine
//! does (`max_cached_requests` per cache, `MAX_SUFFIX_CACHES` caches). Nothing larger than
//! `MAX_FILE_BYTES` is read, no length field allocates past the bytes that back it, and a file is
//! only ever replaced whole (written beside it, synced, renamed), so a crash mid-save leaves the
//! previous file.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::suffix::SuffixCache;
use crate::engine::MAX_SUFFIX_CACHES;
use crate::error::{Error, Result};
use crate::spec_config::SpeculativeConfig;

/// The first bytes of every suffix cache file.
pub const MAGIC: [u8; 8] = *b"SPRSSUFX";
/// Bumped whenever the layout changes; other versions are refused, never guessed at.
pub const FORMAT_VERSION: u32 = 1;
/// Magic, version, payload length, checksum.
pub const HEADER_BYTES: usize = 8 + 4 + 8 + 8;
/// Files over this are refused before they are read (and saves that would exceed it fail). 1 GiB
/// holds 268M token ids, far more than the caches' own bounds keep in practice (the default
/// 10,000 responses of a few hundred tokens are about 10-40 MB); it only stops a wrong path (a
/// model file, a disk image) from being read whole.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Which model a file's token ids belong to. A cache from another model would draft ids that mean
/// other text (or lie outside the vocabulary), so any difference refuses the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Rows of the embedding: every token id the model can produce is below it.
    pub vocab_size: u64,
    /// FNV-1a over every token's text (see `engine/suffix_persistence.rs`).
    pub tokenizer_fingerprint: u64,
    /// The model's shape in words (architecture, layers, hidden size), shown when files differ.
    pub description: String,
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, tokenizer {:016x}", self.description, self.tokenizer_fingerprint)
    }
}

/// FNV-1a 64, streamed: the payload checksum and the tokenizer fingerprint. Any single changed
/// byte changes it (each step is a bijection of the state), and its value never depends on the
/// Rust version or platform.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub fn finish(self) -> u64 {
        self.0
    }

    pub fn of(bytes: &[u8]) -> u64 {
        let mut h = Self::default();
        h.update(bytes);
        h.finish()
    }
}

/// Builds a file's bytes one cache at a time, so a caller can hold each cache's lock only while
/// that cache is copied.
pub struct Encoder {
    payload: Vec<u8>,
    /// Where the cache count goes once every cache is in.
    num_caches_at: usize,
    num_caches: u32,
    num_responses: usize,
}

impl Encoder {
    pub fn new(model: &ModelIdentity) -> Self {
        let mut payload = Vec::new();
        payload.extend_from_slice(&model.vocab_size.to_le_bytes());
        payload.extend_from_slice(&model.tokenizer_fingerprint.to_le_bytes());
        put_str(&mut payload, &model.description);
        let num_caches_at = payload.len();
        payload.extend_from_slice(&0u32.to_le_bytes());
        Self { payload, num_caches_at, num_caches: 0, num_responses: 0 }
    }

    /// Appends `cache` under `key` (its speculative config JSON). Fails, leaving the encoder
    /// unusable for writing, once the file would pass `MAX_FILE_BYTES`.
    pub fn add(&mut self, key: &str, cache: &SuffixCache) -> Result<()> {
        put_str(&mut self.payload, key);
        self.payload.extend_from_slice(&count_u32(cache.num_cached_requests(), "responses")?.to_le_bytes());
        for response in cache.responses() {
            self.payload.extend_from_slice(&count_u32(response.len(), "tokens of a response")?.to_le_bytes());
            self.payload.reserve(4 * response.len());
            for &token in response {
                self.payload.extend_from_slice(&token.to_le_bytes());
            }
            if (HEADER_BYTES + self.payload.len()) as u64 > MAX_FILE_BYTES {
                return Err(Error::config(format!(
                    "the suffix caches take more than {MAX_FILE_BYTES} bytes on disk, the limit of a suffix cache \
                     file; lower suffix_decoding_max_cached_requests"
                )));
            }
        }
        self.num_caches += 1;
        self.num_responses += cache.num_cached_requests();
        Ok(())
    }

    /// Responses added so far.
    pub fn num_responses(&self) -> usize {
        self.num_responses
    }

    /// The whole file: header, then the payload.
    pub fn finish(mut self) -> Vec<u8> {
        self.payload[self.num_caches_at..self.num_caches_at + 4].copy_from_slice(&self.num_caches.to_le_bytes());
        let mut file = Vec::with_capacity(HEADER_BYTES + self.payload.len());
        file.extend_from_slice(&MAGIC);
        file.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        file.extend_from_slice(&(self.payload.len() as u64).to_le_bytes());
        file.extend_from_slice(&Fnv1a::of(&self.payload).to_le_bytes());
        file.extend_from_slice(&self.payload);
        file
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Keys and descriptions are short (a config JSON); u32 cannot overflow for them.
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn count_u32(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Internal(format!("{n} {what} do not fit a suffix cache file's u32 count")))
}

/// The error of a file that is damaged or is not a cache file at all.
fn corrupt(path: &Path, what: &str) -> Error {
    Error::config(format!(
        "suffix cache file {} is corrupt or truncated ({what}); delete it to start with an empty cache (a new \
         one is written at the next save)",
        path.display()
    ))
}

/// Reads a payload front to back; `None` when it ends early.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.bytes.len() {
            return None;
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    }

    fn str(&mut self) -> Option<std::result::Result<&'a str, std::str::Utf8Error>> {
        let len = self.u32()? as usize;
        self.take(len).map(std::str::from_utf8)
    }
}

/// Checks the header and checksum of a whole file; returns its payload.
fn payload<'a>(bytes: &'a [u8], path: &Path) -> Result<&'a [u8]> {
    let magic_len = bytes.len().min(MAGIC.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Err(Error::config(format!(
            "{} is not a specrs suffix cache file (it does not start with {:?}); pass the path of a file specrs \
             wrote, or delete it to start with an empty cache",
            path.display(),
            String::from_utf8_lossy(&MAGIC)
        )));
    }
    if bytes.len() < HEADER_BYTES {
        return Err(corrupt(path, &format!("{} bytes, shorter than the {HEADER_BYTES}-byte header", bytes.len())));
    }
    let mut header = Reader { bytes: &bytes[MAGIC.len()..HEADER_BYTES] };
    let (version, declared, checksum) = match (header.u32(), header.u64(), header.u64()) {
        (Some(v), Some(l), Some(c)) => (v, l, c),
        _ => return Err(Error::Internal("suffix cache header layout".into())),
    };
    if version != FORMAT_VERSION {
        return Err(Error::config(format!(
            "suffix cache file {} has format version {version}, and this specrs reads version {FORMAT_VERSION}; \
             it was written by another specrs version: delete it to start with an empty cache",
            path.display()
        )));
    }
    let payload = &bytes[HEADER_BYTES..];
    if (payload.len() as u64) < declared {
        return Err(corrupt(path, &format!("{} of the {declared} payload bytes its header declares", payload.len())));
    }
    if payload.len() as u64 > declared {
        return Err(corrupt(path, &format!("{} bytes after the payload", payload.len() as u64 - declared)));
    }
    if Fnv1a::of(payload) != checksum {
        return Err(corrupt(path, "checksum mismatch: the file changed after specrs wrote it"));
    }
    Ok(payload)
}

/// The caches in a file's bytes, least recently used first, keyed by their canonical config JSON
/// (so the engine finds them under the key its requests ask for). `path` only names the file in
/// errors; `model` is this engine's identity, which the file must carry.
///
/// Bounds, as a running engine keeps them: past `MAX_SUFFIX_CACHES` caches only the most recently
/// used are kept, and past a config's `max_cached_requests` only its newest responses (the older
/// ones are never indexed). A file specrs wrote never needs either.
pub fn decode(bytes: &[u8], path: &Path, model: &ModelIdentity) -> Result<Vec<(String, SuffixCache)>> {
    let mut r = Reader { bytes: payload(bytes, path)? };
    let ends = |what: &str| corrupt(path, &format!("the payload ends inside {what}"));
    let vocab_size = r.u64().ok_or_else(|| ends("the model"))?;
    let tokenizer_fingerprint = r.u64().ok_or_else(|| ends("the model"))?;
    let description = r.str().ok_or_else(|| ends("the model"))?.map_err(|_| corrupt(path, "model text"))?;
    let file_model = ModelIdentity { vocab_size, tokenizer_fingerprint, description: description.to_string() };
    if file_model != *model {
        return Err(Error::config(format!(
            "suffix cache file {} was written for another model ({file_model}) than this one ({model}): its token \
             ids would mean other text here; pass this model's cache file, or delete it to start with an empty cache",
            path.display()
        )));
    }
    let num_caches = r.u32().ok_or_else(|| ends("the cache count"))? as usize;
    // Caches before this one are checked but not built: an engine would have evicted them.
    let first_kept = num_caches.saturating_sub(MAX_SUFFIX_CACHES);
    let mut keys: Vec<String> = Vec::new();
    let mut caches: Vec<(String, SuffixCache)> = Vec::new();
    for c in 0..num_caches {
        let key = r.str().ok_or_else(|| ends("a cache key"))?.map_err(|_| corrupt(path, "cache key text"))?;
        let config = SpeculativeConfig::from_json(key).map_err(|e| {
            Error::config(format!(
                "suffix cache file {} holds a cache for a speculative config this specrs cannot read ({e}); it was \
                 written by another specrs version: delete it to start with an empty cache",
                path.display()
            ))
        })?;
        let Some(params) = config.suffix_params() else {
            return Err(corrupt(
                path,
                &format!("cache {c} is for method '{}', which keeps none", config.method_name()),
            ));
        };
        let key = config.to_json();
        if keys.contains(&key) {
            return Err(corrupt(path, &format!("two caches for the config {key}")));
        }
        keys.push(key.clone());
        let num_responses = r.u32().ok_or_else(|| ends("a response count"))? as usize;
        // Borrowed token bytes: every response is checked, only the kept ones are indexed.
        let mut responses: Vec<&[u8]> = Vec::with_capacity(num_responses.min(r.bytes.len() / 4));
        for _ in 0..num_responses {
            let len = r.u32().ok_or_else(|| ends("a response"))? as usize;
            let raw = len.checked_mul(4).and_then(|n| r.take(n)).ok_or_else(|| ends("a response"))?;
            responses.push(raw);
        }
        let keep = if c < first_kept { 0 } else { responses.len().min(params.max_cached_requests) };
        let mut cache = SuffixCache::new(params.max_tree_depth, params.max_cached_requests);
        let mut tokens = Vec::new();
        for (i, raw) in responses.iter().enumerate() {
            tokens.clear();
            tokens.extend(raw.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            if let Some(&bad) = tokens.iter().find(|&&t| u64::from(t) >= vocab_size) {
                return Err(corrupt(path, &format!("token id {bad} outside the vocabulary of {vocab_size}")));
            }
            if i >= responses.len() - keep {
                cache.insert_response(&tokens);
            }
        }
        if c >= first_kept {
            caches.push((key, cache));
        }
    }
    if !r.bytes.is_empty() {
        return Err(corrupt(path, &format!("{} bytes after the last cache", r.bytes.len())));
    }
    Ok(caches)
}

/// A file's bytes, refused without reading when it is over `MAX_FILE_BYTES` or not a file.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    let cannot = |e: io::Error| {
        Error::config(format!(
            "cannot read the suffix cache file {}: {e}; check the path, or delete the file to start with an empty \
             cache",
            path.display()
        ))
    };
    let meta = std::fs::metadata(path).map_err(cannot)?;
    if !meta.is_file() {
        return Err(Error::config(format!(
            "the suffix cache path {} is not a file; pass the path of a file (it is created at the first save)",
            path.display()
        )));
    }
    let too_large = |len: u64| {
        Error::config(format!(
            "{} is {len} bytes, over the {MAX_FILE_BYTES}-byte limit of a suffix cache file, so specrs did not write \
             it; pass the path of a suffix cache file, or delete it to start with an empty cache",
            path.display()
        ))
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    File::open(path).and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)).map_err(cannot)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        // It grew after the metadata was read.
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Distinguishes the temporary files of concurrent saves in one process.
static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` atomically: a reader (or a restart after a crash) sees the old file
/// or the new one, never part of one. Creates missing parent directories.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with(path, |file| file.write_all(bytes))
}

/// `write_atomically` with the writing step given, so tests can make it fail part way.
fn write_atomically_with(path: &Path, write: impl FnOnce(&mut File) -> io::Result<()>) -> Result<()> {
    let cannot = |e: io::Error| {
        Error::config(format!(
            "cannot write the suffix cache file {}: {e}; pass a path in a writable directory",
            path.display()
        ))
    };
    let name = path.file_name().ok_or_else(|| cannot(io::Error::other("the path names no file")))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(cannot)?;
    // In the same directory, so the rename never crosses file systems (it would not be atomic);
    // hidden, and named after the file, so a leftover from a killed process is easy to place.
    let temp = dir.join(format!(
        ".{}.{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        NEXT_TEMP.fetch_add(1, Ordering::Relaxed)
    ));
    let written = File::options()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut file| {
            write(&mut file)?;
            // The data must be on disk before the rename makes it the file.
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(cannot(e));
    }
    // Makes the rename itself durable. Some file systems cannot sync a directory; the new file is
    // in place either way, so that is not an error.
    #[cfg(unix)]
    let _ = File::open(&dir).and_then(|d| d.sync_all());
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::proposer::suffix::SuffixProposer;
    use crate::proposer::Proposer;

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % n as u64) as usize
        }
        fn tokens(&mut self, len: usize, alphabet: usize) -> Vec<u32> {
            (0..len).map(|_| self.below(alphabet) as u32).collect()
        }
    }

    fn model() -> ModelIdentity {
        ModelIdentity { vocab_size: 50, tokenizer_fingerprint: 0x1234, description: "llama, 2 layers".into() }
    }

    fn suffix_config(depth: usize, cached: usize) -> SpeculativeConfig {
        SpeculativeConfig::from_json(&format!(
            r#"{{"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": {depth},
                "suffix_decoding_max_cached_requests": {cached}}}"#
        ))
        .unwrap()
    }

    /// Two caches of different configs, each past its response limit (so evictions shaped them).
    fn caches(rng: &mut Rng) -> Vec<(SpeculativeConfig, SuffixCache)> {
        [(8, 6), (24, 40)]
            .into_iter()
            .map(|(depth, cached)| {
                let mut cache = SuffixCache::new(depth, cached);
                for i in 0..cached + 5 {
                    let len = 3 + rng.below(60);
                    cache.insert_response(&rng.tokens(len, [4, 12, 50][i % 3]));
                }
                (suffix_config(depth, cached), cache)
            })
            .collect()
    }

    fn encode(model: &ModelIdentity, caches: &[(SpeculativeConfig, SuffixCache)]) -> Vec<u8> {
        let mut encoder = Encoder::new(model);
        for (config, cache) in caches {
            encoder.add(&config.to_json(), cache).unwrap();
        }
        encoder.finish()
    }

    fn params(config: &SpeculativeConfig) -> crate::spec_config::SuffixParams {
        config.suffix_params().expect("a suffix config")
    }

    /// The drafts a fresh request gets from `cache` over a growing context.
    fn drafts(config: &SpeculativeConfig, cache: SuffixCache, seed: u64) -> Vec<Vec<u32>> {
        let mut rng = Rng(seed);
        let mut proposer = SuffixProposer::new(params(config), Arc::new(Mutex::new(cache)));
        let mut context = rng.tokens(4, 12);
        let mut out = Vec::new();
        for _ in 0..200 {
            let draft = proposer.propose(&context, 8).unwrap().token_ids;
            let accepted = if draft.is_empty() { 0 } else { rng.below(draft.len() + 1) };
            context.extend_from_slice(&draft[..accepted]);
            let fresh = 1 + rng.below(3);
            context.extend(rng.tokens(fresh, 12));
            out.push(draft);
        }
        out
    }

    fn path() -> PathBuf {
        PathBuf::from("/srv/suffix.bin")
    }

    fn refused(bytes: &[u8]) -> String {
        match decode(bytes, &path(), &model()) {
            Ok(_) => panic!("a bad file was accepted"),
            Err(e) => {
                assert!(matches!(e, Error::Config(_)), "{e:?}");
                e.to_string()
            }
        }
    }

    #[test]
    fn round_trip_rebuilds_the_caches_and_their_drafts() {
        let mut rng = Rng(1);
        let original = caches(&mut rng);
        let loaded = decode(&encode(&model(), &original), &path(), &model()).unwrap();
        assert_eq!(loaded.len(), original.len());
        for ((config, before), (key, after)) in original.into_iter().zip(loaded) {
            assert_eq!(key, config.to_json());
            assert_eq!(after.responses().collect::<Vec<_>>(), before.responses().collect::<Vec<_>>());
            assert_eq!(after.num_nodes(), before.num_nodes());
            assert_eq!(
                (after.max_tree_depth(), after.max_cached_requests()),
                (before.max_tree_depth(), before.max_cached_requests())
            );
            // Some drafts must come from the cache for the comparison to mean anything.
            let (a, b) = (drafts(&config, before, 7), drafts(&config, after, 7));
            assert!(a.iter().any(|d| d.len() > 1));
            assert_eq!(a, b);
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = encode(&model(), &caches(&mut Rng(2)));
        for len in [0, 1, 7, 8, 12, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 9, bytes.len() / 2, bytes.len() - 1]
        {
            let message = refused(&bytes[..len]);
            assert!(message.contains("/srv/suffix.bin") && message.contains("delete it"), "{len}: {message}");
            assert!(message.contains("truncated"), "{len}: {message}");
        }
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let mut rng = Rng(3);
        let mut cache = SuffixCache::new(4, 3);
        for _ in 0..3 {
            cache.insert_response(&rng.tokens(20, 9));
        }
        let bytes = encode(&model(), &[(suffix_config(4, 3), cache)]);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            let message = refused(&bad);
            assert!(message.contains("/srv/suffix.bin") && message.contains("delete it"), "byte {i}: {message}");
        }
    }

    #[test]
    fn wrong_magic_and_version_are_named() {
        let bytes = encode(&model(), &caches(&mut Rng(4)));
        let mut gguf = bytes.clone();
        gguf[..4].copy_from_slice(b"GGUF");
        assert!(refused(&gguf).contains("is not a specrs suffix cache file"));
        let mut newer = bytes.clone();
        newer[8..12].copy_from_slice(&2u32.to_le_bytes());
        let message = refused(&newer);
        assert!(message.contains("format version 2") && message.contains("reads version 1"), "{message}");
    }

    #[test]
    fn another_model_is_refused() {
        let caches = caches(&mut Rng(5));
        for other in [
            ModelIdentity { vocab_size: 51, ..model() },
            ModelIdentity { tokenizer_fingerprint: 0x4321, ..model() },
            ModelIdentity { description: "qwen2, 2 layers".into(), ..model() },
        ] {
            let message = refused(&encode(&other, &caches));
            assert!(message.contains("another model") && message.contains(&other.to_string()), "{message}");
            assert!(message.contains(&model().to_string()), "{message}");
        }
    }

    #[test]
    fn bad_contents_behind_a_valid_checksum_are_refused() {
        let mut cache = SuffixCache::new(4, 3);
        cache.insert_response(&[1, 2, 3]);
        let ngram = SpeculativeConfig::from_json(r#"{"method": "ngram", "num_speculative_tokens": 3}"#).unwrap();
        assert!(refused(&encode(&model(), &[(ngram, SuffixCache::new(4, 3))])).contains("which keeps none"));
        let twice = [(suffix_config(4, 3), SuffixCache::new(4, 3)), (suffix_config(4, 3), SuffixCache::new(4, 3))];
        assert!(refused(&encode(&model(), &twice)).contains("two caches"));
        let mut outside = SuffixCache::new(4, 3);
        outside.insert_response(&[1, 50]);
        assert!(refused(&encode(&model(), &[(suffix_config(4, 3), outside)])).contains("token id 50"));
        let mut encoder = Encoder::new(&model());
        encoder.add("{not json", &cache).unwrap();
        assert!(refused(&encoder.finish()).contains("cannot read"));
    }

    #[test]
    fn loading_keeps_the_bounds_of_a_running_engine() {
        // A cache holding 10 responses filed under a config that keeps 3: the newest 3 are loaded.
        let mut rng = Rng(6);
        let mut wide = SuffixCache::new(6, 10);
        for _ in 0..10 {
            wide.insert_response(&rng.tokens(15, 7));
        }
        let newest: Vec<Vec<u32>> = wide.responses().skip(7).map(<[u32]>::to_vec).collect();
        let mut encoder = Encoder::new(&model());
        encoder.add(&suffix_config(6, 3).to_json(), &wide).unwrap();
        let loaded = decode(&encoder.finish(), &path(), &model()).unwrap();
        assert_eq!(loaded[0].1.responses().map(<[u32]>::to_vec).collect::<Vec<_>>(), newest);
        // More caches than an engine keeps: the most recently used (last) ones are loaded.
        let many: Vec<_> =
            (0..MAX_SUFFIX_CACHES + 2).map(|i| (suffix_config(2 + i, 1), SuffixCache::new(2 + i, 1))).collect();
        let loaded = decode(&encode(&model(), &many), &path(), &model()).unwrap();
        let keys: Vec<String> = many[2..].iter().map(|(c, _)| c.to_json()).collect();
        assert_eq!(loaded.into_iter().map(|(k, _)| k).collect::<Vec<_>>(), keys);
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("specrs-suffix-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn dir_entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = temp_dir("atomic");
        let file = dir.join("cache.bin");
        write_atomically(&file, b"old contents").unwrap();
        let failed = write_atomically_with(&file, |f| {
            f.write_all(b"new cont")?;
            Err(io::Error::other("disk full"))
        });
        let message = failed.unwrap_err().to_string();
        assert!(message.contains("disk full") && message.contains("cache.bin"), "{message}");
        assert_eq!(std::fs::read(&file).unwrap(), b"old contents");
        assert_eq!(dir_entries(&dir), ["cache.bin"]);
        // A rename that fails (onto a directory) also cleans up.
        let taken = dir.join("taken");
        std::fs::create_dir(&taken).unwrap();
        std::fs::write(taken.join("x"), b"x").unwrap();
        assert!(write_atomically(&taken, b"new").is_err());
        assert_eq!(dir_entries(&dir), ["cache.bin", "taken"]);
        write_atomically(&file, b"new contents").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"new contents");
        // Missing directories are created.
        write_atomically(&dir.join("a/b/cache.bin"), b"deep").unwrap();
        assert_eq!(std::fs::read(dir.join("a/b/cache.bin")).unwrap(), b"deep");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_over_the_limit_are_refused_unread() {
        let dir = temp_dir("limit");
        let file = dir.join("huge.bin");
        // Sparse: no disk space is used, and nothing is read.
        File::create(&file).unwrap().set_len(MAX_FILE_BYTES + 1).unwrap();
        let message = read_file(&file).unwrap_err().to_string();
        assert!(message.contains("over the") && message.contains("huge.bin"), "{message}");
        let message = read_file(&dir.join("missing.bin")).unwrap_err().to_string();
        assert!(message.contains("missing.bin"), "{message}");
        assert!(read_file(&dir).unwrap_err().to_string().contains("is not a file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
