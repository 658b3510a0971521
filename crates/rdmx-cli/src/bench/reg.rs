//! `rdmx bench reg`: what memory registration costs.
//!
//! Every figure is the median over `--runs` timed runs (after a warm-up) of the mean time
//! per operation within a run:
//!
//! - `register_us`: `register_raw` + deregister of an already-faulted buffer, pinned, by
//!   size. This is the price a hot path pays when it registers per transfer.
//! - `cache_hit_ns`: a registration-cache lookup that hits, plus giving the handle back.
//! - `cache_miss_us`: a lookup that misses (registers 64 KiB, watches it for unmap) plus
//!   giving it back with no idle room left, which deregisters it.
//! - `pool_get_put_ns`, `pool_get_put_2t_ns`: a 4 KiB pool buffer taken and returned, on
//!   one thread and on each of two threads running at once.
//! - `memcpy_64k_ns`: copying 64 KiB in cache between 64-byte-aligned buffers (memcpy's
//!   fast case), measured in the same run as an anchor for
//!   the speed of this machine; `memcpy_64k_misaligned_ns` the same with the destination
//!   16 bytes further (on some CPUs an order of magnitude slower).
//! - `copy_64k_ns`, `copy_64k_misaligned_ns`: the copy the shm provider moves payloads
//!   with (`rdmx::shm::copy_slice`), for the same two alignment pairs;
//!   `copy_misaligned_with` what it copies differently aligned blocks with on this CPU
//!   (`rdmx::shm::copy_method`), `copy_mid_with` and `copy_large_with` what it copies
//!   blocks of 32 to 512 KiB and of 512 KiB or more that `rep movsb` takes at full speed
//!   with (`rdmx::shm::mid_copy_method`, `rdmx::shm::large_copy_method`).
//! - `line_one_way_ns`: half the round trip of a cache line between two threads spinning
//!   on two cores (each stores a counter the other waits for): the time a store takes
//!   to reach the other core, on this machine now, measured as an anchor for the
//!   latency tests. A half round trip between processes (`write_lat`, `send_lat`) moves
//!   at least one line from one core to the other, so it cannot beat this.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::Instant;

use rdmx::{Access, BufferPool, Context, Mapping, Pinning, PoolConfig, RegCache};
use rdmx::{CacheConfig, Monitoring};
use serde_json::{json, Map, Value};

use super::stats::{median, median_ns_per_iter};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 64 << 20];

/// Options of `rdmx bench reg`.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 9)]
    runs: usize,
}

pub(crate) fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd();
    let runs = args.runs.max(1);
    let rw = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;

    let mut register_us = Map::new();
    for size in SIZES {
        let map = Mapping::new(size)?;
        // Fault the pages in so the figure is registration, not first touch.
        // SAFETY: the mapping is `size` bytes and nothing else uses it yet.
        unsafe { std::ptr::write_bytes(map.as_ptr(), 1, size) };
        let iters = (256 << 20) / size as u64;
        let iters = iters.clamp(4, 4000);
        let mut failure = None;
        let ns = median_ns_per_iter(runs, iters, |n| {
            for _ in 0..n {
                // SAFETY: the mapping outlives the region, which is dropped at once.
                match unsafe { pd.register_raw(map.as_ptr(), size, rw, Pinning::Pinned) } {
                    Ok(mr) => drop(black_box(mr)),
                    Err(e) => {
                        failure.get_or_insert(e);
                        return;
                    }
                }
            }
        });
        let value = match failure {
            None => json!(round(ns / 1000.0, 3)),
            Some(e) => {
                eprintln!("rdmx: register {size} bytes: {e}");
                Value::Null
            }
        };
        register_us.insert(size.to_string(), value);
    }

    let cache = RegCache::new(pd.clone(), CacheConfig::default())?;
    let buf = Mapping::new(64 << 10)?;
    let cache_hit_ns = median_ns_per_iter(runs, 1_000_000, |n| {
        for _ in 0..n {
            // SAFETY: `buf` outlives the handle, dropped at once.
            let h = unsafe { cache.get_raw(buf.as_ptr(), 64 << 10, rw) }.expect("cache get");
            drop(black_box(h));
        }
    });
    let monitoring = cache.monitoring();
    let hit_stats = cache.stats();
    // The idle entry would keep `buf` pinned and make misses skip mlock.
    drop(cache);

    let miss_cache = RegCache::new(pd.clone(), CacheConfig::default().max_idle_entries(0))?;
    let miss_buf = Mapping::new(64 << 10)?;
    // SAFETY: fault the pages in; nothing else uses the mapping yet.
    unsafe { std::ptr::write_bytes(miss_buf.as_ptr(), 1, 64 << 10) };
    let cache_miss_ns = median_ns_per_iter(runs, 2000, |n| {
        for _ in 0..n {
            // SAFETY: `miss_buf` outlives the handle, dropped at once.
            let h =
                unsafe { miss_cache.get_raw(miss_buf.as_ptr(), 64 << 10, rw) }.expect("cache get");
            drop(black_box(h));
        }
    });
    let miss_stats = miss_cache.stats();

    let pool = BufferPool::new(pd.clone(), PoolConfig::default())?;
    let pool_get_put_ns = median_ns_per_iter(runs, 2_000_000, |n| {
        for _ in 0..n {
            drop(black_box(pool.get(4096).expect("pool get")));
        }
    });
    let pool_get_put_2t_ns = two_threads(&pool, runs, 2_000_000);
    let pool_stats = pool.stats();

    // Both buffers start on a 64-byte boundary: the aligned case. (Two 64 KiB `Vec`s from
    // malloc usually sit 16 bytes apart within a cache line, where memcpy on some CPUs
    // runs an order of magnitude slower.)
    let mut src_buf = vec![1u8; (64 << 10) + 64];
    let mut dst_buf = vec![0u8; (64 << 10) + 64];
    let (so, d_off) = (
        src_buf.as_ptr().align_offset(64),
        dst_buf.as_ptr().align_offset(64),
    );
    let src = &mut src_buf[so..so + (64 << 10)];
    let dst = &mut dst_buf[d_off..d_off + (64 << 10)];
    let memcpy_64k_ns = median_ns_per_iter(runs, 20_000, |n| {
        for _ in 0..n {
            dst.copy_from_slice(black_box(&*src));
            black_box(&mut *dst);
        }
    });
    // The copy software providers move payloads with (rdmx::shm::copy_slice), aligned
    // and with source and destination 16 bytes apart within a cache line; and memcpy
    // with them 16 bytes apart, the case where it falls off a cliff on some CPUs.
    let copy_64k_ns = median_ns_per_iter(runs, 20_000, |n| {
        for _ in 0..n {
            rdmx::shm::copy_slice(dst, black_box(&*src));
            black_box(&mut *dst);
        }
    });
    let mis = &mut dst_buf[d_off + 16..d_off + 16 + (64 << 10)];
    let src = &src_buf[so..so + (64 << 10)];
    let copy_64k_misaligned_ns = median_ns_per_iter(runs, 20_000, |n| {
        for _ in 0..n {
            rdmx::shm::copy_slice(mis, black_box(src));
            black_box(&mut *mis);
        }
    });
    let memcpy_64k_misaligned_ns = median_ns_per_iter(runs, 20_000, |n| {
        for _ in 0..n {
            mis.copy_from_slice(black_box(src));
            black_box(&mut *mis);
        }
    });

    let line_one_way_ns = median_ns_per_iter(runs, 200_000, line_round_trips) / 2.0;

    let reg_64k_ns = register_us["65536"].as_f64().map(|us| us * 1000.0);
    let out = json!({
        "register_us": register_us,
        "cache_hit_ns": round(cache_hit_ns, 1),
        "cache_miss_us": round(cache_miss_ns / 1000.0, 3),
        "pool_get_put_ns": round(pool_get_put_ns, 1),
        "pool_get_put_2t_ns": round(pool_get_put_2t_ns, 1),
        "memcpy_64k_ns": round(memcpy_64k_ns, 1),
        "memcpy_64k_misaligned_ns": round(memcpy_64k_misaligned_ns, 1),
        "copy_64k_ns": round(copy_64k_ns, 1),
        "copy_64k_misaligned_ns": round(copy_64k_misaligned_ns, 1),
        "copy_misaligned_with": rdmx::shm::copy_method(),
        "copy_mid_with": rdmx::shm::mid_copy_method(),
        "copy_large_with": rdmx::shm::large_copy_method(),
        "line_one_way_ns": round(line_one_way_ns, 1),
        "hit_vs_register_64k": reg_64k_ns.map(|r| round(r / cache_hit_ns, 1)),
        "cache_monitoring": match monitoring {
            Monitoring::Userfaultfd => "userfaultfd",
            Monitoring::Explicit => "explicit",
        },
        "cache_hits": hit_stats.hits,
        "cache_misses": miss_stats.misses,
        "pool_hits": pool_stats.hits,
        "pool_misses": pool_stats.misses,
        "pool_bytes_registered": pool_stats.bytes_registered,
        "pinning": "mlock",
        "runs": runs,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_table(&out);
    }
    Ok(())
}

/// `n` round trips of a cache line between this thread and another: this one stores
/// the round's number in one line and waits until the other stores it back in a second
/// line (each line crosses once per round trip). Spins without `pause`, as a poller
/// waiting for a message does. A wait that spins far longer than a crossing takes
/// yields: on a machine whose other cores are busy, the two threads may share one, and
/// each round trip then takes a switch between them rather than a time slice.
fn line_round_trips(n: u64) {
    #[repr(align(128))]
    struct Line(AtomicU64);
    fn wait(line: &Line, i: u64) {
        let mut spins = 0u32;
        while line.0.load(Ordering::Acquire) != i {
            spins = spins.wrapping_add(1);
            if spins % (1 << 14) == 0 {
                std::thread::yield_now();
            }
        }
    }
    let (ping, pong) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 1..=n {
                wait(&ping, i);
                pong.0.store(i, Ordering::Release);
            }
        });
        for i in 1..=n {
            ping.0.store(i, Ordering::Release);
            wait(&pong, i);
        }
    });
}

/// Median per-operation time of two threads each running `iters` get+put at once.
fn two_threads(pool: &BufferPool, runs: usize, iters: u64) -> f64 {
    let mut per: Vec<f64> = (0..runs + 1)
        .map(|_| {
            let barrier = Barrier::new(2);
            let times: Vec<f64> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(|| {
                            // Warm this thread's cache, then start together.
                            drop(pool.get(4096).expect("pool get"));
                            barrier.wait();
                            let t = Instant::now();
                            for _ in 0..iters {
                                drop(black_box(pool.get(4096).expect("pool get")));
                            }
                            t.elapsed().as_nanos() as f64 / iters as f64
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("thread")).collect()
            });
            times.iter().sum::<f64>() / times.len() as f64
        })
        .skip(1)
        .collect();
    median(&mut per)
}

fn round(v: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (v * p).round() / p
}

fn print_table(v: &Value) {
    println!(
        "# rdmx bench reg: software context, pages pinned with mlock, median of {} runs",
        v["runs"]
    );
    println!("{:<36} {:>14}", "operation", "time");
    for size in SIZES {
        let t = &v["register_us"][size.to_string()];
        let shown = t
            .as_f64()
            .map_or("failed".to_string(), |t| format!("{t:.3} us"));
        println!(
            "{:<36} {:>14}",
            format!("register+deregister {}", human(size)),
            shown
        );
    }
    println!(
        "{:<36} {:>11.1} ns",
        "cache hit (get+put)",
        v["cache_hit_ns"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "{:<36} {:>11.3} us",
        "cache miss 64 KiB (get+put)",
        v["cache_miss_us"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "{:<36} {:>11.1} ns",
        "pool get+put 4 KiB, 1 thread",
        v["pool_get_put_ns"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "{:<36} {:>11.1} ns",
        "pool get+put 4 KiB, 2 threads",
        v["pool_get_put_2t_ns"].as_f64().unwrap_or(f64::NAN)
    );
    for (what, key) in [
        ("anchor: memcpy 64 KiB", "memcpy_64k_ns"),
        ("memcpy 64 KiB, 16 B apart", "memcpy_64k_misaligned_ns"),
        ("rdmx copy 64 KiB", "copy_64k_ns"),
        ("rdmx copy 64 KiB, 16 B apart", "copy_64k_misaligned_ns"),
        ("anchor: cache line, core to core", "line_one_way_ns"),
    ] {
        println!(
            "{what:<36} {:>11.1} ns",
            v[key].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!(
        "rdmx copy, 16 B apart, runs with: {} (the faster on this CPU)",
        v["copy_misaligned_with"].as_str().unwrap_or("?")
    );
    println!(
        "rdmx copy, blocks of 32-512 KiB, runs with: {} (the loop unless rep movsb won by 15%)",
        v["copy_mid_with"].as_str().unwrap_or("?")
    );
    println!(
        "rdmx copy, blocks of 512 KiB or more, runs with: {} (the faster on this CPU)",
        v["copy_large_with"].as_str().unwrap_or("?")
    );
    if let Some(r) = v["hit_vs_register_64k"].as_f64() {
        println!("cache hit is {r:.0}x cheaper than register+deregister of 64 KiB");
    }
    println!(
        "cache invalidation: {}",
        v["cache_monitoring"].as_str().unwrap_or("?")
    );
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}
