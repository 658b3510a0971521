//! A prefill engine ships KV-cache blocks to a decode engine and tells it when a layer is
//! in place; the decode engine reads a block back. Both engines run in this process here
//! and talk over real transports (shm on one host, tcp with `--tcp`); across processes
//! or hosts only the address passed to `open_segment` changes.
//!
//! ```text
//! cargo run -p rdmx-transfer --example kv_transfer [-- --tcp]
//! ```

use std::time::Duration;

use rdmx::Access;
use rdmx_transfer::{Batch, Config, Engine, Rail, RequestStatus, Target};

const BLOCK: u64 = 256 << 10;
const BLOCKS: u64 = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tcp = std::env::args().any(|a| a == "--tcp");
    let config = || {
        let rails = if tcp {
            vec![
                Rail::tcp("127.0.0.1:0".parse().unwrap()),
                Rail::tcp("127.0.0.1:0".parse().unwrap()),
            ]
        } else {
            vec![Rail::Shm, Rail::tcp("127.0.0.1:0".parse().unwrap())]
        };
        Config::default()
            .rails(rails)
            .listen("127.0.0.1:0".parse().unwrap())
    };

    // The decode side: a KV-cache region peers may write and read.
    let decode = Engine::new("decode-0", config())?;
    let kv = decode.register(
        "kv",
        (BLOCK * BLOCKS) as usize,
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;

    // The prefill side: its blocks, filled with something recognisable.
    let prefill = Engine::new("prefill-0", config())?;
    let out = prefill.register("out", (BLOCK * BLOCKS) as usize, Access::LOCAL_WRITE)?;
    for b in 0..BLOCKS {
        out.write(b * BLOCK, &vec![b as u8 + 1; BLOCK as usize])?;
    }

    // Open the decode engine's segment: handshake, transport chosen, queue pairs connected.
    let seg = prefill.open_segment(&decode.control_addr().to_string())?;
    println!(
        "{} -> {} over {}, {} paths",
        prefill.name(),
        seg.name(),
        seg.transport(),
        seg.paths().len()
    );

    // One batch per layer: every block, then a notification once all of it is in place.
    let mut batch = Batch::with_capacity(BLOCKS as usize);
    for b in 0..BLOCKS {
        batch.write(
            (&out, b * BLOCK),
            &seg,
            Target::Buffer("kv", b * BLOCK),
            BLOCK,
        )?;
    }
    batch.notify(b"layer 0")?;
    let handle = prefill.submit(batch);
    let status = handle.wait(Duration::from_secs(30))?;
    println!("batch: {status:?}");
    if let Some(RequestStatus::Failed(f)) = (0..handle.len()).find_map(|i| {
        handle
            .status(i)
            .filter(|s| matches!(s, RequestStatus::Failed(_)))
    }) {
        return Err(format!("a request failed: {f}").into());
    }

    let note = decode
        .recv_notification(Duration::from_secs(30))
        .ok_or("no notification")?;
    println!(
        "{} got {:?} from {}",
        decode.name(),
        String::from_utf8_lossy(&note.data),
        note.from
    );
    let mut first = [0u8; 4];
    kv.read(5 * BLOCK, &mut first)?;
    assert_eq!(first, [6; 4]);

    // And back: the decode engine reads from the prefill engine's segment over the same
    // connection. Only buffers registered with REMOTE_READ can be read: "out" is refused
    // when the request is built, "scratch" (registered after the connection was opened,
    // hence the refresh) is read.
    let back = decode.register("back", BLOCK as usize, Access::LOCAL_WRITE)?;
    let to_prefill = decode.open_segment(&prefill.control_addr().to_string())?;
    prefill.register("scratch", BLOCK as usize, Access::REMOTE_READ)?;
    decode.refresh(&to_prefill)?;
    let mut read = Batch::new();
    read.read(
        (&back, 0),
        &to_prefill,
        Target::Buffer("out", 3 * BLOCK),
        BLOCK,
    )
    .map(|_| ())
    .unwrap_or_else(|e| println!("reading \"out\" is refused, as registered: {e}"));
    read.read((&back, 0), &to_prefill, Target::Buffer("scratch", 0), BLOCK)?;
    println!(
        "read back: {:?}",
        decode.submit(read).wait(Duration::from_secs(30))?
    );
    for (peer, transport, paths) in prefill.status() {
        for p in paths {
            println!(
                "{peer} {transport}: {} up={} failures={} bw={} B/s",
                p.name, p.up, p.failures, p.bandwidth
            );
        }
    }
    Ok(())
}
