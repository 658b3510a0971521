//! Integration tests of the userfaultfd monitor against the real kernel.
//!
//! Every test uses the process-wide monitor, and every sink sees every range that goes
//! away in the process, so assertions look for ranges recorded after a mark taken just
//! before the operation under test.

mod monitor {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::{Duration, Instant};

    use rdmx_mem::monitor::{global, InvalidationSink, Monitor};
    use rdmx_mem::sys::page_size;

    fn monitor() -> &'static Monitor {
        match global() {
            Ok(m) => m,
            Err(e) => panic!("the userfaultfd monitor must work on this machine: {e}"),
        }
    }

    /// Records every range it is given.
    #[derive(Default)]
    struct Recorder {
        ranges: Mutex<Vec<(usize, usize)>>,
    }

    impl InvalidationSink for Recorder {
        fn invalidate(&self, start: usize, end: usize) {
            self.ranges.lock().unwrap().push((start, end));
        }
    }

    impl Recorder {
        /// A subscribed recorder and its subscription id.
        fn subscribed() -> (Arc<Recorder>, u64) {
            let rec = Arc::new(Recorder::default());
            let id = monitor().subscribe(rec.clone());
            (rec, id)
        }

        /// Where the next recorded range will go.
        fn mark(&self) -> usize {
            self.ranges.lock().unwrap().len()
        }

        /// Whether one range recorded at or after `mark` covers `[start, end)`.
        fn covered_since(&self, mark: usize, start: usize, end: usize) -> bool {
            self.ranges.lock().unwrap()[mark..]
                .iter()
                .any(|&(s, e)| s <= start && e >= end)
        }

        fn dump_since(&self, mark: usize) -> String {
            let ranges = self.ranges.lock().unwrap();
            let shown: Vec<String> = ranges[mark..]
                .iter()
                .map(|(s, e)| format!("{s:#x}..{e:#x}"))
                .collect();
            shown.join(", ")
        }
    }

    /// Counts calls; survives the sink that holds it.
    struct Counter(Arc<AtomicUsize>);

    impl InvalidationSink for Counter {
        fn invalidate(&self, _start: usize, _end: usize) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A fresh private anonymous read/write mapping of `pages` pages.
    fn map(pages: usize) -> usize {
        map_with(pages, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn map_with(pages: usize, prot: libc::c_int) -> usize {
        // SAFETY: a new private anonymous mapping touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * page_size(),
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        p as usize
    }

    fn unmap(addr: usize, len: usize) {
        // SAFETY: the tests unmap only mappings they made and no longer reference.
        let rc = unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    }

    /// Runs `f` on another thread and fails if it does not finish within `secs` seconds
    /// (a hang would otherwise hang the whole test run).
    fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(Duration::from_secs(secs)) {
            Ok(v) => {
                worker.join().unwrap();
                v
            }
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("did not finish within {secs} s"),
            // The worker panicked: report its panic.
            Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(()) => unreachable!("worker ended without sending"),
            },
        }
    }

    // (a) The race protocol: once munmap has returned and wait_idle() has returned, the
    // range has been delivered. No sleeping anywhere; several threads at once.
    #[test]
    fn munmap_is_delivered_once_munmap_returned_and_monitor_is_idle() {
        let (rec, id) = Recorder::subscribed();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let rec = Arc::clone(&rec);
                std::thread::spawn(move || {
                    let m = monitor();
                    let len = 4 * page_size();
                    for i in 0..100 {
                        let p = map(4);
                        m.watch(p, len).unwrap();
                        // SAFETY: p is a fresh 4-page read/write mapping.
                        unsafe { std::ptr::write_bytes(p as *mut u8, 0xa5, len) };
                        let mark = rec.mark();
                        unmap(p, len);
                        m.wait_idle();
                        assert!(
                            rec.covered_since(mark, p, p + len),
                            "iteration {i}: munmap of {p:#x}..{:#x} not delivered; saw {}",
                            p + len,
                            rec.dump_since(mark)
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        monitor().unsubscribe(id);
    }

    // (b) madvise(MADV_DONTNEED) is reported; the memory stays mapped and reads as zero.
    #[test]
    fn madvise_dontneed_is_delivered_and_memory_reads_zero() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let page = page_size();
        let p = map(4);
        // SAFETY: p is a fresh 4-page read/write mapping.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0x5a, 4 * page) };
        m.watch(p, 4 * page).unwrap();
        let mark = rec.mark();
        // SAFETY: pages 1 and 2 of the mapping; nothing references them.
        let rc = unsafe {
            libc::madvise(
                (p + page) as *mut libc::c_void,
                2 * page,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        m.wait_idle();
        assert!(
            rec.covered_since(mark, p + page, p + 3 * page),
            "saw {}",
            rec.dump_since(mark)
        );
        // SAFETY: the whole mapping is still mapped read/write and owned by this test.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, 4 * page) };
        assert!(bytes[..page].iter().all(|&b| b == 0x5a));
        assert!(bytes[page..3 * page].iter().all(|&b| b == 0));
        assert!(bytes[3 * page..].iter().all(|&b| b == 0x5a));
        bytes[page..3 * page].fill(7);
        assert!(bytes[page..3 * page].iter().all(|&b| b == 7));
        unmap(p, 4 * page);
        m.unsubscribe(id);
    }

    // (c) mremap moving a watched range reports the old range; the new location stays
    // watched, so unmapping it later is reported too.
    #[test]
    fn mremap_move_invalidates_old_range_and_new_range_stays_watched() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let len = 4 * page_size();
        let old = map(4);
        // SAFETY: old is a fresh 4-page read/write mapping.
        unsafe { std::ptr::write_bytes(old as *mut u8, 3, len) };
        m.watch(old, len).unwrap();
        let target = map_with(4, libc::PROT_NONE);
        let mark = rec.mark();
        // SAFETY: moves this test's mapping onto this test's reserved range.
        let new = unsafe {
            libc::mremap(
                old as *mut libc::c_void,
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                target as *mut libc::c_void,
            )
        };
        assert_ne!(new, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let new = new as usize;
        assert_eq!(new, target);
        m.wait_idle();
        assert!(
            rec.covered_since(mark, old, old + len),
            "saw {}",
            rec.dump_since(mark)
        );
        // SAFETY: the moved mapping, owned by this test.
        let bytes = unsafe { std::slice::from_raw_parts(new as *const u8, len) };
        assert!(bytes.iter().all(|&b| b == 3));
        let mark = rec.mark();
        unmap(new, len);
        m.wait_idle();
        assert!(
            rec.covered_since(mark, new, new + len),
            "the moved range is no longer watched; saw {}",
            rec.dump_since(mark)
        );
        m.unsubscribe(id);
    }

    // (d) Registering in write-protect mode only: first touches of never-populated pages
    // are ordinary faults, never delivered to the monitor, so they do not hang.
    #[test]
    fn touching_unpopulated_watched_pages_does_not_hang() {
        let m = monitor();
        let pages = 64;
        let page = page_size();
        let p = map(pages);
        m.watch(p, pages * page).unwrap();
        let sum = within(5, move || {
            let mut sum = 0u64;
            for i in 0..pages {
                let at = (p + i * page) as *mut u8;
                // SAFETY: inside this test's mapping; only this thread touches it now.
                unsafe {
                    sum += u64::from(at.read_volatile());
                    at.write_volatile(i as u8 + 1);
                    sum += u64::from(at.read_volatile());
                }
            }
            sum
        });
        assert_eq!(sum, (1..=pages as u64).sum::<u64>());
        unmap(p, pages * page);
    }

    const TMPFS_MAGIC: i64 = 0x0102_1994;

    fn is_tmpfs(dir: &std::path::Path) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
            return true;
        };
        // SAFETY: statfs writes one struct statfs; all-zero bytes are a valid one.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: c is a NUL-terminated path and st is writable.
        let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
        rc != 0 || st.f_type as i64 == TMPFS_MAGIC
    }

    // (e) A private mapping of a file on a disk filesystem cannot be watched: Err, no panic.
    // (Files on tmpfs are shared memory, which the kernel does watch.)
    #[test]
    fn watching_a_file_backed_mapping_is_refused() {
        let m = monitor();
        let candidates = [
            std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
            std::env::temp_dir(),
            std::path::PathBuf::from("/var/tmp"),
        ];
        let Some(dir) = candidates.iter().find(|d| d.is_dir() && !is_tmpfs(d)) else {
            panic!("no directory outside tmpfs among {candidates:?} for a file-backed mapping");
        };
        let path = dir.join(format!("rdmx-monitor-file-{}", std::process::id()));
        let len = 2 * page_size();
        std::fs::write(&path, vec![9u8; len]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        // SAFETY: a new private mapping of this test's file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        let p = p as usize;
        let err = m
            .watch(p, len)
            .expect_err("a file-backed private mapping must not be watchable");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
        // SAFETY: the mapping is this test's, still mapped.
        assert_eq!(unsafe { *(p as *const u8) }, 9);
        unmap(p, len);
    }

    // (f) Unsubscribed and dropped sinks are not called; a subscribed one is.
    #[test]
    fn unsubscribed_and_dropped_sinks_are_not_called() {
        let m = monitor();
        let (control, control_id) = Recorder::subscribed();

        let unsub_calls = Arc::new(AtomicUsize::new(0));
        let unsub: Arc<dyn InvalidationSink> = Arc::new(Counter(Arc::clone(&unsub_calls)));
        let unsub_id = m.subscribe(unsub.clone());
        m.unsubscribe(unsub_id);

        let dropped_calls = Arc::new(AtomicUsize::new(0));
        let dropped: Arc<dyn InvalidationSink> = Arc::new(Counter(Arc::clone(&dropped_calls)));
        m.subscribe(dropped.clone());
        drop(dropped);
        // Other tests unmap watched memory at the same time: a delivery that began
        // before the unsubscription (or that upgraded the dropped sink before the drop)
        // may still call them. Once deliveries under way are over, nothing may.
        m.wait_idle();
        let unsub_before = unsub_calls.load(Ordering::SeqCst);
        let dropped_before = dropped_calls.load(Ordering::SeqCst);

        let len = 2 * page_size();
        let p = map(2);
        m.watch(p, len).unwrap();
        let mark = control.mark();
        unmap(p, len);
        m.wait_idle();
        assert!(
            control.covered_since(mark, p, p + len),
            "saw {}",
            control.dump_since(mark)
        );
        assert_eq!(unsub_calls.load(Ordering::SeqCst), unsub_before);
        assert_eq!(dropped_calls.load(Ordering::SeqCst), dropped_before);
        // The unsubscribed sink is still alive, so only the unsubscription kept it silent.
        drop(unsub);
        m.unsubscribe(control_id);
    }

    // Watching is idempotent, covers partly watched ranges, and fails cleanly on bad input.
    #[test]
    fn watch_is_idempotent_and_rejects_bad_ranges() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let page = page_size();
        let p = map(8);
        m.watch(p, 4 * page).unwrap();
        m.watch(p, 4 * page).unwrap();
        m.watch(p + 2 * page, 6 * page).unwrap();
        m.watch(p + 1, 10).unwrap();
        // The last page is watched only through the call that overlapped a watched range.
        let mark = rec.mark();
        unmap(p + 7 * page, page);
        m.wait_idle();
        assert!(rec.covered_since(mark, p + 7 * page, p + 8 * page));
        let mark = rec.mark();
        unmap(p, 7 * page);
        m.wait_idle();
        assert!(rec.covered_since(mark, p, p + 7 * page));

        let zero = m.watch(p, 0).unwrap_err();
        assert_eq!(zero.kind(), std::io::ErrorKind::InvalidInput);
        let overflow = m.watch(usize::MAX - 10, 100).unwrap_err();
        assert_eq!(overflow.kind(), std::io::ErrorKind::InvalidInput);
        // Nothing is ever mapped below mmap_min_addr (other tests may reuse `p` by now).
        let low = m.watch(page, 4 * page).unwrap_err();
        assert!(low.raw_os_error().is_some(), "{low}");
        m.unsubscribe(id);
    }

    // A guard unwatches only the pages nothing else holds: pages also held by another
    // guard, or watched for good, are still reported when they go; its own others are not.
    #[test]
    fn a_dropped_watch_leaves_what_others_hold_watched() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let page = page_size();
        let p = map(6);
        // Page 0: the dropped guard alone; 1: also for good; 2: also another guard.
        let dropped = m.watch_while(p, 3 * page).unwrap();
        m.watch(p + page, page).unwrap();
        let kept = m.watch_while(p + 2 * page, page).unwrap();
        drop(dropped);
        for (i, reported) in [(0, false), (1, true), (2, true)] {
            let mark = rec.mark();
            unmap(p + i * page, page);
            m.wait_idle();
            assert_eq!(
                rec.covered_since(mark, p + i * page, p + (i + 1) * page),
                reported,
                "page {i}: saw {}",
                rec.dump_since(mark)
            );
        }
        drop(kept);
        unmap(p + 3 * page, 3 * page);
        m.unsubscribe(id);
    }

    /// Blocks on `gate` when given a range overlapping `target`.
    struct Gated {
        gate: Arc<Mutex<()>>,
        target: (usize, usize),
        entered: AtomicBool,
        returned: AtomicBool,
    }

    impl InvalidationSink for Gated {
        fn invalidate(&self, start: usize, end: usize) {
            if start < self.target.1 && end > self.target.0 {
                self.entered.store(true, Ordering::SeqCst);
                drop(self.gate.lock().unwrap());
                self.returned.store(true, Ordering::SeqCst);
            }
        }
    }

    fn wait_for(flag: &AtomicBool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !flag.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "{what} within 5 s");
            std::thread::yield_now();
        }
    }

    // busy() stays set, and wait_idle() waits, until every sink has returned.
    #[test]
    fn busy_until_every_sink_has_returned() {
        let m = monitor();
        let len = 2 * page_size();
        let p = map(2);
        m.watch(p, len).unwrap();
        let gate = Arc::new(Mutex::new(()));
        let sink = Arc::new(Gated {
            gate: Arc::clone(&gate),
            target: (p, p + len),
            entered: AtomicBool::new(false),
            returned: AtomicBool::new(false),
        });
        let id = m.subscribe(sink.clone());
        let held = gate.lock().unwrap();
        unmap(p, len);
        // The event was read (munmap returned) but cannot be delivered while the gate is
        // held.
        assert!(m.busy());
        wait_for(&sink.entered, "the sink is called");
        assert!(m.busy());
        assert!(!sink.returned.load(Ordering::SeqCst));
        drop(held);
        m.wait_idle();
        assert!(sink.returned.load(Ordering::SeqCst));
        m.unsubscribe(id);
    }

    // A thread that holds a lock a sink is waiting for may still unmap watched memory: the
    // reading never waits for delivery. (With one thread reading and delivering, the
    // second munmap below would wait forever for a reader stuck in the sink.)
    #[test]
    fn munmap_under_a_lock_a_sink_waits_for_does_not_deadlock() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let len = 2 * page_size();
        let (a, b) = (map(2), map(2));
        m.watch(a, len).unwrap();
        m.watch(b, len).unwrap();
        let gate = Arc::new(Mutex::new(()));
        let sink = Arc::new(Gated {
            gate: Arc::clone(&gate),
            target: (a, a + len),
            entered: AtomicBool::new(false),
            returned: AtomicBool::new(false),
        });
        let gated_id = m.subscribe(sink.clone());
        let mark = rec.mark();
        let sink2 = Arc::clone(&sink);
        within(10, move || {
            let held = gate.lock().unwrap();
            unmap(a, len);
            wait_for(&sink2.entered, "the sink is called for the first range");
            // The delivery thread now waits for `gate`, which this thread holds.
            unmap(b, len);
            drop(held);
        });
        m.wait_idle();
        assert!(sink.returned.load(Ordering::SeqCst));
        assert!(
            rec.covered_since(mark, a, a + len),
            "{}",
            rec.dump_since(mark)
        );
        assert!(
            rec.covered_since(mark, b, b + len),
            "{}",
            rec.dump_since(mark)
        );
        m.unsubscribe(gated_id);
        m.unsubscribe(id);
    }

    /// Unmaps `victim` (watched) from inside the sink, then calls wait_idle and
    /// unsubscribes itself, all on the delivery thread.
    struct Reentrant {
        trigger: (usize, usize),
        victim: Mutex<Option<(usize, usize)>>,
        id: Mutex<Option<u64>>,
        done: AtomicBool,
    }

    impl InvalidationSink for Reentrant {
        fn invalidate(&self, start: usize, end: usize) {
            if start <= self.trigger.0 && end >= self.trigger.1 {
                if let Some((addr, len)) = self.victim.lock().unwrap().take() {
                    unmap(addr, len);
                    monitor().wait_idle();
                    if let Some(id) = self.id.lock().unwrap().take() {
                        monitor().unsubscribe(id);
                    }
                    self.done.store(true, Ordering::SeqCst);
                }
            }
        }
    }

    // A sink may unmap watched memory, call wait_idle() and unsubscribe itself without
    // deadlocking, and the memory it unmapped is reported before the monitor is idle.
    #[test]
    fn sink_may_unmap_watched_memory_and_call_back_into_the_monitor() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let len = 2 * page_size();
        let (trigger, victim) = (map(2), map(2));
        m.watch(trigger, len).unwrap();
        m.watch(victim, len).unwrap();
        let sink = Arc::new(Reentrant {
            trigger: (trigger, trigger + len),
            victim: Mutex::new(Some((victim, len))),
            id: Mutex::new(None),
            done: AtomicBool::new(false),
        });
        let reentrant_id = m.subscribe(sink.clone());
        *sink.id.lock().unwrap() = Some(reentrant_id);
        let mark = rec.mark();
        within(10, move || {
            unmap(trigger, len);
            monitor().wait_idle();
        });
        assert!(sink.done.load(Ordering::SeqCst));
        assert!(rec.covered_since(mark, trigger, trigger + len));
        assert!(
            rec.covered_since(mark, victim, victim + len),
            "the sink's own munmap was not delivered before idle: {}",
            rec.dump_since(mark)
        );
        m.unsubscribe(id);
    }

    // mmap(MAP_FIXED) over a watched range replaces its pages: reported as an unmap.
    #[test]
    fn map_fixed_over_a_watched_range_is_delivered() {
        let m = monitor();
        let (rec, id) = Recorder::subscribed();
        let page = page_size();
        let p = map(4);
        m.watch(p, 4 * page).unwrap();
        let mark = rec.mark();
        // SAFETY: replaces page 1 of this test's own mapping.
        let q = unsafe {
            libc::mmap(
                (p + page) as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(q as usize, p + page);
        m.wait_idle();
        assert!(
            rec.covered_since(mark, p + page, p + 2 * page),
            "{}",
            rec.dump_since(mark)
        );
        unmap(p, 4 * page);
        m.unsubscribe(id);
    }

    #[test]
    fn global_returns_the_same_monitor() {
        let a = monitor() as *const Monitor;
        let b = monitor() as *const Monitor;
        assert_eq!(a, b);
        assert!(format!("{:?}", monitor()).contains("Monitor"));
    }
}
