//! `OutputText`: a request's text as its tokens are committed, one token's text at a time, with
//! vLLM's stop strings found on it and the part a stream may show yet.
//!
//! A stop string is found in the token whose text completes it; the request then ends with that
//! token, and its text ends right before the stop string (or right after it with
//! `include_stop_str_in_output`). When one token's text completes several, the first completed
//! reading left to right wins (ties: the one that starts first), so where the text ends does not
//! depend on how it was cut into tokens, nor into speculative steps.
//!
//! Invariant: the emitted text never holds text past a stop string, and while the request runs
//! (without `include_stop_str_in_output`) never ends in a proper prefix of a stop string: that
//! end is held back until the next text shows it starts none (vLLM holds back the longest stop
//! string's length less one; this holds back only what can still become one). Hence every stop
//! string found later starts within the held text, which is all the search reads.

/// See the module header.
#[derive(Debug, Clone, Default)]
pub struct OutputText {
    stops: Vec<String>,
    include_stop: bool,
    /// Text already emitted (a stream has shown it).
    emitted: String,
    /// Text past `emitted` that may still begin a stop string.
    held: String,
}

impl OutputText {
    pub fn new(stops: Vec<String>, include_stop: bool) -> Self {
        Self { stops, include_stop, ..Self::default() }
    }

    /// Appends one token's text. `may_stop`: whether a stop string completed by it counts (vLLM
    /// ignores those completed within the first `min_tokens` tokens). Returns the stop string it
    /// completes, if any; the text is then cut at it (before it, or after it when included), and
    /// nothing may be pushed after.
    pub fn push(&mut self, text: &str, may_stop: bool) -> Option<String> {
        self.held.push_str(text);
        if !may_stop || text.is_empty() || self.stops.is_empty() {
            return None;
        }
        // The search reads the held text and, for an included stop string (nothing is held
        // back then), the end of the emitted text that a stop string ending in `text` may start in.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut tail_start = self.emitted.len().saturating_sub(longest);
        while !self.emitted.is_char_boundary(tail_start) {
            tail_start += 1;
        }
        let window = [&self.emitted[tail_start..], self.held.as_str()].concat();
        let new_from = window.len() - text.len();
        // (end, start, which): the earliest end, then the earliest start, among occurrences that
        // end in the new text (one ending before it was found, or did not count, earlier).
        let mut first: Option<(usize, usize, usize)> = None;
        for (which, stop) in self.stops.iter().enumerate() {
            let mut from = (new_from + 1).saturating_sub(stop.len());
            while !window.is_char_boundary(from) {
                from += 1; // a stop string starts on a character boundary
            }
            if let Some(at) = window[from..].find(stop.as_str()) {
                let start = from + at;
                let found = (start + stop.len(), start, which);
                if first.is_none_or(|best| (found.0, found.1) < (best.0, best.1)) {
                    first = Some(found);
                }
            }
        }
        let (end, start, which) = first?;
        let cut = if self.include_stop { end } else { start };
        let tail_len = self.emitted.len() - tail_start;
        match cut.checked_sub(tail_len) {
            Some(in_held) => self.held.truncate(in_held),
            // Emitted already (the invariant says this does not happen): the result still ends there.
            None => {
                self.emitted.truncate(tail_start + cut);
                self.held.clear();
            }
        }
        Some(self.stops[which].clone())
    }

    /// Moves the text that can no longer begin a stop string (all of it once `finished`) to the
    /// emitted text, and returns it.
    pub fn release(&mut self, finished: bool) -> String {
        let keep = if finished || self.include_stop { 0 } else { self.stop_prefix_len() };
        let released = self.held.split_off(0);
        let (out, kept) = released.split_at(released.len() - keep);
        self.held = kept.to_string();
        self.emitted.push_str(out);
        out.to_string()
    }

    /// Everything emitted so far.
    pub fn emitted(&self) -> &str {
        &self.emitted
    }

    /// Bytes of the longest end of `held` that is a proper prefix of a stop string.
    fn stop_prefix_len(&self) -> usize {
        let mut longest = 0;
        for stop in &self.stops {
            for (len, _) in stop.char_indices().skip(1) {
                if len > longest && self.held.ends_with(&stop[..len]) {
                    longest = len;
                }
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(stops: &[&str], include: bool) -> OutputText {
        OutputText::new(stops.iter().map(|s| s.to_string()).collect(), include)
    }

    /// Feeds `pieces` one token's text at a time, releasing after each; (every release, the stop).
    fn run(text: &mut OutputText, pieces: &[&str]) -> (Vec<String>, Option<String>) {
        let mut released = Vec::new();
        for piece in pieces {
            if let Some(stop) = text.push(piece, true) {
                released.push(text.release(true));
                return (released, Some(stop));
            }
            released.push(text.release(false));
        }
        released.push(text.release(true));
        (released, None)
    }

    #[test]
    fn the_text_ends_before_the_first_stop_string_whatever_the_token_cuts() {
        for pieces in [vec!["Hello wor", "ld. Bye"], vec!["Hello", " world", ".", " Bye"], vec!["Hello world. Bye"]] {
            let mut text = stops(&["world", "Bye"], false);
            let (_, stop) = run(&mut text, &pieces);
            assert_eq!((text.emitted(), stop.as_deref()), ("Hello ", Some("world")), "{pieces:?}");
        }
        let mut text = stops(&["world"], true);
        run(&mut text, &["Hello wor", "ld. Bye"]);
        assert_eq!(text.emitted(), "Hello world");
    }

    #[test]
    fn the_first_completed_stop_wins_then_the_first_started() {
        let mut text = stops(&["abc", "b"], false);
        assert_eq!(text.push("xabc", true).as_deref(), Some("b"));
        assert_eq!(text.release(true), "xa");
        let mut text = stops(&["b", "ab"], false);
        assert_eq!(text.push("xab", true).as_deref(), Some("ab"));
        assert_eq!(text.release(true), "x");
    }

    #[test]
    fn only_a_possible_beginning_of_a_stop_string_is_held_back() {
        let mut text = stops(&["\n\nUser:"], false);
        assert_eq!(text.push("Hi\n", true), None);
        assert_eq!(text.release(false), "Hi", "\"\\n\" may begin the stop string");
        assert_eq!(text.push("\nUse", true), None);
        assert_eq!(text.release(false), "");
        assert_eq!(text.push("d it", true), None);
        assert_eq!(text.release(false), "\n\nUsed it");
        // Included stop strings hold nothing back: all text up to their end is output anyway.
        let mut text = stops(&["\n\n"], true);
        text.push("a\n", true);
        assert_eq!(text.release(false), "a\n");
    }

    #[test]
    fn a_stop_string_that_did_not_count_is_not_found_later() {
        let mut text = stops(&["ab"], false);
        assert_eq!(text.push("xab", false), None, "within min_tokens");
        assert_eq!(text.push("c", true), None);
        assert_eq!(text.push("ab", true).as_deref(), Some("ab"));
        assert_eq!(text.release(true), "xabc");
    }

    #[test]
    fn multibyte_stop_strings_and_text() {
        let mut text = stops(&["é!"], false);
        assert_eq!(text.push("café", true), None);
        assert_eq!(text.release(false), "caf");
        assert_eq!(text.push("!", true).as_deref(), Some("é!"));
        assert_eq!(text.release(true), "");
        assert_eq!(text.emitted(), "caf");
    }
}
