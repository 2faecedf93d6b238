/*
 * What the long-running guest tools (tandem-jitter, tandem-dirty) share:
 * a stop flag their SIGINT/SIGTERM handler sets, the monotonic clock in
 * nanoseconds, and a strict parser of unsigned decimal arguments. Static
 * functions in a header: each tool is one translation unit, built static
 * with musl by resources/build-guest.sh and build-rootfs.sh (whose cache
 * keys hash this file too).
 */
#ifndef TANDEM_TOOL_H
#define TANDEM_TOOL_H

#include <signal.h>
#include <stdint.h>
#include <time.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000 + (uint64_t)ts.tv_nsec;
}

/* A plain unsigned decimal no larger than max, or -1. */
static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
	uint64_t v = 0;
	if (!*s)
		return -1;
	for (; *s; s++) {
		if (*s < '0' || *s > '9')
			return -1;
		v = v * 10 + (uint64_t)(*s - '0');
		if (v > max)
			return -1;
	}
	*out = v;
	return 0;
}

#endif
