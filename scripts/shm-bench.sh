#!/usr/bin/env bash
# The shm provider against its anchors, in one run on one machine: UCX's shared-memory
# transports (`UCX_TLS=sm ucx_perftest`, two processes) and memcpy of 64 KiB between
# equally aligned buffers (`rdmx bench reg`). rdmx runs in two processes (--server and a
# client) and in one. Each figure is the median of ROUNDS interleaved runs; the last line
# gives the ratios. rdmx runs on its default data paths (between processes the ring, in
# one process direct, as the runs report them); the `_cma` figures ask for the cma path
# (RDMX_SHM_DATA_PATH=cma: payloads of 16 KiB or more pulled with process_vm_readv), and
# `one_write_64k_ring` for the ring in one process; the `_mapped` figures ask for the
# mapped path (RDMX_SHM_DATA_PATH=mapped: the bench's regions are memfd-backed, the
# initiator maps the target's and executes WRITEs and READs with one memcpy), against
# UCX's put and get at the same sizes, and its 8-byte rate and latencies against UCX's.
# `copy_mis/copy` is the provider's copy of 64 KiB with source and destination 16 bytes
# apart against aligned (`rdmx bench reg`), `memcpy_mis/memcpy` the same for glibc's
# memcpy. Bandwidth runs warm up first on both sides: ucx_perftest by its default (a
# tenth of the iterations, at most 10000, unmeasured), rdmx with --perform_warm_up (one
# window of 128 requests).
#
# Usage: scripts/shm-bench.sh            (ROUNDS=5 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
if ! command -v ucx_perftest >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get install -y -qq ucx-utils >/dev/null
fi
cargo build --release --locked -p rdmx-cli >/dev/null 2>&1
RDMX=${CARGO_TARGET_DIR:-target}/release/rdmx
out=$(mktemp -d)
trap 'rm -rf "$out"; kill $(jobs -p) 2>/dev/null || true' EXIT

j() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
ucx() { # test size iters -> MiB/s (bw), M msg/s (bw of 8 B) or usec (lat)
    UCX_TLS=sm ucx_perftest -t "$1" -s "$2" -n "$3" -p 5312 >/dev/null 2>&1 & sleep 0.5
    UCX_TLS=sm ucx_perftest 127.0.0.1 -t "$1" -s "$2" -n "$3" -p 5312 -f 2>/dev/null |
        python3 -c "
import sys
rows = [l.split() for l in sys.stdin if l.split() and l.split()[0].isdigit()]
f = rows[-1]  # iterations, median latency, avg, overall, bw avg, bw overall (MB/s), msgrate avg, overall
print(f[1] if '$1'.endswith('lat') else (float(f[7]) / 1e6 if '$2' == '8' else f[5]))"
    wait
}
pick="d['results'][0].get('bw_avg_mib_s') or d['results'][0]['t_typical_us']"
rate="d['results'][0]['msg_rate_mpps']"
warm() { # the warm-up option for a bandwidth test (latency tests always warm up)
    case $1 in *_bw) echo --perform_warm_up ;; esac
}
one() { # test size iters [extra...] -> MiB/s or t_typical usec, one process
    local t=$1 s=$2 n=$3; shift 3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" $(warm "$t") --json "$@" | j "${J:-$pick}"
}
two() { # the same across two processes
    local t=$1 s=$2 n=$3; shift 3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" --server --port 5313 "$@" >/dev/null 2>&1 &
    sleep 0.3
    "$RDMX" bench "$t" --provider shm -s "$s" -n "$n" --port 5313 $(warm "$t") --json "$@" \
        127.0.0.1 |
        tee "$out/last.json" | j "${J:-$pick}"
    wait
}
memcpy() { # 64 KiB copies (memcpy aligned, memcpy misaligned, rdmx copy aligned and
    # misaligned), MiB/s each, into four files
    "$RDMX" bench reg --runs 3 --json >"$out/reg.json"
    for k in memcpy_64k memcpy_64k_misaligned copy_64k copy_64k_misaligned; do
        j "65536 / d['${k}_ns'] * 1e9 / 1048576" <"$out/reg.json" >>"$out/$k"
    done
}
for r in $(seq "$ROUNDS"); do
    memcpy
    ucx ucp_put_bw 65536 100000 >>"$out/ucx_put_64k"
    ucx ucp_put_bw 1048576 10000 >>"$out/ucx_put_1m"
    ucx ucp_get 65536 100000 >>"$out/ucx_get_64k"
    ucx ucp_get 1048576 10000 >>"$out/ucx_get_1m"
    ucx ucp_put_bw 8 1000000 >>"$out/ucx_put_8"
    ucx ucp_put_lat 8 100000 >>"$out/ucx_put_lat"
    ucx ucp_am_lat 8 100000 >>"$out/ucx_am_lat"
    two write_bw 65536 100000 >>"$out/write_64k"
    j "d['data_path']" <"$out/last.json" >>"$out/path"
    RDMX_SHM_DATA_PATH=cma two write_bw 65536 100000 >>"$out/write_64k_cma"
    j "d['data_path']" <"$out/last.json" >>"$out/path_cma"
    RDMX_SHM_DATA_PATH=cma two write_bw 1048576 10000 >>"$out/write_1m_cma"
    RDMX_SHM_DATA_PATH=cma two read_bw 65536 100000 >>"$out/read_64k_cma"
    RDMX_SHM_DATA_PATH=mapped two write_bw 65536 100000 >>"$out/write_64k_mapped"
    j "d['data_path']" <"$out/last.json" >>"$out/path_mapped"
    RDMX_SHM_DATA_PATH=mapped two write_bw 1048576 10000 >>"$out/write_1m_mapped"
    RDMX_SHM_DATA_PATH=mapped two read_bw 65536 100000 >>"$out/read_64k_mapped"
    RDMX_SHM_DATA_PATH=mapped two read_bw 1048576 10000 >>"$out/read_1m_mapped"
    RDMX_SHM_DATA_PATH=mapped J=$rate two write_bw 8 200000 -l 32 >>"$out/write_8_mapped"
    RDMX_SHM_DATA_PATH=mapped two write_lat 8 20000 >>"$out/write_lat_mapped"
    RDMX_SHM_DATA_PATH=mapped two send_lat 8 20000 >>"$out/send_lat_mapped"
    two write_bw 1048576 10000 >>"$out/write_1m"
    two read_bw 65536 100000 >>"$out/read_64k"
    J=$rate two write_bw 8 200000 -l 32 >>"$out/write_8"
    two write_lat 8 20000 >>"$out/write_lat"
    two send_lat 8 20000 >>"$out/send_lat"
    one write_bw 65536 100000 >>"$out/one_write_64k"
    J="d['data_path']" one write_bw 65536 2000 >>"$out/one_path"
    RDMX_SHM_DATA_PATH=cma one write_bw 65536 100000 >>"$out/one_write_64k_cma"
    RDMX_SHM_DATA_PATH=ring one write_bw 65536 100000 >>"$out/one_write_64k_ring"
    echo "round $r/$ROUNDS done" >&2
done
med() { sort -g "$out/$1" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
figs=(memcpy_64k ucx_put_64k ucx_put_1m ucx_get_64k ucx_put_8 ucx_put_lat ucx_am_lat
    write_64k write_1m read_64k write_8 write_lat send_lat one_write_64k
    write_64k_cma write_1m_cma read_64k_cma one_write_64k_cma one_write_64k_ring
    memcpy_64k_misaligned copy_64k copy_64k_misaligned
    ucx_get_1m write_64k_mapped write_1m_mapped read_64k_mapped read_1m_mapped
    write_8_mapped write_lat_mapped send_lat_mapped)
printf '%-14s %10s   (median of %s; MiB/s, M msg/s for 8 B bandwidth, latency in usec)\n' \
    figure value "$ROUNDS"
args=()
for f in "${figs[@]}"; do
    printf '%-14s %10.3f\n' "$f" "$(med "$f")"
    args+=("$(med "$f")")
done
path=$(sort -u "$out/path" | paste -sd/)
path_cma=$(sort -u "$out/path_cma" | paste -sd/)
one_path=$(sort -u "$out/one_path" | paste -sd/)
path_mapped=$(sort -u "$out/path_mapped" | paste -sd/)
python3 - "$path" "$path_cma" "$one_path" "$path_mapped" "${args[@]}" <<'PY'
import sys
path, path_cma, one_path, path_mapped = sys.argv[1:5]
(mc, up64, up1m, ug64, up8, upl, aml, w64, w1m, r64, w8, wl, sl, o64,
 w64c, w1mc, r64c, o64c, o64r, mcm, cp, cpm,
 ug1m, w64m, w1mm, r64m, r1mm, w8m, wlm, slm) = map(float, sys.argv[5:])
print(f"ratio write_bw_64k/ucx_put_bw={w64/up64:.2f} write_bw_1m/ucx_put_bw={w1m/up1m:.2f} "
      f"read_bw_64k/ucx_get={r64/ug64:.2f} write_bw_8/ucx_put_bw_8={w8/up8:.2f} "
      f"write_lat/ucx_put_lat={wl/upl:.2f} send_lat/ucx_am_lat={sl/aml:.2f} "
      f"(data path: {path}); one_process_write_bw_64k/memcpy_aligned={o64/mc:.2f} "
      f"(data path: {one_path}); "
      f"asking for cma (data path: {path_cma}): write_bw_64k/ucx_put_bw={w64c/up64:.2f} "
      f"write_bw_1m/ucx_put_bw={w1mc/up1m:.2f} read_bw_64k/ucx_get={r64c/ug64:.2f} "
      f"one_process_write_bw_64k/memcpy_aligned={o64c/mc:.2f}; "
      f"one process on the ring: write_bw_64k/memcpy_aligned={o64r/mc:.2f}; "
      f"copy_mis/copy={cpm/cp:.2f} copy/memcpy={cp/mc:.2f} memcpy_mis/memcpy={mcm/mc:.2f}")
print(f"ratio mapped (data path: {path_mapped}): write_bw_64k/ucx_put_bw={w64m/up64:.2f} "
      f"write_bw_1m/ucx_put_bw={w1mm/up1m:.2f} read_bw_64k/ucx_get={r64m/ug64:.2f} "
      f"read_bw_1m/ucx_get={r1mm/ug1m:.2f} write_bw_8/ucx_put_bw_8={w8m/up8:.2f} "
      f"write_lat/ucx_put_lat={wlm/upl:.2f} send_lat/ucx_am_lat={slm/aml:.2f}")
PY
