//! Whether every schema a JSON schema document can generate through has a finite instance.
//!
//! llguidance compiles an object that requires itself (`{"properties": {"a": {"$ref": "#"}},
//! "required": ["a"], "type": "object"}`) into a rule with no way out; when the output enters it,
//! the matcher forces `{"a": {"a": ...` until its 50,000-item limit on forced tokens: an internal
//! error mid-output. Behind a choice (an optional property, an `anyOf` branch, array items) the
//! start of the output is fine, so the compile-time first steps do not see it. Refused here.
//!
//! A schema is *productive* (has a finite instance) by the least fixed point of, over the
//! schemas reachable from the root (through `$ref`, `allOf`/`anyOf`/`oneOf`, `properties`,
//! `patternProperties`, `additionalProperties`, `items`, `prefixItems`, `additionalItems`):
//! - a `$ref`: its target is; `allOf`: every part is; `anyOf` / `oneOf`: some branch is;
//! - its `type`: some allowed type is: a scalar type (or no `type`: any value) always is; an
//!   `object` when the schema of each required property is; an `array` when `minItems` is 0 or
//!   absent, or the schemas of its first `minItems` items are;
//! - all of the above that a schema has (they are conjuncts), and anything else always is.
//!
//! A document is refused when a reachable schema is not productive: llguidance may take any
//! branch. Invariant: it never refuses a document all of whose reachable schemas have finite
//! instances. Every approximation errs towards "productive", so it can only accept more:
//! - conjuncts are judged one by one, not intersected (`{"type": "null", "anyOf": [{"type":
//!   "object"}]}` counts as productive although its parts exclude each other);
//! - `enum` / `const` make a schema productive and end the walk there (its value is given);
//! - `not`, `if`/`then`/`else`, `contains`, `dependentSchemas`, `unevaluated*`, `propertyNames`
//!   and the `false` schema are neither followed nor judged (a cycle only through them, e.g. an
//!   array that `contains` itself, passes as before): what they exclude is llguidance's to check;
//! - a required property missing from `properties` counts as productive, unless its object has
//!   an `additionalProperties` schema and no `patternProperties` (which a name may match): then
//!   it needs that schema.
//!
//! Iterative (explicit stacks and a work list), like every measurement in `limits`.

use serde_json::{Map, Value};

use super::{resolve, Document};
use crate::error::{Error, Result};

/// Types whose instances need nothing from other schemas.
const SCALAR_TYPES: [&str; 5] = ["null", "boolean", "number", "integer", "string"];

/// One conjunct of a schema: met when any of `options` (schemas or type branches) is productive.
struct Need<'a> {
    why: Why<'a>,
    options: Vec<usize>,
}

/// What a conjunct is, for the error message.
#[derive(Clone, Copy)]
enum Why<'a> {
    Ref(&'a str),
    AllOf(usize),
    AnyOf(&'static str),
    /// The allowed types (`object`, `array`), each a branch vertex of its own.
    Types,
    Required(&'a str),
    Item(usize),
    /// Items past the `prefixItems` that `minItems` asks for.
    MoreItems(u64),
}

/// Refuses `document` when a schema reachable from its root has no finite instance; `what`
/// names the document in errors.
pub(super) fn check(document: &Document, what: &str) -> Result<()> {
    let graph = Graph::build(document);
    let productive = graph.least_fixed_point();
    let unproductive = |v: &usize| graph.reached[*v] && !productive[*v];
    // Name a schema whose own structure (a required property, minItems) closes the cycle when
    // there is one; else (a cycle of $ref / allOf / anyOf alone) the first in the document.
    let structural = (0..document.values.len()).filter(unproductive).find(|&v| {
        graph.needs[v].iter().any(|need| matches!(need.why, Why::Types) && !need.options.iter().any(|&o| productive[o]))
    });
    let Some(schema) = structural.or_else(|| (0..document.values.len()).find(unproductive)) else { return Ok(()) };
    let reason = graph.blame(schema, &productive);
    Err(Error::config(format!(
        "{what} has a schema with no finite instance, at `{}`: every instance of it needs {reason}, which has none \
         either (they need each other without end, so llguidance would force output forever); make that property \
         optional, allow null or another type in it, lower minItems to 0, or add a branch that ends",
        document.pointer(schema)
    )))
}

/// The rules of the fixed point: a vertex per JSON value of the document (its index there),
/// then a vertex per `object` / `array` type branch of a schema.
struct Graph<'a> {
    needs: Vec<Vec<Need<'a>>>,
    /// Values reached as schemas from the root.
    reached: Vec<bool>,
}

impl<'a> Graph<'a> {
    fn build(document: &Document<'a>) -> Self {
        let n = document.values.len();
        let mut graph = Graph { needs: (0..n).map(|_| Vec::new()).collect(), reached: vec![false; n] };
        let root = document.values[0];
        let mut stack = vec![0usize];
        graph.reached[0] = true;
        while let Some(v) = stack.pop() {
            let Value::Object(map) = document.values[v] else { continue };
            if map.contains_key("enum") || map.contains_key("const") {
                continue;
            }
            let mut follow = |value: &'a Value| -> usize {
                let index = document.index_of[&(value as *const Value)];
                if !graph.reached[index] {
                    graph.reached[index] = true;
                    stack.push(index);
                }
                index
            };
            let mut needs = Vec::new();
            if let Some(Value::String(reference)) = map.get("$ref") {
                if let Some(target) = resolve(root, reference) {
                    needs.push(Need { why: Why::Ref(reference), options: vec![follow(target)] });
                }
            }
            if let Some(Value::Array(parts)) = map.get("allOf") {
                for (k, part) in parts.iter().enumerate() {
                    needs.push(Need { why: Why::AllOf(k), options: vec![follow(part)] });
                }
            }
            for keyword in ["anyOf", "oneOf"] {
                if let Some(Value::Array(branches)) = map.get(keyword) {
                    let options: Vec<usize> = branches.iter().map(&mut follow).collect();
                    if !options.is_empty() {
                        needs.push(Need { why: Why::AnyOf(keyword), options });
                    }
                }
            }
            for keyword in ["properties", "patternProperties"] {
                if let Some(Value::Object(schemas)) = map.get(keyword) {
                    schemas.values().for_each(|s| {
                        follow(s);
                    });
                }
            }
            for keyword in ["additionalProperties", "items", "prefixItems", "additionalItems"] {
                match map.get(keyword) {
                    Some(Value::Array(schemas)) => schemas.iter().for_each(|s| {
                        follow(s);
                    }),
                    Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                        follow(schema);
                    }
                    _ => {}
                }
            }
            let index = |value: &Value| document.index_of[&(value as *const Value)];
            if let Some(branches) = type_branches(map) {
                let mut options = Vec::new();
                if branches.object {
                    options.push(graph.add_branch(object_needs(map, index)));
                }
                if branches.array {
                    options.push(graph.add_branch(array_needs(map, index)));
                }
                needs.push(Need { why: Why::Types, options });
            }
            graph.needs[v] = needs;
        }
        graph
    }

    fn add_branch(&mut self, needs: Vec<Need<'a>>) -> usize {
        self.needs.push(needs);
        self.needs.len() - 1
    }

    /// Which vertices are productive: a work list from those with nothing to need, each met
    /// need counted down once (linear in the size of the rules).
    fn least_fixed_point(&self) -> Vec<bool> {
        let total = self.needs.len();
        let mut watchers: Vec<Vec<(u32, u32)>> = vec![Vec::new(); total];
        let mut unmet: Vec<usize> = self.needs.iter().map(Vec::len).collect();
        let mut met: Vec<Vec<bool>> = self.needs.iter().map(|needs| vec![false; needs.len()]).collect();
        for (v, needs) in self.needs.iter().enumerate() {
            for (k, need) in needs.iter().enumerate() {
                for &option in &need.options {
                    watchers[option].push((v as u32, k as u32));
                }
            }
        }
        let mut productive = vec![false; total];
        let mut work: Vec<usize> = (0..total).filter(|&v| unmet[v] == 0).collect();
        work.iter().for_each(|&v| productive[v] = true);
        while let Some(done) = work.pop() {
            for &(v, k) in &watchers[done] {
                let (v, k) = (v as usize, k as usize);
                if met[v][k] {
                    continue;
                }
                met[v][k] = true;
                unmet[v] -= 1;
                if unmet[v] == 0 && !productive[v] {
                    productive[v] = true;
                    work.push(v);
                }
            }
        }
        productive
    }

    /// The first need of unproductive `v` that is unmet, in words (a type branch's own need).
    fn blame(&self, v: usize, productive: &[bool]) -> String {
        let unmet = |v: usize| self.needs[v].iter().find(|need| !need.options.iter().any(|&o| productive[o]));
        let Some(need) = unmet(v) else { return "something".into() };
        let why = match need.why {
            Why::Types => need.options.iter().find_map(|&branch| unmet(branch)).map_or(need.why, |n| n.why),
            why => why,
        };
        match why {
            Why::Ref(reference) => format!("its $ref `{reference}`"),
            Why::AllOf(k) => format!("its allOf part {k}"),
            Why::AnyOf(keyword) => format!("one of its {keyword} branches"),
            Why::Types => "one of its types (object or array)".into(),
            Why::Required(name) => format!("its required property `{name}`"),
            Why::Item(i) => format!("its item {i} (minItems asks for it)"),
            Why::MoreItems(min) => format!("items (minItems {min})"),
        }
    }
}

struct TypeBranches {
    object: bool,
    array: bool,
}

/// The `object` / `array` branches a schema's `type` allows, or `None` when it also allows a
/// scalar, allows any type (no `type`) or names none of these (llguidance's to refuse).
fn type_branches(map: &Map<String, Value>) -> Option<TypeBranches> {
    let names: Vec<&str> = match map.get("type")? {
        Value::String(name) => vec![name.as_str()],
        Value::Array(names) => names.iter().filter_map(Value::as_str).collect(),
        _ => return None,
    };
    if names.iter().any(|name| SCALAR_TYPES.contains(name)) {
        return None;
    }
    let branches = TypeBranches { object: names.contains(&"object"), array: names.contains(&"array") };
    (branches.object || branches.array).then_some(branches)
}

/// What an object instance needs: an instance of each required property's schema.
fn object_needs<'a>(map: &'a Map<String, Value>, index: impl Fn(&Value) -> usize) -> Vec<Need<'a>> {
    let Some(Value::Array(required)) = map.get("required") else { return Vec::new() };
    let properties = map.get("properties").and_then(Value::as_object);
    let additional = match map.get("additionalProperties") {
        Some(schema @ Value::Object(_)) if !map.contains_key("patternProperties") => Some(schema),
        _ => None,
    };
    required
        .iter()
        .filter_map(Value::as_str)
        .filter_map(|name| {
            let schema = properties.and_then(|p| p.get(name)).or(additional)?;
            Some(Need { why: Why::Required(name), options: vec![index(schema)] })
        })
        .collect()
}

/// What an array instance needs: instances of its first `minItems` items' schemas.
fn array_needs<'a>(map: &'a Map<String, Value>, index: impl Fn(&Value) -> usize) -> Vec<Need<'a>> {
    let min_items = map.get("minItems").and_then(Value::as_u64).unwrap_or(0);
    if min_items == 0 {
        return Vec::new();
    }
    // prefixItems then items (2020-12), or items as a list then additionalItems (older drafts).
    let (prefix, rest) = match (map.get("prefixItems"), map.get("items")) {
        (Some(Value::Array(prefix)), rest) => (prefix.as_slice(), rest),
        (_, Some(Value::Array(prefix))) => (prefix.as_slice(), map.get("additionalItems")),
        (_, rest) => (&[][..], rest),
    };
    let schema = |value: &Value| matches!(value, Value::Object(_) | Value::Bool(_));
    let mut needs: Vec<Need> = prefix
        .iter()
        .take(usize::try_from(min_items).unwrap_or(usize::MAX))
        .enumerate()
        .filter(|(_, item)| schema(item))
        .map(|(i, item)| Need { why: Why::Item(i), options: vec![index(item)] })
        .collect();
    if min_items > prefix.len() as u64 {
        if let Some(rest) = rest.filter(|r| schema(r)) {
            needs.push(Need { why: Why::MoreItems(min_items), options: vec![index(rest)] });
        }
    }
    needs
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::error::Error;

    fn check(schema: serde_json::Value) -> crate::error::Result<()> {
        super::super::check(&schema, "the JSON schema")
    }

    /// This check alone (the whole one would stop a long chain at `MAX_SCHEMA_DEPTH` first).
    fn finite_instances(schema: &serde_json::Value) -> Result<(), String> {
        let document = super::Document::index(schema, "the JSON schema").map_err(|e| e.to_string())?;
        super::check(&document, "the JSON schema").map_err(|e| e.to_string())
    }

    /// The message refusing `schema`, which must name `at` and `reason`.
    fn refused(schema: serde_json::Value, at: &str, reason: &str) {
        match check(schema.clone()) {
            Err(Error::Config(message)) => {
                assert!(message.contains("no finite instance"), "{schema}: {message}");
                assert!(message.contains(&format!("at `{at}`")), "{schema}: {message}");
                assert!(message.contains(reason), "{schema}: {message}");
                assert!(message.contains("make that property optional, allow null"), "{message}");
            }
            other => panic!("{schema}: expected a config error, got {other:?}"),
        }
    }

    fn self_requiring() -> serde_json::Value {
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"]})
    }

    #[test]
    fn a_self_requiring_object_behind_a_choice_is_refused() {
        // The fuzz finding's shape: an array of them inside anyOf (minItems 0: the branch starts).
        refused(
            json!({"$defs": {"x": self_requiring()},
                "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/x"}}, {"type": "null"}]}),
            "#/$defs/x",
            "required property `a`",
        );
        // Directly through anyOf, and behind an optional property.
        refused(
            json!({"$defs": {"x": self_requiring()}, "anyOf": [{"$ref": "#/$defs/x"}, {"type": "string"}]}),
            "#/$defs/x",
            "required property `a`",
        );
        refused(
            json!({"$defs": {"x": self_requiring()}, "type": "object", "properties": {"opt": {"$ref": "#/$defs/x"}}}),
            "#/$defs/x",
            "required property `a`",
        );
        // At the root too (the first steps caught only this, and only when forced from the start).
        refused(json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}), "#", "`a`");
    }

    #[test]
    fn self_requiring_through_array_items_and_mutual_recursion_are_refused() {
        refused(
            json!({"$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}},
                "type": "object", "properties": {"p": {"$ref": "#/$defs/x"}}}),
            "#/$defs/x",
            "items (minItems 1)",
        );
        refused(
            json!({"prefixItems": [{"type": "integer"}, {"$ref": "#"}], "minItems": 2, "type": "array"}),
            "#",
            "item 1",
        );
        refused(
            json!({"$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
                "anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}),
            "#/$defs/a",
            "required property `b`",
        );
        // Through allOf, and a $ref cycle with nothing in between.
        refused(
            json!({"$defs": {"x": {"allOf": [{"type": "object"}, {"required": ["a"], "type": "object",
                "properties": {"a": {"$ref": "#/$defs/x"}}}]}}, "anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}]}),
            "#/$defs/x/allOf/1",
            "`a`",
        );
        refused(
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
            "#",
            "$ref",
        );
    }

    #[test]
    fn recursion_with_a_way_out_passes() {
        let accepted = [
            // A tree whose children array may be empty.
            json!({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}},
                "$ref": "#/$defs/node"}),
            // A linked list with an optional next, and one whose next may be null.
            json!({"type": "object", "properties": {"v": {"type": "string"}, "next": {"$ref": "#"}}, "required": ["v"]}),
            json!({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                "required": ["next"]}),
            json!({"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
            json!({"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
            // No type: a scalar is an instance; an enum gives its own; minItems 1 of a finite item.
            json!({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"], "enum": [{"a": 1}]}),
            json!({"type": "array", "items": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}, "minItems": 3}),
            // An unused self-requiring definition is never generated.
            json!({"$defs": {"x": self_requiring()}, "type": "string"}),
        ];
        for schema in accepted {
            assert!(check(schema.clone()).is_ok(), "{schema}: {:?}", check(schema.clone()));
        }
    }

    #[test]
    fn a_long_chain_needs_no_stack() {
        // 10,000 definitions, each requiring the next, the last a string: no recursion measures
        // it (with the last one requiring the first, none has an instance).
        let n = 10_000;
        let defs = |last: serde_json::Value| {
            let mut defs = serde_json::Map::new();
            for i in 0..n {
                defs.insert(format!("d{i}"), json!({"allOf": [{"$ref": format!("#/$defs/d{}", i + 1)}]}));
            }
            defs.insert(format!("d{n}"), last);
            defs
        };
        let finite = finite_instances(&json!({"$defs": defs(json!({"type": "string"})), "$ref": "#/$defs/d0"}));
        assert_eq!(finite, Ok(()));
        let endless = finite_instances(&json!({"$defs": defs(json!({"$ref": "#/$defs/d0"})), "$ref": "#/$defs/d0"}));
        assert!(endless.unwrap_err().contains("no finite instance"));
    }
}
