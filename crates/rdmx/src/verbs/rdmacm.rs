//! Connection setup through the RDMA connection manager (librdmacm, loaded at run time like
//! libibverbs), for queue pairs rdmx created on its own
//! `ibv_context`.
//!
//! The `rdma_cm_id`s carry no QP: `rdma_connect`/`rdma_accept` name rdmx's QP by number
//! (`rdma_conn_param.qp_num`), and rdmx moves the QP itself, through its checked modify
//! path, with the attributes `rdma_init_qp_attr` gives for each state (peer QPN, PSNs,
//! address vector, path MTU, negotiated READ/atomic depths, retry counts). Because the id
//! has no QP, librdmacm leaves these steps to the caller, as its rules for such ids are:
//!
//! - active side: address and route resolution, `rdma_connect`, then
//!   `RDMA_CM_EVENT_CONNECT_RESPONSE` (not ESTABLISHED); the QP goes to RTR and RTS and
//!   `rdma_establish` sends the RTU;
//! - passive side: `RDMA_CM_EVENT_CONNECT_REQUEST` gives a new id; the QP goes to INIT and
//!   RTR, then `rdma_accept`; the QP goes to RTS once the accept has set this side's
//!   starting PSN, and the side waits for `RDMA_CM_EVENT_ESTABLISHED`.
//!
//! What rdmx's [`ConnectOptions`] decide locally stays theirs: access flags, the RNR timer
//! this side asks for, the ACK timeout, and an upper bound on the path MTU and READ depths.
//!
//! Every wait on an event channel polls its descriptor with a deadline. The connected id
//! and its channel are kept by the queue pair until it is dropped (destroying the id
//! disconnects the peer).

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::time::Instant;

use rdmx_core::{ConnectParams, Mtu, QpState};

use super::ffi;
use super::qp::Qp;
use super::sys;
use crate::ConnectOptions;
use crate::{Error, Result};

use ffi::rdma_cm_event_type as ev;

/// The errno of a failed call, or `fallback` when it left none.
fn last_error(fallback: i32) -> io::Error {
    match io::Error::last_os_error().raw_os_error() {
        Some(e) if e != 0 => io::Error::from_raw_os_error(e),
        _ => io::Error::from_raw_os_error(fallback),
    }
}

/// A librdmacm return code (0, or -1 with errno) as a result.
fn check(rc: i32, what: &'static str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Io(what, last_error(libc::EIO)))
    }
}

/// The name of an `rdma_cm_event_type`.
pub(crate) fn event_name(kind: u32) -> &'static str {
    match kind {
        ev::RDMA_CM_EVENT_ADDR_RESOLVED => "RDMA_CM_EVENT_ADDR_RESOLVED",
        ev::RDMA_CM_EVENT_ADDR_ERROR => "RDMA_CM_EVENT_ADDR_ERROR",
        ev::RDMA_CM_EVENT_ROUTE_RESOLVED => "RDMA_CM_EVENT_ROUTE_RESOLVED",
        ev::RDMA_CM_EVENT_ROUTE_ERROR => "RDMA_CM_EVENT_ROUTE_ERROR",
        ev::RDMA_CM_EVENT_CONNECT_REQUEST => "RDMA_CM_EVENT_CONNECT_REQUEST",
        ev::RDMA_CM_EVENT_CONNECT_RESPONSE => "RDMA_CM_EVENT_CONNECT_RESPONSE",
        ev::RDMA_CM_EVENT_CONNECT_ERROR => "RDMA_CM_EVENT_CONNECT_ERROR",
        ev::RDMA_CM_EVENT_UNREACHABLE => "RDMA_CM_EVENT_UNREACHABLE",
        ev::RDMA_CM_EVENT_REJECTED => "RDMA_CM_EVENT_REJECTED",
        ev::RDMA_CM_EVENT_ESTABLISHED => "RDMA_CM_EVENT_ESTABLISHED",
        ev::RDMA_CM_EVENT_DISCONNECTED => "RDMA_CM_EVENT_DISCONNECTED",
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => "RDMA_CM_EVENT_DEVICE_REMOVAL",
        ev::RDMA_CM_EVENT_ADDR_CHANGE => "RDMA_CM_EVENT_ADDR_CHANGE",
        ev::RDMA_CM_EVENT_TIMEWAIT_EXIT => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => "an unexpected rdma_cm event",
    }
}

/// Milliseconds left until `deadline`, at least 1, as librdmacm's timeouts take them.
fn ms_left(deadline: Instant) -> i32 {
    deadline
        .saturating_duration_since(Instant::now())
        .as_millis()
        .clamp(1, i32::MAX as u128) as i32
}

/// An event channel (`rdma_event_channel`), non-blocking.
struct Channel {
    ptr: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: librdmacm objects may be used from any thread; rdmx serialises the use of each.
unsafe impl Send for Channel {}
// SAFETY: as above; shared references only read the descriptor.
unsafe impl Sync for Channel {}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel was destroyed or migrated before (the owners
        // below drop their id first); the channel is destroyed once.
        unsafe { ffi::rdma_destroy_event_channel(self.ptr.as_ptr()) };
    }
}

/// What rdmx keeps of an event; the event itself is acknowledged when it is taken.
struct Event {
    kind: u32,
    status: i32,
    id: *mut ffi::rdma_cm_id,
    private: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

impl Channel {
    fn new() -> Result<Channel> {
        // SAFETY: no arguments; returns an owned channel or NULL.
        let p = unsafe { ffi::rdma_create_event_channel() };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::Io(
                "rdma_create_event_channel (rdma_cm needs librdmacm and the rdma_ucm module)",
                last_error(libc::ENOSYS),
            )
        })?;
        let ch = Channel { ptr };
        let fd = ch.fd();
        // SAFETY: fcntl on the channel's own descriptor; only O_NONBLOCK is added.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::Io(
                "make the rdma_cm event channel non-blocking",
                io::Error::last_os_error(),
            ));
        }
        Ok(ch)
    }

    fn fd(&self) -> RawFd {
        // SAFETY: reading a field of the live channel.
        unsafe { (*self.ptr.as_ptr()).fd }
    }

    /// The next event, waiting until `deadline` at most (then `Timeout(during)`).
    fn next(&self, deadline: Instant, during: &'static str) -> Result<Event> {
        loop {
            let mut event = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; `event` is a valid out-pointer.
            if unsafe { ffi::rdma_get_cm_event(self.ptr.as_ptr(), &mut event) } == 0 {
                return Ok(Event::take(event));
            }
            let e = io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                return Err(Error::Io("rdma_get_cm_event", e));
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(during));
            }
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, ms_left(deadline)) } < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(Error::Io("poll the rdma_cm event channel", e));
                }
            }
        }
    }
}

impl Event {
    /// Copies what rdmx needs out of `event` and acknowledges it.
    fn take(event: *mut ffi::rdma_cm_event) -> Event {
        // SAFETY: rdma_get_cm_event returned a valid event, readable until acknowledged.
        let e = unsafe { &*event };
        let (kind, status, id) = (e.event, e.status, e.id);
        let mut out = Event {
            kind,
            status,
            id,
            private: Vec::new(),
            responder_resources: 0,
            initiator_depth: 0,
        };
        if matches!(
            kind,
            ev::RDMA_CM_EVENT_CONNECT_REQUEST
                | ev::RDMA_CM_EVENT_CONNECT_RESPONSE
                | ev::RDMA_CM_EVENT_ESTABLISHED
        ) {
            // SAFETY: for these events of a connected (RC) id librdmacm fills `param.conn`,
            // whose private data points into the event.
            let conn = unsafe { &e.param.conn };
            out.responder_resources = conn.responder_resources;
            out.initiator_depth = conn.initiator_depth;
            if !conn.private_data.is_null() && conn.private_data_len > 0 {
                // SAFETY: librdmacm gives `private_data_len` readable bytes at the pointer,
                // valid until the event is acknowledged below.
                let data = unsafe {
                    std::slice::from_raw_parts(
                        conn.private_data.cast::<u8>(),
                        usize::from(conn.private_data_len),
                    )
                };
                out.private = data.to_vec();
            }
        }
        // SAFETY: the event is acknowledged once, after its last use.
        unsafe { ffi::rdma_ack_cm_event(event) };
        out
    }

    /// The event if it is `want` with status 0, else the typed error naming what came.
    fn expect(self, want: u32, during: &'static str) -> Result<Event> {
        if self.kind == want && self.status == 0 {
            Ok(self)
        } else {
            Err(Error::RdmaCm {
                event: event_name(self.kind),
                status: self.status,
                during,
            })
        }
    }
}

/// An `rdma_cm_id` (RC, `RDMA_PS_TCP`); dropping it destroys it, which disconnects.
struct Id {
    ptr: NonNull<ffi::rdma_cm_id>,
}

// SAFETY: see Channel.
unsafe impl Send for Id {}
// SAFETY: see Channel.
unsafe impl Sync for Id {}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: the id is live, has no QP, and is destroyed once; its channel outlives
        // it (owners drop the id first).
        unsafe { ffi::rdma_destroy_id(self.ptr.as_ptr()) };
    }
}

/// A socket address as `sockaddr_storage`, for librdmacm calls.
fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe { ptr::addr_of_mut!(ss).cast::<libc::sockaddr_in>().write(sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above.
            unsafe {
                ptr::addr_of_mut!(ss)
                    .cast::<libc::sockaddr_in6>()
                    .write(sin6)
            };
        }
    }
    ss
}

impl Id {
    fn create(channel: &Channel) -> Result<Id> {
        let mut id = ptr::null_mut();
        // SAFETY: the channel is live; `id` is a valid out-pointer.
        let rc = unsafe {
            ffi::rdma_create_id(
                channel.ptr.as_ptr(),
                &mut id,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        check(rc, "rdma_create_id")?;
        NonNull::new(id)
            .map(|ptr| Id { ptr })
            .ok_or(Error::Io("rdma_create_id", last_error(libc::ENOMEM)))
    }

    /// Takes ownership of the id a CONNECT_REQUEST event created.
    fn from_request(event: &Event) -> Result<Id> {
        NonNull::new(event.id)
            .map(|ptr| Id { ptr })
            .ok_or(Error::Protocol(
                "rdma_cm reported a connect request without an id",
            ))
    }

    /// The device (name) and port the id is bound to, once it has one.
    fn device(&self) -> Option<(String, u8)> {
        // SAFETY: reading fields of the live id.
        let (verbs, port) = unsafe { ((*self.ptr.as_ptr()).verbs, (*self.ptr.as_ptr()).port_num) };
        if verbs.is_null() {
            return None;
        }
        // SAFETY: a bound id's context is open and names its device, whose name is a
        // NUL-terminated string owned by libibverbs.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name((*verbs).device)) };
        Some((name.to_string_lossy().into_owned(), port))
    }

    /// The address the id is bound to.
    fn local_addr(&self) -> Result<SocketAddr> {
        // SAFETY: the id is live; the source address is a sockaddr of the family it names
        // (sockaddr_storage space in the route).
        let sa = unsafe { ffi::rdma_get_local_addr(&*self.ptr.as_ptr()) };
        let sa: *const libc::sockaddr = sa;
        // SAFETY: as above; the family says which sockaddr it is.
        match i32::from(unsafe { (*sa).sa_family }) {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { sa.cast::<libc::sockaddr_in>().read_unaligned() };
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Ok(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { sa.cast::<libc::sockaddr_in6>().read_unaligned() };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Ok(SocketAddr::new(
                    IpAddr::V6(ip),
                    u16::from_be(sin6.sin6_port),
                ))
            }
            _ => Err(Error::Protocol("rdma_cm bound the id to a non-IP address")),
        }
    }

    /// `rdma_init_qp_attr` for `state` (an `ibv_qp_state`).
    fn qp_attr(&self, state: u32) -> Result<sys::QpAttr> {
        let mut attr = sys::qp_attr();
        attr.qp_state = state;
        let mut mask = 0;
        // SAFETY: the id is live; both out-pointers are valid.
        let rc = unsafe { ffi::rdma_init_qp_attr(self.ptr.as_ptr(), &mut attr, &mut mask) };
        check(rc, "rdma_init_qp_attr")?;
        Ok(attr)
    }
}

/// An id with an event channel of its own: a connection, kept by the queue pair.
pub(crate) struct Conn {
    _id: Id,
    _channel: Channel,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rdmacm::Conn").finish_non_exhaustive()
    }
}

/// Checks that the id resolved to the QP's device and port.
fn check_device(qp: &Qp, id: &Id) -> Result<()> {
    let dev = qp.device();
    match id.device() {
        Some((name, port)) if name == dev.name && port == dev.port => Ok(()),
        Some((name, port)) => Err(Error::NoDevice(format!(
            "rdma_cm reaches the peer through {name} port {port}, but the queue pair is on \
             {} port {}: open the context on {name} or use an address of {}",
            dev.name, dev.port, dev.name
        ))),
        None => Err(Error::Protocol("rdma_cm bound the id to no device")),
    }
}

/// The READ/atomic depths this side offers: (initiator depth, responder resources).
fn depths(qp: &Qp, opts: &ConnectOptions) -> (u8, u8) {
    let caps = &qp.device().caps;
    (
        opts.max_rd_atomic.min(caps.max_qp_init_rd_atom),
        opts.max_dest_rd_atomic.min(caps.max_qp_rd_atom),
    )
}

/// Moves `qp` to `state` with the attributes rdma_cm gives for it (see the module docs
/// for what `opts` decides instead), through the QP's checked modify.
fn move_to(
    qp: &Qp,
    id: &Id,
    state: QpState,
    opts: &ConnectOptions,
    depths: (u8, u8),
) -> Result<()> {
    use sys::consts::qp_state as s;
    let hw_state = match state {
        QpState::Init => s::IBV_QPS_INIT,
        QpState::Rtr => s::IBV_QPS_RTR,
        _ => s::IBV_QPS_RTS,
    };
    let a = id.qp_attr(hw_state)?;
    let dev = qp.device();
    let cm_mtu = Mtu::from_ib_code(a.path_mtu as u8).unwrap_or(dev.caps.active_mtu);
    let params = ConnectParams {
        access: opts.access,
        mtu: opts.mtu.map_or(cm_mtu, |m| m.min(cm_mtu)),
        dest_qpn: a.dest_qp_num,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        max_rd_atomic: a.max_rd_atomic.min(depths.0),
        max_dest_rd_atomic: a.max_dest_rd_atomic.min(depths.1),
        timeout: opts.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        min_rnr_timer: opts.min_rnr_timer,
    };
    let [init, rtr, rts] = params.steps();
    let (mut attr, mask) = match state {
        QpState::Init => init,
        QpState::Rtr => rtr,
        _ => rts,
    };
    match state {
        QpState::Init => attr.pkey_index = a.pkey_index,
        QpState::Rtr => {
            if a.ah_attr.port_num != dev.port {
                return Err(Error::Protocol(
                    "rdma_cm's path leaves from another port than the queue pair's",
                ));
            }
            qp.set_cm_path(a.ah_attr);
        }
        _ => {}
    }
    qp.modify(&attr, mask)
}

/// Whether the QP's device runs iWARP.
fn iwarp(qp: &Qp) -> bool {
    qp.device().caps.transport == crate::Transport::Iwarp
}

/// iWARP, once the connection is established: the kernel has moved the adapter's QP to
/// RTS; rdmx's state follows, with the attributes this side chose (iWARP has no peer QP
/// number or PSNs to record).
fn iwarp_connected(qp: &Qp, opts: &ConnectOptions, depths: (u8, u8)) -> Result<()> {
    let dev = qp.device();
    let params = ConnectParams {
        access: opts.access,
        mtu: opts
            .mtu
            .map_or(dev.caps.active_mtu, |m| m.min(dev.caps.active_mtu)),
        dest_qpn: 0,
        rq_psn: 0,
        sq_psn: 0,
        max_rd_atomic: depths.0,
        max_dest_rd_atomic: depths.1,
        timeout: opts.timeout,
        retry_cnt: opts.retry_cnt,
        rnr_retry: opts.rnr_retry,
        min_rnr_timer: opts.min_rnr_timer,
    };
    let [_, rtr, rts] = params.steps();
    qp.connected_by_cm([rtr, rts])
}

/// The connection parameters for `rdma_connect`/`rdma_accept`.
fn conn_param(
    qp: &Qp,
    opts: &ConnectOptions,
    private: &[u8],
    depths: (u8, u8),
) -> ffi::rdma_conn_param {
    ffi::rdma_conn_param {
        private_data: if private.is_empty() {
            ptr::null()
        } else {
            private.as_ptr().cast()
        },
        private_data_len: private.len() as u8,
        responder_resources: depths.1,
        initiator_depth: depths.0,
        flow_control: 1,
        retry_count: opts.retry_cnt.min(7),
        rnr_retry_count: opts.rnr_retry.min(7),
        srq: u8::from(qp.has_srq()),
        qp_num: qp.qp_num(),
    }
}

/// The active side: resolves `addr`, connects `qp` to the listener there and returns the
/// peer's private data. `private` is at most [`super::cm::MAX_CONNECT_PRIVATE`]
/// bytes (checked by the caller). `ready` runs once the QP is in INIT, before the connect
/// request leaves (see [`super::cm::connect_then`]).
pub(crate) fn connect(
    qp: &Qp,
    addr: SocketAddr,
    opts: &ConnectOptions,
    private: &[u8],
    deadline: Instant,
    ready: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<u8>> {
    let channel = Channel::new()?;
    let id = Id::create(&channel)?;
    let mut dst = sockaddr(addr);
    // SAFETY: the id is live; `dst` is a valid sockaddr for the call; no source address.
    let rc = unsafe {
        ffi::rdma_resolve_addr(
            id.ptr.as_ptr(),
            ptr::null_mut(),
            ptr::addr_of_mut!(dst).cast(),
            ms_left(deadline),
        )
    };
    check(rc, "rdma_resolve_addr")?;
    let during = "rdma_cm: resolving the peer's address";
    channel
        .next(deadline, during)?
        .expect(ev::RDMA_CM_EVENT_ADDR_RESOLVED, during)?;
    check_device(qp, &id)?;
    // SAFETY: the id is live and its address resolved.
    let rc = unsafe { ffi::rdma_resolve_route(id.ptr.as_ptr(), ms_left(deadline)) };
    check(rc, "rdma_resolve_route")?;
    let during = "rdma_cm: resolving the route to the peer";
    channel
        .next(deadline, during)?
        .expect(ev::RDMA_CM_EVENT_ROUTE_RESOLVED, during)?;
    let depths = depths(qp, opts);
    move_to(qp, &id, QpState::Init, opts, depths)?;
    ready()?;
    let mut param = conn_param(qp, opts, private, depths);
    // SAFETY: the id is live with its route resolved; `param` and the private data it
    // points to live across the call (librdmacm copies them).
    let rc = unsafe { ffi::rdma_connect(id.ptr.as_ptr(), &mut param) };
    check(rc, "rdma_connect")?;
    let during = "rdma_cm: waiting for the peer to accept";
    if iwarp(qp) {
        // iWARP: the kernel moves the QP to RTS when MPA finishes and reports the
        // connection established; there is no RTU to send.
        let reply = channel
            .next(deadline, during)?
            .expect(ev::RDMA_CM_EVENT_ESTABLISHED, during)?;
        iwarp_connected(qp, opts, depths)?;
        qp.keep_cm(Conn {
            _id: id,
            _channel: channel,
        });
        return Ok(reply.private);
    }
    let reply = channel
        .next(deadline, during)?
        .expect(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, during)?;
    move_to(qp, &id, QpState::Rtr, opts, depths)?;
    move_to(qp, &id, QpState::Rts, opts, depths)?;
    // SAFETY: the id is live, after its CONNECT_RESPONSE, with the QP in RTS.
    let rc = unsafe { ffi::rdma_establish(id.ptr.as_ptr()) };
    check(rc, "rdma_establish")?;
    qp.keep_cm(Conn {
        _id: id,
        _channel: channel,
    });
    Ok(reply.private)
}

/// A listening id (the passive side).
pub(crate) struct Listener {
    id: Id,
    channel: Channel,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rdmacm::Listener")
            .field("addr", &self.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// `rdma_bind_addr` and `rdma_listen` on `addr` (port 0 picks one).
    pub(crate) fn bind(addr: SocketAddr) -> Result<Listener> {
        let channel = Channel::new()?;
        let id = Id::create(&channel)?;
        let mut sa = sockaddr(addr);
        // SAFETY: the id is live and `sa` a valid sockaddr for the call.
        let rc = unsafe { ffi::rdma_bind_addr(id.ptr.as_ptr(), ptr::addr_of_mut!(sa).cast()) };
        check(rc, "rdma_bind_addr")?;
        // SAFETY: the id is live and bound.
        let rc = unsafe { ffi::rdma_listen(id.ptr.as_ptr(), 16) };
        check(rc, "rdma_listen")?;
        Ok(Listener { id, channel })
    }

    /// The address it listens on.
    pub(crate) fn local_addr(&self) -> Result<SocketAddr> {
        self.id.local_addr()
    }

    /// Waits until `deadline` for a connect request, connects `qp` to it and returns the
    /// peer's private data. `private` is at most
    /// [`super::cm::MAX_ACCEPT_PRIVATE`] bytes (checked by the caller). `ready` runs once
    /// the QP is in INIT, before the accept leaves (see
    /// [`super::cm::Listener::accept_then`]).
    pub(crate) fn accept(
        &self,
        qp: &Qp,
        opts: &ConnectOptions,
        private: &[u8],
        deadline: Instant,
        ready: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<u8>> {
        // The connection gets a channel of its own, so that the listener's keeps only
        // connect requests. Declared before the id, so that it is dropped after it.
        let channel = Channel::new()?;
        let during = "rdma_cm: waiting for a connect request";
        let req = self
            .channel
            .next(deadline, during)?
            .expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST, during)?;
        let id = Id::from_request(&req)?;
        match Self::accept_request(&id, &channel, &req, qp, opts, private, deadline, ready) {
            Ok(()) => {
                qp.keep_cm(Conn {
                    _id: id,
                    _channel: channel,
                });
                Ok(req.private)
            }
            Err(e) => {
                // SAFETY: the id is live; a reject without private data. Its outcome does
                // not change the error reported.
                let _ = unsafe { ffi::rdma_reject(id.ptr.as_ptr(), ptr::null(), 0) };
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // the steps of one accept, kept together
    fn accept_request(
        id: &Id,
        channel: &Channel,
        req: &Event,
        qp: &Qp,
        opts: &ConnectOptions,
        private: &[u8],
        deadline: Instant,
        ready: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        // SAFETY: both are live; the request's event was acknowledged already, so no event
        // of the id is outstanding on the old channel.
        let rc = unsafe { ffi::rdma_migrate_id(id.ptr.as_ptr(), channel.ptr.as_ptr()) };
        check(rc, "rdma_migrate_id")?;
        check_device(qp, id)?;
        let (init, resp) = depths(qp, opts);
        // What the peer offers bounds what this side may use.
        let depths = (
            init.min(req.responder_resources),
            resp.min(req.initiator_depth),
        );
        move_to(qp, id, QpState::Init, opts, depths)?;
        ready()?;
        let iwarp = iwarp(qp);
        if !iwarp {
            move_to(qp, id, QpState::Rtr, opts, depths)?;
        }
        let mut param = conn_param(qp, opts, private, depths);
        // SAFETY: the id is live in the connect-request state; `param` and its private
        // data live across the call (librdmacm copies them).
        let rc = unsafe { ffi::rdma_accept(id.ptr.as_ptr(), &mut param) };
        check(rc, "rdma_accept")?;
        // The accept set this side's starting PSN; only now does RTS have it. (iWARP:
        // the kernel moves the QP to RTS once MPA finishes.)
        if !iwarp {
            move_to(qp, id, QpState::Rts, opts, depths)?;
        }
        let during = "rdma_cm: waiting for the peer to establish the connection";
        channel
            .next(deadline, during)?
            .expect(ev::RDMA_CM_EVENT_ESTABLISHED, during)?;
        if iwarp {
            iwarp_connected(qp, opts, depths)?;
        }
        Ok(())
    }
}
