#!/usr/bin/env bash
# perftest and `rdmx bench` side by side on Soft-RoCE (rxe0), in a qemu VM
# (scripts/rxe-vm.sh): ib_write_bw -s 65536, ib_read_bw -s 65536 and ib_write_lat -s 2, server
# and client in the same VM over eth0's address and its IPv4-mapped GID, then the same tests
# through `rdmx bench TEST --provider verbs -d rxe0`. If the rdmx verbs provider cannot run
# (`rdmx bench write_bw --provider verbs` fails), the rdmx side is skipped with a message.
# Both tools run as two processes, a server and a client over eth0's address. The tests
# run in ROUNDS interleaved rounds (perftest, then rdmx, test by test): emulation is
# noisy, and a neighbour's load hits both tools alike. Prints each round's figures
# (bandwidth: BW average in MiB/s; latency: t_typical in usec), their medians, and, as
# its last line, the ratios of the medians (rdmx/perftest):
#   ratio write_bw=X read_bw=Y write_lat=Z        (n/a where rdmx could not run)
# Figures are from TCG emulation: compare them with each other, not with hardware.
#
# Usage: scripts/rxe-bench.sh [-n ITERS] [--rounds N] [--mtu N] [--timeout SECS]
#   -n ITERS    iterations for every test, both tools (default: perftest's own defaults)
#   --rounds N  rounds (default 5)
#   --mtu N    eth0 MTU in the VM (default 9000: rxe active_mtu 4096; 1500 gives 1024)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
iters='' timeout=1800 mtu=9000 rounds=5
while [ $# -gt 0 ]; do
    case $1 in
    -n) iters=$2; shift 2 ;;
    --mtu) mtu=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    *) echo "usage: scripts/rxe-bench.sh [-n ITERS] [--rounds N] [--mtu N] [--timeout SECS]" >&2; exit 2 ;;
    esac
done
if ! command -v python3 >/dev/null; then
    SUDO=''; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-minimal >/dev/null
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rxe-bench.XXXXXX")
build_pid=''
# shellcheck disable=SC2317 # called by the trap
cleanup() {
    if [ -n "$build_pid" ]; then kill "$build_pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

scripts/rxe-vm.sh build &
build_pid=$!
cargo build --release --locked -p rdmx-cli
rc=0
wait "$build_pid" || rc=$?
build_pid=''
[ "$rc" -eq 0 ] || { echo "rxe-bench: the VM rootfs build failed" >&2; exit "$rc"; }
target=${CARGO_TARGET_DIR:-target}
rdmx=$(cd "$target" && pwd)/release/rdmx

# Inside the VM: $1 the rdmx binary, $2 the iterations (or empty), $3 the rounds. Each
# run's output is
# framed by "@@rxe-bench begin TOOL TEST" / "@@rxe-bench end TOOL TEST status N".
# shellcheck disable=SC2016 # expanded inside the VM
guest='
rdmx_bin=$1 n=${2:+-n $2} rounds=$3
perftest() { # TEST TOOL ARGS...
    local test=$1 tool=$2 srv rc=0
    shift 2
    "$tool" -d "$RXE_DEV" -x "$RXE_GID_INDEX" -F $n "$@" >/tmp/server.out 2>&1 &
    srv=$!
    echo "@@rxe-bench begin perftest $test"
    if rxe-wait-listen 18515 20; then
        # shellcheck disable=SC2086
        "$tool" -d "$RXE_DEV" -x "$RXE_GID_INDEX" -F $n "$@" "$RXE_IP" 2>&1 || rc=$?
    else
        kill $srv
        rc=1
    fi
    wait $srv || rc=$?
    [ $rc -eq 0 ] || { echo "-- $tool server output:"; cat /tmp/server.out; }
    echo "@@rxe-bench end perftest $test status $rc"
}
rdmx() { # TEST ARGS...
    local rc=0 srv
    # shellcheck disable=SC2086
    "$rdmx_bin" bench "$1" --provider verbs -d "$RXE_DEV" "${@:2}" $n --server -p 18516 \
        >/tmp/server.out 2>&1 &
    srv=$!
    echo "@@rxe-bench begin rdmx $1"
    if rxe-wait-listen 18516 20; then
        # shellcheck disable=SC2086
        "$rdmx_bin" bench "$1" --provider verbs -d "$RXE_DEV" "${@:2}" $n -p 18516 --json \
            "$RXE_IP" 2>&1 || rc=$?
    else
        kill $srv
        rc=1
    fi
    wait $srv || rc=$?
    [ $rc -eq 0 ] || { echo "-- rdmx server output:"; cat /tmp/server.out; }
    echo "@@rxe-bench end rdmx $1 status $rc"
    return $rc
}
rdmx_ok=1
for r in $(seq "$rounds"); do
    for t in "write_bw ib_write_bw -s 65536" "read_bw ib_read_bw -s 65536" "write_lat ib_write_lat -s 2"; do
        set -- $t
        perftest "$1" "${@:2}"
        if [ $rdmx_ok = 1 ] && ! rdmx "$1" "${@:3}"; then
            rdmx_ok=0
            echo "rxe-bench: rdmx bench $1 --provider verbs -d $RXE_DEV failed (no verbs provider in this build?); skipping the rdmx side"
        fi
    done
done
'
rc=0
scripts/rxe-vm.sh run --timeout "$timeout" --mtu "$mtu" -- bash -c "$guest" rxe-bench "$rdmx" "$iters" "$rounds" |
    tee "$tmp/log" || rc=$?
[ "$rc" -eq 0 ] || echo "rxe-bench: the VM run failed (status $rc)" >&2

python3 - "$tmp/log" <<'PY' || rc=$?
import json, re, statistics, sys

# (tool, test) -> one {"lines", "status"} per round, in order.
sections, cur = {}, None
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"@@rxe-bench (begin|end) (\S+) (\S+)(?: status (\d+))?", line)
    if m and m[1] == "begin":
        cur = {"lines": [], "status": None}
        sections.setdefault((m[2], m[3]), []).append(cur)
    elif m and cur:
        cur["status"] = int(m[4])
        cur = None
    elif cur:
        cur["lines"].append(line.rstrip("\n"))

def perftest_figure(lines, want):
    """The `want` column ('BW average' or 't_typical') of perftest's result row, in MiB/s
    or usec; None if absent. Column names come from the header line (the one starting with
    #bytes); names contain single spaces, columns are separated by several."""
    for i, line in enumerate(lines):
        if not line.strip().startswith("#bytes"):
            continue
        cols = re.findall(r"#\w+|[^\s\[\]][^\[\]]*?\[[^\]]*\]", line.strip())
        idx = next((k for k, c in enumerate(cols) if c.startswith(want)), None)
        if idx is None:
            continue
        for row in lines[i + 1:]:
            f = row.split()
            if len(f) > idx and re.fullmatch(r"\d+", f[0]):
                try:
                    v = float(f[idx])
                except ValueError:
                    break
                unit = cols[idx]
                if "Gb/sec" in unit:  # --report_gbits
                    v = v * 1e9 / 8 / 2**20
                return v
    return None

def rdmx_figure(lines, key):
    """`key` of the first result in the JSON document `rdmx bench --json` printed (it may
    span several lines)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
    if start is None:
        return None
    try:
        doc, _ = json.JSONDecoder().raw_decode("\n".join(lines[start:]))
        return float(doc["results"][0][key])
    except (ValueError, KeyError, IndexError, TypeError):
        return None

tests = [("write_bw", "BW average", "bw_avg_mib_s", "MiB/s"),
         ("read_bw", "BW average", "bw_avg_mib_s", "MiB/s"),
         ("write_lat", "t_typical", "t_typical_us", "usec")]
def figures(tool, name, parse, key):
    """The figure of every round that ran and parsed."""
    runs = sections.get((tool, name), [])
    vals = [parse(r["lines"], key) for r in runs if r["status"] == 0]
    return [v for v in vals if v is not None]

def median(vals):
    return statistics.median(vals) if vals else None

fmt = lambda v: "n/a" if v is None else f"{v:.2f}"
bad, ratios = [], []
print()
print(f"{'test':<10} {'tool':<9} {'median':>9}  rounds (MiB/s or usec; rxe0 in a TCG VM)")
for name, col, key, unit in tests:
    pv = figures("perftest", name, perftest_figure, col)
    rv = figures("rdmx", name, rdmx_figure, key)
    if not pv:
        bad.append(name)
    for tool, vals in (("perftest", pv), ("rdmx", rv)):
        print(f"{name:<10} {tool:<9} {fmt(median(vals)):>9}  " + " ".join(fmt(v) for v in vals))
    pm, rm = median(pv), median(rv)
    ratios.append(f"{name}=" + ("n/a" if pm is None or rm is None or pm == 0 else f"{rm / pm:.2f}"))
if bad:
    print("rxe-bench: no perftest figure for " + ", ".join(bad))
print("ratio " + " ".join(ratios))
sys.exit(1 if bad else 0)
PY
exit "$rc"
