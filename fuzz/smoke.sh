#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time; exits non-zero if any crashed
# (after running the rest).
#
#   fuzz/smoke.sh                 # every target, FUZZ_SECONDS each (default 20)
#   fuzz/smoke.sh wire_packet     # only the targets named
#
# Environment:
#   FUZZ_SECONDS    seconds per target (default 20)
#   FUZZ_SANITIZER  none (default) or address; address needs -Zsanitizer, which stable
#                   Rust accepts with RUSTC_BOOTSTRAP=1, set here for that case only
#   FUZZ_CORPUS     where new corpus entries go (default: a fresh temporary directory,
#                   so a run never grows the repository); fuzz/seeds/TARGET is read too,
#                   and fuzz/dicts/TARGET is given to libFuzzer as a dictionary
#   CARGO_TARGET_DIR  as usual (default fuzz/target)
#
# Installs cargo-fuzz (`cargo install cargo-fuzz --locked`, about a minute on 2 cores)
# when it is missing. A crash leaves its input in fuzz/artifacts/TARGET/; reproduce it
# with `cargo fuzz run --sanitizer none TARGET fuzz/artifacts/TARGET/crash-...`.
set -euo pipefail
cd "$(dirname "$0")"

seconds="${FUZZ_SECONDS:-20}"
sanitizer="${FUZZ_SANITIZER:-none}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(wire_packet engine_responder engine_requester tcp_stream cm_exchange shm_ring ud_datagram)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    start=$SECONDS
    cargo install cargo-fuzz --locked
    echo "cargo-fuzz installed in $((SECONDS - start)) s"
fi
cargo fuzz --version

case "$sanitizer" in
none) ;;
address | leak | memory | thread) export RUSTC_BOOTSTRAP=1 ;;
*)
    echo "FUZZ_SANITIZER must be none, address, leak, memory or thread" >&2
    exit 2
    ;;
esac

echo "== build (sanitizer: $sanitizer)"
start=$SECONDS
cargo fuzz build --sanitizer "$sanitizer"
echo "built in $((SECONDS - start)) s"

tmp=""
if [ -z "${FUZZ_CORPUS:-}" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
fi

failed=()
for t in "${targets[@]}"; do
    corpus="${FUZZ_CORPUS:-$tmp}/$t"
    mkdir -p "$corpus" "artifacts/$t"
    dirs=("$corpus")
    [ -d "seeds/$t" ] && dirs+=("seeds/$t")
    dict=()
    [ -f "dicts/$t" ] && dict=("-dict=dicts/$t")
    echo "== $t: ${seconds} s"
    log="$(mktemp)"
    # -timeout: an input taking over 10 s is reported as a hang; -rss_limit_mb: as an OOM.
    if ! cargo fuzz run --sanitizer "$sanitizer" "$t" "${dirs[@]}" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 "${dict[@]}" >"$log" 2>&1; then
        tail -n 60 "$log"
        rm -f "$log"
        echo "FAIL: $t crashed; the input is in fuzz/artifacts/$t/" >&2
        failed+=("$t")
        continue
    fi
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" || tail -n 5 "$log"
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
    rm -f "$log"
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz smoke: ${#failed[@]} of ${#targets[@]} targets crashed: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz smoke: ${#targets[@]} targets, ${seconds} s each, no crash"
