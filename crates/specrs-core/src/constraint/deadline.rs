//! A time budget on each call into a request's llguidance matcher.
//!
//! Some grammars make one matcher call run without end: two greedy terminals back to back, the
//! first of which swallows what the second needs (`start: /b+b+/ /b+b+/`), make llguidance force
//! one byte after another for ever (found by the `grammar_compile` fuzz target), and no check of a
//! grammar's text rules out every such shape. One such call would hold the engine's step, and so
//! every other request, for ever. So every call runs armed: a watchdog thread cancels the matcher
//! (llguidance's `CancellationHandle`, which it checks between bytes and parser rows) once the
//! call has run `MATCHER_CALL_BUDGET`. A cancelled matcher stays cancelled, and the request ends
//! with an `Error::Config` naming the budget (`Constraint::failed`). The same calls also run under
//! a memory budget (`call_memory`), since forcing bytes keeps parser state for each one.
//!
//! Invariants: a call that ends within the budget is untouched (arming and disarming only take a
//! lock); a call that does not is cancelled within the budget plus one cancellation check. The
//! budget is far above what any call of a grammar within the limits needs (milliseconds; the
//! slowest compile at a limit takes well under a second), so whether a grammar that ends is
//! refused never depends on the machine's speed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::CancellationHandle;

/// The longest one matcher call (a mask, forced tokens, consuming or checking tokens) may run.
pub const MATCHER_CALL_BUDGET: Duration = Duration::from_secs(10);

/// The budget calls are armed with, in milliseconds: `MATCHER_CALL_BUDGET` but in a fuzz target.
static BUDGET_MS: AtomicU64 = AtomicU64::new(MATCHER_CALL_BUDGET.as_millis() as u64);

/// Arms later calls with `budget` instead of `MATCHER_CALL_BUDGET`. For the `grammar_compile`
/// fuzz target only: its inputs that force bytes for ever would each spend the whole budget, and
/// a shorter one runs more inputs in the same time (a cancelled call is the same `Error::Config`).
#[doc(hidden)]
pub fn set_matcher_call_budget_for_fuzzing(budget: Duration) {
    BUDGET_MS.store(budget.as_millis() as u64, Ordering::Relaxed);
}

/// One armed call.
struct Watch {
    id: u64,
    deadline: Instant,
    handle: CancellationHandle,
}

#[derive(Default)]
struct Watches {
    next_id: u64,
    armed: Vec<Watch>,
}

struct Watchdog {
    watches: Mutex<Watches>,
    /// Signalled when a call is armed while none was: the thread then has a deadline to wait for.
    armed_first: Condvar,
}

/// Disarms its call when dropped (the call ended, however).
pub(super) struct Armed {
    id: u64,
}

impl Drop for Armed {
    fn drop(&mut self) {
        let mut watches = lock(&watchdog().watches);
        watches.armed.retain(|watch| watch.id != self.id);
    }
}

/// Arms the call about to run on the matcher `handle` cancels.
pub(super) fn arm(handle: CancellationHandle) -> Armed {
    let dog = watchdog();
    let mut watches = lock(&dog.watches);
    let id = watches.next_id;
    watches.next_id += 1;
    watches.armed.push(Watch {
        id,
        deadline: Instant::now() + Duration::from_millis(BUDGET_MS.load(Ordering::Relaxed)),
        handle,
    });
    if watches.armed.len() == 1 {
        dog.armed_first.notify_one();
    }
    Armed { id }
}

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<&'static Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let dog: &'static Watchdog =
            Box::leak(Box::new(Watchdog { watches: Mutex::new(Watches::default()), armed_first: Condvar::new() }));
        std::thread::Builder::new()
            .name("specrs-grammar-watchdog".into())
            .spawn(move || watch(dog))
            .expect("starting the grammar watchdog thread");
        dog
    })
}

/// The watchdog thread: cancels each armed call past its deadline; sleeps until the earliest.
fn watch(dog: &'static Watchdog) {
    let mut watches = lock(&dog.watches);
    loop {
        let now = Instant::now();
        watches.armed.retain(|watch| {
            let expired = watch.deadline <= now;
            if expired {
                watch.handle.cancel();
            }
            !expired
        });
        watches = match watches.armed.iter().map(|watch| watch.deadline).min() {
            Some(deadline) => {
                dog.armed_first.wait_timeout(watches, deadline - now).map_or_else(|e| e.into_inner().0, |(w, _)| w)
            }
            None => dog.armed_first.wait(watches).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

/// The lock, also after a panic elsewhere (the list stays consistent: each change is one call).
fn lock(watches: &Mutex<Watches>) -> std::sync::MutexGuard<'_, Watches> {
    watches.lock().unwrap_or_else(|e| e.into_inner())
}
