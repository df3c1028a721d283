//! Counted repetitions of a regular expression (`a{1000}`, `(x{10}){100}`), measured on
//! regex-syntax's syntax tree (the parser llguidance's regex engine uses; iterative, with its own
//! nesting limit).
//!
//! Why: llguidance expands a counted repetition lazily, one derivative per byte, and forcing the
//! bytes a grammar allows (a long run of `a`s) costs work that grows with the count times the
//! counts around it; past its per-token budget the matcher fails at that token, long after the
//! grammar compiled. Invariant: `repetition` reports the largest product of nested counts along
//! any path of the tree, and the largest single count.

use regex_syntax::ast::{self, Ast, RepetitionKind, RepetitionRange};

/// What a regex repeats at most.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Repetition {
    /// The largest bound of one counted repetition (`{n}`, `{n,}`, `{n,m}`: n, n, max(n, m)).
    pub largest_count: u64,
    /// The largest product of the counts of repetitions nested in each other.
    pub largest_product: u64,
}

/// The counted repetitions of `regex`; `None` when regex-syntax cannot parse it (llguidance then
/// refuses it with its own message).
pub(super) fn repetition(regex: &str) -> Option<Repetition> {
    let tree = ast::parse::Parser::new().parse(regex).ok()?;
    ast::visit(&tree, Measure { counts: vec![1], found: Repetition { largest_count: 0, largest_product: 1 } }).ok()
}

struct Measure {
    /// The product of the counts around the current node, one entry per enclosing repetition.
    counts: Vec<u64>,
    found: Repetition,
}

impl ast::Visitor for Measure {
    type Output = Repetition;
    type Err = ();

    fn finish(self) -> Result<Repetition, ()> {
        Ok(self.found)
    }

    fn visit_pre(&mut self, node: &Ast) -> Result<(), ()> {
        if let Ast::Repetition(rep) = node {
            let count = match &rep.op.kind {
                RepetitionKind::Range(RepetitionRange::Exactly(n) | RepetitionRange::AtLeast(n)) => u64::from(*n),
                RepetitionKind::Range(RepetitionRange::Bounded(n, m)) => u64::from(*n.max(m)),
                RepetitionKind::ZeroOrOne | RepetitionKind::ZeroOrMore | RepetitionKind::OneOrMore => 1,
            };
            let around = *self.counts.last().expect("the outermost entry stays");
            let product = around.saturating_mul(count.max(1));
            self.counts.push(product);
            self.found.largest_count = self.found.largest_count.max(count);
            self.found.largest_product = self.found.largest_product.max(product);
        }
        Ok(())
    }

    fn visit_post(&mut self, node: &Ast) -> Result<(), ()> {
        if let Ast::Repetition(_) = node {
            self.counts.pop();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(regex: &str) -> (u64, u64) {
        let r = repetition(regex).unwrap();
        (r.largest_count, r.largest_product)
    }

    #[test]
    fn counts_and_their_nested_products() {
        assert_eq!(measured("abc"), (0, 1));
        assert_eq!(measured("a*b+c?"), (1, 1));
        assert_eq!(measured("a{1000000}"), (1_000_000, 1_000_000));
        assert_eq!(measured("(x{1000}){1000}"), (1000, 1_000_000));
        assert_eq!(measured("a{5,}b{2,7}"), (7, 7));
        assert_eq!(measured("(a{3}|b{4}){5}c{100}"), (100, 100));
        assert_eq!(measured("((a{2}){3}){4}"), (4, 24));
        // Verbose mode allows spaces in the braces: still counted.
        assert_eq!(measured("(?x) a{ 5000 }"), (5000, 5000));
        assert_eq!(measured(r"\{1000\}[{]"), (0, 1));
    }

    #[test]
    fn unparsable_regexes_are_left_to_llguidance() {
        assert_eq!(repetition("a{"), None);
        assert_eq!(repetition("(((a"), None);
    }
}
