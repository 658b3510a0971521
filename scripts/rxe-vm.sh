#!/usr/bin/env bash
# Real rdma-core on Soft-RoCE (rdma_rxe) in a qemu VM, for machines whose kernel has no
# RDMA support. Builds (once, cached) a Debian trixie rootfs with rdma-core, perftest and a
# kernel that has rdma_rxe, boots it under TCG with the rootfs served over 9p, creates rxe0
# on eth0 and runs a command there. Host directories (by default the repo and
# $CARGO_TARGET_DIR) are mounted at the same absolute paths inside, so binaries built on
# the host run with their compiled-in paths.
#
# Usage:
#   scripts/rxe-vm.sh build                     build the rootfs + initrd (no-op when cached)
#   scripts/rxe-vm.sh build-siw                 build siw.ko for its kernel (no-op when cached)
#   scripts/rxe-vm.sh path                      print the cache directory in use (builds it)
#   scripts/rxe-vm.sh run [OPTS] -- CMD [ARG...]
#         boot one VM (eth0 10.0.2.15/24 on a restricted user netdev, rxe0 on it), run CMD;
#         exit status = CMD's
#   scripts/rxe-vm.sh run2 [OPTS] --a 'SHELL CMD A' --b 'SHELL CMD B'
#         boot two VMs joined by a qemu socket netdev (a: 10.77.0.1/24, b: 10.77.0.2/24),
#         each with rxe0; output lines are prefixed [a] / [b]; fails if either fails
# OPTS:
#   --share DIR      share DIR at the same path inside (repeatable; replaces the defaults)
#   --timeout SECS   kill the VM after SECS (default $RXE_VM_TIMEOUT or 900)
#   --mtu N          eth0 MTU (default 9000, giving rxe active_mtu 4096; 1500 gives 1024)
#   --cwd DIR        working directory of the command (default: $PWD if shared, else /)
#   --siw            soft-iWARP instead of Soft-RoCE: load siw.ko (built once, cached under
#                    a key of its own) and create siw0 on eth0 instead of rxe0
#   --env NAME       pass the host's NAME=value into the VM (repeatable; RUST_BACKTRACE,
#                    RUST_LOG and RUST_TEST_THREADS always pass)
#   --b-no-rxe       run2: VM b gets no rxe0 (rdma_rxe is not loaded, so UDP port 4791 is
#                    free for a user-space RoCEv2 peer); RXE_DEV and RXE_GID_INDEX are
#                    empty there
#
# Inside the VM the command sees: RXE_DEV=rxe0 (siw0 with --siw), RXE_IP (eth0's address), RXE_PEER (the
# other VM's address in run2, else RXE_IP), RXE_GID_INDEX (index of the IPv4-mapped GID,
# for perftest -x / ibv_*_pingpong -g), RXE_ROLE (vm, a or b), and two helpers on PATH:
#   rxe-wait-listen PORT [SECS]   wait until something in this VM listens on TCP PORT
#   rxe-retry SECS CMD [ARG...]   rerun CMD until it succeeds or SECS pass (for clients
#                                 started before their server, e.g. across run2's VMs)
#
# Environment: RDMX_VM_CACHE (default ~/.cache/rdmx-vm), RXE_VM_MIRROR (default
# http://deb.debian.org/debian), RXE_VM_TIMEOUT, RXE_VM_KERNEL_ARGS (appended to the guest
# kernel's command line), RXE_VM_BOOTS (default 3: a VM whose kernel dies before the
# command starts - an early panic under TCG on a loaded host - is booted again, with
# noapic, up to this many boots in all). Needs root (or sudo) to build the rootfs.
# This file can also be sourced; it then only defines the rxe_* functions.
set -euo pipefail

RXE_VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RXE_REPO=$(cd "$RXE_VM_DIR/.." && pwd)

# ---------------------------------------------------------------------------------------
# The rootfs. Everything that decides its contents is in RXE_SUITE, RXE_PACKAGES and the
# functions rxe_build_into / rxe_initrd_conf; the cache key is a hash of exactly those.
RXE_SUITE=trixie
RXE_PACKAGES=linux-image-amd64,kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,perftest,procps

rxe_cache_key() {
    { declare -p RXE_SUITE RXE_PACKAGES; declare -f rxe_build_into rxe_initrd_conf; } |
        sha256sum | cut -c1-16
}

rxe_cache_dir() {
    echo "${RDMX_VM_CACHE:-$HOME/.cache/rdmx-vm}/$(rxe_cache_key)"
}

# A slim initrd: only the modules needed to mount the rootfs over virtio 9p, with a
# writable tmpfs overlay on top (so mount points for the host shares can be made), and the
# per-run share "rxerun" mounted at /rxe (it carries the init that runs).
rxe_initrd_conf() { # ROOTFS
    local root=$1
    sed -i -e 's/^MODULES=.*/MODULES=list/' -e 's/^COMPRESS=.*/COMPRESS=gzip/' \
        "$root/etc/initramfs-tools/initramfs.conf"
    printf '%s\n' virtio_pci 9pnet_virtio 9p overlay >"$root/etc/initramfs-tools/modules"
    cat >"$root/etc/initramfs-tools/scripts/rxe9p" <<'EOF'
# boot=rxe9p: the root is the 9p tag "rootfs" (read-only) under a tmpfs overlay.
mountroot()
{
	modprobe -q virtio_pci
	modprobe -q 9pnet_virtio
	modprobe -q 9p
	modprobe -q overlay
	mkdir -p /rxe-lower /rxe-rw
	mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose rootfs /rxe-lower ||
		panic "rxe9p: cannot mount the 9p rootfs"
	mount -t tmpfs -o mode=0755 rxe-rw /rxe-rw
	mkdir -p /rxe-rw/upper /rxe-rw/work
	mount -t overlay -o lowerdir=/rxe-lower,upperdir=/rxe-rw/upper,workdir=/rxe-rw/work \
		overlay "${rootmnt}" || panic "rxe9p: cannot mount the overlay root"
	mount -t devtmpfs -o mode=0755 devtmpfs "${rootmnt}/dev"
	mkdir -p "${rootmnt}/rxe"
	mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 rxerun "${rootmnt}/rxe" ||
		panic "rxe9p: cannot mount the run share"
}
EOF
}

rxe_build_into() { # DIR MIRROR: debootstrap into DIR/rootfs, leave DIR/vmlinuz, DIR/initrd
    local dir=$1 mirror=$2 root kver
    root=$dir/rootfs
    debootstrap --variant=minbase --include="$RXE_PACKAGES" "$RXE_SUITE" "$root" "$mirror"
    kver=$(basename "$(echo "$root"/lib/modules/*)")
    rxe_initrd_conf "$root"
    chroot "$root" mkinitramfs -o /boot/initrd.rxe9p "$kver"
    echo rxe-vm >"$root/etc/hostname"
    printf '127.0.0.1 localhost\n::1 localhost\n' >"$root/etc/hosts"
    rm -f "$root/boot/initrd.img-$kver"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    mv "$root/boot/initrd.rxe9p" "$dir/initrd"
    cp "$root/boot/vmlinuz-$kver" "$dir/vmlinuz"
}
# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# soft-iWARP. Debian's kernels do not build siw (CONFIG_RDMA_SIW is unset); the module is
# built out of tree for the rootfs's kernel, in a throwaway overlay over the rootfs (which
# stays untouched), and cached under a key of its own: a hash of rxe_siw_build_into and the
# kernel version, so changing this never rebuilds the rootfs.
rxe_kver() { # ROOTFS
    basename "$(echo "$1"/lib/modules/*)"
}

rxe_siw_cache_dir() {
    local kver
    kver=$(rxe_kver "$(rxe_cache_dir)/rootfs")
    echo "${RDMX_VM_CACHE:-$HOME/.cache/rdmx-vm}/siw-$({ echo "$kver"; declare -f rxe_siw_build_into; } |
        sha256sum | cut -c1-16)"
}

rxe_siw_build_into() { # DIR ROOTFS MIRROR KVER: leave DIR/siw.ko, built for kernel KVER
    local dir=$1 lower=$2 mirror=$3 kver=$4 ovl=$1/ovl series
    series=${kver%%-*}
    series=${series%.*}
    mkdir -p "$ovl/upper" "$ovl/work" "$ovl/root"
    mount -t overlay -o "lowerdir=$lower,upperdir=$ovl/upper,workdir=$ovl/work" overlay "$ovl/root"
    mount -t proc proc "$ovl/root/proc"
    trap 'umount -l "$ovl/root/proc" "$ovl/root" 2>/dev/null || true' EXIT
    cp /etc/resolv.conf "$ovl/root/etc/resolv.conf"
    printf 'deb %s trixie main\n' "$mirror" >"$ovl/root/etc/apt/sources.list"
    chroot "$ovl/root" apt-get update -qq
    chroot "$ovl/root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "linux-headers-$kver" "linux-source-$series" make gcc xz-utils bc
    chroot "$ovl/root" bash -c "set -euo pipefail; mkdir -p /siw; cd /siw
        tar -xJf /usr/src/linux-source-$series.tar.xz --strip-components=1 \
            linux-source-$series/drivers/infiniband/sw/siw
        make -s -C /lib/modules/$kver/build M=/siw/drivers/infiniband/sw/siw CONFIG_RDMA_SIW=m modules"
    cp "$ovl/root/siw/drivers/infiniband/sw/siw/siw.ko" "$dir/siw.ko"
    umount -l "$ovl/root/proc" "$ovl/root"
    trap - EXIT
    rm -rf "$ovl"
}

# Build siw.ko unless cached (after the rootfs), under the same kind of lock and
# rename-into-place as the rootfs.
rxe_siw_build() {
    local dest base tmp start kver
    rxe_build
    dest=$(rxe_siw_cache_dir)
    [ -e "$dest/siw.ko" ] && return 0
    kver=$(rxe_kver "$(rxe_cache_dir)/rootfs")
    base=$(dirname "$dest")
    exec {lockfd}>"$base/.lock"
    flock "$lockfd"
    if [ ! -e "$dest/siw.ko" ]; then
        tmp=$(mktemp -d "$base/.tmp-siw-XXXXXX")
        # shellcheck disable=SC2064 # expand now: the trap must remove this build's dir
        trap "rxe_rm_tree '$tmp'" EXIT
        start=$SECONDS
        echo "rxe-vm: building siw.ko for $kver into $dest (about 2 minutes)" >&2
        if ! rxe_sudo bash -c "set -euo pipefail; $(declare -f rxe_siw_build_into)
                rxe_siw_build_into '$tmp' '$(rxe_cache_dir)/rootfs' '${RXE_VM_MIRROR:-http://deb.debian.org/debian}' '$kver'" \
            >"$tmp.log" 2>&1; then
            tail -n 30 "$tmp.log" >&2
            echo "rxe-vm: siw build failed (log above)" >&2
            rm -f "$tmp.log"
            exit 1
        fi
        rm -f "$tmp.log"
        chmod 755 "$tmp"
        mv "$tmp" "$dest"
        trap - EXIT
        echo "rxe-vm: siw.ko built in $((SECONDS - start)) s" >&2
    fi
    flock -u "$lockfd"
    exec {lockfd}>&-
}
# ---------------------------------------------------------------------------------------

rxe_sudo() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

rxe_host_packages() {
    local need=()
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    [ -e /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
    command -v flock >/dev/null || need+=(util-linux)
    if [ ${#need[@]} -gt 0 ]; then
        echo "rxe-vm: installing ${need[*]}" >&2
        rxe_sudo apt-get update -qq
        rxe_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "${need[@]}" >/dev/null
    fi
}

# Lazily unmount whatever is mounted under DIR (debootstrap mounts proc/sys in its target
# and may leave them behind when interrupted), then remove DIR without leaving its device.
rxe_rm_tree() {
    local dir=$1 m
    [ -e "$dir" ] || return 0
    while read -r m; do
        rxe_sudo umount -l "$m" 2>/dev/null || true
    done < <(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
    rxe_sudo rm -rf --one-file-system "$dir"
}

# Build the rootfs unless cached. Builds into a temporary directory next to the cache
# entry and renames it into place on success, under a lock, so an interrupted or
# concurrent build never leaves a half-built entry.
rxe_build() {
    local dest base tmp start
    dest=$(rxe_cache_dir)
    [ -e "$dest/initrd" ] && return 0
    rxe_host_packages
    base=$(dirname "$dest")
    mkdir -p "$base"
    exec {lockfd}>"$base/.lock"
    flock "$lockfd"
    if [ ! -e "$dest/initrd" ]; then
        local d
        for d in "$base"/.tmp-*; do rxe_rm_tree "$d"; done # leftovers of killed builds
        tmp=$(mktemp -d "$base/.tmp-XXXXXX")
        # shellcheck disable=SC2064 # expand now: the trap must remove this build's dir
        trap "rxe_rm_tree '$tmp'" EXIT
        start=$SECONDS
        echo "rxe-vm: building the $RXE_SUITE rootfs into $dest (about 2 minutes)" >&2
        if ! rxe_sudo bash -c "set -euo pipefail; RXE_SUITE=$RXE_SUITE RXE_PACKAGES=$RXE_PACKAGES
                $(declare -f rxe_build_into rxe_initrd_conf); rxe_build_into '$tmp' '${RXE_VM_MIRROR:-http://deb.debian.org/debian}'" \
            >"$tmp.log" 2>&1; then
            tail -n 30 "$tmp.log" >&2
            echo "rxe-vm: rootfs build failed (log above)" >&2
            rm -f "$tmp.log"
            exit 1
        fi
        rm -f "$tmp.log"
        chmod 755 "$tmp"
        mv "$tmp" "$dest"
        trap - EXIT
        echo "rxe-vm: rootfs built in $((SECONDS - start)) s" >&2
    fi
    flock -u "$lockfd"
    exec {lockfd}>&-
}

# The init the VM runs (PID 1), written into each run's share. Not part of the rootfs, so
# changing it does not rebuild anything.
rxe_write_init() { # RUNDIR
    cat >"$1/init" <<'EOF'
#!/bin/bash
# PID 1 inside the rxe VM (written by scripts/rxe-vm.sh).
export PATH=/rxe/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb LANG=C.UTF-8
say() { echo "rxe-vm: $*"; }
vm_exit() { # report STATUS to qemu through isa-debug-exit (qemu exits with 2*STATUS+1)
    local rc=$1
    say "exit status $rc"
    if [ "$rc" -gt 127 ]; then say "(reported to the host as 127)"; rc=127; fi
    sync
    printf "\\$(printf %03o "$rc")" | dd of=/dev/port bs=1 seek=244 count=1 status=none
    sleep 2
    exit "$rc" # not reached; a dying init panics and panic=-1 -no-reboot ends qemu
}
fail() { say "setup failed: $*"; vm_exit 125; }
trap 'fail "init error at line $LINENO"' ERR

mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mountpoint -q /run || mount -t tmpfs -o mode=0755 tmpfs /run
. /rxe/env
hostname "rxe-$RXE_ROLE"
for s in "${RXE_SHARES[@]}"; do # tag=path
    mkdir -p "${s#*=}"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "${s%%=*}" "${s#*=}" ||
        fail "cannot mount ${s#*=}"
done

modprobe virtio_net
for _ in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.05; done
[ -e /sys/class/net/eth0 ] || fail "no eth0"
ip link set lo up
if [ "$RXE_MTU" != 1500 ]; then
    ip link set eth0 mtu "$RXE_MTU" || say "cannot set eth0 mtu $RXE_MTU; keeping 1500"
fi
ip addr add "$RXE_IP/24" dev eth0
ip link set eth0 up
if [ "${RXE_NO_RXE:-0}" = 1 ]; then
    RXE_DEV='' RXE_GID_INDEX=''
    export RXE_GID_INDEX RXE_DEV RXE_IP RXE_PEER RXE_ROLE
    ulimit -l unlimited
    say "no rxe here (eth0 $RXE_IP, mtu $(cat /sys/class/net/eth0/mtu)): UDP port 4791 is free"
else
modprobe rdma_ucm # rdma_cm for user space (/dev/infiniband/rdma_cm)
dmesg -n 1 # keep rxe's per-QP error messages off the console
if [ "$RXE_SIW" = 1 ]; then
    # soft-iWARP instead of Soft-RoCE: the out-of-tree siw.ko (unsigned: loads with a taint)
    # needs these loaded first, libcrc32c for its CRC32c.
    modprobe -a ib_core rdma_cm iw_cm libcrc32c
    insmod /rxe/siw.ko || fail "insmod siw.ko failed"
    rdma link add siw0 type siw netdev eth0 || fail "rdma link add siw0 failed"
    port=/sys/class/infiniband/siw0/ports/1
    for _ in $(seq 200); do
        [ "$(cat $port/state 2>/dev/null)" = "4: ACTIVE" ] && break
        sleep 0.05
    done
    [ "$(cat $port/state 2>/dev/null)" = "4: ACTIVE" ] || fail "siw0 not ACTIVE ($(cat $port/state 2>&1))"
    # iWARP addresses peers by IP through rdma_cm; GID index 0 carries the MAC.
    export RXE_GID_INDEX=0 RXE_DEV=siw0 RXE_IP RXE_PEER RXE_ROLE
    ulimit -l unlimited
    say "siw0 ACTIVE on eth0 $RXE_IP (mtu $(cat /sys/class/net/eth0/mtu))"
else
    modprobe rdma_rxe
    rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0 failed"
    port=/sys/class/infiniband/rxe0/ports/1
    IFS=. read -r a b c d <<<"$RXE_IP"
    want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$a" "$b" "$c" "$d")
    RXE_GID_INDEX=
    for _ in $(seq 200); do
        if [ "$(cat $port/state 2>/dev/null)" = "4: ACTIVE" ]; then
            for g in $port/gids/*; do
                if [ "$(cat "$g" 2>/dev/null)" = "$want" ]; then RXE_GID_INDEX=${g##*/}; break; fi
            done
            [ -n "$RXE_GID_INDEX" ] && break
        fi
        sleep 0.05
    done
    [ -n "$RXE_GID_INDEX" ] || fail "rxe0 not ACTIVE with the IPv4 GID ($(cat $port/state 2>&1))"
    export RXE_GID_INDEX RXE_DEV=rxe0 RXE_IP RXE_PEER RXE_ROLE
    ulimit -l unlimited
    mtu=$(ibv_devinfo -d rxe0 | awk '/active_mtu/ {print $2}')
    say "rxe0 ACTIVE on eth0 $RXE_IP (mtu $(cat /sys/class/net/eth0/mtu)), active_mtu $mtu, IPv4 GID index $RXE_GID_INDEX"
fi
fi
trap - ERR

cd "$RXE_CWD" 2>/dev/null || cd /
# Tells the host the VM booted: a VM that ends without this marker never ran the command
# and may be booted again.
: >/rxe/started
rc=0
bash /rxe/cmd </dev/null || rc=$?
vm_exit "$rc"
EOF
    chmod +x "$1/init"
    mkdir -p "$1/bin"
    cat >"$1/bin/rxe-wait-listen" <<'EOF'
#!/bin/bash
# rxe-wait-listen PORT [SECS]: wait until a local socket listens on TCP PORT.
port=$(printf '%04X' "$1"); end=$((SECONDS + ${2:-30}))
while [ $SECONDS -lt $end ]; do
    awk -v p=":$port" '$4 == "0A" && substr($2, length($2) - 4) == p {f=1} END {exit !f}' \
        /proc/net/tcp /proc/net/tcp6 && exit 0
    sleep 0.1
done
echo "rxe-wait-listen: nothing listens on port $1" >&2; exit 1
EOF
    cat >"$1/bin/rxe-retry" <<'EOF'
#!/bin/bash
# rxe-retry SECS CMD [ARG...]: run CMD until it succeeds, for at most SECS seconds.
end=$((SECONDS + $1)); shift
until "$@"; do
    [ $SECONDS -lt "$end" ] || { echo "rxe-retry: giving up on $1" >&2; exit 1; }
    sleep 1
done
EOF
    chmod +x "$1/bin/rxe-wait-listen" "$1/bin/rxe-retry"
}

# Turn the serial stream into plain lines: no \r, no ANSI/VT escape sequences, and not
# qemu's warning about the fw_cfg item that keeps SeaBIOS off the serial console.
rxe_strip() {
    sed -u -e 's/\r//g' -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1b[()][A-Za-z0-9]//g' \
        -e 's/\x1b[=>78cDEHM]//g' -e 's/\x1b//g' -e '/etc\/sercon-port.*prefixed with/d'
}

# Option parsing shared by run and run2; sets RXE_OPT_* and leaves the rest in RXE_ARGS.
rxe_parse_opts() {
    RXE_OPT_SHARES=() RXE_OPT_ENV=(RUST_BACKTRACE RUST_LOG RUST_TEST_THREADS)
    RXE_OPT_TIMEOUT=${RXE_VM_TIMEOUT:-900} RXE_OPT_MTU=9000 RXE_OPT_CWD=$PWD
    RXE_OPT_A='' RXE_OPT_B='' RXE_OPT_B_NO_RXE=0 RXE_ARGS=() RXE_OPT_SIW=0
    while [ $# -gt 0 ]; do
        case $1 in
        --share) RXE_OPT_SHARES+=("$(cd "$2" && pwd)"); shift 2 ;;
        --timeout) RXE_OPT_TIMEOUT=$2; shift 2 ;;
        --mtu) RXE_OPT_MTU=$2; shift 2 ;;
        --cwd) RXE_OPT_CWD=$2; shift 2 ;;
        --env) RXE_OPT_ENV+=("$2"); shift 2 ;;
        --siw) RXE_OPT_SIW=1; shift ;;
        --a) RXE_OPT_A=$2; shift 2 ;;
        --b) RXE_OPT_B=$2; shift 2 ;;
        --b-no-rxe) RXE_OPT_B_NO_RXE=1; shift ;;
        --) shift; RXE_ARGS=("$@"); return ;;
        *) echo "rxe-vm: unknown option $1" >&2; exit 2 ;;
        esac
    done
}

# Shares: the given ones, or the repo and the cargo target dir; nested ones are dropped.
rxe_shares() {
    local s t p keep=()
    if [ ${#RXE_OPT_SHARES[@]} -eq 0 ]; then
        RXE_OPT_SHARES=("$RXE_REPO")
        if [ -n "${CARGO_TARGET_DIR:-}" ]; then
            t=$CARGO_TARGET_DIR
            case $t in /*) ;; *) t=$RXE_REPO/$t ;; esac
            mkdir -p "$t"
            RXE_OPT_SHARES+=("$(cd "$t" && pwd)")
        fi
    fi
    while read -r s; do
        for p in "${keep[@]}"; do
            case $s/ in "$p"/*) continue 2 ;; esac
        done
        keep+=("$s")
    done < <(printf '%s\n' "${RXE_OPT_SHARES[@]}" | sort -u)
    RXE_OPT_SHARES=("${keep[@]}")
}

# Prepare the share of one VM: init, helpers, env and the command.
rxe_prepare() { # RUNDIR ROLE IP PEER CMDTEXT [NO_RXE]
    local run=$1 i n cwd=/
    mkdir -p "$run"
    rxe_write_init "$run"
    for i in "${RXE_OPT_SHARES[@]}"; do
        case $RXE_OPT_CWD/ in "$i"/*) cwd=$RXE_OPT_CWD ;; esac
    done
    {
        printf 'RXE_ROLE=%q RXE_IP=%q RXE_PEER=%q RXE_MTU=%q RXE_CWD=%q RXE_SIW=%q RXE_NO_RXE=%q\n' \
            "$2" "$3" "$4" "$RXE_OPT_MTU" "$cwd" "$RXE_OPT_SIW" "${6:-0}"
        printf 'RXE_SHARES=('
        for i in "${!RXE_OPT_SHARES[@]}"; do printf '%q ' "host$i=${RXE_OPT_SHARES[$i]}"; done
        printf ')\n'
        for n in "${RXE_OPT_ENV[@]}"; do
            [ -z "${!n+x}" ] || printf 'export %s=%q\n' "$n" "${!n}"
        done
    } >"$run/env"
    printf '%s\n' "$5" >"$run/cmd"
    if [ "$RXE_OPT_SIW" = 1 ]; then cp "$(rxe_siw_cache_dir)/siw.ko" "$run/siw.ko"; fi
}

# Print the qemu command line for one VM, NUL-separated.
rxe_qemu_args() { # RUNDIR PIDFILE NETDEV MAC
    local cache i
    cache=$(rxe_cache_dir)
    # thread=single: the guest kernel patches its code on the fly (static keys: the
    # network stack's first flow hash, the clocksource), with an int3 over the first byte
    # while it writes the rest; multi-threaded TCG can run a vCPU through a stale copy
    # of the half-patched code after the patch is done, which ends in an "Oops: int3"
    # and a panic (seen in sched_clock_cpu and in __skb_get_hash_net under rxe). One
    # host thread for both vCPUs sees every write at once. tsc=reliable: under TCG the
    # clocksource watchdog sometimes finds the TSC skewed and marks it unstable, which
    # patches the sched_clock static key.
    # shellcheck disable=SC2054 # the commas are qemu's
    local args=(timeout --foreground -k 10 "$RXE_OPT_TIMEOUT"
        qemu-system-x86_64 -accel tcg,thread=single -cpu max -smp 2 -m 2048 -nographic -no-reboot
        -kernel "$cache/vmlinuz" -initrd "$cache/initrd"
        -append "console=ttyS0 boot=rxe9p init=/rxe/init net.ifnames=0 quiet panic=-1 tsc=reliable${RXE_VM_KERNEL_ARGS:+ $RXE_VM_KERNEL_ARGS}"
        -virtfs "local,path=$cache/rootfs,mount_tag=rootfs,security_model=none,readonly=on"
        -virtfs "local,path=$1,mount_tag=rxerun,security_model=none"
        -device isa-debug-exit,iobase=0xf4,iosize=0x04 -fw_cfg name=etc/sercon-port,string=0
        -netdev "$3" -device "virtio-net-pci,netdev=n0,mac=$4,romfile="
        -pidfile "$2")
    for i in "${!RXE_OPT_SHARES[@]}"; do
        args+=(-virtfs "local,path=${RXE_OPT_SHARES[$i]},mount_tag=host$i,security_model=none,multidevs=remap")
    done
    printf '%s\0' "${args[@]}"
}

# Map qemu's exit status to the command's: isa-debug-exit gives 2*rc+1.
rxe_status() { # QEMU_STATUS LABEL
    local s=$1
    if [ $((s % 2)) -eq 1 ]; then
        echo $((s >> 1))
    elif [ "$s" -eq 124 ] || [ "$s" -eq 137 ]; then
        echo "rxe-vm: $2 timed out after $RXE_OPT_TIMEOUT s" >&2
        echo 124
    else
        echo "rxe-vm: $2 ended without reporting a status (qemu exit $s)" >&2
        echo 125
    fi
}

RXE_TMP=''
rxe_cleanup() {
    local p
    [ -n "$RXE_TMP" ] || return 0
    for p in "$RXE_TMP"/*.pid; do
        if [ -e "$p" ]; then kill "$(cat "$p")" 2>/dev/null || true; fi
    done
    rm -rf "$RXE_TMP"
}

# Start VM ROLE in the background: its serial output, cleaned (and prefixed with PREFIX),
# goes to stdout; qemu's exit status lands in $RXE_TMP/ROLE.st. Waiting on it with `wait`
# (not a foreground pipeline) lets INT/TERM reach the traps, which stop qemu.
rxe_launch() { # ROLE PREFIX QEMU-ARGS...
    local role=$1 prefix=$2
    shift 2
    (
        set +e
        "$@" </dev/null 2>&1 | rxe_strip | sed -u "s/^/$prefix/"
        { echo "${PIPESTATUS[0]}" >"$RXE_TMP/$role.st"; } 2>/dev/null # gone if interrupted
    ) &
}

rxe_run() { # [OPTS] -- CMD...
    local args=()
    rxe_parse_opts "$@"
    [ ${#RXE_ARGS[@]} -gt 0 ] || { echo "usage: rxe-vm.sh run [OPTS] -- CMD [ARG...]" >&2; exit 2; }
    rxe_build
    [ "$RXE_OPT_SIW" = 0 ] || rxe_siw_build
    rxe_shares
    RXE_TMP=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
    trap rxe_cleanup EXIT
    rxe_prepare "$RXE_TMP/vm" vm 10.0.2.15 10.0.2.15 "$(printf '%q ' "${RXE_ARGS[@]}")"
    while :; do
        rm -f "$RXE_TMP/vm.st" "$RXE_TMP/vm.pid" "$RXE_TMP/vm/started"
        mapfile -d '' args < <(rxe_qemu_args "$RXE_TMP/vm" "$RXE_TMP/vm.pid" \
            user,id=n0,restrict=on 52:54:00:77:00:0f)
        rxe_launch vm '' "${args[@]}"
        wait $!
        rxe_boot_failed vm || break
        rxe_boot_again || break
    done
    return "$(rxe_status "$(cat "$RXE_TMP/vm.st")" VM)"
}

# True when VM ROLE ended on its own without a status and without having started its
# command: its kernel did not boot (under TCG on a loaded host it sometimes panics early,
# for example "IO-APIC + timer doesn't work"). A VM stopped by the host or timed out is
# not one.
rxe_boot_failed() { # ROLE
    local st
    st=$(cat "$RXE_TMP/$1.st" 2>/dev/null || echo 0)
    [ $((st % 2)) -eq 0 ] && [ "$st" -ne 124 ] && [ "$st" -ne 137 ] &&
        [ ! -e "$RXE_TMP/$1/started" ] && [ ! -e "$RXE_TMP/$1.killed" ]
}

# Allows another boot after a failed one (at most RXE_VM_BOOTS in all, default 3), with
# noapic added to the kernel command line. False when the boots are used up.
RXE_BOOTS=1
rxe_boot_again() {
    [ "$RXE_BOOTS" -lt "${RXE_VM_BOOTS:-3}" ] || return 1
    RXE_BOOTS=$((RXE_BOOTS + 1))
    case " ${RXE_VM_KERNEL_ARGS:-} " in
    *" noapic "*) ;;
    *) RXE_VM_KERNEL_ARGS="${RXE_VM_KERNEL_ARGS:+$RXE_VM_KERNEL_ARGS }noapic" ;;
    esac
    echo "rxe-vm: a VM did not boot; booting again (boot $RXE_BOOTS, kernel args: $RXE_VM_KERNEL_ARGS)" >&2
}

rxe_free_port() {
    local p hex
    while :; do
        p=$((20000 + RANDOM % 40000))
        hex=$(printf '%04X' "$p")
        awk -v h=":$hex" 'substr($2, length($2) - 4) == h {f=1} END {exit !f}' \
            /proc/net/tcp /proc/net/tcp6 2>/dev/null || { echo "$p"; return; }
    done
}

rxe_listening() { # PORT
    awk -v h=":$(printf '%04X' "$1")" '$4 == "0A" && substr($2, length($2) - 4) == h {f=1} END {exit !f}' \
        /proc/net/tcp
}

rxe_run2() { # [OPTS] --a CMD --b CMD
    local port r st end args_a=() args_b=() rc_a rc_b
    rxe_parse_opts "$@"
    if [ -z "$RXE_OPT_A" ] || [ -z "$RXE_OPT_B" ]; then
        echo "usage: rxe-vm.sh run2 [OPTS] --a 'CMD A' --b 'CMD B'" >&2; exit 2
    fi
    rxe_build
    [ "$RXE_OPT_SIW" = 0 ] || rxe_siw_build
    rxe_shares
    RXE_TMP=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX")
    trap rxe_cleanup EXIT
    rxe_prepare "$RXE_TMP/a" a 10.77.0.1 10.77.0.2 "$RXE_OPT_A"
    rxe_prepare "$RXE_TMP/b" b 10.77.0.2 10.77.0.1 "$RXE_OPT_B" "$RXE_OPT_B_NO_RXE"
    while :; do
        rm -f "$RXE_TMP"/[ab].st "$RXE_TMP"/[ab].pid "$RXE_TMP"/[ab].killed "$RXE_TMP"/[ab]/started
        port=$(rxe_free_port)
        mapfile -d '' args_a < <(rxe_qemu_args "$RXE_TMP/a" "$RXE_TMP/a.pid" \
            "socket,id=n0,listen=127.0.0.1:$port" 52:54:00:77:00:01)
        mapfile -d '' args_b < <(rxe_qemu_args "$RXE_TMP/b" "$RXE_TMP/b.pid" \
            "socket,id=n0,connect=127.0.0.1:$port" 52:54:00:77:00:02)
        rxe_launch a '[a] ' "${args_a[@]}"
        end=$((SECONDS + 20)) # b connects to a's listening socket
        until rxe_listening "$port" || [ -e "$RXE_TMP/a.st" ] || [ $SECONDS -ge $end ]; do
            sleep 0.1
        done
        rxe_launch b '[b] ' "${args_b[@]}"
        # When one VM fails, give the other 20 s to finish, then stop it.
        end=''
        while [ ! -e "$RXE_TMP/a.st" ] || [ ! -e "$RXE_TMP/b.st" ]; do
            if [ -z "$end" ]; then
                for r in a b; do
                    if [ -e "$RXE_TMP/$r.st" ] && [ "$(cat "$RXE_TMP/$r.st")" != 1 ]; then
                        end=$((SECONDS + 20))
                    fi
                done
            elif [ $SECONDS -ge "$end" ]; then
                for r in a b; do
                    if [ ! -e "$RXE_TMP/$r.st" ] && [ -e "$RXE_TMP/$r.pid" ]; then
                        echo "rxe-vm: stopping VM $r (the other one failed)" >&2
                        : >"$RXE_TMP/$r.killed"
                        kill "$(cat "$RXE_TMP/$r.pid")" 2>/dev/null || true
                    fi
                done
                end=$((SECONDS + 3600))
            fi
            sleep 0.2
        done
        wait
        { rxe_boot_failed a || rxe_boot_failed b; } || break
        rxe_boot_again || break
    done
    rc_a=$(rxe_status "$(cat "$RXE_TMP/a.st")" "VM a")
    rc_b=$(rxe_status "$(cat "$RXE_TMP/b.st")" "VM b")
    echo "rxe-vm: a exit $rc_a, b exit $rc_b"
    st=0
    [ "$rc_a" -eq 0 ] || st=$rc_a
    [ "$st" -ne 0 ] || st=$rc_b
    return "$st"
}

rxe_main() {
    local cmd=${1:-}
    trap 'exit 130' INT
    trap 'exit 143' TERM
    [ $# -eq 0 ] || shift
    case $cmd in
    build) rxe_build ;;
    build-siw) rxe_siw_build ;;
    path) rxe_build; rxe_cache_dir ;;
    run) rxe_run "$@" ;;
    run2) rxe_run2 "$@" ;;
    *)
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
        exit 2
        ;;
    esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    rxe_main "$@"
fi
