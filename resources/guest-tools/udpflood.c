/*
 * udpflood: sends UDP datagrams to ADDR:PORT as fast as the socket lets it
 * for SECONDS, then prints what it sent. Each datagram starts with its
 * sequence number (8 bytes, big endian) so the receiver can check that
 * nothing was lost or reordered. Built static by resources/build-guest.sh
 * and run inside the guest (busybox's nc has no UDP mode).
 *
 * usage: udpflood ADDR PORT SECONDS [SIZE]
 * output: "udpflood: sent N packets B bytes in T ms, E errors"
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int main(int argc, char **argv)
{
	if (argc < 4 || argc > 5) {
		fprintf(stderr, "usage: udpflood ADDR PORT SECONDS [SIZE]\n");
		return 2;
	}
	struct sockaddr_in to = { .sin_family = AF_INET };
	if (inet_pton(AF_INET, argv[1], &to.sin_addr) != 1) {
		fprintf(stderr, "udpflood: bad address %s\n", argv[1]);
		return 2;
	}
	long port = strtol(argv[2], NULL, 10);
	long secs = strtol(argv[3], NULL, 10);
	long size = argc == 5 ? strtol(argv[4], NULL, 10) : 1400;
	if (port <= 0 || port > 65535 || secs <= 0 || size < 8 || size > 65507) {
		fprintf(stderr, "udpflood: bad port, duration or size\n");
		return 2;
	}
	to.sin_port = htons((uint16_t)port);
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&to, sizeof(to)) < 0) {
		perror("udpflood: socket");
		return 1;
	}
	char *buf = calloc(1, (size_t)size);
	if (!buf)
		return 1;
	uint64_t start = now_ms(), end = start + (uint64_t)secs * 1000;
	uint64_t seq = 0, bytes = 0, errors = 0, t = start;
	while (t < end) {
		for (int i = 0; i < (int)(sizeof(seq)); i++)
			buf[i] = (char)(seq >> (56 - 8 * i));
		ssize_t n = send(fd, buf, (size_t)size, 0);
		if (n == size) {
			seq++;
			bytes += (uint64_t)n;
		} else if (n < 0 && errno != EINTR) {
			errors++;
		}
		t = now_ms();
	}
	printf("udpflood: sent %llu packets %llu bytes in %llu ms, %llu errors\n",
	       (unsigned long long)seq, (unsigned long long)bytes,
	       (unsigned long long)(t - start), (unsigned long long)errors);
	return 0;
}
