/* The bare two-copy ring the shm provider's ring data path stands on, for
 * scripts/shm-bench.sh: two processes share a ring of RING_MIB MiB (the provider's default
 * is 4) in a MAP_SHARED mapping; the producer memcpys MSG-byte messages from a private
 * buffer into the ring's next slot and publishes a counter, the consumer waits for it,
 * memcpys the slot into a private buffer and publishes its own counter (the counters on
 * lines of their own). No headers, no transport, no completions: what is left is the two
 * copies and every ring line crossing from one core's cache to the other's, which bound
 * the ring path whatever its software does. The consumer prints what it received per
 * second, from the first message to the last, in MiB/s.
 *
 * Usage: shm-ring-anchor MSG_BYTES COUNT [RING_MIB]
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct ctl {
    _Alignas(64) _Atomic uint64_t produced;
    _Alignas(64) _Atomic uint64_t consumed;
    _Alignas(64) char pad[64];
};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void relax(void)
{
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MSG_BYTES COUNT [RING_MIB]\n", argv[0]);
        return 2;
    }
    size_t msg = strtoull(argv[1], 0, 0);
    uint64_t count = strtoull(argv[2], 0, 0);
    size_t ring = (argc > 3 ? strtoull(argv[3], 0, 0) : 4) << 20;
    if (msg == 0 || msg > ring || count == 0) {
        fprintf(stderr, "shm-ring-anchor: bad sizes\n");
        return 2;
    }
    uint64_t slots = ring / msg;
    size_t len = 4096 + ring;
    char *shared = mmap(0, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(shared, 0, len);
    struct ctl *c = (struct ctl *)shared;
    char *data = shared + 4096;
    char *buf = aligned_alloc(4096, (msg + 4095) & ~(size_t)4095);
    memset(buf, 7, msg);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) { /* the producer */
        for (uint64_t i = 0; i < count; i++) {
            while (i - atomic_load_explicit(&c->consumed, memory_order_acquire) >= slots)
                relax();
            memcpy(data + (i % slots) * msg, buf, msg);
            atomic_store_explicit(&c->produced, i + 1, memory_order_release);
        }
        _exit(0);
    }
    char *out = aligned_alloc(4096, (msg + 4095) & ~(size_t)4095);
    memset(out, 0, msg);
    double start = 0;
    for (uint64_t i = 0; i < count; i++) {
        while (atomic_load_explicit(&c->produced, memory_order_acquire) <= i)
            relax();
        if (i == 0)
            start = now();
        memcpy(out, data + (i % slots) * msg, msg);
        atomic_store_explicit(&c->consumed, i + 1, memory_order_release);
    }
    double secs = now() - start;
    int st;
    waitpid(pid, &st, 0);
    if (out[0] != 7 || out[msg - 1] != 7) {
        fprintf(stderr, "shm-ring-anchor: the consumer read the wrong bytes\n");
        return 1;
    }
    printf("%.1f\n", (double)(count - 1) * msg / secs / 1048576.0);
    return 0;
}
