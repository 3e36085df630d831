/*
 * cedana-pidbase: move the PID cursor of the caller's PID namespace up to BASE.
 *
 *   cedana-pidbase BASE
 *
 * Writes BASE to /proc/sys/kernel/ns_last_pid when the cursor is below BASE, so that the
 * next process forked in the namespace gets a PID above BASE. cedana-init runs it before
 * forking a kernel on a server without a PID namespace: kernels then live above BASE,
 * away from the low PIDs a freshly started server (a new pod, a restarted service) and
 * its threads take, so their images can be restored there with the same PIDs.
 *
 * Writing ns_last_pid needs CAP_CHECKPOINT_RESTORE: this program carries it as a file
 * capability (scripts/grant-criu-caps.sh) and does nothing else with it. It only ever
 * raises the cursor, never lowers it, and takes the same flock on ns_last_pid that CRIU
 * takes while it steers PIDs for a restore, so it never moves the cursor between CRIU's
 * write and CRIU's fork.
 *
 * Exit status: 0 raised or already above, 1 error, 2 usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#define LAST_PID "/proc/sys/kernel/ns_last_pid"
#define PID_MAX "/proc/sys/kernel/pid_max"
/* PIDs below this are never handed out again after a wrap (the kernel's RESERVED_PIDS). */
#define RESERVED_PIDS 300

static long read_long(int fd)
{
	char buf[32];
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	return strtol(buf, NULL, 10);
}

int main(int argc, char **argv)
{
	char *end;
	if (argc != 2) {
		fprintf(stderr, "usage: cedana-pidbase BASE\n");
		return 2;
	}
	long base = strtol(argv[1], &end, 10);
	if (*argv[1] == '\0' || *end != '\0' || base < RESERVED_PIDS) {
		fprintf(stderr, "cedana-pidbase: BASE must be a number >= %d\n", RESERVED_PIDS);
		return 2;
	}
	int max_fd = open(PID_MAX, O_RDONLY | O_CLOEXEC);
	long pid_max = max_fd >= 0 ? read_long(max_fd) : -1;
	if (max_fd >= 0)
		close(max_fd);
	if (pid_max > 0 && base >= pid_max - 1) {
		fprintf(stderr, "cedana-pidbase: BASE %ld is not below pid_max %ld\n", base,
			pid_max);
		return 2;
	}
	int fd = open(LAST_PID, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		fprintf(stderr, "cedana-pidbase: %s: %s\n", LAST_PID, strerror(errno));
		return 1;
	}
	if (flock(fd, LOCK_EX) < 0) {
		fprintf(stderr, "cedana-pidbase: flock: %s\n", strerror(errno));
		return 1;
	}
	long last = read_long(fd);
	if (last < 0) {
		fprintf(stderr, "cedana-pidbase: cannot read %s\n", LAST_PID);
		return 1;
	}
	if (last < base) {
		char buf[32];
		int len = snprintf(buf, sizeof(buf), "%ld", base);
		if (pwrite(fd, buf, (size_t)len, 0) != len) {
			fprintf(stderr, "cedana-pidbase: writing %s: %s\n", LAST_PID,
				strerror(errno));
			return 1;
		}
	}
	close(fd); /* releases the lock */
	return 0;
}
