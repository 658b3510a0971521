//! Metadata in etcd: the real server (Debian's `etcd-server`), started here on free
//! 127.0.0.1 ports with a temporary data directory and stopped after each test. Without
//! the `etcd` binary the tests say so and skip.
#![cfg(feature = "etcd")]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::tcp_rails;
use rdmx::Access;
use rdmx_transfer::{Batch, Config, Engine, Error, SegmentEvent, Target};

const T: Duration = Duration::from_secs(20);

struct Etcd {
    child: Child,
    dir: PathBuf,
    client: SocketAddr,
}

impl Etcd {
    fn start() -> Option<Etcd> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .or_else(|| {
                std::env::var_os("PATH").and_then(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("etcd"))
                        .find(|p| p.exists())
                })
            });
        let Some(bin) = bin else {
            eprintln!("SKIPPED: no `etcd` binary (Debian package etcd-server)");
            return None;
        };
        // etcd cannot listen on a port the kernel picks and report it, so the test picks
        // them. Below the kernel's ephemeral range a port given back here cannot become
        // another test's outgoing connection before etcd binds it; if etcd still exits
        // (another run took it), start again on other ports.
        for attempt in 0..8 {
            let (client, peer) = (unused_port(attempt), unused_port(attempt + 100));
            let dir = std::env::temp_dir().join(format!(
                "rdmx-te-etcd-{}-{}",
                std::process::id(),
                client.port()
            ));
            let child = Command::new(&bin)
                .arg("--name=t")
                .arg(format!("--data-dir={}", dir.display()))
                .arg(format!("--listen-client-urls=http://{client}"))
                .arg(format!("--advertise-client-urls=http://{client}"))
                .arg(format!("--listen-peer-urls=http://{peer}"))
                .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
                .arg(format!("--initial-cluster=t=http://{peer}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start etcd");
            let mut e = Etcd { child, dir, client };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if e.http("/health", None).is_some_and(|r| r.contains("true")) {
                    return Some(e);
                }
                if e.child.try_wait().ok().flatten().is_some() {
                    break; // exited: most likely a port was taken
                }
                assert!(Instant::now() < deadline, "etcd did not come up");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        panic!("etcd exited at start eight times");
    }

    fn url(&self) -> String {
        format!("etcd://{}", self.client)
    }

    /// A request to etcd's HTTP gateway; the body of the answer.
    fn http(&self, path: &str, body: Option<&str>) -> Option<String> {
        let mut s = TcpStream::connect_timeout(&self.client, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let req = match body {
            Some(b) => format!(
                "POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            ),
            None => format!("GET {path} HTTP/1.0\r\n\r\n"),
        };
        s.write_all(req.as_bytes()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    /// Puts raw bytes under a key, as a hostile or broken writer could.
    fn put_raw(&self, key: &str, value: &[u8]) {
        let body = format!(
            "{{\"key\":\"{}\",\"value\":\"{}\"}}",
            b64(key.as_bytes()),
            b64(value)
        );
        let r = self.http("/v3/kv/put", Some(&body)).expect("etcd answers");
        assert!(r.contains("200 OK"), "{r}");
    }
}

/// A 127.0.0.1 port that is free now and below the kernel's ephemeral range, so nothing
/// takes it as the local end of an outgoing connection.
fn unused_port(salt: u32) -> SocketAddr {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(2048, 65535);
    let span = low - 1024;
    let mut x = std::process::id()
        .wrapping_mul(2654435761)
        .wrapping_add(salt.wrapping_mul(40503))
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    loop {
        let port = 1024 + x % span;
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port as u16)) {
            return l.local_addr().expect("a bound address");
        }
        x = x.wrapping_mul(1103515245).wrapping_add(12345);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn b64(raw: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in raw.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An engine's configuration: its lease lives 10 s, kept alive every third of that, so
/// a busy machine that delays a keep-alive does not let it expire mid-test.
fn cfg(url: &str) -> Config {
    tcp_rails(1)
        .metadata(url)
        .lease_ttl(Duration::from_secs(10))
}

/// [`cfg`] with a lease of 2 s: for the engine whose entry is to expire.
fn cfg_short_lease(url: &str) -> Config {
    tcp_rails(1).metadata(url).lease_ttl(Duration::from_secs(2))
}

fn wait_event(e: &Engine, want: &SegmentEvent) {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if e.next_segment_event(Duration::from_millis(200)).as_ref() == Some(want) {
            return;
        }
    }
    panic!("no {want:?} within {T:?}");
}

#[test]
fn engines_find_each_other_in_etcd_and_leave_it() {
    let Some(etcd) = Etcd::start() else { return };
    let a = Engine::new("a", cfg(&etcd.url())).unwrap();
    let b = Engine::new("b", cfg(&etcd.url())).unwrap();
    let dst = b.register("dst", 1 << 20, Access::REMOTE_WRITE).unwrap();
    wait_event(&a, &SegmentEvent::Added("b".into()));
    assert!(a.segments().contains(&"b".to_string()));
    let src = a
        .register("src", vec![5u8; 1 << 20], Access::LOCAL_WRITE)
        .unwrap();
    let seg = a.open_segment("b").unwrap();
    let mut batch = Batch::new();
    batch
        .write((&src, 0), &seg, Target::Buffer("dst", 0), 1 << 20)
        .unwrap();
    assert!(a.submit(batch).wait(T).unwrap().is_success());
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 5));
    // A closed engine leaves etcd at once (its lease revoked).
    drop(b);
    wait_event(&a, &SegmentEvent::Removed("b".into()));
    let e = a.open_segment("nobody").unwrap_err();
    assert!(e.to_string().contains("no segment named"), "{e}");
}

/// Called from async code (in a tokio task, as a server on tokio would call it), an engine
/// with its metadata in etcd starts, publishes, looks its peer up, transfers and leaves
/// (before, each etcd call panicked: "Cannot start a runtime from within a runtime").
#[test]
fn an_engine_with_etcd_works_from_async_code() {
    let Some(etcd) = Etcd::start() else { return };
    let url = etcd.url();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let a = Engine::new("a", cfg(&url)).unwrap();
        let b = Engine::new("b", cfg(&url)).unwrap();
        let dst = b.register("dst", 4096, Access::REMOTE_WRITE).unwrap();
        let src = a
            .register("src", vec![7u8; 4096], Access::LOCAL_WRITE)
            .unwrap();
        let seg = a.open_segment("b").unwrap();
        let mut batch = Batch::new();
        batch
            .write((&src, 0), &seg, Target::Buffer("dst", 0), 4096)
            .unwrap();
        assert!(a.submit(batch).wait(T).unwrap().is_success());
        let mut got = vec![0u8; 4096];
        dst.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 7));
        drop(b);
        wait_event(&a, &SegmentEvent::Removed("b".into()));
    });
}

/// Not a test by itself: the engine process the next test kills (run only when the
/// parent sets `RDMX_TE_CHILD_ETCD`).
#[test]
fn child_engine_process() {
    let Ok(url) = std::env::var("RDMX_TE_CHILD_ETCD") else {
        return;
    };
    let _e = Engine::new("victim", cfg_short_lease(&url)).unwrap();
    println!("child ready");
    std::thread::sleep(Duration::from_secs(600));
}

/// An engine process killed outright (no goodbye): its entry goes when its lease
/// expires, and the others' watch says so.
#[test]
fn a_killed_engines_entry_expires_with_its_lease() {
    let Some(etcd) = Etcd::start() else { return };
    let a = Engine::new("a", cfg(&etcd.url())).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_engine_process", "--nocapture"])
        .env("RDMX_TE_CHILD_ETCD", etcd.url())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_event(&a, &SegmentEvent::Added("victim".into()));
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    wait_event(&a, &SegmentEvent::Removed("victim".into()));
    // The lease's TTL is 2 s; etcd may take a little longer to revoke it.
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "{:?}",
        killed.elapsed()
    );
    let e = a.open_segment("victim").unwrap_err();
    assert!(e.to_string().contains("no segment named"), "{e}");
}

#[test]
fn with_etcd_stopped_open_peers_keep_transferring_and_new_opens_say_why() {
    let Some(etcd) = Etcd::start() else { return };
    let a = Engine::new("a", cfg(&etcd.url())).unwrap();
    let b = Engine::new("b", cfg(&etcd.url())).unwrap();
    let _c = Engine::new("c", cfg(&etcd.url())).unwrap();
    b.register("dst", 1 << 20, Access::REMOTE_WRITE).unwrap();
    let src = a.register("src", 1 << 20, Access::LOCAL_WRITE).unwrap();
    let seg = a.open_segment("b").unwrap();
    drop(etcd);
    for _ in 0..5 {
        let mut batch = Batch::new();
        batch
            .write((&src, 0), &seg, Target::Offset(0), 1 << 20)
            .unwrap();
        assert!(a.submit(batch).wait(T).unwrap().is_success());
    }
    // Opening b again finds the open connection; opening c needs etcd.
    assert!(a.open_segment("b").is_ok());
    let e = a.open_segment("c").unwrap_err();
    assert!(matches!(e, Error::Metadata(_)), "{e}");
    assert!(e.to_string().contains("unreachable"), "{e}");
}

#[test]
fn garbage_and_forged_descriptors_in_etcd_are_refused() {
    let Some(etcd) = Etcd::start() else { return };
    let a = Engine::new("a", cfg(&etcd.url())).unwrap();
    let b = Engine::new("b", cfg(&etcd.url())).unwrap();
    etcd.put_raw("/rdmx/transfer/segments/junk", b"not a descriptor");
    let e = a.open_segment("junk").unwrap_err();
    assert!(matches!(e, Error::Descriptor(_)), "{e}");
    // b's descriptor copied under another name: refused, it names someone else.
    let mut raw = Vec::new();
    {
        let d = b.desc();
        raw.extend_from_slice(&d.to_bytes());
    }
    etcd.put_raw("/rdmx/transfer/segments/mallory", &raw);
    let e = a.open_segment("mallory").unwrap_err();
    assert!(e.to_string().contains("describes \"b\""), "{e}");
    // Neither shows up as a segment. (b does, once a's watch has delivered it: waited
    // for, not assumed of a fixed sleep. The sleep then gives the two forged entries,
    // put after b's, the time to show up if they were taken.)
    wait_event(&a, &SegmentEvent::Added("b".into()));
    std::thread::sleep(Duration::from_millis(500));
    let segs = a.segments();
    assert!(!segs.contains(&"junk".to_string()) && !segs.contains(&"mallory".to_string()));
    assert!(segs.contains(&"b".to_string()), "{segs:?}");
}
