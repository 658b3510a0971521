#!/usr/bin/env bash
# The transfer engine (`rdmx bench transfer`) against its anchors, in one run on one
# machine, interleaved rounds, medians, ratios on the last line:
#   - Mooncake's Transfer Engine over tcp (its transfer_engine_bench, P2PHANDSHAKE
#     metadata, two processes; installed from PyPI into a virtual environment) against
#     the engine over tcp, two processes, same block and batch sizes and threads;
#   - `rdmx bench write_bw --provider tcp` at 64 KiB against the engine over tcp at 64 KiB
#     (both in one process, the engine with two threads keeping batches in flight as
#     write_bw keeps its queue full: the engine's cost over the bare queue pair);
#   - `rdmx bench write_bw --provider shm` at 1 MiB against the engine over shm at 1 MiB.
#     write_bw, as perftest, sends every request from one buffer into one buffer, which
#     stays in the caches; the engine runs these two with --reuse-block, every request on
#     one block, alike (1 MiB x 128 x 2 threads of distinct memory per round runs at
#     DRAM speed, a third of the cached figure here). Its figures with a block per
#     request (te_*_spread) are printed for information;
#   - the median time to submit a batch of 1,024 requests of 4 KiB.
#
# Usage: scripts/te-bench.sh     (ROUNDS=3, SECONDS_PER_RUN=3 by default; NO_MOONCAKE=1
#                                 skips the Mooncake runs)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
D=${SECONDS_PER_RUN:-3}
VENV=${MOONCAKE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rdmx-mooncake-venv}
MC=""
if [ -z "${NO_MOONCAKE:-}" ]; then
    if [ ! -x "$VENV/bin/transfer_engine_bench" ]; then
        python3 -m venv "$VENV" >/dev/null
        "$VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda >/dev/null 2>&1 ||
            echo "te-bench: could not install mooncake-transfer-engine-non-cuda; skipping Mooncake" >&2
    fi
    [ -x "$VENV/bin/transfer_engine_bench" ] && MC="$VENV/bin/transfer_engine_bench"
fi
cargo build --release --locked -p rdmx-cli >/dev/null 2>&1
RDMX=${CARGO_TARGET_DIR:-target}/release/rdmx
out=$(mktemp -d)
pids=()
cleanup() {
    local rc=$?
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    if [ "$rc" -ne 0 ] && [ -s "$out/stderr" ]; then
        echo "te-bench: a run failed; its messages:" >&2
        tail -20 "$out/stderr" >&2
    fi
    rm -rf "$out"
}
trap cleanup EXIT

# Reads all of its input before Python starts: an interpreter starting beside a short run
# on a 2-vCPU machine takes a core from it.
after() { local in; in=$(cat); printf '%s\n' "$in" | "$@"; }
j() { after python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# Mooncake: one target for the whole run, an initiator per figure (GB/s).
if [ -n "$MC" ]; then
    "$MC" --mode=target --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
        --protocol=tcp --buffer_size=268435456 >"$out/mc-target.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do grep -qs "listening on" "$out/mc-target.log" && break; sleep 0.1; done
    MC_SEG=$(grep -o "listening on [0-9.]*:[0-9]*" "$out/mc-target.log" | head -1 | awk '{print $3}')
fi
mooncake() { # block batch -> GB/s
    "$MC" --mode=initiator --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1 \
        --protocol=tcp --buffer_size=268435456 --segment_id="$MC_SEG" --operation=write \
        --block_size="$1" --batch_size="$2" --threads=2 --duration="$D" 2>&1 |
        grep -o "throughput [0-9.]* GB/s" | awk '{print $2}'
}

# The engine's target in its own process, for the two-process figures.
"$RDMX" bench transfer --mode target --rails tcp:127.0.0.1:0 --listen 127.0.0.1:0 \
    --buffer-size 268435456 >"$out/te-target.log" 2>>"$out/stderr" &
pids+=($!)
for _ in $(seq 100); do grep -qs "listening on" "$out/te-target.log" && break; sleep 0.1; done
TE_SEG=$(awk '/listening on/ {print $4}' "$out/te-target.log")

te2() { # block batch -> GB/s, initiator against the target process, tcp
    "$RDMX" bench transfer --mode initiator --segment "$TE_SEG" --rails tcp:127.0.0.1:0 \
        --block-size "$1" --batch-size "$2" --threads 2 --duration "$D" --json 2>>"$out/stderr" |
        j "d['results'][0]['bw_gb_s']"
}
te1() { # rails block batch field [args] -> value, both roles in this process
    "$RDMX" bench transfer --rails "$1" --block-size "$2" --batch-size "$3" --threads 2 --duration "$D" \
        "${@:5}" --json 2>>"$out/stderr" | j "d['results'][0]['$4']"
}
wbw() { # provider size -> MiB/s
    "$RDMX" bench write_bw --provider "$1" -s "$2" -D "$D" --json 2>>"$out/stderr" |
        j "d['results'][0]['bw_avg_mib_s']"
}
for r in $(seq "$ROUNDS"); do
    if [ -n "$MC" ]; then
        mooncake 65536 128 >>"$out/mc_64k"
        mooncake 1048576 128 >>"$out/mc_1m"
    fi
    te2 65536 128 >>"$out/te_tcp_64k_2p"
    te2 1048576 128 >>"$out/te_tcp_1m_2p"
    wbw tcp 65536 >>"$out/write_bw_tcp_64k"
    te1 tcp:127.0.0.1:0 65536 128 bw_mib_s --reuse-block >>"$out/te_tcp_64k"
    te1 tcp:127.0.0.1:0 65536 128 bw_mib_s >>"$out/te_tcp_64k_spread"
    wbw shm 1048576 >>"$out/write_bw_shm_1m"
    te1 shm 1048576 128 bw_mib_s --reuse-block >>"$out/te_shm_1m"
    te1 shm 1048576 128 bw_mib_s >>"$out/te_shm_1m_spread"
    te1 tcp:127.0.0.1:0 4096 1024 submit_p50_us >>"$out/submit_4k_x1024"
    echo "round $r/$ROUNDS done" >&2
done
med() { [ -s "$out/$1" ] || { echo nan; return; }; sort -g "$out/$1" | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
printf '%-18s %10s   (median of %s rounds of %s s)\n' figure value "$ROUNDS" "$D"
for f in mc_64k mc_1m te_tcp_64k_2p te_tcp_1m_2p write_bw_tcp_64k te_tcp_64k te_tcp_64k_spread \
    write_bw_shm_1m te_shm_1m te_shm_1m_spread submit_4k_x1024; do
    unit=GB/s; case $f in *_2p) ;; *write_bw*|te_tcp_64k*|te_shm_1m*) unit=MiB/s;; submit*) unit=us;; esac
    printf '%-18s %10s %s\n' "$f" "$(med $f)" "$unit"
done
[ -n "$MC" ] || echo "Mooncake: not measured in this run (not installed); ratios use its recorded 0.71 / 0.85 GB/s"
python3 - "$(med mc_64k)" "$(med mc_1m)" "$(med te_tcp_64k_2p)" "$(med te_tcp_1m_2p)" \
    "$(med write_bw_tcp_64k)" "$(med te_tcp_64k)" "$(med write_bw_shm_1m)" "$(med te_shm_1m)" \
    "$(med submit_4k_x1024)" <<'PY'
import math, sys
mc64, mc1m, te64, te1m, wt, tt, ws, ts, sub = map(float, sys.argv[1:])
if math.isnan(mc64): mc64, mc1m = 0.71, 0.85
print(f"ratio te/mooncake_tcp_64k={te64/mc64:.2f} te/mooncake_tcp_1m={te1m/mc1m:.2f} "
      f"te/write_bw_tcp_64k={tt/wt:.2f} te/write_bw_shm_1m={ts/ws:.2f} submit_4k_x1024_us={sub:.1f}")
PY
