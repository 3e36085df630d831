/*
 * cedana-init: the process a checkpointable kernel runs under.
 *
 *   cedana-init [--pidns] [--pidfile PATH] -- CMD ARGS...
 *
 * With --pidns (needs CAP_SYS_ADMIN) it creates a new PID namespace and forks; the child
 * becomes PID 1 there and the parent stays behind in the host namespace, forwarding
 * signals and exiting with the child's status. CRIU dumps the namespace from that PID 1,
 * and a restore recreates the namespace, so restored kernels never collide with PID
 * numbers taken since the dump (pid_max is small here).
 *
 * As PID 1 (or as the plain init without --pidns) it starts a session (a session leader
 * outside the namespace breaks the dump), runs CMD in its own process group, forwards
 * signals to that group, reaps orphans, and exits with CMD's status. Python as PID 1 would
 * ignore SIGTERM and leave zombies. It sets no parent-death signal: one would fire right
 * after a restore, since the restored tree has a new parent.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1,
                                SIGUSR2, SIGWINCH, SIGCONT, SIGALRM};
#define NFORWARDED (sizeof(forwarded) / sizeof(forwarded[0]))

static void die(const char *what)
{
	fprintf(stderr, "cedana-init: %s: %s\n", what, strerror(errno));
	exit(127);
}

static void noop(int sig) { (void)sig; }

/*
 * A PID-namespace init only receives signals from outside for which it installed a
 * handler, so a blocked SIG_DFL signal would be dropped: install a no-op handler, then
 * block and take them synchronously.
 */
static void take_signals(sigset_t *set)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = noop;
	sigemptyset(set);
	for (size_t i = 0; i < NFORWARDED; i++) {
		sigaction(forwarded[i], &sa, NULL);
		sigaddset(set, forwarded[i]);
	}
	sigaction(SIGCHLD, &sa, NULL);
	sigaddset(set, SIGCHLD);
	if (sigprocmask(SIG_BLOCK, set, NULL) < 0)
		die("sigprocmask");
}

static void reset_signals(void)
{
	sigset_t empty;
	sigemptyset(&empty);
	for (size_t i = 0; i < NFORWARDED; i++)
		signal(forwarded[i], SIG_DFL);
	signal(SIGCHLD, SIG_DFL);
	sigprocmask(SIG_SETMASK, &empty, NULL);
}

static int exit_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return 1;
}

/* Waits for `main_pid`, reaping every other child on the way; forwards signals to `target`. */
static int supervise(pid_t main_pid, pid_t target, const sigset_t *set)
{
	for (;;) {
		int status;
		pid_t pid;
		while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
			if (pid == main_pid)
				return exit_code(status);
		}
		if (pid < 0 && errno == ECHILD)
			return 1;
		/* A timeout keeps the loop alive across a CRIU restore, which may interrupt the wait. */
		struct timespec timeout = {.tv_sec = 1, .tv_nsec = 0};
		int sig = sigtimedwait(set, NULL, &timeout);
		if (sig > 0 && sig != SIGCHLD)
			kill(target, sig);
	}
}

static void write_pidfile(const char *path, pid_t pid)
{
	char tmp[4096];
	if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) {
		errno = ENAMETOOLONG;
		die("pidfile");
	}
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		die("pidfile");
	dprintf(fd, "%d\n", (int)pid);
	close(fd);
	if (rename(tmp, path) < 0)
		die("pidfile rename");
}

static int run_init(char **argv, const sigset_t *set)
{
	/* Fails with EPERM when already a session leader (no --pidns): that is fine. */
	setsid();
	unsetenv("JPY_PARENT_PID");
	pid_t kernel = fork();
	if (kernel < 0)
		die("fork");
	if (kernel == 0) {
		setpgid(0, 0);
		reset_signals();
		execvp(argv[0], argv);
		die(argv[0]);
	}
	setpgid(kernel, kernel);
	return supervise(kernel, -kernel, set);
}

int main(int argc, char **argv)
{
	int pidns = 0;
	const char *pidfile = NULL;
	int i = 1;
	for (; i < argc; i++) {
		if (strcmp(argv[i], "--pidns") == 0) {
			pidns = 1;
		} else if (strcmp(argv[i], "--pidfile") == 0 && i + 1 < argc) {
			pidfile = argv[++i];
		} else if (strcmp(argv[i], "--") == 0) {
			i++;
			break;
		} else {
			break;
		}
	}
	if (i >= argc) {
		fprintf(stderr, "usage: cedana-init [--pidns] [--pidfile PATH] -- CMD [ARGS...]\n");
		return 2;
	}
	char **cmd = &argv[i];
	sigset_t set;
	take_signals(&set);

	if (!pidns) {
		if (pidfile)
			write_pidfile(pidfile, getpid());
		return run_init(cmd, &set);
	}
	if (unshare(CLONE_NEWPID) < 0)
		die("unshare(CLONE_NEWPID)");
	pid_t init = fork();
	if (init < 0)
		die("fork");
	if (init == 0)
		return run_init(cmd, &set);
	if (pidfile)
		write_pidfile(pidfile, init);
	return supervise(init, init, &set);
}
