//! `SpeculativeConfig::from_json` on arbitrary text (first byte even) or on JSON objects built from
//! vLLM's keys and edge-case values (first byte odd). Properties: every rejection is a
//! `ConfigError`; every accepted config survives `to_json` -> `from_json` unchanged.
#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};
use specrs_core::spec_config::{KEYS, METHODS};
use specrs_core::{Error, SpeculativeConfig};

/// The config's own methods, its aliases, and an empty name.
fn methods() -> Vec<&'static str> {
    METHODS.iter().copied().chain(["[ngram]", "draft", ""]).collect()
}

fn value(u: &mut Unstructured) -> Result<Value> {
    Ok(match u.int_in_range(0..=13)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => json!(*u.choose(&[0u64, 1, 2, 3, 4, 5, 8, 24, 63, 64, 65, 1 << 32, u64::MAX])?),
        3 => json!(u.arbitrary::<u64>()?),
        4 => json!(u.arbitrary::<i64>()?),
        5 => json!(*u.choose(&[0.0f64, -0.0, 0.1, 0.5, 1.0, 1.5, -1.0, 1e-45, 1e-300, 3.5e38, 1e300, 2.5])?),
        6 => json!(u.arbitrary::<f64>()?),
        7 => json!(*u.choose(&methods())?),
        8 => json!(*u.choose(&["q4_0", "Q2_K", "q8_0", "q1", "heuristic", "constant", "d.gguf", ""])?),
        9 => json!(u.arbitrary::<String>()?),
        10 => json!([]),
        11 => json!({}),
        12 => json!([u.arbitrary::<u8>()?]),
        // Cost curves (verify_cost_ratios): a few ratios, ordered or not.
        _ => Value::Array(
            (0..u.int_in_range(0..=6)?)
                .map(|_| Ok(json!(*u.choose(&[1.0f64, 1.4, 2.0, 0.5, 0.0, -1.0, 1e300, 2.5])?)))
                .collect::<Result<_>>()?,
        ),
    })
}

fn config_object(u: &mut Unstructured) -> Result<Map<String, Value>> {
    let mut map = Map::new();
    if u.ratio(9, 10)? {
        map.insert("method".into(), json!(*u.choose(&methods())?));
    }
    for _ in 0..u.int_in_range(0..=5)? {
        let key = if u.ratio(9, 10)? { u.choose(&KEYS)?.to_string() } else { u.arbitrary()? };
        map.insert(key, value(u)?);
    }
    Ok(map)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let text = if mode % 2 == 0 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        match config_object(&mut Unstructured::new(rest)) {
            Ok(map) => Value::Object(map).to_string(),
            Err(_) => return,
        }
    };
    match SpeculativeConfig::from_json(&text) {
        Ok(config) => {
            let again = SpeculativeConfig::from_json(&config.to_json());
            assert_eq!(
                again.as_ref().ok(),
                Some(&config),
                "round trip of {text:?} -> {} -> {again:?}",
                config.to_json()
            );
        }
        Err(Error::Config(_)) => {}
        Err(other) => panic!("{text:?} was refused with a non-config error: {other:?}"),
    }
});
