#!/usr/bin/env bash
# The tcp provider against its anchors, in one run on one machine: iperf3 single-stream
# loopback bandwidth, and UCX's tcp transport (ucx_perftest ucp_put_bw / ucp_put_lat).
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

j() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
iperf() {
    iperf3 -s -1 -p 5301 >/dev/null 2>&1 & sleep 0.3
    iperf3 -c 127.0.0.1 -p 5301 -t 3 -l 64K -J | j "d['end']['sum_received']['bits_per_second']/8/1048576"
    wait
}
ucx() { # test size iters -> MiB/s (bw) or usec (lat)
    UCX_TLS=tcp ucx_perftest -t "$1" -s "$2" -n "$3" -p 5302 >/dev/null 2>&1 & sleep 0.5
    UCX_TLS=tcp ucx_perftest 127.0.0.1 -t "$1" -s "$2" -n "$3" -p 5302 -f 2>/dev/null |
        python3 -c "
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
for r in $(seq "$ROUNDS"); do
    iperf >>"$out/iperf3"
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
for f in iperf3 ucx_put_bw ucx_put_lat write_bw read_bw send_bw write_lat; do
    printf '%-12s %10.2f\n' "$f" "$(med $f)"
done
python3 - "$(med iperf3)" "$(med ucx_put_bw)" "$(med ucx_put_lat)" "$(med write_bw)" "$(med read_bw)" "$(med send_bw)" "$(med write_lat)" <<'PY'
import sys
ip, ub, ul, wb, rb, sb, wl = map(float, sys.argv[1:])
print(f"ratio write_bw/iperf3={wb/ip:.2f} read_bw/iperf3={rb/ip:.2f} send_bw/iperf3={sb/ip:.2f} "
      f"write_bw/ucx_put_bw={wb/ub:.2f} write_lat/ucx_put_lat={wl/ul:.2f}")
PY
