//! The ring's rules, checked from both ends, a hostile peer's included.

use super::*;

fn roundtrip(seg: &Segment, p: &mut Producer, c: &mut Consumer, prefix: &[u8], body: &[u8]) {
    let pushed = seg
        .push(
            0,
            p,
            false,
            prefix.len(),
            body.len(),
            body.as_ptr() as usize,
            |a, b| {
                // SAFETY: test buffers into the ranges push names.
                unsafe {
                    copy(a, prefix.as_ptr(), prefix.len());
                    copy(b, body.as_ptr(), body.len());
                }
            },
        )
        .unwrap();
    assert!(pushed);
    let rec = seg.peek(0, c).unwrap().expect("a record");
    assert_eq!((rec.prefix, rec.len), (prefix.len(), body.len()));
    let mut a = vec![0u8; rec.prefix];
    let mut b = vec![0u8; rec.len];
    // SAFETY: local buffers of the record's lengths.
    unsafe {
        seg.read(0, &rec, false, 0, a.as_mut_ptr(), a.len());
        seg.read(0, &rec, true, 0, b.as_mut_ptr(), b.len());
    }
    assert_eq!((&a[..], &b[..]), (prefix, body));
    seg.consume(0, c, &rec);
}

#[test]
fn a_side_that_left_is_copied_from_no_more() {
    let (seg, _fd) = Segment::create(1 << 14).unwrap();
    // A copy that began first: the side leaving sees it, and waits for its end.
    assert!(seg.copy_begin(1));
    assert!(seg.leave(0), "the copy in progress is seen");
    assert!(seg.copying(1));
    seg.copy_done(1);
    assert!(!seg.copying(1));
    // After the leave: no copy begins.
    assert!(!seg.copy_begin(1));
    assert!(!seg.copying(1), "a refused copy leaves no flag");
    // The other direction is untouched.
    assert!(seg.copy_begin(0));
    seg.copy_done(0);
}

#[test]
fn a_short_record_ends_where_a_cache_line_does() {
    let (seg, _fd) = Segment::create(1 << 14).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    // Headers and payloads of the sizes SENDs, ACKs and WRITEs have, in turn, so
    // that records start at every 16-byte offset the old layout gave them.
    for i in 0..300usize {
        let prefix = [12, 16, 28, 4][i % 4];
        let body: Vec<u8> = (0..(i * 7) % 200).map(|j| (i ^ j) as u8).collect();
        roundtrip(&seg, &mut p, &mut c, &vec![i as u8; prefix], &body);
        assert_eq!(c.head() % 64, 0, "record {i} ends mid-line");
    }
    // A long payload keeps its source's offset in a cache line instead.
    let body = vec![7u8; 1000];
    roundtrip(&seg, &mut p, &mut c, &[1; 12], &body[3..]);
    assert!(seg.peek(0, &mut c).unwrap().is_none());
}

#[test]
fn records_wrap_and_keep_their_bytes() {
    let (seg, _fd) = Segment::create(1 << 14).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    for i in 0..500usize {
        let body: Vec<u8> = (0..(i * 37) % 3000).map(|j| (i + j) as u8).collect();
        roundtrip(&seg, &mut p, &mut c, &[i as u8; 28], &body);
    }
    assert!(seg.peek(0, &mut c).unwrap().is_none());
}

#[test]
fn a_drained_ring_shows_nothing_old_as_new() {
    // Many laps of bursts: the ring filled, then drained; every record read once, in
    // order, and nothing after the last (stale records from earlier laps included).
    let (seg, _fd) = Segment::create(1 << 12).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    let mut next = 0u32;
    for lap in 0..200u32 {
        let mut sent = Vec::new();
        loop {
            let len = ((lap * 131 + next * 17) % 700) as usize;
            let tag = next;
            let pushed = seg
                .push(0, &mut p, false, 4, len, 0, |a, b| {
                    // SAFETY: `push` hands out 4 bytes at `a` and `len` at `b`.
                    unsafe {
                        copy(a, tag.to_ne_bytes().as_ptr(), 4);
                        std::ptr::write_bytes(b, tag as u8, len);
                    }
                })
                .unwrap();
            if !pushed {
                break;
            }
            sent.push((tag, len));
            next += 1;
        }
        assert!(!sent.is_empty());
        for (tag, len) in sent {
            let rec = seg.peek(0, &mut c).unwrap().expect("a record");
            let mut got = [0u8; 4];
            // SAFETY: a local buffer of the prefix's length.
            unsafe { seg.read(0, &rec, false, 0, got.as_mut_ptr(), 4) };
            assert_eq!((u32::from_ne_bytes(got), rec.len), (tag, len));
            seg.consume(0, &mut c, &rec);
        }
        assert!(seg.peek(0, &mut c).unwrap().is_none(), "lap {lap}");
    }
}

#[test]
fn a_drained_ring_starts_over_near_its_start() {
    // Request and answer in turn: the ring drains after every record, so past its
    // first bytes the producer wraps, and the records stay in the ring's first pages.
    let cap = 1 << 20;
    let (seg, _fd) = Segment::create(cap).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    let mut furthest = 0;
    for i in 0..20_000usize {
        let body = [i as u8; 40];
        roundtrip(&seg, &mut p, &mut c, &(i as u32).to_ne_bytes(), &body);
        furthest = furthest.max((p.tail as usize - 1) & (cap - 1));
    }
    assert!(p.tail > cap as u64, "the producer went round");
    assert!(
        furthest < early_wrap(cap) + RECHECK as usize + 128,
        "records reached byte {furthest}"
    );
    // A ring that does not drain goes on to its end, as before.
    let (seg, _fd) = Segment::create(cap).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    for i in 0..20_000u32 {
        let pushed = seg.push(0, &mut p, false, 4, 40, 0, |a, b| {
            // SAFETY: `push` hands out 4 bytes at `a` and 40 at `b`.
            unsafe {
                copy(a, i.to_ne_bytes().as_ptr(), 4);
                std::ptr::write_bytes(b, i as u8, 40);
            }
        });
        assert!(pushed.unwrap());
        // The consumer takes the record before the newest: one always waits.
        if i > 0 {
            let rec = seg.peek(0, &mut c).unwrap().expect("a record");
            let mut got = [0u8; 4];
            // SAFETY: a local buffer of the prefix's length.
            unsafe { seg.read(0, &rec, false, 0, got.as_mut_ptr(), 4) };
            assert_eq!(u32::from_ne_bytes(got), i - 1);
            seg.consume(0, &mut c, &rec);
        }
    }
    assert!(
        p.tail > (cap / 2) as u64,
        "records went past the early wrap"
    );
}

#[test]
fn a_wrap_record_where_no_producer_wraps_is_an_error() {
    let cap = 1 << 20;
    let (seg, _fd) = Segment::create(cap).unwrap();
    let (_, data) = seg.layout(0);
    let mut c = Consumer::default();
    // At the start (it would lead to itself), and anywhere before the early wrap.
    for pos in [0, 16, early_wrap(cap) - 16] {
        seg.scribble(data + pos, &[2, 0, 0, 0]);
        c.head = pos as u64;
        assert!(
            matches!(seg.peek(0, &mut c), Err(RingError::Garbage(_))),
            "a wrap at {pos}"
        );
    }
    // Where a drained ring's producer may wrap, it leads to the start.
    seg.scribble(data, &[0; 16]);
    seg.scribble(data + early_wrap(cap), &[2, 0, 0, 0]);
    c.head = early_wrap(cap) as u64;
    assert!(seg.peek(0, &mut c).unwrap().is_none());
    assert_eq!(c.head, cap as u64);
}

#[test]
fn a_full_ring_says_so() {
    let (seg, _fd) = Segment::create(1 << 12).unwrap();
    let mut p = Producer::default();
    let mut n = 0;
    while seg.push(0, &mut p, false, 12, 1000, 0, |_, _| {}).unwrap() {
        n += 1;
    }
    assert!(n >= 2);
}

#[test]
fn a_record_larger_than_half_a_ring_is_an_error() {
    let (seg, _fd) = Segment::create(1 << 12).unwrap();
    let mut p = Producer::default();
    let got = seg.push(0, &mut p, false, 12, 2048, 0, |_, _| panic!("written"));
    assert!(
        matches!(got, Err(RingError::TooLarge(n)) if n > 2048),
        "{got:?}"
    );
    // Nothing was written: a record that fits still goes.
    assert!(seg.push(0, &mut p, false, 12, 1000, 0, |_, _| {}).unwrap());
}

#[test]
fn hostile_indices_and_headers_are_errors() {
    let (seg, _fd) = Segment::create(1 << 12).unwrap();
    let (head, data) = seg.layout(0);
    let mut c = Consumer::default();
    seg.scribble(data, &[0xff; 16]);
    assert!(matches!(seg.peek(0, &mut c), Err(RingError::Garbage(_))));
    seg.scribble(
        data,
        &[1, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0xff, 0xff, 0, 0],
    );
    assert!(matches!(seg.peek(0, &mut c), Err(RingError::Garbage(_))));
    seg.scribble(data, &[2, 0, 0, 0]);
    assert!(matches!(seg.peek(0, &mut c), Err(RingError::Garbage(_))));
    let mut p = Producer::default();
    seg.scribble(head, &(1u64 << 50).to_ne_bytes());
    let mut filled = Ok(true);
    for _ in 0..10 {
        filled = seg.push(0, &mut p, false, 12, 1000, 0, |_, _| {});
        if filled != Ok(true) {
            break;
        }
    }
    assert!(matches!(filled, Err(RingError::Index { .. })));
}

/// Pushes a record of 4 prefix bytes and `len` payload bytes, all `tag`.
fn push_tagged(seg: &Segment, p: &mut Producer, tag: u8, len: usize) -> bool {
    let body = vec![tag; len];
    seg.push(0, p, false, 4, len, 0, |a, b| {
        // SAFETY: test buffers into the ranges push names.
        unsafe {
            copy(a, [tag; 4].as_ptr(), 4);
            copy(b, body.as_ptr(), len);
        }
    })
    .unwrap()
}

/// Reads every record published, in order: their tags.
fn drain_tags(seg: &Segment, c: &mut Consumer) -> Vec<u8> {
    let mut tags = Vec::new();
    while let Some(rec) = seg.peek(0, c).unwrap() {
        let mut pre = [0u8; 4];
        // SAFETY: a local buffer of the record's prefix length.
        unsafe { seg.read(0, &rec, false, 0, pre.as_mut_ptr(), 4) };
        let mut body = vec![0u8; rec.len];
        // SAFETY: a local buffer of the record's payload length.
        unsafe { seg.read(0, &rec, true, 0, body.as_mut_ptr(), rec.len) };
        assert!(
            body.iter().all(|&b| b == pre[0]),
            "a record's bytes mixed up"
        );
        tags.push(pre[0]);
        seg.consume(0, c, &rec);
    }
    tags
}

#[test]
fn a_batch_reaches_the_consumer_whole_and_in_order() {
    let (seg, _fd) = Segment::create(1 << 14).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    // Short records: none is seen before the batch is published.
    p.batch();
    for tag in 1..=3 {
        assert!(push_tagged(&seg, &mut p, tag, 8));
    }
    assert_eq!(drain_tags(&seg, &mut c), [] as [u8; 0]);
    seg.publish(0, &mut p);
    assert_eq!(drain_tags(&seg, &mut c), [1, 2, 3]);
    // A record longer than a batch holds back goes at once, with what came before it.
    p.batch();
    assert!(push_tagged(&seg, &mut p, 4, 8));
    assert!(push_tagged(&seg, &mut p, 5, BATCH_BYTES + 100));
    assert_eq!(drain_tags(&seg, &mut c), [4, 5]);
    seg.publish(0, &mut p);
    // A long batch is published as it goes, never more than BATCH_BYTES held back.
    p.batch();
    let mut seen = Vec::new();
    for tag in 6..60 {
        assert!(push_tagged(&seg, &mut p, tag, 40));
        seen.extend(drain_tags(&seg, &mut c));
        assert!(p.batched < BATCH_BYTES);
    }
    assert!(
        seen.len() > 20,
        "only {} records published early",
        seen.len()
    );
    seg.publish(0, &mut p);
    seen.extend(drain_tags(&seg, &mut c));
    assert_eq!(seen, (6..60).collect::<Vec<u8>>());
    // Outside a batch, each record goes at once.
    assert!(push_tagged(&seg, &mut p, 60, 8));
    assert_eq!(drain_tags(&seg, &mut c), [60]);
}

#[test]
fn batches_wrap_and_keep_their_order() {
    // Batches of every length across many laps of a small ring, wraps and full rings
    // among them: every record read once, in order.
    let (seg, _fd) = Segment::create(1 << 12).unwrap();
    let (mut p, mut c) = (Producer::default(), Consumer::default());
    let (mut next, mut want) = (0u8, 0u8);
    for lap in 0..400usize {
        p.batch();
        for i in 0..lap % 9 {
            if !push_tagged(&seg, &mut p, next, (lap * 31 + i * 57) % 700) {
                break;
            }
            next = next.wrapping_add(1);
        }
        seg.publish(0, &mut p);
        for tag in drain_tags(&seg, &mut c) {
            assert_eq!(tag, want);
            want = want.wrapping_add(1);
        }
        assert_eq!(want, next, "lap {lap}: a published record was not seen");
    }
}
