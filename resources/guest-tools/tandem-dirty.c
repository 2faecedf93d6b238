/*
 * tandem-dirty: a guest workload that dirties memory at a steady rate, for
 * live-migration runs (pre-copy has to keep up with it). It maps MIB MiB of
 * anonymous memory (asking for transparent huge pages, so setup takes few
 * page faults: each costs milliseconds when the guest kernel is emulated),
 * touches every 4 KiB page once, then writes one 8-byte counter into each
 * page in turn, cycling through the area, at RATE_MIB_PER_S: in 10 ms
 * slices, each ending at an absolute deadline (no drift; when behind, it
 * catches up without sleeping). RATE 0 dirties as fast as it can. Runs for
 * SECONDS (0 or none: until SIGTERM or SIGINT). Built static by
 * resources/build-guest.sh.
 *
 * usage: tandem-dirty MIB RATE_MIB_PER_S [SECONDS]
 * output: "tandem-dirty: MIB MiB ready in T ms" once set up, then on exit
 *         "tandem-dirty: P pages dirtied in S s, R MiB/s" (the first pass
 *         is not counted) and "tandem-dirty: every page holds its last
 *         write" or "tandem-dirty: N pages do not hold their last write"
 *         (each page's counter checked against the one it was last given:
 *         a page that went back to an older copy, as a migration that
 *         delivers an old copy after a newer one would leave it, shows)
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

#include "tool.h"

#define PAGE 4096
#define HUGE_PAGE (2u << 20)
#define SLICE_NS 10000000ull


int main(int argc, char **argv)
{
	uint64_t mib, rate, secs = 0;
	if (argc < 3 || argc > 4 || parse_u64(argv[1], 1 << 20, &mib) || mib == 0 ||
	    parse_u64(argv[2], 1 << 20, &rate) ||
	    (argc == 4 && parse_u64(argv[3], 100000000, &secs))) {
		fprintf(stderr, "usage: tandem-dirty MIB RATE_MIB_PER_S [SECONDS]\n");
		return 2;
	}

	uint64_t t0 = now_ns();
	size_t size = (size_t)mib << 20;
	/* One huge page more, to start the area on a huge-page boundary. */
	char *map = mmap(NULL, size + HUGE_PAGE, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (map == MAP_FAILED) {
		perror("tandem-dirty: mmap");
		return 1;
	}
	volatile char *area = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
	madvise((void *)area, size, MADV_HUGEPAGE); /* no THP: more faults, same result */
	const uint64_t pages = mib * (1 << 20) / PAGE;
	for (uint64_t p = 0; p < pages; p++)
		area[p * PAGE] = 1;

	struct sigaction sa = { .sa_handler = on_signal };
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	uint64_t start = now_ns();
	printf("tandem-dirty: %llu MiB ready in %llu ms\n", (unsigned long long)mib,
	       (unsigned long long)((start - t0) / 1000000));
	fflush(stdout);

	uint64_t end = secs ? start + secs * 1000000000 : UINT64_MAX;
	uint64_t counter = 0, next = 0, t = start;
	if (rate == 0) {
		/* Flat out, looking at the clock (vDSO) every 1 MiB. */
		while (!stop && t < end) {
			for (int i = 0; i < 256; i++) {
				*(volatile uint64_t *)(area + next * PAGE) = ++counter;
				if (++next == pages)
					next = 0;
			}
			t = now_ns();
		}
	} else {
		/* Slice k ends at start + (k+1) * 10 ms; by then
		 * floor((k+1) * rate * 256 / 100) pages are dirtied, so a
		 * rate that is not a whole number of pages per slice holds. */
		for (uint64_t k = 0; !stop && t < end; k++) {
			uint64_t due = (k + 1) * rate * 256 / 100;
			while (counter < due) {
				*(volatile uint64_t *)(area + next * PAGE) = ++counter;
				if (++next == pages)
					next = 0;
			}
			uint64_t deadline = start + (k + 1) * SLICE_NS;
			struct timespec ts = {
				.tv_sec = (time_t)(deadline / 1000000000),
				.tv_nsec = (long)(deadline % 1000000000),
			};
			if (now_ns() < deadline)
				clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
			t = now_ns();
		}
	}
	/* Page j was last given the largest counter c <= counter with
	 * c = j + 1 (mod pages); before its first write it holds the 1 the
	 * set-up touch left. */
	uint64_t wrong = 0;
	for (uint64_t j = 0; j < pages; j++) {
		uint64_t want = counter < j + 1 ? 1 : j + 1 + (counter - (j + 1)) / pages * pages;
		if (*(volatile uint64_t *)(area + j * PAGE) != want)
			wrong++;
	}
	double s = (double)(t - start) / 1e9;
	printf("tandem-dirty: %llu pages dirtied in %.3f s, %.1f MiB/s\n",
	       (unsigned long long)counter, s,
	       s > 0 ? (double)counter * PAGE / (1 << 20) / s : 0.0);
	if (wrong)
		printf("tandem-dirty: %llu pages do not hold their last write\n",
		       (unsigned long long)wrong);
	else
		printf("tandem-dirty: every page holds its last write\n");
	return wrong ? 1 : 0;
}
