//! An upper bound on how deep a recursive compiler can go through a graph of definitions whose
//! cycles it cuts: llguidance compiles a `$ref` target or a Lark rule once, marking it "in
//! progress" first, so its recursion follows a path that never enters the same definition twice.
//!
//! Which path it takes depends on its traversal order, which is not ours to know; the bound holds
//! for any order. Invariant: the bound is at least the weight of every path that repeats no
//! vertex. A path stays in each strongly connected component (SCC) for one stretch (the
//! components form a DAG), so the longest path of the component DAG, each component weighing at
//! least what one stretch through it can weigh (`component_weight`), bounds every such path.
//!
//! Everything here is iterative (explicit stacks): it measures inputs before anything recursive
//! runs on them.

/// A directed graph with a weight per vertex.
#[derive(Default)]
pub(super) struct DepthGraph {
    weights: Vec<u64>,
    edges: Vec<Vec<u32>>,
}

impl DepthGraph {
    pub fn add_vertex(&mut self, weight: u64) -> usize {
        self.weights.push(weight);
        self.edges.push(Vec::new());
        self.weights.len() - 1
    }

    pub fn add_edge(&mut self, from: usize, to: usize) {
        self.edges[from].push(to as u32);
    }

    pub fn len(&self) -> usize {
        self.weights.len()
    }

    pub fn weight(&self, vertex: usize) -> u64 {
        self.weights[vertex]
    }

    /// The largest weight a path starting at any of `starts` can have without repeating a
    /// vertex. `component_weight(members)` gives what one stretch through a component of several
    /// vertices (or one with an edge to itself) can weigh at most; a lone vertex weighs its own
    /// weight.
    pub fn longest_path_bound(&self, starts: &[usize], component_weight: impl Fn(&[usize]) -> u64) -> u64 {
        let components = self.components();
        let mut best = vec![0u64; components.members.len()];
        // Tarjan emits a component after every component it reaches, so their bounds are known.
        for (c, members) in components.members.iter().enumerate() {
            let cyclic = members.len() > 1 || self.edges[members[0]].contains(&(members[0] as u32));
            let own = if cyclic { component_weight(members) } else { self.weights[members[0]] };
            let after = members
                .iter()
                .flat_map(|&v| &self.edges[v])
                .map(|&w| components.of[w as usize])
                .filter(|&d| d != c)
                .map(|d| best[d])
                .max()
                .unwrap_or(0);
            best[c] = own.saturating_add(after);
        }
        starts.iter().map(|&s| best[components.of[s]]).max().unwrap_or(0)
    }

    /// Tarjan's strongly connected components, iteratively: members of each component, in the
    /// order emitted (every component after those it has edges to), and each vertex's component.
    fn components(&self) -> Components {
        const UNSEEN: u32 = u32::MAX;
        let n = self.len();
        let mut index = vec![UNSEEN; n];
        let mut low = vec![0u32; n];
        let mut on_stack = vec![false; n];
        let mut stack: Vec<usize> = Vec::new();
        let mut out = Components { members: Vec::new(), of: vec![0; n] };
        let mut next_index = 0u32;
        // The call stack of the recursive formulation: (vertex, next edge to look at).
        let mut calls: Vec<(usize, usize)> = Vec::new();
        for root in 0..n {
            if index[root] != UNSEEN {
                continue;
            }
            calls.push((root, 0));
            while let Some(&(v, next_edge)) = calls.last() {
                if next_edge == 0 && index[v] == UNSEEN {
                    index[v] = next_index;
                    low[v] = next_index;
                    next_index += 1;
                    stack.push(v);
                    on_stack[v] = true;
                }
                if let Some(&w) = self.edges[v].get(next_edge) {
                    calls.last_mut().expect("v's call").1 += 1;
                    let w = w as usize;
                    if index[w] == UNSEEN {
                        calls.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                calls.pop();
                if let Some(&(parent, _)) = calls.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] == index[v] {
                    let c = out.members.len();
                    let mut members = Vec::new();
                    loop {
                        let w = stack.pop().expect("v is on the stack");
                        on_stack[w] = false;
                        out.of[w] = c;
                        members.push(w);
                        if w == v {
                            break;
                        }
                    }
                    out.members.push(members);
                }
            }
        }
        out
    }
}

struct Components {
    members: Vec<Vec<usize>>,
    of: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(graph: &DepthGraph) -> impl Fn(&[usize]) -> u64 + '_ {
        |members| members.iter().map(|&v| graph.weight(v)).sum()
    }

    #[test]
    fn a_chain_weighs_its_vertices() {
        let mut g = DepthGraph::default();
        let vs: Vec<usize> = (0..5).map(|i| g.add_vertex(i + 1)).collect();
        for w in vs.windows(2) {
            g.add_edge(w[0], w[1]);
        }
        assert_eq!(g.longest_path_bound(&[0], sum(&g)), 15);
        assert_eq!(g.longest_path_bound(&[3], sum(&g)), 9);
    }

    #[test]
    fn a_cycle_weighs_its_component_once() {
        // 0 -> 1 -> 2 -> 1, 2 -> 3: the cycle {1, 2} counts once, then 3.
        let mut g = DepthGraph::default();
        for w in [1, 10, 100, 1000] {
            g.add_vertex(w);
        }
        for (a, b) in [(0, 1), (1, 2), (2, 1), (2, 3)] {
            g.add_edge(a, b);
        }
        assert_eq!(g.longest_path_bound(&[0], sum(&g)), 1111);
        assert_eq!(g.longest_path_bound(&[0], |_| 7), 1008);
    }

    #[test]
    fn a_self_loop_is_a_component_of_its_own() {
        let mut g = DepthGraph::default();
        g.add_vertex(3);
        g.add_edge(0, 0);
        assert_eq!(g.longest_path_bound(&[0], |_| 42), 42);
    }

    #[test]
    fn the_longest_branch_wins_and_a_long_chain_needs_no_stack() {
        let mut g = DepthGraph::default();
        let n = 200_000;
        for _ in 0..n {
            g.add_vertex(1);
        }
        for v in 1..n {
            g.add_edge(v - 1, v);
        }
        let side = g.add_vertex(5);
        g.add_edge(0, side);
        assert_eq!(g.longest_path_bound(&[0], sum(&g)), n as u64);
    }
}
