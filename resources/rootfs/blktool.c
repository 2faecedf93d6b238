/*
 * blktool: block device work inside the guest, each job in one process
 * (every exec costs a lot under emulation, so a shell loop of dd would
 * measure exec, not I/O). Built statically into the root disk image by
 * resources/build-rootfs.sh; used by tests/tests/blk.rs and bench/blk.sh.
 *
 *   blktool bench DEVICE MIB SECONDS
 *       With O_DIRECT (the page cache never answers): sequential writes of
 *       the first MIB MiB in 1 MiB requests, pass after pass until SECONDS
 *       have passed (at least one pass), then fdatasync; sequential reads of
 *       them the same way; then 4 KiB reads at random 4 KiB-aligned offsets
 *       within them for SECONDS. Timing whole passes over at least SECONDS
 *       keeps a coarse guest clock from quantizing fast runs. One
 *       `key=value` line per figure. DEVICE is overwritten.
 *   blktool zeroout DEVICE OFFSET LENGTH
 *       BLKZEROOUT: the kernel zeroes the byte range (a write-zeroes request
 *       when the device offers it). busybox has no tool for it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define BIG (1 << 20)
#define SMALL 4096

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what)
{
    fprintf(stderr, "blktool: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int usage(void)
{
    fprintf(stderr, "usage: blktool bench DEVICE MIB SECONDS\n"
                    "       blktool zeroout DEVICE OFFSET LENGTH\n");
    return 2;
}

static int bench(const char *dev, long mib, double secs)
{
    if (mib <= 0 || secs <= 0)
        return usage();
    int fd = open(dev, O_RDWR | O_DIRECT);
    if (fd < 0)
        die(dev);
    void *buf;
    if (posix_memalign(&buf, 4096, BIG))
        die("posix_memalign");
    for (size_t i = 0; i < BIG; i++)
        ((unsigned char *)buf)[i] = (unsigned char)(i * 131 + 7);

    double t0 = now(), t1;
    long passes = 0;
    do {
        for (long i = 0; i < mib; i++)
            if (pwrite(fd, buf, BIG, (off_t)i * BIG) != BIG)
                die("write");
        passes++;
    } while (now() - t0 < secs);
    if (fdatasync(fd))
        die("fdatasync");
    t1 = now();
    printf("seq_write_mib_s=%.2f\n", passes * mib / (t1 - t0));
    fflush(stdout);

    t0 = now();
    passes = 0;
    do {
        for (long i = 0; i < mib; i++)
            if (pread(fd, buf, BIG, (off_t)i * BIG) != BIG)
                die("read");
        passes++;
    } while ((t1 = now()) - t0 < secs);
    printf("seq_read_mib_s=%.2f\n", passes * mib / (t1 - t0));
    fflush(stdout);

    uint64_t x = 0x9e3779b97f4a7c15ull, blocks = (uint64_t)mib * (BIG / SMALL), ops = 0;
    t0 = now();
    do {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if (pread(fd, buf, SMALL, (off_t)(x % blocks) * SMALL) != SMALL)
            die("random read");
        ops++;
    } while ((t1 = now()) - t0 < secs);
    printf("rand_read_4k_iops=%.1f\n", ops / (t1 - t0));
    return 0;
}

static int zeroout(const char *dev, uint64_t off, uint64_t len)
{
    int fd = open(dev, O_RDWR);
    if (fd < 0)
        die(dev);
    uint64_t range[2] = {off, len};
    if (ioctl(fd, BLKZEROOUT, range))
        die("BLKZEROOUT");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && !strcmp(argv[1], "bench"))
        return bench(argv[2], atol(argv[3]), atof(argv[4]));
    if (argc == 5 && !strcmp(argv[1], "zeroout"))
        return zeroout(argv[2], strtoull(argv[3], 0, 0), strtoull(argv[4], 0, 0));
    return usage();
}
