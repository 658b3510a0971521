#!/usr/bin/env bash
# The shm provider against its anchors, in one run on one machine: UCX's shared-memory
# transports (`UCX_TLS=sm ucx_perftest`, two processes) and memcpy of 64 KiB between
# equally aligned buffers (`rdmx bench reg`). rdmx runs in two processes (--server and a
# client) and in one. Each figure is the median of ROUNDS interleaved runs; the last lines
# give the ratios, each the median over the rounds of that round's ratio, in which the
# anchor ran right before or right after the rdmx figures compared with it, by turns (a
# machine whose speed drifts moves both, and neither always runs first). rdmx runs on
# its default data paths (between processes the ring, in one process direct, as the
# runs report them); the `_cma` figures ask for the cma path
# (RDMX_SHM_DATA_PATH=cma: payloads of 16 KiB or more pulled with process_vm_readv), and
# `one_write_64k_ring` for the ring in one process; the `_mapped` figures ask for the
# mapped path (RDMX_SHM_DATA_PATH=mapped: the bench's regions are memfd-backed, the
# initiator maps the target's and executes WRITEs and READs with one memcpy), against
# UCX's put and get at the same sizes, and its 8-byte rate and latencies against UCX's.
# `copy_mis/copy` is the provider's copy of 64 KiB with source and destination 16 bytes
# apart against aligned (`rdmx bench reg`), `memcpy_mis/memcpy` the same for glibc's
# memcpy. `line_one_way` (`rdmx bench reg`) is the time a cache line takes from one core
# to the other on this machine in that round, in usec: the floor of any half round trip
# between two processes; the last line gives each latency in units of it. Bandwidth runs
# warm up first on both sides: ucx_perftest by its default (a tenth of the iterations, at
# most 10000, unmeasured), rdmx with --perform_warm_up (one window of 128 requests).
# `ring_anchor` (scripts/shm-ring-anchor.c) is the bare two-copy ring under the ring data
# path: two processes, a 4 MiB shared ring, the producer memcpys each message in and the
# consumer memcpys it out, nothing else. Every ring line crosses from one core's cache to
# the other's, which bounds the ring path (and is why UCX, whose put writes into memory
# it maps, is compared with the mapped path); `ring/anchor` is the ring path against it.
#
# Each run's output is read after it ends, never through a pipe into Python while it runs:
# an interpreter starting beside a run of a tenth of a second, on a 2-vCPU machine, halved
# the 8-byte rate of the ring path (5.5 M msg/s against 10).
#
# Usage: scripts/shm-bench.sh            (ROUNDS=6 by default: as many rounds with the
# anchors first as with them last)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-6}
if ! command -v ucx_perftest >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get install -y -qq ucx-utils >/dev/null
fi
cargo build --release --locked -p rdmx-cli >/dev/null 2>&1
RDMX=${CARGO_TARGET_DIR:-target}/release/rdmx
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT
cc -O2 -o "$out/ring-anchor" scripts/shm-ring-anchor.c

j() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
ucx() { # test size iters -> MiB/s (bw), M msg/s (bw of 8 B) or usec (lat)
    UCX_TLS=sm ucx_perftest -t "$1" -s "$2" -n "$3" -p 5312 >/dev/null 2>&1 & sleep 0.5
    UCX_TLS=sm ucx_perftest 127.0.0.1 -t "$1" -s "$2" -n "$3" -p 5312 -f 2>/dev/null \
        >"$out/ucx.txt"
    wait
    python3 -c "
import sys
rows = [l.split() for l in sys.stdin if l.split() and l.split()[0].isdigit()]
f = rows[-1]  # iterations, median latency, avg, overall, bw avg, bw overall (MB/s), msgrate avg, overall
print(f[1] if '$1'.endswith('lat') else (float(f[7]) / 1e6 if '$2' == '8' else f[5]))" \
        <"$out/ucx.txt"
}
pick="d['results'][0].get('bw_avg_mib_s') or d['results'][0]['t_typical_us']"
rate="d['results'][0]['msg_rate_mpps']"
warm() { # the warm-up option for a bandwidth test (latency tests always warm up)
    case $1 in *_bw) echo --perform_warm_up ;; esac
}
one() { # test size iters [extra...] -> MiB/s or t_typical usec, one process
    local t=$1 s=$2 n=$3; shift 3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" $(warm "$t") --json "$@" >"$out/one.json"
    j "${J:-$pick}" <"$out/one.json"
}
two() { # the same across two processes
    local t=$1 s=$2 n=$3; shift 3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" --server --port 5313 "$@" >/dev/null 2>&1 &
    sleep 0.3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" --port 5313 $(warm "$t") --json "$@" \
        127.0.0.1 >"$out/last.json"
    wait
    j "${J:-$pick}" <"$out/last.json"
}
memcpy() { # 64 KiB copies (memcpy aligned, memcpy misaligned, rdmx copy aligned and
    # misaligned), MiB/s each, into four files; and the cache line's trip between cores
    "$RDMX" bench reg --runs 3 --json >"$out/reg.json"
    for k in memcpy_64k memcpy_64k_misaligned copy_64k copy_64k_misaligned; do
        j "65536 / d['${k}_ns'] * 1e9 / 1048576" <"$out/reg.json" >>"$out/$k"
    done
    # The latency anchor: a cache line from one core to the other, in usec.
    j "d['line_one_way_ns'] / 1000" <"$out/reg.json" >>"$out/line_one_way"
}
# Each anchor and the rdmx figures compared with it run one after the other, so that a
# ratio compares runs seconds apart, not a round apart; the anchor runs first in odd
# rounds and last in even ones, so that neither side is always the one that runs first.
put_64k() {
    ucx ucp_put_bw 65536 100000 >>"$out/ucx_put_64k"
    "$out/ring-anchor" 65536 100000 >>"$out/ring_anchor_64k"
}
write_64k() {
    RDMX_SHM_DATA_PATH=mapped two write_bw 65536 100000 >>"$out/write_64k_mapped"
    j "d['data_path']" <"$out/last.json" >>"$out/path_mapped"
    two write_bw 65536 100000 >>"$out/write_64k"
    j "d['data_path']" <"$out/last.json" >>"$out/path"
    RDMX_SHM_DATA_PATH=cma two write_bw 65536 100000 >>"$out/write_64k_cma"
    j "d['data_path']" <"$out/last.json" >>"$out/path_cma"
}
put_1m() {
    ucx ucp_put_bw 1048576 10000 >>"$out/ucx_put_1m"
    "$out/ring-anchor" 1048576 10000 >>"$out/ring_anchor_1m"
}
write_1m() {
    RDMX_SHM_DATA_PATH=mapped two write_bw 1048576 10000 >>"$out/write_1m_mapped"
    two write_bw 1048576 10000 >>"$out/write_1m"
    RDMX_SHM_DATA_PATH=cma two write_bw 1048576 10000 >>"$out/write_1m_cma"
}
get_64k() { ucx ucp_get 65536 100000 >>"$out/ucx_get_64k"; }
read_64k() {
    RDMX_SHM_DATA_PATH=mapped two read_bw 65536 100000 >>"$out/read_64k_mapped"
    two read_bw 65536 100000 >>"$out/read_64k"
    RDMX_SHM_DATA_PATH=cma two read_bw 65536 100000 >>"$out/read_64k_cma"
}
get_1m() { ucx ucp_get 1048576 10000 >>"$out/ucx_get_1m"; }
read_1m() { RDMX_SHM_DATA_PATH=mapped two read_bw 1048576 10000 >>"$out/read_1m_mapped"; }
# The small-message and latency runs take as many iterations as UCX's: the ring's
# 8-byte rate over 200,000 messages (25 ms) came out below its steady rate by up to 4x.
put_8() { ucx ucp_put_bw 8 1000000 >>"$out/ucx_put_8"; }
write_8() {
    RDMX_SHM_DATA_PATH=mapped J=$rate two write_bw 8 1000000 -l 32 >>"$out/write_8_mapped"
    J=$rate two write_bw 8 1000000 -l 32 >>"$out/write_8"
}
put_lat() { ucx ucp_put_lat 8 100000 >>"$out/ucx_put_lat"; }
write_lat() {
    RDMX_SHM_DATA_PATH=mapped two write_lat 8 100000 >>"$out/write_lat_mapped"
    two write_lat 8 100000 >>"$out/write_lat"
}
am_lat() { ucx ucp_am_lat 8 100000 >>"$out/ucx_am_lat"; }
send_lat() {
    RDMX_SHM_DATA_PATH=mapped two send_lat 8 100000 >>"$out/send_lat_mapped"
    two send_lat 8 100000 >>"$out/send_lat"
}
one_process() {
    one write_bw 65536 100000 >>"$out/one_write_64k"
    J="d['data_path']" one write_bw 65536 2000 >>"$out/one_path"
    RDMX_SHM_DATA_PATH=cma one write_bw 65536 100000 >>"$out/one_write_64k_cma"
    RDMX_SHM_DATA_PATH=ring one write_bw 65536 100000 >>"$out/one_write_64k_ring"
}
pair() { # anchor figures: in round $r
    if ((r % 2)); then "$1"; "$2"; else "$2"; "$1"; fi
}
for r in $(seq "$ROUNDS"); do
    pair put_64k write_64k
    pair put_1m write_1m
    pair get_64k read_64k
    pair get_1m read_1m
    pair put_8 write_8
    pair put_lat write_lat
    pair am_lat send_lat
    pair memcpy one_process
    echo "round $r/$ROUNDS done" >&2
done
med() { sort -g "$out/$1" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
figs=(memcpy_64k ucx_put_64k ucx_put_1m ucx_get_64k ucx_put_8 ucx_put_lat ucx_am_lat
    write_64k write_1m read_64k write_8 write_lat send_lat one_write_64k
    write_64k_cma write_1m_cma read_64k_cma one_write_64k_cma one_write_64k_ring
    memcpy_64k_misaligned copy_64k copy_64k_misaligned
    ucx_get_1m write_64k_mapped write_1m_mapped read_64k_mapped read_1m_mapped
    write_8_mapped write_lat_mapped send_lat_mapped line_one_way ring_anchor_64k
    ring_anchor_1m)
printf '%-14s %10s   (median of %s; MiB/s, M msg/s for 8 B bandwidth, latency in usec)\n' \
    figure value "$ROUNDS"
for f in "${figs[@]}"; do
    printf '%-14s %10.3f\n' "$f" "$(med "$f")"
done
path=$(sort -u "$out/path" | paste -sd/)
path_cma=$(sort -u "$out/path_cma" | paste -sd/)
one_path=$(sort -u "$out/one_path" | paste -sd/)
path_mapped=$(sort -u "$out/path_mapped" | paste -sd/)
python3 - "$out" "$path" "$path_cma" "$one_path" "$path_mapped" <<'PY'
import statistics, sys
out, path, path_cma, one_path, path_mapped = sys.argv[1:6]
def vals(name):
    return [float(x) for x in open(f"{out}/{name}").read().split()]
def r(a, b):
    """The median over rounds of figure a over anchor b, each round's pair."""
    return statistics.median(x / y for x, y in zip(vals(a), vals(b)))
print(f"ratio write_bw_64k/ucx_put_bw={r('write_64k', 'ucx_put_64k'):.2f} "
      f"write_bw_1m/ucx_put_bw={r('write_1m', 'ucx_put_1m'):.2f} "
      f"read_bw_64k/ucx_get={r('read_64k', 'ucx_get_64k'):.2f} "
      f"write_bw_8/ucx_put_bw_8={r('write_8', 'ucx_put_8'):.2f} "
      f"write_lat/ucx_put_lat={r('write_lat', 'ucx_put_lat'):.2f} "
      f"send_lat/ucx_am_lat={r('send_lat', 'ucx_am_lat'):.2f} "
      f"(data path: {path}); "
      f"one_process_write_bw_64k/memcpy_aligned={r('one_write_64k', 'memcpy_64k'):.2f} "
      f"(data path: {one_path}); "
      f"asking for cma (data path: {path_cma}): "
      f"write_bw_64k/ucx_put_bw={r('write_64k_cma', 'ucx_put_64k'):.2f} "
      f"write_bw_1m/ucx_put_bw={r('write_1m_cma', 'ucx_put_1m'):.2f} "
      f"read_bw_64k/ucx_get={r('read_64k_cma', 'ucx_get_64k'):.2f} "
      f"one_process_write_bw_64k/memcpy_aligned={r('one_write_64k_cma', 'memcpy_64k'):.2f}; "
      f"ring/anchor (two-copy ring, no software): "
      f"write_bw_64k={r('write_64k', 'ring_anchor_64k'):.2f} "
      f"write_bw_1m={r('write_1m', 'ring_anchor_1m'):.2f}; "
      f"one process on the ring: "
      f"write_bw_64k/memcpy_aligned={r('one_write_64k_ring', 'memcpy_64k'):.2f}; "
      f"copy_mis/copy={r('copy_64k_misaligned', 'copy_64k'):.2f} "
      f"copy/memcpy={r('copy_64k', 'memcpy_64k'):.2f} "
      f"memcpy_mis/memcpy={r('memcpy_64k_misaligned', 'memcpy_64k'):.2f}")
print(f"ratio mapped (data path: {path_mapped}): "
      f"write_bw_64k/ucx_put_bw={r('write_64k_mapped', 'ucx_put_64k'):.2f} "
      f"write_bw_1m/ucx_put_bw={r('write_1m_mapped', 'ucx_put_1m'):.2f} "
      f"read_bw_64k/ucx_get={r('read_64k_mapped', 'ucx_get_64k'):.2f} "
      f"read_bw_1m/ucx_get={r('read_1m_mapped', 'ucx_get_1m'):.2f} "
      f"write_bw_8/ucx_put_bw_8={r('write_8_mapped', 'ucx_put_8'):.2f} "
      f"write_lat/ucx_put_lat={r('write_lat_mapped', 'ucx_put_lat'):.2f} "
      f"send_lat/ucx_am_lat={r('send_lat_mapped', 'ucx_am_lat'):.2f}")
print(f"latency anchor (a cache line from core to core, {statistics.median(vals('line_one_way')) * 1000:.0f} ns): "
      f"ucx_put_lat/line={r('ucx_put_lat', 'line_one_way'):.1f} "
      f"write_lat_mapped/line={r('write_lat_mapped', 'line_one_way'):.1f} "
      f"ucx_am_lat/line={r('ucx_am_lat', 'line_one_way'):.1f} "
      f"send_lat/line={r('send_lat', 'line_one_way'):.1f} "
      f"send_lat_mapped/line={r('send_lat_mapped', 'line_one_way'):.1f}")
PY
