/* The bare kernel path the udp provider's bandwidth stands on, for scripts/udp-bench.sh:
 * UDP GSO over loopback, datagrams shaped as a 64 KiB RoCEv2 WRITE at a 4096-byte MTU
 * (4112 bytes: a 12-byte header, 4096 payload bytes from an aligned buffer, a 4-byte
 * trailer, each its own iovec), no ICRC, no transport. SHAPE is the number of datagrams
 * per send, repeated: "15", or "2,14", the provider's runs (a WRITE's first packet carries
 * a RETH, so it cannot head a run of middle packets). The receiver reads with UDP GRO
 * and copies each payload out, as the provider does; it prints what it received per
 * second, from its first datagram to its last, in MiB/s.
 *
 * Usage: udp-gso-anchor MIB SHAPE PORT
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

enum { HDR = 12, PAY = 4096, TRAIL = 4, SEG = HDR + PAY + TRAIL, MAXRUN = 15 };
enum { BUF = 4 << 20 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* A copy that keeps its speed whatever the two offsets within a cache line (glibc's
 * memcpy does not on some CPUs); the provider's copy picks between memcpy and such a loop
 * by measuring which is faster on the CPU, this one always takes the loop. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static void copy_out(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    memcpy(d + i, s + i, n - i);
}
#else
static void copy_out(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#endif

static int receiver(int fd, long long total) {
    char *slot = aligned_alloc(4096, 1 << 17), *mr = aligned_alloc(4096, BUF);
    if (!slot || !mr) return 1;
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    long long got = 0;
    size_t at = 0;
    double first = 0, last = 0;
    while (got < total) {
        ssize_t n = recv(fd, slot, 1 << 17, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            break; /* two quiet seconds: the rest was dropped */
        }
        last = now();
        if (first == 0) first = last;
        for (ssize_t off = 0; off + SEG <= n; off += SEG) {
            copy_out(mr + at, slot + off + HDR, PAY);
            at = (at + PAY) % BUF;
            got += PAY;
        }
    }
    if (got == 0 || last <= first) {
        fprintf(stderr, "udp-gso-anchor: nothing measured (%lld bytes)\n", got);
        return 1;
    }
    printf("%.1f\n", got / (last - first) / 1048576.0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: udp-gso-anchor MIB SHAPE PORT\n");
        return 2;
    }
    long long total = atoll(argv[1]) << 20;
    int shape[16], nshape = 0;
    for (char *p = strtok(argv[2], ","); p && nshape < 16; p = strtok(NULL, ",")) {
        int k = atoi(p);
        if (k < 1 || k > MAXRUN) {
            fprintf(stderr, "udp-gso-anchor: runs are 1 to %d datagrams\n", MAXRUN);
            return 2;
        }
        shape[nshape++] = k;
    }
    if (total <= 0 || nshape == 0) return 2;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
    a.sin_addr.s_addr = htonl(0x7f000001);
    int r = socket(AF_INET, SOCK_DGRAM, 0), one = 1, big = 64 << 20;
    if (r < 0 || bind(r, (struct sockaddr *)&a, sizeof a)) {
        perror("udp-gso-anchor: bind");
        return 1;
    }
    setsockopt(r, SOL_UDP, UDP_GRO, &one, sizeof one);
    setsockopt(r, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) return receiver(r, total);
    close(r);
    int s = socket(AF_INET, SOCK_DGRAM, 0), seg = SEG;
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) return 1;
    setsockopt(s, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big);
    if (setsockopt(s, SOL_UDP, UDP_SEGMENT, &seg, sizeof seg)) {
        perror("udp-gso-anchor: UDP_SEGMENT");
        return 1;
    }
    char *mr = aligned_alloc(4096, BUF), hdr[MAXRUN][HDR], trail[MAXRUN][TRAIL];
    if (!mr) return 1;
    memset(mr, 7, BUF);
    memset(hdr, 0, sizeof hdr);
    memset(trail, 0, sizeof trail);
    long long sent = 0;
    size_t at = 0;
    for (int run = 0; sent < total; run = (run + 1) % nshape) {
        struct iovec iov[3 * MAXRUN];
        int k, n = shape[run];
        if (at + (size_t)n * PAY > BUF) at = 0;
        for (k = 0; k < n; k++) {
            iov[3 * k] = (struct iovec){hdr[k], HDR};
            iov[3 * k + 1] = (struct iovec){mr + at + (size_t)k * PAY, PAY};
            iov[3 * k + 2] = (struct iovec){trail[k], TRAIL};
        }
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = 3 * n};
        if (sendmsg(s, &m, 0) < 0) {
            if (errno == ENOBUFS || errno == EAGAIN || errno == EINTR) continue;
            perror("udp-gso-anchor: sendmsg");
            break;
        }
        sent += (long long)n * PAY;
        at += (size_t)n * PAY;
    }
    int st = 1;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}
