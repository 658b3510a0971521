//! `rdmx devices`: every provider and device available here, with capabilities.

use serde_json::json;

/// Options of `rdmx devices`.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let devices = rdmx::devices();
    if args.json {
        let list: Vec<_> = devices
            .iter()
            .map(|d| {
                let c = &d.capabilities;
                json!({
                    "provider": d.provider,
                    "device": d.name,
                    "max_qp": c.max_qp,
                    "max_qp_wr": c.max_qp_wr,
                    "max_sge": c.max_sge,
                    "max_cqe": c.max_cqe,
                    "max_mr": c.max_mr,
                    "max_mr_size": c.max_mr_size,
                    "max_qp_rd_atom": c.max_qp_rd_atom,
                    "max_qp_init_rd_atom": c.max_qp_init_rd_atom,
                    "max_mtu": c.max_mtu.bytes(),
                    "max_inline_data": c.max_inline_data,
                    "atomics": c.atomics.name(),
                    "transport": c.transport.name(),
                    "imm_data": c.imm_data,
                    "max_read_sge": c.max_read_sge,
                    "rnr_retry": c.rnr_retry,
                    "remote_error_completions": c.remote_error_completions,
                    "qp_types": c.qp_types().map(|t| t.name()).collect::<Vec<_>>(),
                    "multicast": c.multicast,
                    "counts_dropped": c.counts_dropped,
                    "gid_index": d.gid.map(|(i, _)| i),
                    "gid": d.gid.map(|(_, g)| g.to_string()),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "devices": list }))?
        );
        return Ok(());
    }
    for d in &devices {
        let c = &d.capabilities;
        println!("device: {} (provider {})", d.name, d.provider);
        println!("\tmax_qp:\t\t\t{}", c.max_qp);
        println!("\tmax_qp_wr:\t\t{}", c.max_qp_wr);
        println!("\tmax_sge:\t\t{}", c.max_sge);
        println!("\tmax_cqe:\t\t{}", c.max_cqe);
        println!("\tmax_mr:\t\t\t{}", c.max_mr);
        println!("\tmax_mr_size:\t\t{:#x}", c.max_mr_size);
        println!("\tmax_qp_rd_atom:\t\t{}", c.max_qp_rd_atom);
        println!("\tmax_qp_init_rd_atom:\t{}", c.max_qp_init_rd_atom);
        println!("\tmax_mtu:\t\t{}", c.max_mtu.bytes());
        println!("\tmax_inline_data:\t{}", c.max_inline_data);
        println!("\tatomics:\t\t{}", c.atomics.name());
        println!("\ttransport:\t\t{}", c.transport.name());
        println!("\timm_data:\t\t{}", c.imm_data);
        println!("\tmax_read_sge:\t\t{}", c.max_read_sge);
        println!("\trnr_retry:\t\t{}", c.rnr_retry);
        println!("\tremote_error_completions: {}", c.remote_error_completions);
        let types: Vec<_> = c.qp_types().map(|t| t.name()).collect();
        println!("\tqp_types:\t\t{}", types.join(" "));
        println!("\tmulticast:\t\t{}", if c.multicast { "yes" } else { "no" });
        println!("\tcounts_dropped:\t\t{}", c.counts_dropped);
        if let Some((i, gid)) = d.gid {
            println!("\tactive_mtu:\t\t{}", c.active_mtu.bytes());
            println!("\tgid_index:\t\t{i} ({gid})");
        }
    }
    Ok(())
}
