//! The C API of libibverbs and librdmacm, with both libraries loaded at run time, so that
//! neither building rdmx nor running it on a machine without rdma-core needs them.
//!
//! [`bindings`] holds the types, constants and function signatures of rdma-core's
//! `infiniband/verbs.h` and `rdma/rdma_cma.h`. `scripts/gen-verbs-bindings.sh` generates it
//! with bindgen and it is checked in: the build runs no bindgen (and so needs no libclang),
//! and CI regenerates it and fails when it differs. Its `Lib` is a table of the functions
//! rdmx calls, resolved by name from a library opened with `libloading`.
//!
//! This module opens `libibverbs.so.1` and `librdmacm.so.1` once, on first use, keeps them
//! loaded for the life of the process, and offers each function as an `unsafe fn` of the
//! same name and signature as in C. A function whose library or symbol is missing fails the
//! way the C libraries report a missing feature: `errno` is set to `EOPNOTSUPP` and it
//! returns what its failures return (NULL, -1 or `EOPNOTSUPP`; `ibv_get_device_name` an
//! empty name). Without rdma-core, `ibv_get_device_list` thus returns NULL, which the
//! provider reports as no devices.
//!
//! Some of the C API is `static inline` in the headers and has no symbol to load. Its
//! equivalents here do what the inline functions do: the data-path verbs (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) call the
//! provider through the context's ops table, `ibv_query_port` calls the exported symbol
//! that older binaries call, and `rdma_get_local_addr` reads the id's route.
//!
//! The bindings were generated on x86_64 Linux. They state no sizes or offsets of their own
//! (pthread and socket types are libc's; the one size written out is the 128 bytes of a
//! `sockaddr_storage`, the same on every Linux target), so Rust's C layout rules reproduce
//! the C compiler's on other 64-bit Linux targets too.

use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;
use std::sync::OnceLock;

use libc::{sockaddr, EOPNOTSUPP};

#[allow(
    dead_code,
    missing_docs,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    unreachable_pub,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
#[rustfmt::skip]
mod bindings;

pub(crate) use bindings::*;

/// The `imm_data`/`invalidate_rkey` union of `ibv_send_wr`.
pub(crate) use bindings::ibv_send_wr__bindgen_ty_1 as ibv_send_wr_imm;
/// The `wr` union of `ibv_send_wr`, and its `rdma` and `atomic` members.
pub(crate) use bindings::{
    ibv_send_wr__bindgen_ty_2 as ibv_send_wr_wr,
    ibv_send_wr__bindgen_ty_2__bindgen_ty_1 as ibv_send_wr_rdma,
    ibv_send_wr__bindgen_ty_2__bindgen_ty_2 as ibv_send_wr_atomic,
    ibv_send_wr__bindgen_ty_2__bindgen_ty_3 as ibv_send_wr_ud,
};

/// `struct ibv_wc` with its anonymous `imm_data`/`invalidated_rkey` union named
/// `imm_data_invalidated_rkey_union`. The layout is the generated one, checked field by
/// field at compile time.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_wc {
    pub(crate) wr_id: u64,
    pub(crate) status: ibv_wc_status::Type,
    pub(crate) opcode: ibv_wc_opcode::Type,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm_data_invalidated_rkey_union: bindings::ibv_wc__bindgen_ty_1,
    pub(crate) qp_num: u32,
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: c_uint,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    type C = bindings::ibv_wc;
    assert!(size_of::<ibv_wc>() == size_of::<C>());
    assert!(align_of::<ibv_wc>() == align_of::<C>());
    macro_rules! same_offset {
        ($($ours:ident = $theirs:ident),* $(,)?) => {
            $(assert!(offset_of!(ibv_wc, $ours) == offset_of!(C, $theirs));)*
        };
    }
    same_offset!(
        wr_id = wr_id,
        status = status,
        opcode = opcode,
        vendor_err = vendor_err,
        byte_len = byte_len,
        imm_data_invalidated_rkey_union = __bindgen_anon_1,
        qp_num = qp_num,
        src_qp = src_qp,
        wc_flags = wc_flags,
        pkey_index = pkey_index,
        slid = slid,
        sl = sl,
        dlid_path_bits = dlid_path_bits,
    );
};

/// libibverbs, if it could be loaded.
fn ibverbs() -> Option<&'static Lib> {
    static LIB: OnceLock<Option<Lib>> = OnceLock::new();
    LIB.get_or_init(|| load("libibverbs.so.1")).as_ref()
}

/// librdmacm, if it could be loaded.
fn rdmacm() -> Option<&'static Lib> {
    static LIB: OnceLock<Option<Lib>> = OnceLock::new();
    LIB.get_or_init(|| load("librdmacm.so.1")).as_ref()
}

/// Opens `name` and resolves the table's functions in it. Functions of the other library
/// stay unresolved (unless `name` pulls that library in), and are never called through
/// this table.
fn load(name: &str) -> Option<Lib> {
    // SAFETY: opening the library runs its initialisers, which for libibverbs and librdmacm
    // only set up their own state; every symbol the table resolves is declared by the
    // library's headers with the signature the table gives it.
    match unsafe { Lib::new(name) } {
        Ok(lib) => Some(lib),
        Err(err) => {
            tracing::debug!(%err, "rdma-core library {name} not loaded");
            None
        }
    }
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life.
    unsafe { *libc::__errno_location() = e };
}

/// Defines each function as a call through `$lib`'s table, or sets `errno` to
/// `EOPNOTSUPP` and returns `$missing` when the library or the symbol is missing. The call
/// only compiles if the arguments and result are of the generated signature's types.
/// `$names` lists the functions with whether a table resolved each, for the tests.
macro_rules! loaded {
    ($lib:ident, $names:ident: $(
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $missing:expr;
    )*) => {
        #[cfg(test)]
        const $names: &[(&str, fn(&Lib) -> bool)] =
            &[$((stringify!($name), |lib| lib.$name.is_ok())),*];
        $(
        #[doc = concat!("`", stringify!($name), "` from ", stringify!($lib), ".")]
        ///
        /// # Safety
        ///
        /// As for the C function.
        pub(crate) unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
            match $lib().and_then(|lib| lib.$name.as_ref().ok().copied()) {
                // SAFETY: the function has this signature (generated from the headers), and
                // the caller upholds its contract.
                Some(f) => unsafe { f($($arg),*) },
                None => {
                    set_errno(EOPNOTSUPP);
                    $missing
                }
            }
        }
    )*};
}

loaded! { ibverbs, IBVERBS_FUNCTIONS:
    fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device = ptr::null_mut();
    fn ibv_free_device_list(list: *mut *mut ibv_device) = ();
    fn ibv_get_device_name(device: *mut ibv_device) -> *const std::os::raw::c_char =
        c"".as_ptr();
    fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context = ptr::null_mut();
    fn ibv_close_device(context: *mut ibv_context) -> c_int = EOPNOTSUPP;
    fn ibv_query_device(context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int =
        EOPNOTSUPP;
    fn ibv_query_gid(context: *mut ibv_context, port_num: u8, index: c_int, gid: *mut ibv_gid)
        -> c_int = EOPNOTSUPP;
    fn _ibv_query_gid_ex(
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> c_int = EOPNOTSUPP;
    fn ibv_get_async_event(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int =
        -1;
    fn ibv_ack_async_event(event: *mut ibv_async_event) = ();
    fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd = ptr::null_mut();
    fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int = EOPNOTSUPP;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int)
        -> *mut ibv_mr = ptr::null_mut();
    fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int = EOPNOTSUPP;
    fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel =
        ptr::null_mut();
    fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int = EOPNOTSUPP;
    fn ibv_create_cq(
        context: *mut ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: c_int,
    ) -> *mut ibv_cq = ptr::null_mut();
    fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int = EOPNOTSUPP;
    fn ibv_get_cq_event(
        channel: *mut ibv_comp_channel,
        cq: *mut *mut ibv_cq,
        cq_context: *mut *mut c_void,
    ) -> c_int = -1;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) = ();
    fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp =
        ptr::null_mut();
    fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int =
        EOPNOTSUPP;
    fn ibv_query_qp(
        qp: *mut ibv_qp,
        attr: *mut ibv_qp_attr,
        attr_mask: c_int,
        init_attr: *mut ibv_qp_init_attr,
    ) -> c_int = EOPNOTSUPP;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int = EOPNOTSUPP;
    fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq =
        ptr::null_mut();
    fn ibv_modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, attr_mask: c_int) -> c_int =
        EOPNOTSUPP;
    fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int = EOPNOTSUPP;
    fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah = ptr::null_mut();
    fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int = EOPNOTSUPP;
    fn ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int = EOPNOTSUPP;
    fn ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int = EOPNOTSUPP;
}

loaded! { rdmacm, RDMACM_FUNCTIONS:
    fn rdma_create_event_channel() -> *mut rdma_event_channel = ptr::null_mut();
    fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) = ();
    fn rdma_get_cm_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event)
        -> c_int = -1;
    fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int = -1;
    fn rdma_create_id(
        channel: *mut rdma_event_channel,
        id: *mut *mut rdma_cm_id,
        context: *mut c_void,
        ps: rdma_port_space::Type,
    ) -> c_int = -1;
    fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int = -1;
    fn rdma_resolve_addr(
        id: *mut rdma_cm_id,
        src_addr: *mut sockaddr,
        dst_addr: *mut sockaddr,
        timeout_ms: c_int,
    ) -> c_int = -1;
    fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int = -1;
    fn rdma_connect(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int = -1;
    fn rdma_establish(id: *mut rdma_cm_id) -> c_int = -1;
    fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int = -1;
    fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int = -1;
    fn rdma_reject(id: *mut rdma_cm_id, private_data: *const c_void, private_data_len: u8)
        -> c_int = -1;
    fn rdma_migrate_id(id: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int = -1;
    fn rdma_accept(id: *mut rdma_cm_id, conn_param: *mut rdma_conn_param) -> c_int = -1;
    fn rdma_init_qp_attr(id: *mut rdma_cm_id, qp_attr: *mut ibv_qp_attr, mask: *mut c_int)
        -> c_int = -1;
}

/// `ibv_query_port`. In C a macro calls the provider with the full `ibv_port_attr` when it
/// can; this calls the exported `ibv_query_port` that binaries built against older headers
/// call, which fills the attributes up to `link_layer` and `flags` (all rdmx reads): the
/// fields after them (`port_cap_flags2`, `active_speed_ex`) stay zero.
///
/// # Safety
///
/// `context` is an open device and `port_attr` points to writable attributes.
pub(crate) unsafe fn ibv_query_port(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller passes writable attributes; all-zero is a valid value of them.
    unsafe { port_attr.write_bytes(0, 1) };
    match ibverbs().and_then(|lib| lib.ibv_query_port.as_ref().ok().copied()) {
        // SAFETY: the exported function writes a prefix of `ibv_port_attr` (its
        // `_compat_ibv_port_attr` is the older, shorter layout); the caller upholds the rest.
        Some(f) => unsafe { f(context, port_num, port_attr.cast()) },
        None => {
            set_errno(EOPNOTSUPP);
            EOPNOTSUPP
        }
    }
}

/// `ibv_poll_cq`: the provider's `poll_cq`.
///
/// # Safety
///
/// `cq` is a live CQ and `wc` has room for `num_entries` completions.
#[inline]
pub(crate) unsafe fn ibv_poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live CQ points to its live context.
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: the provider's function for this CQ; `ibv_wc` has the layout of the
        // header's (checked above); the caller upholds the rest.
        Some(poll) => unsafe { poll(cq, num_entries, wc.cast()) },
        None => -EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: the provider's `req_notify_cq`.
///
/// # Safety
///
/// `cq` is a live CQ.
#[inline]
pub(crate) unsafe fn ibv_req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: a live CQ points to its live context.
    match unsafe { (*(*cq).context).ops.req_notify_cq } {
        // SAFETY: the provider's function for this CQ, called as verbs.h calls it.
        Some(notify) => unsafe { notify(cq, solicited_only) },
        None => EOPNOTSUPP,
    }
}

/// `ibv_post_send`: the provider's `post_send`.
///
/// # Safety
///
/// `qp` is a live QP and `wr` a well-formed list of requests whose memory stays valid until
/// they complete.
#[inline]
pub(crate) unsafe fn ibv_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a live QP points to its live context.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the provider's function for this QP; the caller upholds the rest.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => {
            // SAFETY: `bad_wr` is a valid out-pointer, as for the C function.
            unsafe { *bad_wr = wr };
            EOPNOTSUPP
        }
    }
}

/// `ibv_post_recv`: the provider's `post_recv`.
///
/// # Safety
///
/// As [`ibv_post_send`].
#[inline]
pub(crate) unsafe fn ibv_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a live QP points to its live context.
    match unsafe { (*(*qp).context).ops.post_recv } {
        // SAFETY: the provider's function for this QP; the caller upholds the rest.
        Some(post) => unsafe { post(qp, wr, bad_wr) },
        None => {
            // SAFETY: `bad_wr` is a valid out-pointer, as for the C function.
            unsafe { *bad_wr = wr };
            EOPNOTSUPP
        }
    }
}

/// `ibv_post_srq_recv`: the provider's `post_srq_recv`.
///
/// # Safety
///
/// As [`ibv_post_send`], for a live SRQ.
#[inline]
pub(crate) unsafe fn ibv_post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: a live SRQ points to its live context.
    match unsafe { (*(*srq).context).ops.post_srq_recv } {
        // SAFETY: the provider's function for this SRQ; the caller upholds the rest.
        Some(post) => unsafe { post(srq, wr, bad_wr) },
        None => {
            // SAFETY: `bad_wr` is a valid out-pointer, as for the C function.
            unsafe { *bad_wr = wr };
            EOPNOTSUPP
        }
    }
}

/// `rdma_get_local_addr`: the source address of the id's route.
///
/// # Safety
///
/// `id` is a live id.
pub(crate) unsafe fn rdma_get_local_addr(id: *const rdma_cm_id) -> *mut sockaddr {
    // SAFETY: the caller passes a live id; this takes the address of a field, reading nothing.
    unsafe { ptr::addr_of!((*id).route.addr.__bindgen_anon_1.src_addr) }
        .cast::<sockaddr>()
        .cast_mut()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> Option<i32> {
        std::io::Error::last_os_error().raw_os_error()
    }

    #[test]
    fn a_missing_library_is_not_loaded() {
        assert!(load("librdmx-no-such-library.so.1").is_none());
    }

    /// Where rdma-core is installed, every function rdmx calls resolves in it.
    #[test]
    fn every_function_resolves_where_rdma_core_is_installed() {
        for (lib, names) in [(ibverbs(), IBVERBS_FUNCTIONS), (rdmacm(), RDMACM_FUNCTIONS)] {
            let Some(lib) = lib else { continue };
            for (name, resolved) in names {
                assert!(resolved(lib), "{name} is missing");
            }
        }
    }

    #[test]
    fn the_device_list_is_null_only_without_libibverbs() {
        let mut n = -1;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if ibverbs().is_none() {
            assert!(list.is_null());
            assert_eq!(errno(), Some(EOPNOTSUPP));
        } else if !list.is_null() {
            assert!(n >= 0);
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { ibv_free_device_list(list) };
        }
    }

    #[test]
    fn without_librdmacm_its_calls_fail_with_eopnotsupp() {
        if rdmacm().is_some() {
            return;
        }
        // SAFETY: no arguments.
        assert!(unsafe { rdma_create_event_channel() }.is_null());
        assert_eq!(errno(), Some(EOPNOTSUPP));
    }
}
