//! Refuses a compiled grammar whose output can enter a rule that never ends.
//!
//! A rule none of whose alternatives derives a finite string (`r1: r1`, `r: "(" r ")"`) is a dead
//! end. llguidance compiles it, and once the output reaches it (behind a choice, so the compile's
//! first steps pass) the matcher has no token left to allow and fails mid-output with an internal
//! error ("NoExtensionBias"): a 500 from the server. Found by the `grammar_compile` fuzz target
//! for Lark (a rule reachable after a nested `%lark { ... }` block). Checked here on llguidance's
//! compiled grammar, after nested grammars (`%lark`, `%json`, `%llguidance`) are linked into it,
//! so one check covers every way of writing such a rule, in every kind of `GrammarSpec`.
//!
//! A symbol is *productive* (derives a finite string) by the least fixed point of: a terminal
//! (a lexeme), a nullable symbol, or a symbol with a rule all of whose right-hand side is
//! productive. A grammar is refused when a symbol reachable from its start is not productive:
//! the matcher may enter any alternative that starts with what the output has so far.
//!
//! Invariant: it never refuses a grammar all of whose reachable symbols derive a finite string.
//! Approximations err towards "productive", so they can only accept more: a lexeme's language is
//! taken as non-empty; the conditions on a parametric grammar's rules are ignored (every rule
//! counts, and a conditionally nullable symbol counts as nullable); a nested grammar not linked
//! by a rule counts as productive. Iterative (a work list), linear in the grammar's size.

use std::collections::HashMap;

use llguidance::earley::{CGrammar, CSymIdx};

use crate::error::{Error, Result};

/// At most this many dead-end rules are named in the error.
const NAMED: usize = 5;

/// `Err(Error::Config)` naming the dead-end rules of `grammar` (the one `kind` compiled to).
pub(super) fn check(grammar: &CGrammar, kind: &str) -> Result<()> {
    let dead = dead_ends(grammar);
    if dead.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = dead.iter().take(NAMED).map(|name| format!("`{name}`")).collect();
    let more = if dead.len() > NAMED { format!(" and {} more", dead.len() - NAMED) } else { String::new() };
    Err(Error::config(format!(
        "invalid {kind} for constrained decoding: the output can reach {} that never {} (every alternative \
         needs a rule that never ends, e.g. itself), where generation would stop with no token allowed; \
         give each an alternative that ends, or remove it, and resend",
        if dead.len() == 1 { format!("rule {}", names[0]) } else { format!("rules {}{more}", names.join(", ")) },
        if dead.len() == 1 { "ends" } else { "end" },
    )))
}

/// Names of the symbols reachable from `grammar`'s start that derive no finite string, nearest
/// the start first.
fn dead_ends(grammar: &CGrammar) -> Vec<String> {
    // Reachable symbols, breadth first from the start; `local` numbers them in that order.
    let mut symbols: Vec<CSymIdx> = vec![grammar.start()];
    let mut local: HashMap<usize, usize> = HashMap::from([(grammar.start().as_index(), 0)]);
    // Rules of the reachable symbols: (left-hand side, right-hand side), in local numbers.
    let mut rules: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut next = 0;
    while next < symbols.len() {
        let lhs = next;
        for &rule in grammar.rules_of(symbols[next]) {
            let (rhs, _, _) = grammar.rule_rhs(rule);
            let rhs = rhs
                .iter()
                .map(|&sym| {
                    *local.entry(sym.as_index()).or_insert_with(|| {
                        symbols.push(sym);
                        symbols.len() - 1
                    })
                })
                .collect();
            rules.push((lhs, rhs));
        }
        next += 1;
    }

    let mut productive: Vec<bool> = symbols
        .iter()
        .map(|&sym| {
            let data = grammar.sym_data(sym);
            data.is_terminal
                || data.lexeme.is_some()
                || data.is_nullable
                || !data.cond_nullable.is_empty()
                || (data.gen_grammar.is_some() && data.rules.is_empty())
        })
        .collect();
    // Per rule, how many of its right-hand side's symbols are not known productive yet; per
    // symbol, the rules it occurs in (once per occurrence, matching the count).
    let mut missing: Vec<usize> =
        rules.iter().map(|(_, rhs)| rhs.iter().filter(|&&s| !productive[s]).count()).collect();
    let mut occurs_in: Vec<Vec<usize>> = vec![Vec::new(); symbols.len()];
    for (rule, (_, rhs)) in rules.iter().enumerate() {
        for &sym in rhs.iter().filter(|&&s| !productive[s]) {
            occurs_in[sym].push(rule);
        }
    }
    let mut work: Vec<usize> = (0..rules.len()).filter(|&rule| missing[rule] == 0).collect();
    while let Some(rule) = work.pop() {
        let lhs = rules[rule].0;
        if productive[lhs] {
            continue;
        }
        productive[lhs] = true;
        for &user in &occurs_in[lhs] {
            missing[user] -= 1;
            if missing[user] == 0 {
                work.push(user);
            }
        }
    }
    symbols.iter().zip(&productive).filter(|(_, &ok)| !ok).map(|(&sym, _)| grammar.sym_data(sym).name.clone()).collect()
}
