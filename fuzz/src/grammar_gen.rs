//! Structure-aware grammars for the `grammar_compile` target: JSON schemas with `$defs` chains
//! (`$ref`, properties, items, anyOf, allOf hops), cycles and nesting; Lark grammars with rule and
//! terminal chains, bracket nesting, repetitions, `%json` and `%lark` blocks; regexes with counted
//! repetitions; choices. Sizes are mostly small (fast executions) and sometimes at, just past or
//! far past the limits of `specrs_core::constraint::limits`, so both sides of each are explored.
//!
//! Invariant: the builders are iterative or bounded in recursion depth (`MAX_BUILD_DEPTH`), so
//! building an input never overflows the fuzzer's own stack.

use arbitrary::{Result, Unstructured};
use serde_json::{json, Map, Value};
use specrs_core::constraint::limits::{
    MAX_CHOICES, MAX_CHOICE_BYTES, MAX_JSON_NESTING, MAX_LARK_DEPTH, MAX_LARK_RULES, MAX_PATTERN_MIN_LENGTH,
    MAX_REGEX_REPEAT, MAX_SCHEMA_DEPTH,
};

/// How deep the random (not chained) parts of an input nest.
const MAX_BUILD_DEPTH: usize = 6;

/// A size: usually small, sometimes around a limit (below, at, past) or far past it.
pub fn size(u: &mut Unstructured, around: &[usize]) -> Result<usize> {
    if u.ratio(7, 8)? {
        return u.int_in_range(0..=6);
    }
    let base = *u.choose(around)?;
    let offset = *u.choose(&[-2i64, -1, 0, 1, 2, 100])?;
    Ok((base as i64 + offset).max(0) as usize)
}

fn count_value(u: &mut Unstructured) -> Result<u64> {
    let r = MAX_REGEX_REPEAT;
    Ok(*u.choose(&[0, 1, 2, 3, 5, 10, 100, r / 100, r - 1, r, r + 1, 100_000, 1_000_000, u32::MAX as u64])?)
}

/// A regex built from pieces: literals, classes, groups, alternations and repetitions.
pub fn regex(u: &mut Unstructured, depth: usize) -> Result<String> {
    let pieces = u.int_in_range(1..=3)?;
    let mut out = String::new();
    for _ in 0..pieces {
        let piece = match u.int_in_range(0..=9)? {
            0 | 1 => u.choose(&["a", "b", "x", "0", "ab", "\\.", "\"", "\\n", "é", "\\{"])?.to_string(),
            2 => u.choose(&["[a-z]", "[0-9]", ".", "\\d", "\\w", "[^\"]", "[ab]", "\\s"])?.to_string(),
            3 | 4 if depth < MAX_BUILD_DEPTH => format!("({})", regex(u, depth + 1)?),
            5 if depth < MAX_BUILD_DEPTH => format!("({}|{})", regex(u, depth + 1)?, regex(u, depth + 1)?),
            6 if depth < MAX_BUILD_DEPTH => format!("({}){{{}}}", regex(u, depth + 1)?, count_value(u)?),
            7 => {
                let (low, high) = (count_value(u)?, count_value(u)?);
                format!("a{{{},{}}}", low.min(high), low.max(high))
            }
            8 => format!("x{{{},}}", count_value(u)?),
            _ => u.choose(&["a*", "b+", "c?", "(ab)*", "^", "$"])?.to_string(),
        };
        out.push_str(&piece);
        if u.ratio(1, 4)? {
            out.push_str(u.choose(&["*", "+", "?", "{2}", "{0,3}"])?);
        }
    }
    Ok(out)
}

/// A `$ref` string: to a definition, the document, into a definition, or one llguidance cannot
/// resolve.
fn reference(u: &mut Unstructured, defs: usize) -> Result<String> {
    let def = if defs == 0 { 0 } else { u.choose_index(defs)? };
    Ok(match u.int_in_range(0..=7)? {
        0..=3 => format!("#/$defs/d{def}"),
        4 => "#".into(),
        5 => format!("#/$defs/d{def}/properties/a"),
        6 => format!("#/$defs/d{def}/anyOf/0"),
        _ => (*u.choose(&["#/", "#/nope", "d0", "#/$defs", "http://x/y#/a", "#anchor"])?).into(),
    })
}

/// A random schema, `defs` definitions available to `$ref`.
pub fn schema(u: &mut Unstructured, depth: usize, defs: usize) -> Result<Value> {
    let leaf = depth >= MAX_BUILD_DEPTH;
    Ok(match u.int_in_range(0..=15)? {
        0 => json!({"type": u.choose(&["string", "integer", "number", "boolean", "null", "object", "array"])?}),
        1 if !leaf => {
            let n = u.int_in_range(0..=3)?;
            let mut properties = Map::new();
            for i in 0..n {
                properties.insert(format!("p{i}"), schema(u, depth + 1, defs)?);
            }
            let required: Vec<String> =
                (0..n).filter(|_| u.ratio(1, 2).unwrap_or(false)).map(|i| format!("p{i}")).collect();
            let mut object = json!({"type": "object", "properties": properties, "required": required});
            if u.ratio(1, 3)? {
                object["additionalProperties"] =
                    if u.arbitrary()? { schema(u, depth + 1, defs)? } else { json!(false) };
            }
            object
        }
        2 if !leaf => {
            let mut array = json!({"type": "array", "items": schema(u, depth + 1, defs)?});
            if u.arbitrary()? {
                array["minItems"] = json!(size(u, &[10, 1000, 100_000])?);
            }
            if u.arbitrary()? {
                array["maxItems"] = json!(size(u, &[10, 1000, 100_000])?);
            }
            array
        }
        3 if !leaf => json!({"anyOf": [schema(u, depth + 1, defs)?, schema(u, depth + 1, defs)?]}),
        4 if !leaf => json!({"allOf": [schema(u, depth + 1, defs)?]}),
        5 if !leaf => json!({"oneOf": [schema(u, depth + 1, defs)?, schema(u, depth + 1, defs)?]}),
        6 | 7 => json!({"$ref": reference(u, defs)?}),
        8 => {
            let mut string = json!({"type": "string"});
            if u.arbitrary()? {
                string["pattern"] = json!(regex(u, 0)?);
            }
            if u.ratio(1, 4)? {
                string["format"] = json!(*u.choose(&["email", "date-time", "date", "uuid", "ipv4", "nope"])?);
            }
            let lengths = [MAX_PATTERN_MIN_LENGTH as usize, 500, 100_000];
            if u.arbitrary()? {
                string["minLength"] = json!(size(u, &lengths)?);
            }
            if u.arbitrary()? {
                string["maxLength"] = json!(size(u, &lengths)?);
            }
            string
        }
        9 => json!({"enum": (0..size(u, &[1000, 60_000])?).map(|i| json!(format!("e{i}"))).collect::<Vec<_>>()}),
        10 => {
            json!({"const": *u.choose(&[json!("x"), json!(1), json!(null), json!([1, {"a": 2}]), json!("a".repeat(300))])?})
        }
        11 => {
            let low = *u.choose(&[-1e300, -5.0, 0.0, 1.5, 1e18])?;
            json!({"type": u.choose(&["integer", "number"])?, "minimum": low, "maximum": low + *u.choose(&[0.0, 1.0, 1e6])?,
                   "multipleOf": *u.choose(&[1.0, 0.5, 3.0, 1e-9])?})
        }
        12 if !leaf => {
            json!({"type": "array", "prefixItems": [schema(u, depth + 1, defs)?], "items": schema(u, depth + 1, defs)?})
        }
        13 if !leaf => json!({"type": "object", "patternProperties": {regex(u, 0)?: schema(u, depth + 1, defs)?}}),
        14 => Value::Bool(u.arbitrary()?),
        _ => nested(u, json!({"type": "string"}))?,
    })
}

/// `inner` wrapped `n` times in items, properties or anyOf (iteratively), n up to past
/// `MAX_JSON_NESTING`.
fn nested(u: &mut Unstructured, inner: Value) -> Result<Value> {
    let n = size(u, &[MAX_JSON_NESTING / 2 - 1, MAX_JSON_NESTING - 1, 200])?;
    let mut value = inner;
    for _ in 0..n {
        value = hop(u, value)?;
    }
    Ok(value)
}

/// One level around `inner`: a plain wrapper, an object property, array items, an anyOf branch
/// or an allOf element.
fn hop(u: &mut Unstructured, inner: Value) -> Result<Value> {
    Ok(match u.int_in_range(0..=4)? {
        0 => inner,
        1 => json!({"type": "object", "properties": {"a": inner}, "required": ["a"]}),
        2 => json!({"type": "array", "items": inner, "maxItems": 2}),
        3 => json!({"anyOf": [inner, {"type": "null"}]}),
        _ => json!({"allOf": [inner]}),
    })
}

/// A schema document: `$defs` that often chain (`d{i}` a hop around a `$ref` to `d{i+1}`, up to
/// and past `MAX_SCHEMA_DEPTH`), sometimes refer back (cycles), and a root using them.
pub fn schema_document(u: &mut Unstructured) -> Result<Value> {
    let n = size(u, &[3, MAX_SCHEMA_DEPTH / 3, MAX_SCHEMA_DEPTH / 2, MAX_SCHEMA_DEPTH - 4, 5000])?;
    let chained = u.ratio(3, 4)?;
    let mut defs = Map::new();
    for i in 0..n {
        let def = if chained {
            let next = if u.ratio(1, 16)? { u.choose_index(n)? } else { i + 1 };
            hop(u, json!({"$ref": format!("#/$defs/d{next}")}))?
        } else {
            schema(u, 1, n + 1)?
        };
        defs.insert(format!("d{i}"), def);
    }
    defs.insert(format!("d{n}"), schema(u, 1, n + 1)?);
    let mut root = match schema(u, 0, n + 1)? {
        Value::Object(map) => map,
        other => return Ok(other),
    };
    if chained && u.ratio(3, 4)? {
        root = Map::new();
        root.insert("$ref".into(), json!("#/$defs/d0"));
    }
    root.insert("$defs".into(), Value::Object(defs));
    Ok(Value::Object(root))
}

/// A Lark grammar: `start`, rules `r{i}` that often chain (up to and past `MAX_LARK_DEPTH` and
/// `MAX_LARK_RULES`) inside brackets, terminals `T{i}` that chain, regexes, repetitions, and
/// `%json` / `%lark` blocks.
pub fn lark(u: &mut Unstructured, block_depth: usize) -> Result<String> {
    let rules = size(u, &[5, MAX_LARK_DEPTH / 29, MAX_LARK_DEPTH - 2, 5000, MAX_LARK_RULES])?;
    let terminals = size(u, &[5, MAX_LARK_DEPTH - 2])?;
    let brackets = if u.ratio(1, 4)? { u.int_in_range(0..=31)? } else { 0 };
    let mut g = String::from("start: r0\n");
    for i in 0..rules {
        let mut body = Vec::new();
        for _ in 0..u.int_in_range(1..=3)? {
            body.push(match u.int_in_range(0..=11)? {
                0..=4 => format!("r{}", i + 1),
                5 => format!("r{}", u.int_in_range(0..=rules)?),
                6 => format!("T{}", u.int_in_range(0..=terminals)?),
                7 => format!("/{}/", regex(u, 0)?.replace('/', "\\/")),
                8 => format!("\"s{i}\"~{}", count_value(u)?),
                9 => format!("(\"a\" | \"b\")~{}..{}", count_value(u)?, count_value(u)?),
                10 => format!("%json {}", schema(u, MAX_BUILD_DEPTH - 2, 0)?),
                _ if block_depth < 2 => format!("%lark {{\n{}}}", lark(u, block_depth + 1)?),
                _ => "\"x\"".into(),
            });
        }
        let alternative = if u.ratio(1, 4)? { " | \"end\"" } else { "" };
        g += &format!("r{i}: {}{}{}{alternative}\n", "(".repeat(brackets), body.join(" "), ")".repeat(brackets));
    }
    g += &format!("r{rules}: \"x\"\n");
    for i in 0..terminals {
        g += &format!("T{i}: T{} | /[a-z]/\n", i + 1);
    }
    g += &format!("T{terminals}: \"t\"\n");
    if u.ratio(1, 8)? {
        g += "%import common.NUMBER\n%ignore /[ \\t]+/\n";
    }
    Ok(g)
}

/// A choice: up to and past `MAX_CHOICES` strings, or strings up to and past `MAX_CHOICE_BYTES`.
pub fn choice(u: &mut Unstructured) -> Result<Vec<String>> {
    if u.ratio(1, 8)? {
        let len = size(u, &[MAX_CHOICE_BYTES, MAX_CHOICE_BYTES / 2])?.max(1);
        return Ok(vec!["x".repeat(len)]);
    }
    let n = size(u, &[MAX_CHOICES, 2000, 20_000])?.max(1);
    let prefix = if u.arbitrary()? { "" } else { "same-prefix-" };
    Ok((0..n).map(|i| format!("{prefix}{i}")).collect())
}
