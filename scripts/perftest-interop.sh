#!/usr/bin/env bash
# Stock perftest and ibv_rc_pingpong on Soft-RoCE (rxe0, VM a) against rdmx on its udp
# provider (VM b, no rxe): one side's part of a `scripts/rxe-vm.sh run2 --b-no-rxe` run.
# For each test, the stock tool is the server and `rdmx bench TEST --perftest` the client,
# then the other way round; then the `pingpong` example against ibv_rc_pingpong, both
# ways. Each run has its own TCP port; clients retry until their server listens.
#
# Usage (inside the VMs): scripts/perftest-interop.sh a|b RDMX PINGPONG [ITERS] [TESTS...]
#   With PERFTEST_INTEROP_PROVIDER=verbs, rdmx runs on rxe0 in VM b instead (run2 without
#   --b-no-rxe) and the pingpong example is skipped.
#   RDMX      the rdmx binary; PINGPONG the pingpong example (or "" to skip it)
#   ITERS     -n of every run (default 100: the VMs run under TCG, ~50 MB/s)
#   TESTS     default: write_bw read_bw send_bw write_lat send_lat atomic_bw
# Over IPv4 the udp side cannot check the ICRCs rxe sends (they cover an IP identification
# a UDP socket does not see): RDMX_UDP_VERIFY_ICRC=0; rxe checks every ICRC it receives.
# Both sides use an ack timeout of 1 s (-u 18) to ride out the emulated VMs' stalls.
set -uo pipefail
side=$1 rdmx=$2 pingpong=$3 iters=${4:-100}
shift 4 2>/dev/null || shift $#
tests=${*:-write_bw read_bw send_bw write_lat send_lat atomic_bw}
port=18700
stock() { # TEST ARGS...: the stock tool on rxe0
    local t=$1
    shift
    timeout 300 "ib_$t" -d "$RXE_DEV" -x "$RXE_GID_INDEX" -F -u 18 -n "$iters" -p "$port" "$@"
}
udp_env() {
    env RDMX_UDP_BIND="$RXE_IP" RDMX_UDP_VERIFY_ICRC=0 RDMX_UDP_WINDOW=32 "$@"
}
provider=${PERFTEST_INTEROP_PROVIDER:-udp}
rdmx_bench() { # TEST ARGS...: rdmx bench on the udp provider (or on rxe0)
    local t=$1
    shift
    if [ "$provider" = verbs ]; then
        timeout 300 "$rdmx" bench "$t" --perftest --provider verbs -d "$RXE_DEV" -x "$RXE_GID_INDEX" \
            -u 18 -n "$iters" -p "$port" "$@"
    else
        udp_env timeout 300 "$rdmx" bench "$t" --perftest --provider udp -u 18 -n "$iters" -p "$port" "$@"
    fi
}
connect() { # CMD...: a client that retries while its server does not listen yet
    local n out rc
    for n in $(seq 60); do
        out=$("$@" 2>&1) && { echo "$out"; return 0; }
        rc=$?
        case $out in
        *"Connection refused"* | *"Couldn't connect"*) sleep 1 ;;
        *) echo "$out"; return $rc ;;
        esac
    done
    echo "$out"
    return 1
}
run() { # NAME CMD...: one run; the first failure ends this side
    local name=$1 t=$SECONDS rc=0
    shift
    echo "== $name"
    "$@" || rc=$?
    if [ $rc -ne 0 ]; then
        echo "== $name: FAILED (status $rc, $((SECONDS - t)) s)"
        exit 1
    fi
    echo "== $name: ok ($((SECONDS - t)) s)"
}
for t in $tests; do
    if [ "$side" = a ]; then
        run "ib_$t (server, rxe0) <- rdmx (udp)" stock "$t"
        port=$((port + 1))
        run "ib_$t (client, rxe0) -> rdmx (udp)" connect stock "$t" "$RXE_PEER"
    else
        run "rdmx bench $t --perftest (client, udp) -> ib_$t" connect rdmx_bench "$t" "$RXE_PEER"
        port=$((port + 1))
        run "rdmx bench $t --perftest --server (udp) <- ib_$t" rdmx_bench "$t" --server
    fi
    port=$((port + 1))
done
[ -n "$pingpong" ] && [ "$provider" = udp ] || exit 0
pp_stock() { timeout 120 ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n "$iters" -s 4096 -p "$port" "$@"; }
pp_udp() { udp_env timeout 120 "$pingpong" -d udp -n "$iters" -s 4096 -p "$port" "$@"; }
if [ "$side" = a ]; then
    run "ibv_rc_pingpong (server, rxe0) <- pingpong -d udp" pp_stock
    port=$((port + 1))
    run "ibv_rc_pingpong (client, rxe0) -> pingpong -d udp" connect pp_stock "$RXE_PEER"
else
    run "pingpong -d udp (client) -> ibv_rc_pingpong" connect pp_udp "$RXE_PEER"
    port=$((port + 1))
    run "pingpong -d udp (server) <- ibv_rc_pingpong" pp_udp
fi
