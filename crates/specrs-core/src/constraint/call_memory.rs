//! A memory budget on each call into a request's llguidance matcher: the bytes the calling
//! thread allocates and keeps while the call runs.
//!
//! Why: a grammar that makes llguidance force one byte after another for ever (`deadline`:
//! `start: r0`, `r0: r1 /a{2,3}xab/`, `r1: /a{100}*a/`, found by the `grammar_compile` fuzz
//! target) also grows the parser's byte and lexer stacks by ~25 bytes per forced byte, and this
//! machine's core forces ~10 million bytes a second: by the time budget the call held 2.6 GB, and
//! a few such requests compiling at once (the server checks grammars on a thread pool) would take
//! the server's memory. Time bounds memory only as tightly as the machine is slow; bytes do not
//! depend on the machine. So the process's allocator (`CountingAllocator`, the global allocator of
//! every binary that links specrs-core) counts, on a thread inside an armed call, the bytes
//! allocated minus those freed, and past `MATCHER_CALL_MEMORY` cancels the call (llguidance's
//! `CancellationHandle`, which the time budget uses too: the request then ends with the same
//! `Error::Config` naming both budgets).
//!
//! Under test the same allocator also counts a thread's large blocks (`buffers_allocated`): the
//! candle decoder's launch count (`model/candle/launches.rs`).
//!
//! Invariants: only the calling thread's allocations count, so other requests' work (other
//! threads) never cancels a call; outside an armed call the allocator is the system's plus one
//! thread-local read; a call that keeps less than the budget is untouched; the count never
//! allocates (the allocator must not re-enter itself).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ptr;

use llguidance::CancellationHandle;

/// The most bytes one matcher call may allocate and keep (net of what it frees) before it is
/// cancelled. The calls of the tests that compile and walk grammars at every limit keep at most
/// 30 MB (a choice at `MAX_CHOICES` and `MAX_CHOICE_BYTES`; 6 MB a regex at `MAX_REGEX_REPEAT`;
/// under 1.3 MB the rest) on SmolLM2's tokenizer; a byte-forcing loop reaches it within a second.
pub const MATCHER_CALL_MEMORY: usize = 128 << 20;

/// The system allocator, counting what an armed call's thread keeps (the module's header).
pub struct CountingAllocator;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

// SAFETY: every method forwards to `System` unchanged; `charge` only reads and writes this
// thread's `Account`, never allocates, and `CancellationHandle::cancel` is one atomic store.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc(layout);
        if !block.is_null() {
            charge(layout.size() as isize);
            #[cfg(test)]
            count_buffer(0, layout.size());
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc_zeroed(layout);
        if !block.is_null() {
            charge(layout.size() as isize);
            #[cfg(test)]
            count_buffer(0, layout.size());
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        System.dealloc(block, layout);
        charge(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = System.realloc(block, layout, new_size);
        if !moved.is_null() {
            charge(new_size as isize - layout.size() as isize);
            #[cfg(test)]
            count_buffer(layout.size(), new_size);
        }
        moved
    }
}

/// One armed call's count, owned by its `Armed` guard on the calling thread.
struct Account {
    /// Bytes allocated minus bytes freed on this thread since the call was armed.
    kept: Cell<isize>,
    /// Cancels the call once `kept` passes the budget.
    handle: CancellationHandle,
}

thread_local! {
    /// The account of the call this thread is inside, if any. A raw pointer in a `const`
    /// thread-local: no destructor to register and no lazy initialisation, so reading it from
    /// inside the allocator never allocates.
    static ACCOUNT: Cell<*const Account> = const { Cell::new(ptr::null()) };
}

/// Adds `bytes` to the account of the call this thread is inside, cancelling it past the budget.
fn charge(bytes: isize) {
    // `try_with`: a thread being torn down has no thread-locals left; nothing is armed there.
    let _ = ACCOUNT.try_with(|account| {
        let account = account.get();
        if account.is_null() {
            return;
        }
        // SAFETY: the pointer is this thread's live `Armed` guard's account (set and cleared
        // only on this thread, cleared before the account is freed).
        let account = unsafe { &*account };
        let kept = account.kept.get() + bytes;
        account.kept.set(kept);
        if kept > MATCHER_CALL_MEMORY as isize {
            account.handle.cancel();
        }
    });
}

#[cfg(test)]
thread_local! {
    /// `(smallest size counted, buffers counted)` while this thread counts its buffers.
    static BUFFERS: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// Counts a block grown from `old` to `new` bytes (`old` 0: a fresh one) if it crossed the size
/// counted: a vector growing past it is one buffer, however many steps it took.
#[cfg(test)]
fn count_buffer(old: usize, new: usize) {
    let _ = BUFFERS.try_with(|buffers| {
        if let Some((min, count)) = buffers.get() {
            if old < min && new >= min {
                buffers.set(Some((min, count + 1)));
            }
        }
    });
}

/// The blocks of at least `min_bytes` this thread allocates while `f` runs, plus what
/// [`count_as`] adds (the decoder's launch count, `model/candle/launches.rs`).
#[cfg(test)]
pub(crate) fn buffers_allocated(min_bytes: usize, f: impl FnOnce()) -> usize {
    BUFFERS.with(|buffers| buffers.set(Some((min_bytes, 0))));
    f();
    BUFFERS.with(|buffers| buffers.replace(None)).map_or(0, |(_, count)| count)
}

/// Runs `f` uncounted and counts `buffers` for it instead (when this thread counts): an op whose
/// CPU internals allocate what its device launch does not, or an in-place one.
#[cfg(test)]
pub(crate) fn count_as<T>(buffers: usize, f: impl FnOnce() -> T) -> T {
    let counting = BUFFERS.with(|b| b.replace(None));
    let result = f();
    BUFFERS.with(|b| b.set(counting.map(|(min, count)| (min, count + buffers))));
    result
}

/// Counts what this thread keeps until dropped (the call ended, however); restores the account
/// of an enclosing armed call, if any.
pub(super) struct Armed {
    account: Box<Account>,
    enclosing: *const Account,
}

/// Arms the call about to run on this thread on the matcher `handle` cancels.
pub(super) fn arm(handle: CancellationHandle) -> Armed {
    let account = Box::new(Account { kept: Cell::new(0), handle });
    let enclosing = ACCOUNT.with(|current| current.replace(&*account));
    Armed { account, enclosing }
}

impl Armed {
    /// Bytes the call kept so far (for the tests that measure what calls need).
    #[cfg(test)]
    fn kept(&self) -> isize {
        self.account.kept.get()
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        ACCOUNT.with(|current| {
            debug_assert!(ptr::eq(current.get(), &*self.account), "armed calls end in the order they began");
            current.set(self.enclosing);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_that_keeps_past_the_budget_is_cancelled_and_one_within_it_is_not() {
        let handle = CancellationHandle::default();
        let armed = arm(handle.clone());
        let within = vec![0u8; MATCHER_CALL_MEMORY / 2];
        assert!(!handle.is_cancelled());
        drop(within); // freed: the call keeps nothing again
        assert!(armed.kept() < 1024, "{}", armed.kept());
        let mut growing: Vec<u64> = Vec::new();
        while !handle.is_cancelled() {
            growing.push(0); // grown by reallocation, as llguidance's stacks grow
        }
        assert!(growing.len() * 8 > MATCHER_CALL_MEMORY && growing.capacity() * 8 <= 2 * MATCHER_CALL_MEMORY + 8);
        drop(armed);
    }

    #[test]
    fn other_threads_and_unarmed_code_are_not_counted() {
        let handle = CancellationHandle::default();
        let armed = arm(handle.clone());
        std::thread::spawn(|| vec![1u8; MATCHER_CALL_MEMORY * 2].len()).join().unwrap();
        assert!(!handle.is_cancelled());
        assert!(armed.kept() < 64 << 10, "{}", armed.kept());
        drop(armed);
        let after = vec![1u8; MATCHER_CALL_MEMORY * 2];
        assert!(!handle.is_cancelled() && !after.is_empty());
    }

    #[test]
    fn a_nested_call_counts_for_itself_and_its_enclosing_call_resumes() {
        let outer_handle = CancellationHandle::default();
        let outer = arm(outer_handle.clone());
        let inner_handle = CancellationHandle::default();
        let inner = arm(inner_handle.clone());
        // black_box: an allocation nothing reads may be elided by the optimizer.
        let kept = std::hint::black_box(vec![0u8; 4 << 20]);
        assert!(inner.kept() >= 4 << 20 && outer.kept() < 64 << 10);
        drop(inner);
        drop(kept);
        assert!(outer.kept() < 0, "the outer call freed what the inner one kept: {}", outer.kept());
        drop(outer);
        assert!(!outer_handle.is_cancelled() && !inner_handle.is_cancelled());
    }
}
