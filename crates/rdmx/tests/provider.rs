//! Provider selection and device listing.

use rdmx::{devices, Context, Error};

#[test]
fn unknown_provider_is_an_error_that_lists_the_available_ones() {
    let err = Context::open_provider("infiniband-magic").unwrap_err();
    assert!(matches!(err, Error::UnknownProvider { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("infiniband-magic") && msg.contains("loopback"),
        "{msg}"
    );
}

#[test]
fn default_context_is_loopback_and_listed() {
    let ctx = Context::open_default().unwrap();
    assert_eq!(ctx.provider(), "loopback");
    let devs = devices();
    let lo = devs
        .iter()
        .find(|d| d.provider == "loopback")
        .expect("loopback device listed");
    assert_eq!(&lo.capabilities, ctx.capabilities());
    assert_eq!(lo.capabilities.atomics, rdmx::AtomicCap::Global);
}

#[test]
fn queue_pair_caps_above_the_device_are_refused() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd();
    let cq = ctx.create_cq(8).unwrap();
    let too_deep = rdmx::QpCaps::default().max_send_wr(ctx.capabilities().max_qp_wr as usize + 1);
    assert!(matches!(
        pd.create_qp(&cq, &cq, too_deep),
        Err(Error::InvalidArgument(_))
    ));
    assert!(ctx
        .create_cq(ctx.capabilities().max_cqe as usize + 1)
        .is_err());
    assert!(ctx.create_cq(0).is_err());
}
