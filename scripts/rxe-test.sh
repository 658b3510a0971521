#!/usr/bin/env bash
# The project's tests against real rdma-core on Soft-RoCE, in a qemu VM (scripts/rxe-vm.sh):
# builds the verbs conformance test and the rdmx CLI on the host, boots the VM with rxe0 and runs there
#   - ibv_devinfo -d rxe0 and ibv_rc_pingpong (server and client on rxe0): the device works;
#   - every test binary whose name starts with conformance_verbs (--test-threads=1), with
#     RDMX_REQUIRE_VERBS=1 so that "no RDMA device" fails instead of skipping; the tests
#     listed in RXE_DEVIATIONS below run in a step of their own that reports them but does
#     not fail (and says so if one starts passing);
#   - `rdmx devices` and `rdmx bench` smoke runs on rxe0, if the rdmx CLI binary was built,
#     and every transfer test between two VMs (server in one, client in the other), and the
#     `pingpong` example against the stock ibv_rc_pingpong, ibv_uc_pingpong and
#     ibv_ud_pingpong across the two VMs, each in both roles; the `multicast` example
#     across two VMs (a UD multicast group, attach and detach);
#   - soft-iWARP (siw0, `rxe-vm.sh --siw`): the verbs conformance suite, whose queue pairs
#     connect through rdma_cm there and whose tests skip what siw0's capabilities lack
#     (the tests listed in SIW_DEVIATIONS reported apart, as for rxe), the rdma_cm tests,
#     and `rdmx bench --rdma-cm` in one VM and across two VMs.
#   - rxe against rdmx's udp provider: rdmx bench on rxe0 in one VM and on the udp
#     provider in another VM without rxe, in both roles.
#   - the transfer engine (rdmx-transfer) on rxe0: its verbs test (two rails, one broken
#     mid-batch) with the suite, and `rdmx bench transfer --verify` between the two VMs
#     (the te_* blocks).
#   - stock perftest against rdmx: ib_{write,read,send,atomic}_bw and ib_{write,send}_lat
#     on rxe0 in one VM against `rdmx bench TEST --perftest` on the udp provider in the
#     other (no rxe), each in both roles; then ibv_rc_pingpong against the `pingpong`
#     example on udp, both ways (scripts/perftest-interop.sh).
# Exits non-zero if any of them fails. The rootfs (cached, see rxe-vm.sh) is built in
# parallel with the crates on the first run.
#
# Usage: scripts/rxe-test.sh [--timeout SECS]     (VM timeout, default 600)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
timeout=600
while [ $# -gt 0 ]; do
    case $1 in
    --timeout) timeout=$2; shift 2 ;;
    *) echo "usage: scripts/rxe-test.sh [--timeout SECS]" >&2; exit 2 ;;
    esac
done
# Conformance tests that Soft-RoCE (kernel 6.12, rdma-core 56) fails because rxe itself
# departs from the verbs contract the suite checks; each with what rxe does.
RXE_DEVIATIONS=(
    "deregistered_keys: a SEND with a stale lkey completes WR_FLUSH_ERR, not LOC_PROT_ERR (the requester moves the QP to ERR and the completer flushes the failed WQE too)"
    "qp_without_remote_access: a responder QP without the access flag NAKs with Invalid Request (REM_INV_REQ_ERR), not Remote Access Error"
    "send_longer_than_receive: the receiver completes LOC_QP_OP_ERR, not LOC_LEN_ERR"
)
# Not a deviation, but what an application on rxe must do: ibv_attach_mcast on rxe
# registers the group with the device only, not with the IP layer, which every RoCEv2
# datagram passes through (a multicast one sent on this host comes back to it only as
# IP's multicast loopback) and which drops datagrams of a group this host has not joined.
# So the suite's ud_multicast and examples/multicast.rs also join their group at the IP
# level on the device's interface, as rdma_cm's rdma_join_multicast does on RoCE. The
# group of the two-host step:
RXE_MCAST_GROUP=239.1.2.3
# The same for soft-iWARP (siw of kernel 6.12, rdma-core 56).
SIW_DEVIATIONS=(
    "deregistered_keys: a SEND with a stale lkey completes LOC_QP_OP_ERR, not LOC_PROT_ERR"
    "error_flushes_outstanding: the READ the responder refused never completes, while the requests after it do"
    "notify_solicited_only: a solicited SEND does not wake a CQ armed for solicited completions"
    "qp_without_remote_access: the responder QP's access flags are not enforced: a WRITE through a QP without remote write lands"
    "region_without_remote_access: a READ of a region registered without remote read succeeds"
    "send_longer_than_receive: a receive with no elements is refused at post (EINVAL)"
)
start=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rxe-test.XXXXXX")
build_pid=''
# shellcheck disable=SC2317 # called by the trap
cleanup() {
    if [ -n "$build_pid" ]; then kill "$build_pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

echo "== building the VM rootfs (if not cached) and the test binaries"
scripts/rxe-vm.sh build-siw & # the rootfs, then siw.ko for its kernel
build_pid=$!
{
    cargo build --locked --message-format=json -p rdmx --test conformance_verbs --test conformance_verbs_async \
        --test conformance_verbs_rdma_cm
    cargo build --locked --message-format=json -p rdmx-cli --bin rdmx
    cargo build --locked --message-format=json -p rdmx --example pingpong --example multicast
} >"$tmp/cargo.json"
# --- The transfer engine on verbs (1/3): its test binary (see te_tests and te_two_hosts).
cargo build --locked --message-format=json -p rdmx-transfer --test verbs >>"$tmp/cargo.json"
# The perftest interop step runs an optimized rdmx (.ci/run's smoke runs built it already):
# a debug build's udp provider is slow enough under TCG to run out of retries.
cargo build --locked --release --message-format=json -p rdmx-cli --bin rdmx >"$tmp/cargo-release.json"
rc=0
wait "$build_pid" || rc=$?
build_pid=''
[ "$rc" -eq 0 ] || { echo "rxe-test: the VM rootfs build failed" >&2; exit "$rc"; }

# "KIND NAME MANIFEST EXECUTABLE" for every artifact with an executable.
sed -n 's/.*"manifest_path":"\([^"]*\)".*"kind":\["\([a-z-]*\)"\].*"name":"\([^"]*\)".*"executable":"\([^"]*\)".*/\2 \3 \1 \4/p' \
    "$tmp/cargo.json" >"$tmp/artifacts"
# Each test binary to run: "DIR EXECUTABLE EXTRA-ARGS" (DIR is its package's, as cargo test),
# in $tmp/tests.rxe and $tmp/tests.siw; the deviations in $tmp/deviations.{rxe,siw}.
: >"$tmp/tests.rxe"
: >"$tmp/tests.siw"
while read -r kind name manifest exe; do
    case $kind:$name in
    test:conformance_verbs*)
        for dev in rxe siw; do
            if [ $dev = rxe ]; then devs=("${RXE_DEVIATIONS[@]}"); else devs=("${SIW_DEVIATIONS[@]}"); fi
            # On siw0: the suite (through rdma_cm) and the rdma_cm tests.
            [ $dev = rxe ] || [ "$name" = conformance_verbs ] || [ "$name" = conformance_verbs_rdma_cm ] ||
                continue
            skips='' names=''
            if [ "$name" = conformance_verbs ]; then # the deviations are the suite's tests
                for d in "${devs[@]}"; do
                    skips+=" --skip conformance_verbs::${d%%:*}" names+=" conformance_verbs::${d%%:*}"
                done
                echo "$(dirname "$manifest") $exe --test-threads=1 --exact$names" >"$tmp/deviations.$dev"
            fi
            echo "$(dirname "$manifest") $exe --test-threads=1$skips" >>"$tmp/tests.$dev"
        done
        ;;
    esac
done <"$tmp/artifacts"
rdmx=$(awk '$1 == "bin" && $2 == "rdmx" && $4 !~ /\/deps\// {print $4; exit}' "$tmp/artifacts")
pingpong=$(awk '$1 == "example" && $2 == "pingpong" {print $4; exit}' "$tmp/artifacts")
# --- The transfer engine on verbs (2/3): rdmx-transfer's `verbs` test (two engines, each
# with two rails on rxe0: a verified batch, and one rail broken mid-batch) runs on rxe0
# with the suite.
te_tests() {
    local manifest exe
    read -r manifest exe < <(awk '$1 == "test" && $2 == "verbs" && $3 ~ /rdmx-transfer/ {print $3, $4; exit}' \
        "$tmp/artifacts") || true
    [ -n "${exe:-}" ] || { echo "rxe-test: no rdmx-transfer verbs test binary in the build" >&2; return 1; }
    echo "$(dirname "$manifest") $exe --test-threads=1" >>"$tmp/tests.rxe"
}
te_tests
multicast=$(awk '$1 == "example" && $2 == "multicast" {print $4; exit}' "$tmp/artifacts")
rdmx_release=$(sed -n 's/.*"kind":\["bin"\].*"name":"rdmx".*"executable":"\([^"]*\)".*/\1/p' \
    "$tmp/cargo-release.json" | head -n 1)
grep -q conformance_verbs "$tmp/tests.rxe" || {
    echo "rxe-test: no conformance_verbs test binary in the build" >&2; exit 1
}
echo "== built in $((SECONDS - start)) s; running in the VM:"
sed 's/^/   /' "$tmp/tests.rxe"
[ -z "$rdmx" ] || echo "   $rdmx devices; $rdmx bench ... --provider verbs -d rxe0"
echo "   known rxe deviations (reported, not failing):"
printf '     %s\n' "${RXE_DEVIATIONS[@]}"
echo "   then on siw0:"
sed 's/^/   /' "$tmp/tests.siw"
echo "   known siw deviations (reported, not failing):"
printf '     %s\n' "${SIW_DEVIATIONS[@]}"

# The part that runs inside the VM. $1: the rdmx binary or empty; then one word list per
# test binary, "DIR EXE ARGS...", as lines of $2; $3 the same for the deviations; $4 1 on
# siw0.
# shellcheck disable=SC2016 # expanded inside the VM
guest='
fails=()
step() { # NAME CMD...
    local name=$1 t=$SECONDS rc=0
    shift
    echo "== $name"
    "$@" || rc=$?
    if [ $rc -eq 0 ]; then
        echo "== $name: ok ($((SECONDS - t)) s)"
    else
        echo "== $name: FAILED (status $rc, $((SECONDS - t)) s)"
        fails+=("$name")
    fi
}
pingpong() {
    local c=0 s=0 srv
    ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n 100 &
    srv=$!
    rxe-wait-listen 18515 10 || { kill $srv; return 1; }
    ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n 100 "$RXE_IP" || c=$?
    wait $srv || s=$?
    echo "client status $c, server status $s"
    [ $c -eq 0 ] && [ $s -eq 0 ]
}
in_dir() { # DIR CMD...: run CMD in DIR with CARGO_MANIFEST_DIR=DIR, as cargo test does
    (cd "$1" && shift && CARGO_MANIFEST_DIR=$PWD "$@")
}
rdmx=$1 siw=$4
step "ibv_devinfo -d $RXE_DEV" ibv_devinfo -d "$RXE_DEV"
# ibv_rc_pingpong exchanges QP numbers, which iWARP does not connect by.
[ "$siw" = 1 ] || step "ibv_rc_pingpong on $RXE_DEV (GID index $RXE_GID_INDEX)" pingpong
while read -r dir exe args; do
    [ -n "$exe" ] || continue
    # shellcheck disable=SC2086
    step "${exe##*/}" in_dir "$dir" "$exe" --color=never $args
done <<<"$2"
if [ -n "$3" ]; then
    read -r dir exe args <<<"$3"
    echo "== known $RXE_DEV deviations (expected to fail; not counted)"
    # shellcheck disable=SC2086
    if in_dir "$dir" "$exe" --color=never $args; then
        echo "== known $RXE_DEV deviations: all passed now; remove them from the list"
    else
        echo "== known $RXE_DEV deviations: failed, as expected"
    fi
fi
cm_bench() { # TEST PORT: rdmx bench --rdma-cm, server and client in this VM
    local srv rc=0
    "$rdmx" bench "$1" --provider verbs -d "$RXE_DEV" -n 100 --verify --rdma-cm -p "$2" --server \
        >/tmp/cm-server.log 2>&1 &
    srv=$!
    rxe-wait-listen "$2" 20 || { kill $srv; return 1; }
    "$rdmx" bench "$1" --provider verbs -d "$RXE_DEV" -n 100 --verify --rdma-cm -p "$2" "$RXE_IP" || rc=$?
    wait $srv || { rc=1; cat /tmp/cm-server.log; }
    return $rc
}
if [ -n "$rdmx" ] && [ "$siw" = 1 ]; then
    step "rdmx devices" "$rdmx" devices
    step "rdmx bench write_bw --rdma-cm on $RXE_DEV" cm_bench write_bw 18600
    step "rdmx bench send_lat --rdma-cm on $RXE_DEV" cm_bench send_lat 18602
elif [ -n "$rdmx" ]; then
    step "rdmx devices" "$rdmx" devices
    for t in write_bw read_bw send_bw write_lat atomic_bw; do
        step "rdmx bench $t on $RXE_DEV" "$rdmx" bench "$t" --provider verbs -d "$RXE_DEV" -n 100 --verify
    done
fi
if [ ${#fails[@]} -eq 0 ]; then
    echo "== rxe-test: all passed"
else
    echo "== rxe-test: FAILED: ${fails[*]}"
    exit 1
fi
'
rc=0
# Inside the VM the verbs tests must run: "no RDMA device" there is a failure, not a skip.
export RDMX_REQUIRE_VERBS=1
scripts/rxe-vm.sh run --timeout "$timeout" --env RDMX_REQUIRE_VERBS -- bash -c "$guest" rxe-test \
    "$rdmx" "$(cat "$tmp/tests.rxe")" "$(cat "$tmp/deviations.rxe" 2>/dev/null)" 0 ||
    rc=$?
# soft-iWARP: the suite's queue pairs connect through rdma_cm on siw0.
t1=$SECONDS
if scripts/rxe-vm.sh run --siw --timeout "$timeout" --env RDMX_REQUIRE_VERBS -- bash -c "$guest" \
    rxe-test "$rdmx" "$(cat "$tmp/tests.siw")" "$(cat "$tmp/deviations.siw" 2>/dev/null)" 1; then
    echo "== siw0: ok ($((SECONDS - t1)) s)"
else
    rc=1
    echo "== siw0: FAILED ($((SECONDS - t1)) s)"
fi

# Two hosts: `rdmx bench --server` in one VM and the client in the other, over rxe0 on a
# link between them: the facade's connection setup across hosts, real GIDs, --verify
# checking the data that crossed; then two of them again with --rdma-cm, their queue
# pairs connected through rdma_cm. Each test has its own port; the client retries only
# while nobody listens there yet.
if [ -n "$rdmx" ] && [ $rc -eq 0 ]; then
    tests="write_bw read_bw send_bw write_lat read_lat send_lat atomic_bw atomic_lat"
    # Then these again with their queue pairs connected through rdma_cm (--rdma-cm).
    cm_tests="write_bw read_lat"
    bench="bench \$t --provider verbs -d \$RXE_DEV -n 100 --verify -p \$((18515 + i))"
    # shellcheck disable=SC2016 # expanded inside the VMs
    client='connect() {
        local n out
        for n in $(seq 60); do
            out=$("$@" 2>&1) && { echo "$out"; return 0; }
            case $out in *"connect to the peer failed"*) sleep 1 ;; *) echo "$out"; return 1 ;; esac
        done
        echo "$out"; return 1
    }'
    # Then the pingpong example against the stock ibv_{rc,uc,ud}_pingpong, each in both
    # roles: the stock server in VM a with the rdmx client in VM b, then the other way
    # round. The clients retry until the server listens (rxe-retry).
    # Sizes are given: the tools' defaults differ between rdma-core versions (UD: at most
    # the path MTU).
    pp="-d \$RXE_DEV -g \$RXE_GID_INDEX -n 100 -s \$s -p \$((18515 + i))"
    pp_sizes="for c in rc uc ud; do s=4096; [ \$c != ud ] || s=1024;"
    pp_a="$pp_sizes ibv_\${c}_pingpong $pp; i=\$((i + 1)); $pingpong -c \$c $pp; \
          i=\$((i + 1)); done"
    pp_b="$pp_sizes rxe-retry 60 $pingpong -c \$c $pp \$RXE_PEER; i=\$((i + 1)); \
          rxe-retry 60 ibv_\${c}_pingpong $pp \$RXE_PEER; i=\$((i + 1)); done"
    [ -n "$pingpong" ] || { pp_a=true pp_b=true; }
    echo "== two hosts: rdmx bench {${tests// /,}} --server in VM a, client in VM b," \
        "then {${cm_tests// /,}} with --rdma-cm, then pingpong against ibv_{rc,uc,ud}_pingpong" \
        "both ways"
    t2=$SECONDS
    if scripts/rxe-vm.sh run2 --timeout "$timeout" \
        --a "set -e; i=0; for t in $tests; do $rdmx $bench --server; i=\$((i + 1)); done; \
             for t in $cm_tests; do $rdmx $bench --rdma-cm --server; i=\$((i + 1)); done; $pp_a" \
        --b "set -e; $client; i=0; for t in $tests; do connect $rdmx $bench \$RXE_PEER; i=\$((i + 1)); done; \
             for t in $cm_tests; do connect $rdmx $bench --rdma-cm \$RXE_PEER; i=\$((i + 1)); done; $pp_b"; then
        echo "== two hosts: ok ($((SECONDS - t2)) s)"
    else
        rc=1
        echo "== two hosts: FAILED ($((SECONDS - t2)) s)"
    fi
fi
# --- The transfer engine on verbs (3/3): `rdmx bench transfer` across two VMs over rxe0,
# two rails on it each side: the target in VM a, the initiator in VM b, WRITE then READ,
# --verify reading every WRITE batch back and checking what each READ brought against a
# pattern written first. Each initiator run ends with a notification the target counts
# (--runs 2, then it exits; one lost fails the step at the target's timeout). The
# initiator retries only while nobody listens yet.
te_two_hosts() {
    local te tgt ini t2=$SECONDS
    te="bench transfer --rails verbs:\$RXE_DEV,verbs:\$RXE_DEV"
    tgt="timeout 150 $rdmx $te --mode target --listen \$RXE_IP:18700 --buffer-size 4194304 --runs 2"
    ini="$rdmx $te --mode initiator --segment \$RXE_PEER:18700 --block-size 65536,200000 \
         --batch-size 8 --duration 2 --verify"
    # shellcheck disable=SC2016 # expanded inside the VM
    local retry='te() {
        local n out
        for n in $(seq 60); do
            out=$("$@" 2>&1) && { echo "$out"; return 0; }
            case $out in *"control listener"*) sleep 1 ;; *) echo "$out"; return 1 ;; esac
        done
        echo "$out"; return 1
    }'
    echo "== two hosts: rdmx bench transfer over rxe0 (two rails), target in VM a," \
        "initiator in VM b, WRITE then READ with --verify"
    if scripts/rxe-vm.sh run2 --timeout "$timeout" \
        --a "set -e; $tgt" \
        --b "set -e; $retry; te $ini --op write; te $ini --op read"; then
        echo "== two hosts, transfer engine: ok ($((SECONDS - t2)) s)"
    else
        echo "== two hosts, transfer engine: FAILED ($((SECONDS - t2)) s)"
        return 1
    fi
}
if [ -n "$rdmx" ] && [ $rc -eq 0 ]; then
    te_two_hosts || rc=1
fi
# UD multicast across two hosts (examples/multicast.rs): three UD queue pairs in VM b
# attached to a group on rxe0, one SEND from VM a reaches each of them; after one
# detaches, the next SEND reaches the other two only (the detached one's next receive
# takes a unicast datagram sent after it). VM b also joins the group at the IP level,
# which rxe needs (see RXE_MCAST_GROUP): without it nothing arrives.
if [ -n "$multicast" ] && [ $rc -eq 0 ]; then
    echo "== two hosts: UD multicast from VM a to three attached queue pairs in VM b, then a detach"
    t2=$SECONDS
    if scripts/rxe-vm.sh run2 --timeout "$timeout" \
        --a "$multicast --role send -d \$RXE_DEV -m $RXE_MCAST_GROUP \$RXE_PEER" \
        --b "$multicast --role recv -d \$RXE_DEV -m $RXE_MCAST_GROUP -q 3"; then
        echo "== two hosts, UD multicast: ok ($((SECONDS - t2)) s)"
    else
        rc=1
        echo "== two hosts, UD multicast: FAILED ($((SECONDS - t2)) s)"
    fi
fi
# The same over soft-iWARP: rdmx bench --rdma-cm across two VMs on siw0 (rdma_cm takes
# the port after -p there, so the ports step by two). On iWARP the bench's client sends
# first and both sides post their receives before connecting (see connect_remote in
# crates/rdmx-cli/src/bench/setup.rs). Without that about one run in eight failed here,
# the server's receives completing flushed: its READY reached the client before the
# client had posted a receive (siw has no RNR: the client terminated the connection), or
# together with the MPA reply (the client's connect failed, CONNECT_ERROR -22).
if [ -n "$rdmx" ] && [ $rc -eq 0 ]; then
    siw_tests="write_bw read_bw"
    siw_bench="bench \$t --provider verbs -d \$RXE_DEV -n 100 --verify --rdma-cm -p \$((18515 + 2 * i))"
    echo "== two hosts on siw0: rdmx bench {${siw_tests// /,}} --rdma-cm --server in VM a, client in VM b"
    t2=$SECONDS
    if scripts/rxe-vm.sh run2 --siw --timeout "$timeout" \
        --a "set -e; i=0; for t in $siw_tests; do $rdmx $siw_bench --server; i=\$((i + 1)); done" \
        --b "set -e; $client; i=0; for t in $siw_tests; do connect $rdmx $siw_bench \$RXE_PEER; i=\$((i + 1)); done"; then
        echo "== two hosts on siw0: ok ($((SECONDS - t2)) s)"
    else
        rc=1
        echo "== two hosts on siw0: FAILED ($((SECONDS - t2)) s)"
    fi
fi
# Linux Soft-RoCE against rdmx's udp provider: `rdmx bench` on rxe0 (verbs) in VM a, on the
# udp provider in VM b, which has no rxe (rdmx speaks RoCEv2 there from user space on UDP
# port 4791); VM a is the server for every test, then VM b. --verify checks the data
# that crossed. Over IPv4 VM b cannot check the ICRCs rxe sends (they cover an IP
# identification a UDP socket does not see), so it runs with RDMX_UDP_VERIFY_ICRC=0; rxe
# checks every ICRC VM b sends. A send window of 32 packets keeps bursts within what the
# VMs' emulated link queues without loss, and an ack timeout of 1 s (-u 18, against
# perftest's 67 ms) rides out the emulated VMs' stalls (a READ burst once exhausted 8
# retries of 67 ms).
if [ -n "$rdmx" ] && [ $rc -eq 0 ]; then
    udp_tests="write_bw read_bw send_bw write_lat send_lat atomic_bw"
    verbs="bench \$t --provider verbs -d \$RXE_DEV -n 100 -u 18 --verify -p \$((18600 + i))"
    udp="env RDMX_UDP_BIND=\$RXE_IP RDMX_UDP_VERIFY_ICRC=0 RDMX_UDP_WINDOW=32 $rdmx bench \$t --provider udp -n 100 -u 18 --verify -p \$((18600 + i))"
    echo "== rxe and the udp provider: rdmx bench {${udp_tests// /,}} on rxe0 in VM a and" \
        "on udp in VM b (no rxe), each side the server in turn"
    t2=$SECONDS
    if scripts/rxe-vm.sh run2 --b-no-rxe --timeout "$timeout" \
        --a "set -e; $client; i=0; for t in $udp_tests; do $rdmx $verbs --server; i=\$((i + 1)); done; \
             for t in $udp_tests; do connect $rdmx $verbs \$RXE_PEER; i=\$((i + 1)); done" \
        --b "set -e; $client; i=0; for t in $udp_tests; do connect $udp \$RXE_PEER; i=\$((i + 1)); done; \
             for t in $udp_tests; do $udp --server; i=\$((i + 1)); done"; then
        echo "== rxe and the udp provider: ok ($((SECONDS - t2)) s)"
    else
        rc=1
        echo "== rxe and the udp provider: FAILED ($((SECONDS - t2)) s)"
    fi
fi
# Stock perftest (and ibv_rc_pingpong) on rxe0 in VM a against rdmx on its udp provider in
# VM b (no rxe): every test with the stock tool as the server and `rdmx bench --perftest`
# as the client, then the other way round; scripts/perftest-interop.sh is each side's
# part (its header says what runs how).
perftest_interop() {
    local t2=$SECONDS s=$PWD/scripts/perftest-interop.sh
    echo "== stock perftest and ibv_rc_pingpong on rxe0 (VM a) against rdmx bench --perftest" \
        "and the pingpong example on udp (VM b, no rxe), each side the server in turn"
    if scripts/rxe-vm.sh run2 --b-no-rxe --timeout "$timeout" \
        --a "$s a $rdmx_release '$pingpong' 50" --b "$s b $rdmx_release '$pingpong' 50"; then
        echo "== stock perftest against rdmx: ok ($((SECONDS - t2)) s)"
    else
        echo "== stock perftest against rdmx: FAILED ($((SECONDS - t2)) s)"
        return 1
    fi
}
if [ -n "$rdmx_release" ] && [ $rc -eq 0 ]; then
    perftest_interop || rc=1
fi
echo "== rxe-test: status $rc after $((SECONDS - start)) s"
exit "$rc"
