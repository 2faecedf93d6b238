/*
 * tandem-jitter: measures how long the guest stops running (a migration's
 * downtime, a COLO checkpoint, a slow exit) from inside the guest. It
 * sleeps INTERVAL_US at a time (clock_nanosleep on CLOCK_MONOTONIC) and
 * reads CLOCK_MONOTONIC (vDSO, no syscall) at every wake-up; the gap is the
 * time between two wake-ups, so it covers everything the loop did too.
 * Every gap over THRESHOLD_MS gets an increasing id (from 0). Every
 * REPORT_MS it sends one UDP datagram to HOST:PORT (one connect()ed socket;
 * send errors such as ECONNREFUSED are counted, not fatal), and one more on
 * exit. Few syscalls and no page faults in the loop: under emulation each
 * costs milliseconds. Built static by resources/build-guest.sh.
 *
 * usage: tandem-jitter HOST:PORT [-t THRESHOLD_MS] [-i INTERVAL_US]
 *                      [-r REPORT_MS] [-d SECONDS]
 *   HOST is an IPv4 literal; defaults: -t 10 -i 1000 -r 100 -d 0 (forever).
 *   SIGTERM or SIGINT ends it like -d does.
 * datagram: one line of ASCII unsigned decimals separated by single spaces,
 *   no newline, under 1400 bytes:
 *   "TJ1 SEQ NOW_US LOOPS MAX_GAP_US N ID END_US GAP_US ..." (N triples)
 *   SEQ counts datagrams from 0; NOW_US is CLOCK_MONOTONIC when sending;
 *   LOOPS counts wake-ups so far; MAX_GAP_US is the largest gap since the
 *   previous datagram (over the threshold or not); the triples are the last
 *   N (up to 32) gaps over the threshold, oldest first: id, CLOCK_MONOTONIC
 *   at the gap's end, length, all in microseconds.
 * output: "tandem-jitter: L loops, G gaps over T ms, max M.MMM ms,
 *          S reports (E send errors)" (one line; S counts datagrams sent,
 *          E of them failed)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tool.h"

#define RING 32
#define MAX_DATAGRAM 1400

struct gap {
	uint64_t id, end_ns, len_ns;
};

static struct gap ring[RING];

static int usage(void)
{
	fprintf(stderr, "usage: tandem-jitter HOST:PORT [-t THRESHOLD_MS] "
			"[-i INTERVAL_US] [-r REPORT_MS] [-d SECONDS]\n");
	return 2;
}

/*
 * Writes the datagram into buf and returns its length: the header, then as
 * many of the most recent gaps (up to RING) as fit under MAX_DATAGRAM.
 */
static size_t format_report(char *buf, uint64_t seq, uint64_t now, uint64_t loops,
			    uint64_t max_gap, uint64_t recorded)
{
	char triple[RING][72];
	size_t tlen[RING], total = 0;
	uint64_t n = recorded < RING ? recorded : RING;
	for (uint64_t i = 0; i < n; i++) {
		const struct gap *g = &ring[(recorded - n + i) % RING];
		int l = snprintf(triple[i], sizeof(triple[i]), " %llu %llu %llu",
				 (unsigned long long)g->id,
				 (unsigned long long)(g->end_ns / 1000),
				 (unsigned long long)(g->len_ns / 1000));
		tlen[i] = (size_t)l;
		total += tlen[i];
	}
	size_t first = 0;
	for (;;) {
		int l = snprintf(buf, MAX_DATAGRAM, "TJ1 %llu %llu %llu %llu %llu",
				 (unsigned long long)seq, (unsigned long long)(now / 1000),
				 (unsigned long long)loops, (unsigned long long)(max_gap / 1000),
				 (unsigned long long)(n - first));
		size_t len = (size_t)l;
		if (len + total < MAX_DATAGRAM) {
			for (size_t i = first; i < n; i++) {
				memcpy(buf + len, triple[i], tlen[i]);
				len += tlen[i];
			}
			return len;
		}
		total -= tlen[first++];
	}
}

int main(int argc, char **argv)
{
	uint64_t threshold_ms = 10, interval_us = 1000, report_ms = 100, secs = 0;
	const char *target = NULL;
	/* By hand, not getopt: HOST:PORT comes first, where musl's getopt stops. */
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (a[0] != '-') {
			if (target)
				return usage();
			target = a;
			continue;
		}
		/* "-t 5" or "-t5" */
		const char *v = a[1] && a[2] ? a + 2 : (i + 1 < argc ? argv[++i] : "");
		int bad;
		switch (a[1]) {
		case 't':
			bad = parse_u64(v, 3600000, &threshold_ms);
			break;
		case 'i':
			bad = parse_u64(v, 10000000, &interval_us) || interval_us == 0;
			break;
		case 'r':
			bad = parse_u64(v, 3600000, &report_ms) || report_ms == 0;
			break;
		case 'd':
			bad = parse_u64(v, 100000000, &secs);
			break;
		default:
			bad = 1;
		}
		if (bad)
			return usage();
	}
	if (!target)
		return usage();

	/* HOST:PORT, split at the last colon. */
	char host[64];
	const char *colon = strrchr(target, ':');
	uint64_t port;
	size_t hlen = colon ? (size_t)(colon - target) : 0;
	if (!colon || hlen == 0 || hlen >= sizeof(host) ||
	    parse_u64(colon + 1, 65535, &port) || port == 0)
		return usage();
	memcpy(host, target, hlen);
	host[hlen] = 0;
	struct sockaddr_in to = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
	if (inet_pton(AF_INET, host, &to.sin_addr) != 1)
		return usage();

	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&to, sizeof(to)) < 0) {
		perror("tandem-jitter: socket");
		return 1;
	}

	/* No SA_RESTART: a signal cuts the sleep short and the loop ends. */
	struct sigaction sa = { .sa_handler = on_signal };
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	const struct timespec interval = {
		.tv_sec = (time_t)(interval_us / 1000000),
		.tv_nsec = (long)(interval_us % 1000000) * 1000,
	};
	const uint64_t threshold = threshold_ms * 1000000, report = report_ms * 1000000;
	char buf[MAX_DATAGRAM];
	uint64_t start = now_ns(), prev = start, next_report = start + report;
	uint64_t end = secs ? start + secs * 1000000000 : UINT64_MAX;
	uint64_t loops = 0, recorded = 0, max_gap = 0, window_max = 0;
	uint64_t seq = 0, errors = 0;
	int last = 0;
	while (!last) {
		clock_nanosleep(CLOCK_MONOTONIC, 0, &interval, NULL);
		uint64_t t = now_ns(), gap = t - prev;
		prev = t;
		loops++;
		if (gap > window_max)
			window_max = gap;
		if (gap > max_gap)
			max_gap = gap;
		if (gap > threshold) {
			ring[recorded % RING] = (struct gap){ recorded, t, gap };
			recorded++;
		}
		last = stop || t >= end;
		/* The last wake-up reports too, so the final gaps are not lost. */
		if (t >= next_report || last) {
			size_t len = format_report(buf, seq, t, loops, window_max, recorded);
			if (send(fd, buf, len, 0) < 0)
				errors++;
			seq++;
			window_max = 0;
			while (next_report <= t)
				next_report += report;
		}
	}
	printf("tandem-jitter: %llu loops, %llu gaps over %llu ms, max %llu.%03llu ms, "
	       "%llu reports (%llu send errors)\n",
	       (unsigned long long)loops, (unsigned long long)recorded,
	       (unsigned long long)threshold_ms, (unsigned long long)(max_gap / 1000000),
	       (unsigned long long)(max_gap / 1000 % 1000), (unsigned long long)seq,
	       (unsigned long long)errors);
	return 0;
}
