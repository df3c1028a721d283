//! A Lark grammar (llguidance's dialect) measured against the limits before llguidance parses it.
//!
//! llguidance's Lark compiler recurses from a rule into each rule or terminal it names that is not
//! compiled yet (a name in progress is a placeholder, so a path never repeats a definition), and
//! into each bracket level of a body (its parser allows 30). A chain of thousands of rules
//! overflows a thread's stack. Measured here by a scan that mirrors llguidance's lexer (names,
//! strings, `/regexes/`, comments, `%json`/`%llguidance`/`%regex` JSON, `%lark { ... }` blocks):
//! - definitions: rules, terminals and `%import`ed names (`MAX_LARK_RULES`);
//! - reference depth (`MAX_LARK_DEPTH`): a bound on the levels the compiler's recursion can reach,
//!   each definition on the path weighing 1 plus its bracket nesting (`DepthGraph`, a component of
//!   mutually recursive definitions weighing all of them). A `%lark { ... }` block is compiled
//!   after its enclosing grammar, from the same frame, so each block is measured on its own;
//! - repetitions: counts of `~ n..m` times what they repeat (a group's or a regex's own counts) and
//!   every `/regex/`'s counted repetitions (`MAX_REGEX_REPEAT`);
//! - each `%json` schema, with the JSON schema limits;
//! - `%ignore` beside a nested grammar (`%json`, `%llguidance`, `%lark { ... }`) anywhere in it:
//!   llguidance compiles it, then its matcher panics mid-output ("grammar stack empty for non-root
//!   grammar", found by the `grammar_compile` fuzz target), so it is refused up front.
//!
//! Where the scan cannot follow the text (an unterminated string, bad JSON after `%json`),
//! llguidance's lexer fails on it too, before compiling anything, so the scan stops there.

use std::collections::HashMap;

use super::depth_graph::DepthGraph;
use super::json_schema;
use super::regex::Repetition;
use super::{too_many, MAX_LARK_DEPTH, MAX_LARK_RULES};
use crate::error::{Error, Result};

pub(super) fn check(text: &str) -> Result<()> {
    let mut scan = Scan {
        bytes: text.as_bytes(),
        text,
        pos: 0,
        definitions: 0,
        scopes: vec![Scope::default()],
        ignores: false,
        nested_grammar: false,
    };
    scan.run()?;
    // Blocks left open are llguidance's parse errors; measure what was seen anyway.
    while let Some(scope) = scan.scopes.pop() {
        scope.check_depth()?;
    }
    if scan.ignores && scan.nested_grammar {
        return Err(ignore_beside_a_nested_grammar());
    }
    Ok(())
}

/// llguidance compiles `%ignore` beside a nested grammar, then its matcher panics mid-output
/// ("grammar stack empty for non-root grammar"), wherever in the grammar the two are.
fn ignore_beside_a_nested_grammar() -> Error {
    Error::config(
        "the Lark grammar has an %ignore directive and a nested grammar (%json, %llguidance or %lark), which \
         llguidance's matcher fails on while generating; drop the %ignore and write the whitespace the grammar \
         allows into its rules",
    )
}

struct Scan<'t> {
    text: &'t str,
    bytes: &'t [u8],
    pos: usize,
    /// Definitions seen in every scope, for `MAX_LARK_RULES`.
    definitions: usize,
    /// The grammar, then each `%lark { ... }` block open inside it.
    scopes: Vec<Scope>,
    /// An `%ignore` directive, and a nested grammar, seen in any scope (see the module header).
    ignores: bool,
    nested_grammar: bool,
}

/// One grammar's definitions and the state of the scan inside it.
struct Scope {
    /// Definitions of each name (llguidance refuses most duplicates; all are followed here).
    index: HashMap<String, Vec<usize>>,
    /// Per definition: 1 + its deepest bracket nesting.
    weight: Vec<u64>,
    names: Vec<Vec<String>>,
    current: Option<usize>,
    /// Open brackets of the current definition: the largest repetition product inside each.
    groups: Vec<u64>,
    /// The repetition product of the last atom (what a `~` after it repeats).
    last_atom: u64,
    /// Names on the current line: the first may be the name a `:` defines.
    line: Vec<String>,
    line_starts_with_name: bool,
    at_line_start: bool,
    /// Braces open in this scope (template parameters), so a `}` ends a `%lark` block only
    /// when it matches the block's `{`.
    braces: usize,
}

impl Default for Scope {
    fn default() -> Self {
        Self {
            index: HashMap::new(),
            weight: Vec::new(),
            names: Vec::new(),
            current: None,
            groups: vec![1],
            last_atom: 1,
            line: Vec::new(),
            line_starts_with_name: false,
            at_line_start: true,
            braces: 0,
        }
    }
}

impl Scope {
    fn token(&mut self) {
        self.at_line_start = false;
    }

    fn name(&mut self, name: String) {
        if self.at_line_start {
            self.line_starts_with_name = true;
        }
        self.token();
        self.line.push(name);
        self.atom(1);
    }

    fn atom(&mut self, product: u64) {
        self.last_atom = product;
        let top = self.groups.last_mut().expect("the definition's own level");
        *top = (*top).max(product);
    }

    fn open(&mut self) {
        self.token();
        self.groups.push(1);
        self.last_atom = 1;
        if let Some(d) = self.current {
            self.weight[d] = self.weight[d].max(self.groups.len() as u64);
        }
    }

    fn close(&mut self) {
        self.token();
        if self.groups.len() > 1 {
            let inner = self.groups.pop().expect("checked");
            self.atom(inner);
        }
    }

    fn repeat(&mut self, count: u64, what: &str) -> Result<()> {
        self.token();
        let product = self.last_atom.saturating_mul(count.max(1));
        json_schema::check_repetition(Repetition { largest_count: count, largest_product: product }, what)?;
        self.atom(product);
        Ok(())
    }

    /// A `:` after the line's first name starts a definition of that name.
    fn define(&mut self) -> bool {
        self.token();
        if !self.line_starts_with_name || self.line.is_empty() {
            return false;
        }
        let name = self.line.remove(0);
        let d = self.weight.len();
        self.index.entry(name).or_default().push(d);
        self.weight.push(1);
        self.names.push(std::mem::take(&mut self.line));
        self.current = Some(d);
        self.groups = vec![1];
        self.last_atom = 1;
        self.line_starts_with_name = false;
        true
    }

    fn end_line(&mut self) {
        if let Some(d) = self.current {
            self.names[d].append(&mut self.line);
        }
        self.line.clear();
        self.line_starts_with_name = false;
        self.at_line_start = true;
    }

    fn check_depth(mut self) -> Result<()> {
        self.end_line();
        let mut graph = DepthGraph::default();
        for &w in &self.weight {
            graph.add_vertex(w);
        }
        for (d, names) in self.names.iter().enumerate() {
            for name in names {
                for &target in self.index.get(name).into_iter().flatten() {
                    graph.add_edge(d, target);
                }
            }
        }
        let all: Vec<usize> = (0..graph.len()).collect();
        let depth = graph.longest_path_bound(&all, |members| members.iter().map(|&m| graph.weight(m)).sum());
        if depth > MAX_LARK_DEPTH as u64 {
            return Err(too_many(
                format!(
                    "the Lark grammar's rules can make llguidance's compiler recurse {depth} levels deep (rules and \
                     terminals naming each other, each counted once, plus their bracket nesting)"
                ),
                "MAX_LARK_DEPTH",
                MAX_LARK_DEPTH as u64,
                "shorten the chains of rules that name the next rule, e.g. with a repetition (item*) or one regex",
            ));
        }
        Ok(())
    }
}

impl Scan<'_> {
    fn scope(&mut self) -> &mut Scope {
        self.scopes.last_mut().expect("the grammar's own scope stays")
    }

    fn peek(&self, ahead: usize) -> u8 {
        self.bytes.get(self.pos + ahead).copied().unwrap_or(0)
    }

    fn skip_while(&mut self, keep: impl Fn(u8) -> bool) {
        while self.pos < self.bytes.len() && keep(self.bytes[self.pos]) {
            self.pos += 1;
        }
    }

    fn run(&mut self) -> Result<()> {
        let mut pending_lark_block = false;
        while self.pos < self.bytes.len() {
            let b = self.bytes[self.pos];
            match b {
                b'\n' => {
                    self.pos += 1;
                    self.scope().end_line();
                }
                b' ' | b'\t' | b'\r' => self.pos += 1,
                b'#' => self.skip_while(|c| c != b'\n'),
                b'/' if self.peek(1) == b'/' => self.skip_while(|c| c != b'\n'),
                b'/' => {
                    let Some(regex) = self.regex() else { return Ok(()) };
                    let found = super::regex::repetition(&regex).unwrap_or_default();
                    let what = format!("the regex /{}/ in the Lark grammar", super::shorten(&regex));
                    json_schema::check_repetition(found, &what)?;
                    let scope = self.scope();
                    scope.token();
                    scope.atom(found.largest_product.max(1));
                }
                b'"' => {
                    if !self.string() {
                        return Ok(());
                    }
                    let scope = self.scope();
                    scope.token();
                    scope.atom(1);
                }
                b'%' => {
                    self.pos += 1;
                    let start = self.pos;
                    self.skip_while(|c| c.is_ascii_lowercase());
                    let keyword = &self.text[start..self.pos];
                    self.scope().token();
                    match keyword {
                        "json" | "llguidance" | "regex" => {
                            self.nested_grammar |= keyword != "regex";
                            let Some(value) = self.json_value() else { return Ok(()) };
                            if keyword == "json" {
                                json_schema::check(&value, "the %json schema in the Lark grammar")?;
                            }
                            self.scope().atom(1);
                        }
                        "lark" => {
                            self.nested_grammar = true;
                            pending_lark_block = true;
                        }
                        "ignore" => {
                            self.ignores = true;
                        }
                        "import" => self.import()?,
                        _ => {}
                    }
                }
                b'{' => {
                    self.pos += 1;
                    if std::mem::take(&mut pending_lark_block) {
                        self.scope().token();
                        self.scopes.push(Scope::default());
                    } else {
                        let scope = self.scope();
                        scope.token();
                        scope.braces += 1;
                    }
                }
                b'}' => {
                    self.pos += 1;
                    let scope = self.scope();
                    scope.token();
                    if scope.braces > 0 {
                        scope.braces -= 1;
                    } else if self.scopes.len() > 1 {
                        let block = self.scopes.pop().expect("checked");
                        block.check_depth()?;
                        self.scope().atom(1);
                    }
                }
                b'(' | b'[' => {
                    self.pos += 1;
                    self.scope().open();
                }
                b')' | b']' => {
                    self.pos += 1;
                    self.scope().close();
                }
                b'~' => {
                    self.pos += 1;
                    let (low, high) = self.range();
                    let text = match high {
                        Some(high) => format!("~{low}..{high}"),
                        None => format!("~{low}"),
                    };
                    self.scope()
                        .repeat(low.max(high.unwrap_or(0)), &format!("the repetition {text} in the Lark grammar"))?;
                }
                b':' if self.peek(1) == b':' => {
                    self.pos += 2;
                    self.scope().token();
                }
                b':' => {
                    self.pos += 1;
                    if self.scope().define() {
                        self.definitions += 1;
                        self.check_count()?;
                    }
                }
                b'<' => {
                    self.skip_while(|c| c != b'>' && c != b'\n');
                    self.pos += 1;
                    self.scope().token();
                }
                b'@' => {
                    self.pos += 1;
                    self.skip_while(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
                    self.scope().token();
                }
                _ => match self.name() {
                    Some(name) => self.scope().name(name),
                    None => {
                        // Numbers, operators (| * + ? = , . & ->) and bytes llguidance's lexer refuses.
                        self.pos += 1;
                        self.scope().token();
                    }
                },
            }
        }
        Ok(())
    }

    fn check_count(&self) -> Result<()> {
        if self.definitions > MAX_LARK_RULES {
            return Err(too_many(
                format!("the Lark grammar has more than {MAX_LARK_RULES} rules and terminals"),
                "MAX_LARK_RULES",
                MAX_LARK_RULES as u64,
                "merge rules, e.g. alternatives of literals into one rule or one regex",
            ));
        }
        Ok(())
    }

    /// `%import common.NAME` or `%import common (A, B)`: each imported name is a definition.
    fn import(&mut self) -> Result<()> {
        while self.pos < self.bytes.len() && self.bytes[self.pos] != b'\n' {
            if self.name().is_some() {
                self.definitions += 1;
                self.check_count()?;
            } else {
                self.pos += 1;
            }
        }
        Ok(())
    }

    /// A rule name (`!?[_?]?[a-z][_a-z0-9-]*`, without its `!`/`?`) or a terminal name
    /// (`_?[A-Z][_A-Z0-9-]*`) at the current position, as llguidance's lexer reads them.
    fn name(&mut self) -> Option<String> {
        let at = |i: usize| self.bytes.get(i).copied().unwrap_or(0);
        let start = self.pos;
        let mut i = start;
        if at(i) == b'!' {
            i += 1;
        }
        if at(i) == b'_' || at(i) == b'?' {
            i += 1;
        }
        if at(i).is_ascii_lowercase() {
            let mut end = i + 1;
            while matches!(at(end), b'_' | b'-' | b'a'..=b'z' | b'0'..=b'9') {
                end += 1;
            }
            self.pos = end;
            return Some(self.text[start..end].trim_start_matches(['!', '?']).to_string());
        }
        let mut i = start;
        if at(i) == b'_' {
            i += 1;
        }
        if at(i).is_ascii_uppercase() {
            let mut end = i + 1;
            while matches!(at(end), b'_' | b'-' | b'A'..=b'Z' | b'0'..=b'9') {
                end += 1;
            }
            self.pos = end;
            return Some(self.text[start..end].to_string());
        }
        None
    }

    /// A JSON string literal (llguidance's: no raw control bytes), then an optional `i`. False
    /// when it does not end on its line.
    fn string(&mut self) -> bool {
        self.pos += 1;
        while self.pos < self.bytes.len() {
            match self.bytes[self.pos] {
                b'\\' => self.pos += 2,
                b'"' => {
                    self.pos += 1;
                    if self.peek(0) == b'i' {
                        self.pos += 1;
                    }
                    return true;
                }
                c if c < 0x20 || c == 0x7f => return false,
                _ => self.pos += 1,
            }
        }
        false
    }

    /// A `/regex/flags` literal's regex, with `\/` unescaped and an `x` flag made inline (it
    /// changes how counts are written); `None` when it does not end.
    fn regex(&mut self) -> Option<String> {
        let start = self.pos + 1;
        let mut i = start;
        while i < self.bytes.len() {
            match self.bytes[i] {
                b'\\' => i += 2,
                b'/' if i > start => break,
                b'/' => return None,
                _ => i += 1,
            }
        }
        if i >= self.bytes.len() {
            return None;
        }
        let body = self.text[start..i].replace("\\/", "/");
        self.pos = i + 1;
        let flags_start = self.pos;
        self.skip_while(|c| b"imslux".contains(&c));
        let verbose = self.text[flags_start..self.pos].contains('x');
        Some(if verbose { format!("(?x){body}") } else { body })
    }

    /// The JSON value after `%json` and friends (serde_json's parser, which refuses nesting past
    /// 128 without recursing further), as llguidance reads it.
    fn json_value(&mut self) -> Option<serde_json::Value> {
        let mut values = serde_json::Deserializer::from_slice(&self.bytes[self.pos..]).into_iter::<serde_json::Value>();
        let value = values.next()?.ok()?;
        self.pos += values.byte_offset();
        Some(value)
    }

    /// `n` or `n..m` after a `~`.
    fn range(&mut self) -> (u64, Option<u64>) {
        let low = self.number();
        let save = self.pos;
        self.skip_while(|c| c == b' ' || c == b'\t');
        if self.peek(0) == b'.' && self.peek(1) == b'.' {
            self.pos += 2;
            return (low, Some(self.number()));
        }
        self.pos = save;
        (low, None)
    }

    fn number(&mut self) -> u64 {
        self.skip_while(|c| c == b' ' || c == b'\t');
        let start = self.pos;
        self.skip_while(|c| c.is_ascii_digit());
        // Past u64 is past any limit too.
        self.text[start..self.pos].parse().unwrap_or(if self.pos > start { u64::MAX } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn refused(text: &str) -> String {
        match check(text) {
            Err(Error::Config(message)) => message,
            other => panic!("{text:?}: {other:?}"),
        }
    }

    fn rule_chain(n: usize) -> String {
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g += &format!("r{i}: r{}\n", i + 1);
        }
        g + &format!("r{n}: \"x\"\n")
    }

    #[test]
    fn ordinary_grammars_pass() {
        check("start: \"yes\" | \"no\"").unwrap();
        check(
            "start: expr\nexpr: term ((\"+\" | \"-\") term)*\nterm: factor ((\"*\" | \"/\") factor)*\n\
             factor: NUMBER | \"(\" expr \")\"\n%import common.NUMBER\n// a comment: with colon\n# another: one\n",
        )
        .unwrap();
        check("start: %json {\"type\": \"object\"}\n").unwrap();
        check("start: %lark {\n  start: \"a\"\n}\n").unwrap();
    }

    #[test]
    fn ignore_beside_a_nested_grammar_is_refused() {
        let json = "r1: %json {\"type\": \"object\"} | \"end\"\n";
        let lark = "r1: %lark {\nstart: \"a\"\n} | \"end\"\n";
        for nested in [json, lark] {
            let message = refused(&format!("start: \"bab\" r1\n{nested}%ignore /[ \\t]+/\n"));
            assert!(message.contains("%ignore") && message.contains("nested grammar"), "{message}");
            check(&format!("start: \"bab\" r1\n{nested}")).unwrap();
        }
        // Found by the grammar_compile fuzz target: an %ignore inside a %lark block, with nested
        // grammars around it, panics the same way; so %ignore goes with no nested grammar anywhere.
        let inside = "start: r2 r3\nr2: %lark {\nstart: \"a\" | \"end\"\n%ignore /[ \\t]+/\n} | \"end\"\n\
                      r3: %json {\"type\": \"null\"} \"x\"\n";
        assert!(refused(inside).contains("%ignore"));
        assert!(refused("start: %lark {\nstart: \"a\" \"b\"\n%ignore \" \"\n}\n").contains("%ignore"));
        // Each on its own is fine.
        check("start: \"a\" \"b\"\n%ignore /[ \\t]+/\n").unwrap();
    }

    #[test]
    fn a_long_chain_of_rules_is_refused_by_depth_and_count() {
        check(&rule_chain(MAX_LARK_DEPTH - 2)).unwrap();
        assert!(refused(&rule_chain(MAX_LARK_DEPTH + 1)).contains("MAX_LARK_DEPTH"));
        let mut flat = String::from("start: r0\n");
        for i in 0..=MAX_LARK_RULES {
            flat += &format!("r{i}: \"x\"\n");
        }
        assert!(refused(&flat).contains("MAX_LARK_RULES"));
    }

    #[test]
    fn nesting_weighs_on_the_depth() {
        // Each rule names the next inside 20 groups: 21 levels per rule.
        let n = MAX_LARK_DEPTH / 21 + 1;
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g += &format!("r{i}: {}r{}{}\n", "(".repeat(20), i + 1, ")".repeat(20));
        }
        g += &format!("r{n}: \"x\"\n");
        assert!(refused(&g).contains("MAX_LARK_DEPTH"));
    }

    #[test]
    fn mutually_recursive_rules_count_once() {
        // a <-> b recursion, many times over, stays small.
        check("start: a\na: \"(\" b \")\" | \"x\"\nb: a | a b\n").unwrap();
    }

    #[test]
    fn repetitions_multiply() {
        check("start: \"a\"~10000").unwrap();
        check("start: (\"a\"~100)~100").unwrap();
        assert!(refused("start: \"a\"~10001").contains("MAX_REGEX_REPEAT"));
        assert!(refused("start: (\"a\"~101)~100").contains("multiply to 10100"));
        assert!(refused("start: /(x{1000}){1000}/").contains("MAX_REGEX_REPEAT"));
        assert!(refused("start: /x{101}/~100").contains("multiply"));
        assert!(refused("start: X\nX: \"a\"~10..50000\n").contains("50000"));
        assert!(refused("start: /a{ 50000 }/x").contains("MAX_REGEX_REPEAT"));
    }

    #[test]
    fn json_inside_lark_is_measured() {
        let deep = format!("start: %json {}{}\n", "{\"items\": ".repeat(70), "{}".to_string() + &"}".repeat(70));
        assert!(refused(&deep).contains("MAX_JSON_NESTING"));
    }

    #[test]
    fn a_block_is_its_own_grammar() {
        // The same names inside a %lark block do not chain with the outer ones.
        let inner = rule_chain(MAX_LARK_DEPTH / 2);
        check(&format!("{}x: %lark {{\n{inner}}}\n", rule_chain(MAX_LARK_DEPTH / 2))).unwrap();
    }

    #[test]
    fn names_split_where_llguidances_lexer_splits_them() {
        // `aB` is the rule a then the terminal B: a -> B -> a is one component.
        check("start: aB\na: \"x\"\nB: \"y\"\n").unwrap();
        let mut s = Scan {
            text: "aBc",
            bytes: b"aBc",
            pos: 0,
            definitions: 0,
            scopes: vec![],
            ignores: false,
            nested_grammar: false,
        };
        assert_eq!(s.name().as_deref(), Some("a"));
        assert_eq!(s.name().as_deref(), Some("B"));
        assert_eq!(s.name().as_deref(), Some("c"));
        assert_eq!(s.name(), None);
    }
}
