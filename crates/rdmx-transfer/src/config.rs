//! How an engine is set up: its rails, slicing, queue pairs per path, retries, timeouts,
//! the transport choice and the metadata service.

use std::net::SocketAddr;
use std::time::Duration;

/// A transport a rail runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Transport {
    /// In-process queue pairs (tests; both engines in one process).
    Loopback = 1,
    /// Shared memory between processes of one host.
    Shm = 2,
    /// TCP streams.
    Tcp = 3,
    /// RDMA adapters through rdma-core.
    Verbs = 4,
}

impl Transport {
    pub(crate) fn from_u8(v: u8) -> Option<Transport> {
        Some(match v {
            1 => Transport::Loopback,
            2 => Transport::Shm,
            3 => Transport::Tcp,
            4 => Transport::Verbs,
            _ => return None,
        })
    }

    /// The rdmx provider name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Loopback => "loopback",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Verbs => "verbs",
        }
    }

    /// The slice size used on this transport unless [`Config::slice_size`] says
    /// otherwise. Striping pays where paths are independent and a slice's cost is small
    /// against its bytes: 64 KiB on tcp (a stream per queue pair) and verbs (as
    /// Mooncake's slices). On shm and loopback every path is a memory copy by the same
    /// cores, so cutting gains nothing and each slice costs a work request, a completion
    /// and an acknowledgement: 1 MiB there.
    pub fn default_slice_size(self) -> usize {
        match self {
            Transport::Shm | Transport::Loopback => 1 << 20,
            Transport::Tcp | Transport::Verbs => 64 << 10,
        }
    }

    /// Parses a provider name.
    pub fn parse(s: &str) -> Option<Transport> {
        [
            Transport::Loopback,
            Transport::Shm,
            Transport::Tcp,
            Transport::Verbs,
        ]
        .into_iter()
        .find(|t| t.name() == s)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One rail: a device of some provider that paths to peers run over.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rail {
    /// In-process queue pairs.
    Loopback,
    /// Shared memory.
    Shm,
    /// TCP, listening on `bind` (port 0: the kernel picks).
    Tcp {
        /// The address peers' queue pairs dial.
        bind: SocketAddr,
    },
    /// A verbs device (`None`: the first).
    Verbs {
        /// The device name.
        device: Option<String>,
    },
}

impl Rail {
    /// A tcp rail on `bind`.
    pub fn tcp(bind: SocketAddr) -> Rail {
        Rail::Tcp { bind }
    }

    /// Its transport.
    pub fn transport(&self) -> Transport {
        match self {
            Rail::Loopback => Transport::Loopback,
            Rail::Shm => Transport::Shm,
            Rail::Tcp { .. } => Transport::Tcp,
            Rail::Verbs { .. } => Transport::Verbs,
        }
    }

    /// Parses `shm`, `loopback`, `tcp:ADDR:PORT`, `tcp` (every interface) or
    /// `verbs[:DEVICE]`.
    pub fn parse(s: &str) -> Option<Rail> {
        Some(match s.split_once(':') {
            None => match s {
                "shm" => Rail::Shm,
                "loopback" => Rail::Loopback,
                "tcp" => Rail::tcp(SocketAddr::from(([0, 0, 0, 0], 0))),
                "verbs" => Rail::Verbs { device: None },
                _ => return None,
            },
            Some(("tcp", a)) => Rail::tcp(a.parse().ok()?),
            Some(("verbs", d)) => Rail::Verbs {
                device: Some(d.to_string()),
            },
            _ => return None,
        })
    }
}

/// The largest slice: with a merged tail (up to a quarter more) a slice stays below an
/// RDMA message's 2 GiB.
const MAX_SLICE: usize = 1 << 30;

/// An engine's configuration; `Config::default()` then the builder methods.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// The rails (default: shm, and tcp on every interface; verbs rails are added by
    /// name). Peers on this host use shm, others tcp (see [`Config::transport`]).
    pub rails: Vec<Rail>,
    /// The address of the control listener peers handshake with (default: every
    /// interface, a port the kernel picks).
    pub listen: SocketAddr,
    /// Where segment descriptors live: `p2p` (the default: exchanged in the handshake)
    /// or `etcd://host:port[,host:port...]`.
    pub metadata: String,
    /// Requests are cut into slices of this many bytes, 4 KiB to 1 GiB (a slice with a
    /// merged tail stays within one RDMA message); a tail smaller than a quarter slice is
    /// merged into the slice before it. Default (`None`): per
    /// transport, [`Transport::default_slice_size`] (64 KiB on tcp and verbs, 1 MiB on
    /// shm and loopback).
    pub slice_size: Option<usize>,
    /// Queue pairs per rail and peer (default 2).
    pub qps_per_rail: usize,
    /// Send-queue depth of each queue pair (default 64).
    pub queue_depth: usize,
    /// How long a rail's worker keeps polling, with work in flight, after its last
    /// completion or post before it sleeps until the next completion (default 1 ms;
    /// zero: sleep at once). Polling on keeps software providers' progress in the
    /// worker instead of a wake-up per completion.
    pub spin: Duration,
    /// How many times a failed slice is retried on another path (default 9).
    pub max_retries: u32,
    /// How long a failed path is set aside before it is rebuilt on demand (default 30 s).
    pub set_aside: Duration,
    /// A slice not completed after this long sets its path aside (its queue pair is moved
    /// to the error state, so its slices flush and are retried on other paths, as after
    /// an error completion: a peer gone silent); one not even flushed within another
    /// `timeout` fails its request (default 30 s).
    pub timeout: Duration,
    /// How long connection setup with a peer may take (default 10 s).
    pub connect_timeout: Duration,
    /// Force a transport for every peer (default: chosen per peer).
    pub transport: Option<Transport>,
    /// Force a path MTU (default: the smaller of both sides').
    pub mtu: Option<u32>,
    /// A token every engine of the cluster is given (up to 64 bytes): with one, this
    /// engine's control listener refuses peers that do not present it. Without one
    /// (the default, as Mooncake's and NIXL's handshakes) anyone who reaches the
    /// listener can open this engine's segment, within the access each buffer grants;
    /// with or without one, nobody takes over the connection of an engine that still
    /// holds it by naming itself after it.
    pub token: Option<String>,
    /// etcd: the TTL of the engine's lease; its descriptor expires this long after the
    /// engine stops renewing it (default 10 s; etcd allows 2 s and up).
    pub lease_ttl: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            rails: vec![Rail::Shm, Rail::tcp(SocketAddr::from(([0, 0, 0, 0], 0)))],
            listen: SocketAddr::from(([0, 0, 0, 0], 0)),
            metadata: "p2p".into(),
            slice_size: None,
            qps_per_rail: 2,
            queue_depth: 64,
            spin: Duration::from_millis(1),
            max_retries: 9,
            set_aside: Duration::from_secs(30),
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            transport: None,
            mtu: None,
            lease_ttl: Duration::from_secs(10),
            token: None,
        }
    }
}

macro_rules! setter {
    ($(#[$doc:meta] $name:ident: $ty:ty),* $(,)?) => {$(
        #[$doc]
        pub fn $name(mut self, v: $ty) -> Self {
            self.$name = v;
            self
        }
    )*};
}

impl Config {
    setter! {
        /// Sets [`rails`](Self::rails).
        rails: Vec<Rail>,
        /// Sets [`listen`](Self::listen).
        listen: SocketAddr,
        /// Sets [`qps_per_rail`](Self::qps_per_rail).
        qps_per_rail: usize,
        /// Sets [`queue_depth`](Self::queue_depth).
        queue_depth: usize,
        /// Sets [`spin`](Self::spin).
        spin: Duration,
        /// Sets [`max_retries`](Self::max_retries).
        max_retries: u32,
        /// Sets [`set_aside`](Self::set_aside).
        set_aside: Duration,
        /// Sets [`timeout`](Self::timeout).
        timeout: Duration,
        /// Sets [`connect_timeout`](Self::connect_timeout).
        connect_timeout: Duration,
        /// Sets [`transport`](Self::transport).
        transport: Option<Transport>,
        /// Sets [`mtu`](Self::mtu).
        mtu: Option<u32>,
        /// Sets [`lease_ttl`](Self::lease_ttl).
        lease_ttl: Duration,
    }

    /// Sets [`slice_size`](Self::slice_size) for every transport (4 KiB to 1 GiB: a size
    /// outside is taken as the nearest bound).
    pub fn slice_size(mut self, v: usize) -> Self {
        self.slice_size = Some(v);
        self
    }

    /// The slice size on transport `t`: [`slice_size`](Self::slice_size) if set, else
    /// `t`'s default.
    pub fn slice_size_for(&self, t: Transport) -> usize {
        self.slice_size
            .unwrap_or_else(|| t.default_slice_size())
            .clamp(4096, MAX_SLICE)
    }

    /// Sets [`token`](Self::token).
    pub fn token(mut self, v: impl Into<String>) -> Self {
        self.token = Some(v.into());
        self
    }

    /// Sets [`metadata`](Self::metadata).
    pub fn metadata(mut self, v: impl Into<String>) -> Self {
        self.metadata = v.into();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice size outside 4 KiB to 1 GiB is taken as the nearest bound: a slice with a
    /// merged tail stays within one RDMA message (a larger one was cut short when posted,
    /// while its request reported every byte moved).
    #[test]
    fn slice_sizes_stay_within_an_rdma_message() {
        let t = Transport::Tcp;
        assert_eq!(
            Config::default().slice_size(8 << 30).slice_size_for(t),
            1 << 30
        );
        assert_eq!(Config::default().slice_size(1).slice_size_for(t), 4096);
        assert_eq!(
            Config::default().slice_size(1 << 20).slice_size_for(t),
            1 << 20
        );
    }
}
