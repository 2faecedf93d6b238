/*
 * tandem-init: PID 1 of the tandem default guest, as /init of its
 * initramfs and /sbin/init of its ext4 root disk image.
 *
 * It does what a shell script would, without starting a program for each
 * step: under KVM without hardware virtualization every exec costs the
 * guest most of a second of emulated kernel work (fork, exec, page faults,
 * exit), and a script's mount and ip commands were a tenth of the boot.
 *
 *  1. mounts proc, sysfs, devtmpfs (unless the kernel has: disk root with
 *     DEVTMPFS_MOUNT) and a tmpfs on /tmp;
 *  2. on a disk root (no /init), remounts / read-write unless the command
 *     line says `ro` or `rw`;
 *  3. configures the network from the command line: tandem.ip=ADDR/PREFIX
 *     for eth0, tandem.ip1=... for eth1, and so on; lo comes up with the
 *     first one; nothing happens without them;
 *  4. prints "tandem-guest: ready";
 *  5. runs a login shell on the console (busybox cttyhack gives it the
 *     serial line as controlling terminal, so Ctrl-C works), again each
 *     time it exits, saying how it ended, and reaps every orphan meanwhile;
 *  6. powers off on SIGUSR2, halts on SIGUSR1 and reboots on SIGTERM (what
 *     busybox's poweroff, halt and reboot send to PID 1 without -f).
 *
 * One thing at a time: processes started at the same time can be hit by a
 * host fault (README, "Known issues"). Every failure is reported on the
 * console with a "tandem-guest:" line and the boot goes on.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void say(const char *what, const char *arg)
{
	printf("tandem-guest: %s %s: %s\n", what, arg, strerror(errno));
	fflush(stdout);
}

static void mount_fs(const char *type, const char *dir, unsigned long flags)
{
	if (mount(type, dir, type, flags, NULL) != 0 && errno != EBUSY)
		say("cannot mount", dir);
}

/* Reads /proc/cmdline into buf (NUL-terminated, newline removed). */
static void read_cmdline(char *buf, size_t size)
{
	buf[0] = '\0';
	int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		say("cannot read", "/proc/cmdline");
		return;
	}
	ssize_t n = read(fd, buf, size - 1);
	close(fd);
	buf[n > 0 ? n : 0] = '\0';
	buf[strcspn(buf, "\n")] = '\0';
}

/* ifr for device dev (names are at most IFNAMSIZ - 1 bytes here). */
static void ifr_for(struct ifreq *ifr, const char *dev)
{
	memset(ifr, 0, sizeof(*ifr));
	snprintf(ifr->ifr_name, sizeof(ifr->ifr_name), "%s", dev);
}

static int set_flags_up(int s, const char *dev)
{
	struct ifreq ifr;
	ifr_for(&ifr, dev);
	if (ioctl(s, SIOCGIFFLAGS, &ifr) != 0)
		return -1;
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	return ioctl(s, SIOCSIFFLAGS, &ifr);
}

/* Gives dev the address "ADDR/PREFIX" and brings it up. */
static void configure(int s, const char *dev, const char *spec)
{
	char addr[64];
	const char *slash = strchr(spec, '/');
	size_t len = slash ? (size_t)(slash - spec) : strlen(spec);
	long prefix = slash ? strtol(slash + 1, NULL, 10) : 32;
	if (len >= sizeof(addr) || prefix < 0 || prefix > 32) {
		printf("tandem-guest: bad address %s for %s\n", spec, dev);
		return;
	}
	memcpy(addr, spec, len);
	addr[len] = '\0';

	struct ifreq ifr;
	struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
	ifr_for(&ifr, dev);
	sin->sin_family = AF_INET;
	if (inet_pton(AF_INET, addr, &sin->sin_addr) != 1) {
		printf("tandem-guest: bad address %s for %s\n", spec, dev);
		return;
	}
	if (ioctl(s, SIOCSIFADDR, &ifr) != 0) {
		say("cannot set the address of", dev);
		return;
	}
	sin->sin_addr.s_addr = prefix ? htonl(~0u << (32 - prefix)) : 0;
	if (ioctl(s, SIOCSIFNETMASK, &ifr) != 0)
		say("cannot set the netmask of", dev);
	if (set_flags_up(s, dev) != 0)
		say("cannot bring up", dev);
}

/* Steps 2 and 3: the root's mode and the network, from the command line. */
static void apply_cmdline(void)
{
	char cmdline[4096], dev[IFNAMSIZ];
	int disk_root = access("/init", F_OK) != 0, remount = disk_root;
	int s = -1, lo = 0;

	read_cmdline(cmdline, sizeof(cmdline));
	for (char *arg = strtok(cmdline, " "); arg; arg = strtok(NULL, " ")) {
		const char *spec;
		if (!strcmp(arg, "ro") || !strcmp(arg, "rw")) {
			remount = 0;
			continue;
		}
		if (!strncmp(arg, "tandem.ip=", 10)) {
			strcpy(dev, "eth0");
			spec = arg + 10;
		} else if (!strncmp(arg, "tandem.ip", 9) && arg[9] >= '0' && arg[9] <= '9' &&
			   arg[10] == '=') {
			snprintf(dev, sizeof(dev), "eth%c", arg[9]);
			spec = arg + 11;
		} else {
			continue;
		}
		if (s < 0 && (s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) < 0) {
			say("cannot open a socket for", dev);
			continue;
		}
		if (!lo) {
			if (set_flags_up(s, "lo") != 0)
				say("cannot bring up", "lo");
			lo = 1;
		}
		configure(s, dev, spec);
	}
	if (s >= 0)
		close(s);
	if (remount && mount(NULL, "/", NULL, MS_REMOUNT, NULL) != 0) {
		say("the root file system stays read-only:", "/");
	}
}

static volatile sig_atomic_t end_how;

static void on_end(int sig)
{
	end_how = sig;
}

static void end_system(void)
{
	sync();
	switch (end_how) {
	case SIGUSR2:
		reboot(RB_POWER_OFF);
		break;
	case SIGUSR1:
		reboot(RB_HALT_SYSTEM);
		break;
	default:
		reboot(RB_AUTOBOOT);
	}
	say("cannot end the system", "");
	end_how = 0;
}

/*
 * Says how the console shell ended, so that a shell that died (a signal)
 * is told apart from one that was left (exit) on the console.
 */
static void shell_ended(int status)
{
	if (WIFSIGNALED(status))
		printf("tandem-guest: the console shell was killed by signal %d (%s)\n",
		       WTERMSIG(status), strsignal(WTERMSIG(status)));
	else
		printf("tandem-guest: the console shell exited with status %d\n",
		       WEXITSTATUS(status));
	fflush(stdout);
}

/* Step 5: the console shell, respawned; orphans reaped. */
static void console_loop(void)
{
	for (;;) {
		pid_t shell = fork();
		if (shell == 0) {
			setsid();
			execl("/bin/cttyhack", "cttyhack", "/bin/sh", "-l", (char *)NULL);
			say("cannot run", "/bin/cttyhack");
			_exit(127);
		}
		if (shell < 0) {
			say("cannot fork", "the console shell");
			sleep(1);
			continue;
		}
		for (;;) {
			if (end_how)
				end_system();
			int status = 0;
			pid_t pid = waitpid(-1, &status, 0);
			if (pid == shell) {
				shell_ended(status);
				break;
			}
			if (pid < 0 && errno == ECHILD)
				break;
		}
		/* A shell that cannot start must not spin the (emulated) CPU. */
		sleep(1);
	}
}

int main(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_end;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	setenv("PATH", "/bin:/sbin:/usr/bin:/usr/sbin", 1);
	setenv("HOME", "/root", 1);
	setenv("TERM", "linux", 1);
	mount_fs("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	mount_fs("sysfs", "/sys", MS_NOSUID | MS_NODEV | MS_NOEXEC);
	/* On a disk root the kernel has mounted devtmpfs already. */
	if (access("/dev/null", F_OK) != 0)
		mount_fs("devtmpfs", "/dev", MS_NOSUID);
	mount_fs("tmpfs", "/tmp", MS_NOSUID | MS_NODEV);
	apply_cmdline();
	printf("tandem-guest: ready\n");
	fflush(stdout);
	if (chdir("/root") != 0)
		say("cannot enter", "/root");
	console_loop();
	return 0;
}
