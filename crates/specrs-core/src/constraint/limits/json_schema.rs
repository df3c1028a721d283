//! A JSON schema measured against the limits before llguidance compiles it.
//!
//! llguidance's schema compiler recurses once per nesting level and once per `$ref` it follows
//! (a target is compiled at its first use, inside the compile of the schema that names it), so a
//! flat document whose `$defs` chain thousands of `$ref`s overflows a thread's stack. Measured
//! here, without recursion:
//! - nesting: arrays and objects inside each other (`MAX_JSON_NESTING`);
//! - size: JSON values in the document (`MAX_SCHEMA_NODES`);
//! - compile depth (`MAX_SCHEMA_DEPTH`): a bound on the levels llguidance's recursion can reach,
//!   nesting plus `$ref` hops. Graph: a vertex per JSON value (weight 1) with edges to its
//!   children, and a vertex per distinct `$ref` string (weight 0: llguidance keys what it has
//!   compiled by that string) with an edge from each object naming it and one to the value it
//!   resolves to. A compile follows a path of this graph that never repeats a `$ref` string;
//!   inside a cycle, between two `$ref`s it only descends the document, so one stretch through a
//!   cycle's component weighs at most its tallest value's height plus, per `$ref` string in it,
//!   the height of its target (`DepthGraph` turns that into a bound over every path).
//! - regexes: counted repetitions of each `pattern` (`MAX_REGEX_REPEAT`), and `minLength` of a
//!   string that also has a `pattern` or `format` (`MAX_PATTERN_MIN_LENGTH`);
//! - finite instances: every schema reachable from the root has one (`finite`: an object that
//!   requires itself would make llguidance force output until an internal error).
//!
//! `$ref`s resolve as llguidance resolves them without its `referencing` feature (which specrs
//! leaves off): `#` or `#/` is the document, `#/a/b/0` walks keys and array indices, anything else
//! is an error of llguidance's (so no edge here).

mod finite;

use std::collections::HashMap;

use serde_json::Value;

use super::depth_graph::DepthGraph;
use super::{
    regex, too_many, MAX_JSON_NESTING, MAX_PATTERN_MIN_LENGTH, MAX_REGEX_REPEAT, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES,
};
use crate::error::Result;

/// Checks `schema` (what llguidance compiles) against the JSON schema limits; `what` names it in
/// errors ("the JSON schema", "the %json schema in the Lark grammar").
pub(super) fn check(schema: &Value, what: &str) -> Result<()> {
    let document = Document::index(schema, what)?;
    let depth = document.compile_depth_bound();
    if depth > MAX_SCHEMA_DEPTH as u64 {
        return Err(too_many(
            format!(
                "{what} can make llguidance's compiler recurse {depth} levels deep (nesting plus chains of $ref, \
                 each $ref target counted once)"
            ),
            "MAX_SCHEMA_DEPTH",
            MAX_SCHEMA_DEPTH as u64,
            "shorten the chains of $ref (a $ref to a $ref to ...) and the nesting",
        ));
    }
    for &value in &document.values {
        check_string_regexes(value, what)?;
    }
    finite::check(&document, what)
}

/// `value` against `MAX_JSON_NESTING`; `what` names it in errors.
pub(crate) fn check_nesting(value: &Value, what: &str) -> Result<()> {
    match nesting_past(value, MAX_JSON_NESTING) {
        Some(depth) => Err(too_many(
            format!("{what} nests arrays and objects {depth} or more levels deep"),
            "MAX_JSON_NESTING",
            MAX_JSON_NESTING as u64,
            "flatten it, e.g. name repeated parts in $defs and use $ref",
        )),
        None => Ok(()),
    }
}

/// Nesting depth of `value` (a scalar is 0, `[]` is 1), measured without recursion and stopping
/// once past `limit`.
fn nesting_past(value: &Value, limit: usize) -> Option<usize> {
    let mut stack = vec![(value, 0usize)];
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => Box::new(map.values()),
            _ => continue,
        };
        if depth + 1 > limit {
            return Some(depth + 1);
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    None
}

/// The document's values in pre-order (a value before its children), with what the compile
/// depth needs.
struct Document<'a> {
    values: Vec<&'a Value>,
    /// Each value's index in `values`, by address.
    index_of: HashMap<*const Value, usize>,
    /// Each value's parent (`u32::MAX` for the root).
    parent: Vec<u32>,
    children: Vec<Vec<u32>>,
    /// Levels below each value (a scalar or empty container: 0).
    height: Vec<u64>,
}

impl<'a> Document<'a> {
    fn index(schema: &'a Value, what: &str) -> Result<Self> {
        check_nesting(schema, what)?;
        let mut values: Vec<&Value> = Vec::new();
        let mut parent: Vec<u32> = Vec::new();
        let mut stack = vec![(schema, u32::MAX)];
        while let Some((v, up)) = stack.pop() {
            if values.len() == MAX_SCHEMA_NODES {
                return Err(too_many(
                    format!("{what} has more than {MAX_SCHEMA_NODES} JSON values"),
                    "MAX_SCHEMA_NODES",
                    MAX_SCHEMA_NODES as u64,
                    "send a smaller schema",
                ));
            }
            let me = values.len() as u32;
            values.push(v);
            parent.push(up);
            match v {
                Value::Array(items) => stack.extend(items.iter().rev().map(|c| (c, me))),
                Value::Object(map) => stack.extend(map.values().rev().map(|c| (c, me))),
                _ => {}
            }
        }
        let mut children = vec![Vec::new(); values.len()];
        let mut height = vec![0u64; values.len()];
        // Children come after their parent in pre-order: walking backwards sees them first.
        for v in (1..values.len()).rev() {
            let up = parent[v] as usize;
            children[up].push(v as u32);
            height[up] = height[up].max(height[v] + 1);
        }
        let index_of = values.iter().enumerate().map(|(i, &v)| (v as *const Value, i)).collect();
        Ok(Self { values, index_of, parent, children, height })
    }

    /// The JSON pointer of value `v`, as a `$ref` names it (`#/$defs/a`).
    fn pointer(&self, mut v: usize) -> String {
        let mut segments = Vec::new();
        while self.parent[v] != u32::MAX {
            let up = self.parent[v] as usize;
            let me = self.values[v] as *const Value;
            let segment = match self.values[up] {
                Value::Array(items) => items.iter().position(|c| std::ptr::eq(c, me)).map(|i| i.to_string()),
                Value::Object(map) => map.iter().find(|(_, c)| std::ptr::eq(*c, me)).map(|(k, _)| k.clone()),
                _ => None,
            };
            segments.push(segment.unwrap_or_default().replace('~', "~0").replace('/', "~1"));
            v = up;
        }
        segments.reverse();
        if segments.is_empty() {
            "#".into()
        } else {
            format!("#/{}", segments.join("/"))
        }
    }

    fn compile_depth_bound(&self) -> u64 {
        let index_of = &self.index_of;
        let mut graph = DepthGraph::default();
        for _ in &self.values {
            graph.add_vertex(1);
        }
        for (v, kids) in self.children.iter().enumerate() {
            for &c in kids {
                graph.add_edge(v, c as usize);
            }
        }
        // One vertex per distinct $ref string; `target_of[vertex - values.len()]` is its value.
        let mut ref_vertex: HashMap<&str, usize> = HashMap::new();
        let mut target_of: Vec<usize> = Vec::new();
        for (v, value) in self.values.iter().enumerate() {
            let Some(Value::String(reference)) = value.get("$ref") else { continue };
            let Some(target) = resolve(self.values[0], reference) else { continue };
            let vertex = *ref_vertex.entry(reference.as_str()).or_insert_with(|| {
                let vertex = graph.add_vertex(0);
                graph.add_edge(vertex, index_of[&(target as *const Value)]);
                target_of.push(index_of[&(target as *const Value)]);
                vertex
            });
            graph.add_edge(v, vertex);
        }
        let first_ref = self.values.len();
        graph.longest_path_bound(&[0], |members| {
            let tallest = members.iter().filter(|&&m| m < first_ref).map(|&m| self.height[m] + 1).max().unwrap_or(0);
            let refs: u64 =
                members.iter().filter(|&&m| m >= first_ref).map(|&m| self.height[target_of[m - first_ref]] + 1).sum();
            tallest + refs
        })
    }
}

/// What llguidance's `$ref` lookup (without `referencing`) finds for `reference` in `root`.
fn resolve<'v>(root: &'v Value, reference: &str) -> Option<&'v Value> {
    if reference == "#" || reference == "#/" {
        return Some(root);
    }
    let mut content = root;
    for segment in reference.strip_prefix("#/")?.split('/') {
        content =
            if content.is_array() { content.get(segment.parse::<usize>().ok()?)? } else { content.get(segment)? };
    }
    Some(content)
}

/// A string schema's `pattern` against `MAX_REGEX_REPEAT`, and its `minLength` when llguidance
/// intersects it with a `pattern` or `format` (the intersection forces long runs expensively).
fn check_string_regexes(value: &Value, what: &str) -> Result<()> {
    let Value::Object(map) = value else { return Ok(()) };
    if let Some(Value::String(pattern)) = map.get("pattern") {
        check_regex(pattern, &format!("the pattern {} in {what}", super::shorten(pattern)))?;
    }
    let constrained =
        map.get("pattern").is_some_and(Value::is_string) || map.get("format").is_some_and(Value::is_string);
    if let (true, Some(min_length)) = (constrained, map.get("minLength").and_then(Value::as_u64)) {
        if min_length > MAX_PATTERN_MIN_LENGTH {
            return Err(too_many(
                format!("{what} has a string with a pattern or format and minLength {min_length}"),
                "MAX_PATTERN_MIN_LENGTH",
                MAX_PATTERN_MIN_LENGTH,
                "lower minLength, or drop the pattern/format and keep the length",
            ));
        }
    }
    Ok(())
}

/// `regex` against `MAX_REGEX_REPEAT`; `what` names it in errors.
pub(super) fn check_regex(regex: &str, what: &str) -> Result<()> {
    let Some(found) = regex::repetition(regex) else { return Ok(()) };
    check_repetition(found, what)
}

pub(super) fn check_repetition(found: regex::Repetition, what: &str) -> Result<()> {
    let limit = MAX_REGEX_REPEAT;
    if found.largest_count > limit {
        return Err(too_many(
            format!("{what} repeats something {} times", found.largest_count),
            "MAX_REGEX_REPEAT",
            limit,
            "use a smaller count, or * or + instead of a large {n}",
        ));
    }
    if found.largest_product > limit {
        return Err(too_many(
            format!("{what} nests counted repetitions that multiply to {}", found.largest_product),
            "MAX_REGEX_REPEAT",
            limit,
            "use smaller counts, or * or + instead of nested {n}",
        ));
    }
    Ok(())
}
