//! An echo server and client on the async API (`rdmx::tokio`): every message the client
//! SENDs comes back, and the client checks it.
//!
//! ```text
//! server:  cargo run --features tokio --example async_echo -- [-d tcp] [-p 18516]
//! client:  cargo run --features tokio --example async_echo -- [-d tcp] [-p PORT] [-n 1000] SERVER_HOST
//! both:    cargo run --features tokio --example async_echo -- --local [-n 1000]
//! ```
//!
//! The server accepts clients one after another through [`rdmx::tokio::cm`] and serves
//! each in its own task, so many clients are echoed at once. Each side keeps its next
//! receive posted before it sends, so a message never waits for a receive. With `-p 0` the
//! server picks a free port and prints it; `--local` runs a server and a client in this
//! process.

use std::time::Duration;

use rdmx::tokio::{cm, AsyncCq, AsyncQp};
use rdmx::{BufferPool, ConnectOptions, Context, PoolBuf, PoolConfig, QpCaps};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TIMEOUT: Duration = Duration::from_secs(30);
/// The largest message.
const MAX: usize = 4096;

struct Args {
    provider: String,
    port: u16,
    iters: usize,
    host: Option<String>,
    local: bool,
}

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        provider: "tcp".into(),
        port: 18516,
        iters: 1000,
        host: None,
        local: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "-d" => a.provider = val()?,
            "-p" => a.port = val()?.parse()?,
            "-n" => a.iters = val()?.parse()?,
            "--local" => a.local = true,
            h if !h.starts_with('-') => a.host = Some(h.to_string()),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    Ok(a)
}

/// One side: a context, an awaitable CQ and a pool.
struct Side {
    pd: rdmx::ProtectionDomain,
    cq: AsyncCq,
    pool: BufferPool,
}

impl Side {
    fn open(provider: &str) -> Result<Side, BoxError> {
        let ctx = Context::open_provider(provider)?;
        let cq = AsyncCq::new(ctx.create_cq(4096)?)?;
        let pd = ctx.alloc_pd();
        let pool = BufferPool::new(pd.clone(), PoolConfig::default())?;
        Ok(Side { pd, cq, pool })
    }

    fn qp(&self) -> Result<AsyncQp, BoxError> {
        let qp = self
            .pd
            .create_qp(self.cq.cq(), self.cq.cq(), QpCaps::default())?;
        Ok(AsyncQp::new(qp, &self.cq, &self.cq)?)
    }
}

/// Echoes every message until the client sends an empty one.
async fn echo(qp: AsyncQp, pool: BufferPool) -> Result<usize, BoxError> {
    let mut next = qp.recv(pool.get(MAX)?);
    let mut served = 0;
    loop {
        let (got, c) = next.await?;
        next = qp.recv(pool.get(MAX)?);
        let len = c.byte_len as usize;
        let mut reply = pool.get(len)?;
        reply.write_at(0, &got.as_slice().ok_or("remote access")?[..len])?;
        drop(got);
        qp.send(reply).await?;
        if len == 0 {
            return Ok(served);
        }
        served += 1;
    }
}

async fn server(a: &Args) -> Result<(), BoxError> {
    let side = Side::open(&a.provider)?;
    let listener = cm::Listener::bind(("0.0.0.0", a.port)).await?;
    println!("listening on {}", listener.local_addr()?);
    loop {
        let qp = side.qp()?;
        let accepted = listener
            .accept(
                std::slice::from_ref(&qp),
                &ConnectOptions::default(),
                b"",
                Duration::from_secs(3600),
            )
            .await;
        if let Err(e) = accepted {
            eprintln!("a client failed to connect: {e}");
            continue;
        }
        let pool = side.pool.clone();
        tokio::spawn(async move {
            match echo(qp, pool).await {
                Ok(n) => println!("echoed {n} messages"),
                Err(e) => eprintln!("echo: {e}"),
            }
        });
    }
}

async fn client(provider: &str, host: &str, port: u16, iters: usize) -> Result<(), BoxError> {
    let side = Side::open(provider)?;
    let qp = side.qp()?;
    cm::connect(
        (host, port),
        std::slice::from_ref(&qp),
        &ConnectOptions::default(),
        b"",
        TIMEOUT,
    )
    .await?;
    let mut next = qp.recv(side.pool.get(MAX)?);
    let start = std::time::Instant::now();
    for i in 0..=iters {
        // The last message is empty: the server's cue to stop.
        let len = if i == iters { 0 } else { 1 + i * 37 % MAX };
        let msg: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
        let mut out: PoolBuf = side.pool.get(len)?;
        out.write_at(0, &msg)?;
        let sent = qp.send(out);
        let (back, c) = tokio::time::timeout(TIMEOUT, next).await??;
        next = qp.recv(side.pool.get(MAX)?);
        if back.as_slice().ok_or("remote access")?[..c.byte_len as usize] != msg[..] {
            return Err(format!("message {i} came back changed").into());
        }
        sent.await?;
    }
    println!(
        "{iters} messages echoed and checked in {:.3} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let a = args()?;
    if a.local {
        let side = Side::open(&a.provider)?;
        let listener = cm::Listener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let server_qp = side.qp()?;
        let serve = async {
            listener
                .accept(
                    std::slice::from_ref(&server_qp),
                    &ConnectOptions::default(),
                    b"",
                    TIMEOUT,
                )
                .await?;
            echo(server_qp.clone(), side.pool.clone()).await
        };
        let (served, asked) = tokio::join!(serve, client(&a.provider, "127.0.0.1", port, a.iters));
        asked?;
        println!("the server echoed {} messages", served?);
        return Ok(());
    }
    match &a.host {
        Some(h) => client(&a.provider, h, a.port, a.iters).await,
        None => server(&a).await,
    }
}
