//! Where segment descriptors live: exchanged in the handshake (`p2p`, the default), or
//! kept in etcd (`etcd://host:port[,host:port...]`, cargo feature `etcd`), where each
//! engine's descriptor is a key under a lease the engine keeps alive (a dead engine's
//! entry expires) and a watch tells every engine of segments added and removed.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::wire::SegmentDesc;

/// A segment that appeared in or left the metadata service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegmentEvent {
    /// An engine published (or updated) its segment.
    Added(String),
    /// An engine's segment went away (it closed, or its lease expired).
    Removed(String),
}

/// The metadata service an engine uses.
pub(crate) enum Meta {
    P2p,
    #[cfg(feature = "etcd")]
    Etcd(Box<etcd::Store>),
}

impl Meta {
    /// Parses a connection string and connects.
    pub(crate) fn open(spec: &str, name: &str, ttl: Duration) -> Result<Meta> {
        if spec == "p2p" {
            return Ok(Meta::P2p);
        }
        let Some(list) = spec.strip_prefix("etcd://") else {
            return Err(Error::Metadata(format!(
                "unknown metadata {spec:?} (\"p2p\" or \"etcd://host:port,...\")"
            )));
        };
        let endpoints: Vec<String> = list
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| format!("http://{s}"))
            .collect();
        if endpoints.is_empty() {
            return Err(Error::Metadata(format!("no etcd endpoint in {spec:?}")));
        }
        #[cfg(feature = "etcd")]
        {
            Ok(Meta::Etcd(Box::new(etcd::Store::connect(
                endpoints, name, ttl,
            )?)))
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = (name, ttl);
            Err(Error::Metadata(format!(
                "{spec:?}: this build has no etcd support (cargo feature `etcd`)"
            )))
        }
    }

    pub(crate) fn is_p2p(&self) -> bool {
        matches!(self, Meta::P2p)
    }

    /// Publishes (or updates) this engine's descriptor; best effort while the service is
    /// away (it is published again once it is back).
    pub(crate) fn publish(&self, desc: &SegmentDesc) {
        match self {
            Meta::P2p => {}
            #[cfg(feature = "etcd")]
            Meta::Etcd(s) => s.publish(desc),
        }
        let _ = desc;
    }

    /// The descriptor of the engine named `name`.
    pub(crate) fn lookup(&self, name: &str) -> Result<SegmentDesc> {
        match self {
            Meta::P2p => Err(Error::Metadata(format!(
                "p2p metadata has no directory: open {name:?} by its control address"
            ))),
            #[cfg(feature = "etcd")]
            Meta::Etcd(s) => s.lookup(name),
        }
    }

    /// Segments the watch knows of now.
    pub(crate) fn segments(&self) -> Vec<String> {
        match self {
            Meta::P2p => Vec::new(),
            #[cfg(feature = "etcd")]
            Meta::Etcd(s) => s.segments(),
        }
    }

    /// The next segment event, waiting up to `timeout`.
    pub(crate) fn next_event(&self, timeout: Duration) -> Option<SegmentEvent> {
        match self {
            Meta::P2p => {
                std::thread::sleep(timeout);
                None
            }
            #[cfg(feature = "etcd")]
            Meta::Etcd(s) => s.next_event(timeout),
        }
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use std::collections::{BTreeMap, VecDeque};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
    use parking_lot::{Condvar, Mutex};
    use tokio::runtime::Runtime;

    use super::SegmentEvent;
    use crate::error::{Error, Result};
    use crate::wire::SegmentDesc;

    pub(crate) const PREFIX: &str = "/rdmx/transfer/segments/";
    const CALL: Duration = Duration::from_secs(3);

    struct State {
        /// What to publish, and whether it still has to be.
        desc: Option<Vec<u8>>,
        dirty: bool,
        known: BTreeMap<String, ()>,
        events: VecDeque<SegmentEvent>,
    }

    /// An etcd client, this engine's lease, and the watch of every segment.
    pub(crate) struct Store {
        /// Taken only by `drop`.
        rt: Option<Runtime>,
        client: Client,
        endpoints: String,
        key: String,
        lease: Arc<Mutex<i64>>,
        state: Arc<(Mutex<State>, Condvar)>,
    }

    /// Runs `f` on the store's runtime and waits for it: from this thread, or, when it is
    /// itself a runtime's (the engine called from async code, where waiting for another
    /// runtime in place is not allowed), from a thread of its own.
    fn run<F>(rt: &Runtime, f: F) -> F::Output
    where
        F: std::future::Future + Send,
        F::Output: Send,
    {
        if tokio::runtime::Handle::try_current().is_err() {
            return rt.block_on(f);
        }
        std::thread::scope(|s| {
            s.spawn(|| rt.block_on(f))
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    fn unreachable(endpoints: &str, e: impl std::fmt::Display) -> Error {
        Error::Metadata(format!("etcd at {endpoints} is unreachable: {e}"))
    }

    impl Store {
        pub(crate) fn connect(endpoints: Vec<String>, name: &str, ttl: Duration) -> Result<Store> {
            let list = endpoints.join(",");
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("rdmx-te-etcd")
                .enable_all()
                .build()
                .map_err(|e| Error::Io("start the etcd client's runtime", e))?;
            let opts = ConnectOptions::new()
                .with_connect_timeout(CALL)
                .with_timeout(CALL);
            let ttl_s = ttl.as_secs().max(2) as i64;
            let connected = run(&rt, async {
                tokio::time::timeout(CALL * 2, async {
                    let mut c = Client::connect(&endpoints, Some(opts)).await?;
                    let lease = c.lease_grant(ttl_s, None).await?.id();
                    Ok::<_, etcd_client::Error>((c, lease))
                })
                .await
            });
            let (client, lease) = match connected {
                Ok(Ok(c)) => c,
                failed => {
                    shut_down(rt);
                    return Err(match failed {
                        Ok(Err(e)) => unreachable(&list, e),
                        _ => unreachable(&list, "no answer"),
                    });
                }
            };
            let state = Arc::new((
                Mutex::new(State {
                    desc: None,
                    dirty: false,
                    known: BTreeMap::new(),
                    events: VecDeque::new(),
                }),
                Condvar::new(),
            ));
            let lease = Arc::new(Mutex::new(lease));
            let key = format!("{PREFIX}{name}");
            rt.spawn(keep_alive(
                client.clone(),
                lease.clone(),
                state.clone(),
                key.clone(),
                ttl_s,
            ));
            rt.spawn(watch(client.clone(), state.clone()));
            Ok(Store {
                rt: Some(rt),
                client,
                endpoints: list,
                key,
                lease,
                state,
            })
        }

        pub(crate) fn publish(&self, desc: &SegmentDesc) {
            let bytes = desc.to_bytes();
            {
                let mut st = self.state.0.lock();
                st.desc = Some(bytes.clone());
                st.dirty = true;
            }
            let mut c = self.client.clone();
            let lease = *self.lease.lock();
            let key = self.key.clone();
            let res = run(self.rt(), async {
                tokio::time::timeout(
                    CALL,
                    c.put(key, bytes, Some(PutOptions::new().with_lease(lease))),
                )
                .await
            });
            match res {
                Ok(Ok(_)) => self.state.0.lock().dirty = false,
                Ok(Err(e)) => tracing::warn!(error = %e, "publishing to etcd failed; will retry"),
                Err(_) => tracing::warn!("publishing to etcd timed out; will retry"),
            }
        }

        pub(crate) fn lookup(&self, name: &str) -> Result<SegmentDesc> {
            let mut c = self.client.clone();
            let key = format!("{PREFIX}{name}");
            let resp = run(self.rt(), async {
                tokio::time::timeout(CALL, c.get(key, None)).await
            })
            .map_err(|_| unreachable(&self.endpoints, "no answer"))?
            .map_err(|e| unreachable(&self.endpoints, e))?;
            let kv = resp
                .kvs()
                .first()
                .ok_or_else(|| Error::Metadata(format!("no segment named {name:?} in etcd")))?;
            let d = SegmentDesc::from_bytes(kv.value())?;
            if d.name != name {
                return Err(Error::Descriptor(format!(
                    "etcd's entry for {name:?} describes {:?}",
                    d.name
                )));
            }
            Ok(d)
        }

        fn rt(&self) -> &Runtime {
            self.rt
                .as_ref()
                .expect("the runtime goes only with the store")
        }

        pub(crate) fn segments(&self) -> Vec<String> {
            self.state.0.lock().known.keys().cloned().collect()
        }

        pub(crate) fn next_event(&self, timeout: Duration) -> Option<SegmentEvent> {
            let deadline = Instant::now() + timeout;
            let (m, cv) = &*self.state;
            let mut st = m.lock();
            loop {
                if let Some(e) = st.events.pop_front() {
                    return Some(e);
                }
                if cv.wait_until(&mut st, deadline).timed_out() {
                    return st.events.pop_front();
                }
            }
        }
    }

    impl Drop for Store {
        fn drop(&mut self) {
            // Leave at once rather than when the lease runs out.
            let mut c = self.client.clone();
            let lease = *self.lease.lock();
            let _ = run(self.rt(), async {
                tokio::time::timeout(Duration::from_secs(1), c.lease_revoke(lease)).await
            });
            if let Some(rt) = self.rt.take() {
                shut_down(rt);
            }
        }
    }

    /// Drops `rt`; from a runtime's thread, without waiting for its tasks (waiting there
    /// is not allowed).
    fn shut_down(rt: Runtime) {
        if tokio::runtime::Handle::try_current().is_ok() {
            rt.shutdown_background();
        }
    }

    /// Keeps the lease alive; when it was lost (etcd away longer than its TTL), takes a new
    /// one and publishes the descriptor again.
    async fn keep_alive(
        mut c: Client,
        lease: Arc<Mutex<i64>>,
        state: Arc<(Mutex<State>, Condvar)>,
        key: String,
        ttl: i64,
    ) {
        let every = Duration::from_millis((ttl as u64 * 1000 / 3).max(300));
        loop {
            tokio::time::sleep(every).await;
            let id = *lease.lock();
            let alive = match tokio::time::timeout(CALL, c.lease_keep_alive(id)).await {
                Ok(Ok((mut keeper, mut stream))) => {
                    let ok = keeper.keep_alive().await.is_ok();
                    match tokio::time::timeout(CALL, stream.message()).await {
                        Ok(Ok(Some(r))) => ok && r.ttl() > 0,
                        _ => false,
                    }
                }
                _ => false,
            };
            let mut renew = !alive;
            if renew {
                match tokio::time::timeout(CALL, c.lease_grant(ttl, None)).await {
                    Ok(Ok(r)) => *lease.lock() = r.id(),
                    _ => continue,
                }
            }
            let (desc, dirty) = {
                let st = state.0.lock();
                (st.desc.clone(), st.dirty)
            };
            renew |= dirty;
            if let (true, Some(d)) = (renew, desc) {
                let opts = PutOptions::new().with_lease(*lease.lock());
                if let Ok(Ok(_)) =
                    tokio::time::timeout(CALL, c.put(key.clone(), d, Some(opts))).await
                {
                    state.0.lock().dirty = false;
                }
            }
        }
    }

    /// Follows every segment key; re-establishes the watch when etcd comes back.
    async fn watch(mut c: Client, state: Arc<(Mutex<State>, Condvar)>) {
        loop {
            let start = match tokio::time::timeout(
                CALL,
                c.get(PREFIX, Some(GetOptions::new().with_prefix())),
            )
            .await
            {
                Ok(Ok(r)) => {
                    let now: Vec<String> = r
                        .kvs()
                        .iter()
                        .filter_map(|kv| name_of(kv.key(), kv.value()))
                        .collect();
                    let (m, cv) = &*state;
                    let mut st = m.lock();
                    let gone: Vec<String> = st
                        .known
                        .keys()
                        .filter(|k| !now.contains(k))
                        .cloned()
                        .collect();
                    for g in gone {
                        st.known.remove(&g);
                        st.events.push_back(SegmentEvent::Removed(g));
                    }
                    for n in now {
                        if st.known.insert(n.clone(), ()).is_none() {
                            st.events.push_back(SegmentEvent::Added(n));
                        }
                    }
                    cv.notify_all();
                    r.header().map_or(0, |h| h.revision()) + 1
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let opts = WatchOptions::new().with_prefix().with_start_revision(start);
            let Ok(Ok((_watcher, mut stream))) =
                tokio::time::timeout(CALL, c.watch(PREFIX, Some(opts))).await
            else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            while let Ok(Some(resp)) = stream.message().await {
                let (m, cv) = &*state;
                let mut st = m.lock();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let Some(name) = std::str::from_utf8(kv.key())
                        .ok()
                        .and_then(|k| k.strip_prefix(PREFIX))
                        .map(str::to_string)
                    else {
                        continue;
                    };
                    match ev.event_type() {
                        EventType::Put => {
                            if name_of(kv.key(), kv.value()).is_some()
                                && st.known.insert(name.clone(), ()).is_none()
                            {
                                st.events.push_back(SegmentEvent::Added(name));
                            }
                        }
                        EventType::Delete => {
                            if st.known.remove(&name).is_some() {
                                st.events.push_back(SegmentEvent::Removed(name));
                            }
                        }
                    }
                }
                cv.notify_all();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The segment name of a key whose value is a well-formed descriptor of that name;
    /// anything else is refused (and logged).
    fn name_of(key: &[u8], value: &[u8]) -> Option<String> {
        let name = std::str::from_utf8(key).ok()?.strip_prefix(PREFIX)?;
        match SegmentDesc::from_bytes(value) {
            Ok(d) if d.name == name => Some(name.to_string()),
            Ok(d) => {
                tracing::warn!(key = name, names = %d.name, "etcd: a descriptor under another name's key; ignored");
                None
            }
            Err(e) => {
                tracing::warn!(key = name, error = %e, "etcd: a malformed descriptor; ignored");
                None
            }
        }
    }
}
