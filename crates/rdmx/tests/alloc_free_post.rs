//! The hot path allocates nothing: with a counting global allocator, a warmed-up tcp queue
//! pair takes receive posts and SEND, WRITE, READ and inline SEND posts (each request
//! built once and posted many times), and the polls that move and reap them, without a
//! single heap allocation on the application's thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use rdmx::{
    Access, Completion, ConnectOptions, Context, LocalSge, QpCaps, RecvRequest, SendRequest,
    WcStatus,
};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the thread-local counters allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNTING.try_with(|on| {
            if on.get() {
                COUNT.with(|c| c.set(c.get() + 1));
            }
        });
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        let _ = COUNTING.try_with(|on| {
            if on.get() {
                COUNT.with(|c| c.set(c.get() + 1));
            }
        });
        // SAFETY: forwarded with the caller's arguments.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Allocations made by this thread while `f` runs.
fn allocations(f: impl FnOnce()) -> u64 {
    COUNT.with(|c| c.set(0));
    COUNTING.with(|on| on.set(true));
    f();
    COUNTING.with(|on| on.set(false));
    COUNT.with(|c| c.get())
}

#[test]
fn posts_and_polls_allocate_nothing_once_warm() {
    let open = || Context::open(rdmx::tcp::Options::default().busy_poll(true)).unwrap();
    let (ca, cb) = (open(), open());
    let (pa, pb) = (ca.alloc_pd(), cb.alloc_pd());
    let (cqa, cqb) = (ca.create_cq(1024).unwrap(), cb.create_cq(1024).unwrap());
    let caps = QpCaps::default().max_send_wr(64).max_recv_wr(64);
    let a = pa.create_qp(&cqa, &cqa, caps).unwrap();
    let b = pb.create_qp(&cqb, &cqb, caps).unwrap();
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let t = std::thread::spawn(move || {
        b.connect(ea, &ConnectOptions::default()).unwrap();
        b
    });
    a.connect(eb, &opts).unwrap();
    let b = t.join().unwrap();

    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let src = pa.register(vec![7u8; 4096], access).unwrap();
    let dst = pb.register(vec![0u8; 1 << 16], access).unwrap();
    let sends = [
        SendRequest::send(1).sge(LocalSge::new(&src, 0, 64).unwrap()),
        SendRequest::write(2, dst.remote_at(4096)).sge(LocalSge::new(&src, 64, 512).unwrap()),
        SendRequest::read(3, dst.remote_at(8192)).sge(LocalSge::new(&src, 1024, 256).unwrap()),
        SendRequest::send(4).inline(b"inline bytes"),
    ];
    let recv = RecvRequest::new(9).sge(LocalSge::new(&dst, 0, 4096).unwrap());

    let mut out = [Completion::default(); 64];
    let mut round = |count: bool| -> u64 {
        let mut n = 0;
        let mut counted = |f: &mut dyn FnMut()| {
            if count {
                n += allocations(f);
            } else {
                f();
            }
        };
        for _ in 0..2 {
            counted(&mut || b.post_recv(&recv).unwrap());
        }
        for s in &sends {
            counted(&mut || a.post_send(s).unwrap());
        }
        // Reap everything: 4 send completions on A, 2 receives on B.
        let (mut got_a, mut got_b) = (0, 0);
        let start = Instant::now();
        while got_a < 4 || got_b < 2 {
            let mut k = 0;
            counted(&mut || k = cqa.poll(&mut out[..]).unwrap());
            for c in &out[..k] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                got_a += 1;
            }
            let mut rb = [Completion::default(); 4];
            counted(&mut || k = cqb.poll(&mut rb).unwrap());
            for c in &rb[..k] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                got_b += 1;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "completions");
        }
        n
    };
    // Warm-up: queues, free lists and socket buffers reach their working sizes.
    for _ in 0..50 {
        round(false);
    }
    let mut total = 0;
    for _ in 0..200 {
        total += round(true);
    }
    assert_eq!(
        total, 0,
        "allocations on the application's thread over 400 receive and 800 send posts and \
         their polls"
    );
}
