#!/usr/bin/env bash
# The tcp provider against its anchors, in one run on one machine: iperf3 single-stream
# loopback bandwidth (64 KiB and 1 MiB writes), and UCX's tcp transport (ucx_perftest
# ucp_put_bw / ucp_put_lat). rdmx runs in one process, and write_bw also in two
# (--server and client) at 64 KiB and 1 MiB, against iperf3 at the same write size.
# Each figure is the median of ROUNDS interleaved runs; the last lines give the ratios.
#
# Usage: scripts/tcp-bench.sh            (ROUNDS=5 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
need=()
command -v iperf3 >/dev/null || need+=(iperf3)
command -v ucx_perftest >/dev/null || need+=(ucx-utils)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
cargo build --release --locked -p rdmx-cli >/dev/null 2>&1
RDMX=${CARGO_TARGET_DIR:-target}/release/rdmx
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT

# Reads all of its input before Python starts: an interpreter starting beside a short run
# on a 2-vCPU machine takes a core from it.
after() { local in; in=$(cat); printf '%s\n' "$in" | "$@"; }
j() { after python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
iperf() { # write size -> MiB/s
    iperf3 -s -1 -p 5301 >/dev/null 2>&1 & sleep 0.3
    iperf3 -c 127.0.0.1 -p 5301 -t 3 -l "$1" -J | j "d['end']['sum_received']['bits_per_second']/8/1048576"
    wait
}
ucx() { # test size iters -> MiB/s (bw) or usec (lat)
    UCX_TLS=tcp ucx_perftest -t "$1" -s "$2" -n "$3" -p 5302 >/dev/null 2>&1 & sleep 0.5
    UCX_TLS=tcp ucx_perftest 127.0.0.1 -t "$1" -s "$2" -n "$3" -p 5302 -f 2>/dev/null |
        after python3 -c "
import sys
rows = [l.split() for l in sys.stdin if l.split() and l.split()[0].isdigit()]
f = rows[-1]  # iterations, median latency, avg, overall, bw avg, bw overall (MB/s), ...
print(f[1] if '$1'.endswith('lat') else f[5])"
    wait
}
rdmx() { # test size -> MiB/s or t_typical usec
    "$RDMX" bench "$1" --provider tcp -s "$2" --json ${3:+-n "$3"} |
        j "d['results'][0].get('bw_avg_mib_s') or d['results'][0]['t_typical_us']"
}
rdmx2p() { # size -> MiB/s, write_bw with server and client in two processes
    "$RDMX" bench write_bw --provider tcp -s "$1" -D 3 --server -p 5303 >/dev/null 2>&1 & sleep 0.3
    "$RDMX" bench write_bw --provider tcp -s "$1" -D 3 -p 5303 --json 127.0.0.1 |
        j "d['results'][0]['bw_avg_mib_s']"
    wait
}
for r in $(seq "$ROUNDS"); do
    iperf 64K >>"$out/iperf3"
    rdmx2p 65536 >>"$out/write_bw_2p"
    iperf 1M >>"$out/iperf3_1m"
    rdmx2p 1048576 >>"$out/write_bw_2p_1m"
    ucx ucp_put_bw 65536 20000 >>"$out/ucx_put_bw"
    ucx ucp_put_lat 8 20000 >>"$out/ucx_put_lat"
    rdmx write_bw 65536 20000 >>"$out/write_bw"
    rdmx read_bw 65536 20000 >>"$out/read_bw"
    rdmx send_bw 65536 20000 >>"$out/send_bw"
    rdmx write_lat 8 10000 >>"$out/write_lat"
    echo "round $r/$ROUNDS done" >&2
done
med() { sort -g "$out/$1" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
printf '%-12s %10s   (median of %s; MiB/s, latency in usec)\n' figure value "$ROUNDS"
for f in iperf3 ucx_put_bw ucx_put_lat write_bw read_bw send_bw write_lat iperf3_1m write_bw_2p \
    write_bw_2p_1m; do
    printf '%-14s %10.2f\n' "$f" "$(med $f)"
done
python3 - "$(med iperf3)" "$(med ucx_put_bw)" "$(med ucx_put_lat)" "$(med write_bw)" "$(med read_bw)" \
    "$(med send_bw)" "$(med write_lat)" "$(med iperf3_1m)" "$(med write_bw_2p)" "$(med write_bw_2p_1m)" <<'PY'
import sys
ip, ub, ul, wb, rb, sb, wl, ip1m, w2, w2m = map(float, sys.argv[1:])
print(f"ratio write_bw/iperf3={wb/ip:.2f} read_bw/iperf3={rb/ip:.2f} send_bw/iperf3={sb/ip:.2f} "
      f"write_bw/ucx_put_bw={wb/ub:.2f} write_lat/ucx_put_lat={wl/ul:.2f} "
      f"write_bw_2p/iperf3={w2/ip:.2f} write_bw_2p_1m/iperf3_1m={w2m/ip1m:.2f}")
PY
