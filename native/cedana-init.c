/*
 * cedana-init: the process a checkpointable kernel runs under.
 *
 *   cedana-init [--pidns] [--pidfile PATH] [--die-with-parent [--parent-pid PID]] [--chdir DIR]
 *               [--ignore-sigint]
 *               [--user UID --gid GID [--groups G1,G2] [--cwd DIR]] -- CMD ARGS...
 *   cedana-init --keeper PIDFILE [--die-with-parent [--parent-pid PID]] -- CMD ARGS...
 *
 * It forks an init (the pid written to --pidfile) and stays behind as its watcher,
 * forwarding signals and exiting with the init's status. With --pidns (needs
 * CAP_SYS_ADMIN) the init is PID 1 of a new PID namespace: CRIU dumps the namespace
 * from it, and a restore recreates the namespace, so restored kernels never collide with
 * PID numbers taken since the dump (pid_max is small here). The init also makes a mount
 * namespace with that PID namespace's /proc (own_proc), and runs itself again there.
 *
 * --die-with-parent [--parent-pid PID]: when the process that started the watcher dies
 * (a jupyter server killed with SIGKILL), the kernel is terminated, as ipykernel would
 * do by itself if it could watch its parent. PID, the starter's own, makes a starter
 * that died before the watcher could look count as dead too. Only the watcher holds the parent-death signal; the init is
 * what CRIU dumps, and a parent-death signal there would fire right after a restore.
 *
 * --chdir DIR: once CMD is started (in the caller's working directory), the init moves
 * to DIR, a private writable directory (with --user, before it drops to the user and
 * forks CMD: DIR is root's). CRIU's parasite in the root task of a tree in its
 * own PID namespace (the host /proc is not that namespace's) makes `proc.crtools` in the
 * task's working directory to mount a /proc there: in the user's directory two dumps of
 * kernels sharing it collide (EEXIST), and a read-only one cannot be dumped at all. CRIU
 * restores the init's working directory, so DIR must exist at restore time too.
 *
 * --keeper PIDFILE: the same watch for a restored kernel: runs CMD (`criu restore -d`,
 * which writes PIDFILE and exits once the tree is restored) as a child subreaper, so that
 * the restored tree's root becomes its child: it reaps it and exits with its status (a
 * keeper of a few hundred KB instead of a criu process staying for the kernel's life).
 * Should its own parent die, it terminates the process named in PIDFILE.
 *
 * As PID 1 (or as the plain init without --pidns) it starts a session (a session leader
 * outside the namespace breaks the dump), runs CMD in its own process group, forwards
 * signals to that group, reaps orphans, and exits with CMD's status. Python as PID 1 would
 * ignore SIGTERM and leave zombies. It sets no parent-death signal: one would fire right
 * after a restore, since the restored tree has a new parent.
 *
 * Without --pidns nothing ends orphans with the namespace, so the init and the watcher
 * are child subreapers: a kernel's orphans (a daemon started from a notebook) become
 * their children instead of the system init's, and are killed when CMD has exited.
 *
 * --user UID --gid GID [--groups G1,G2,...] [--cwd DIR]: the init and the kernel (CMD)
 * run as that user; the watcher (outside the dumped tree) stays root. The init builds
 * the namespace, its /proc and its mounts as root, enters --chdir DIR (root's), and only
 * then, before it forks CMD, drops: the bounding and ambient capability sets are
 * emptied, the groups, gid and uid set (real, effective and saved), the remaining
 * capability sets (inheritable included) cleared and no_new_privs set, so that no
 * setuid or file-capability program gives any of it back. CMD inherits that and enters
 * --cwd DIR with the user's permissions. Every task of the tree CRIU dumps is then the
 * user's: a CRIU whose real uid and gid are the user's can read their resource limits
 * (prlimit) without CAP_SYS_RESOURCE, which root lacks in some containers. Any step
 * that fails stops the launch (exit 127).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <limits.h>
#include <grp.h>
#include <linux/capability.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/stat.h>
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
/* A signal nobody sends by hand: the watcher's parent-death notice. */
#define PARENT_DIED (SIGRTMIN + 3)
#define GRACE_SECONDS 3
#define NGROUPS_MAX_HERE 256
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
	sigaction(PARENT_DIED, &sa, NULL);
	sigaddset(set, PARENT_DIED);
	if (sigprocmask(SIG_BLOCK, set, NULL) < 0)
		die("sigprocmask");
}

/*
 * --ignore-sigint: the kernel starts with SIGINT ignored (a disposition exec keeps). An
 * interrupt that comes while it is still starting is then lost instead of killing it;
 * ipykernel ignores SIGINT once started anyway, and installs Python's handler itself
 * around each request it handles, so a running cell is interrupted as before.
 */
static int ignore_sigint;

static void reset_signals(void)
{
	sigset_t empty;
	sigemptyset(&empty);
	for (size_t i = 0; i < NFORWARDED; i++)
		signal(forwarded[i], SIG_DFL);
	signal(SIGCHLD, SIG_DFL);
	signal(PARENT_DIED, SIG_DFL);
	sigprocmask(SIG_SETMASK, &empty, NULL);
}

/* Kills this process's children (orphans adopted as subreaper included), found by their
 * parent in /proc/PID/stat; returns how many there were. */
static int kill_children(void)
{
	DIR *proc = opendir("/proc");
	struct dirent *e;
	int n = 0;
	pid_t self = getpid();
	if (!proc)
		return -1;
	while ((e = readdir(proc)) != NULL) {
		char path[64], buf[512];
		if (e->d_name[0] < '1' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/stat", atoi(e->d_name));
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t len = read(fd, buf, sizeof(buf) - 1);
		close(fd);
		if (len <= 0)
			continue;
		buf[len] = '\0';
		/* The command name may hold spaces and parentheses: parse after the last ')'. */
		char *rest = strrchr(buf, ')');
		char state;
		int ppid;
		if (rest && sscanf(rest + 1, " %c %d", &state, &ppid) == 2 && ppid == self) {
			kill((pid_t)atoi(e->d_name), SIGKILL);
			n++;
		}
	}
	closedir(proc);
	return n;
}

/* After CMD has exited: kill and reap whatever is left below us. Orphans' own children
 * become ours as their parents die, so repeat until none is left. */
static void kill_leftovers(void)
{
	for (;;) {
		kill_children();
		int status;
		pid_t pid = waitpid(-1, &status, 0);
		if (pid < 0 && errno != EINTR)
			return; /* ECHILD: nothing left */
	}
}

static int exit_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return 1;
}

static pid_t read_pidfile(const char *path)
{
	FILE *f = path ? fopen(path, "re") : NULL;
	int pid = 0;
	if (!f)
		return 0;
	if (fscanf(f, "%d", &pid) != 1)
		pid = 0;
	fclose(f);
	return pid;
}

struct watch {
	int armed;		/* --die-with-parent */
	const char *victim_file; /* --keeper: who to terminate, once known */
	time_t orphaned_at;	/* 0 while the parent lives */
};

/* The parent is gone: ask the kernel to end (SIGTERM, which the init forwards to the
 * kernel's group), and kill it after a grace period. */
static void orphan_step(struct watch *w, pid_t child)
{
	pid_t victim = w->victim_file ? read_pidfile(w->victim_file) : child;
	time_t now = time(NULL);
	if (!w->orphaned_at) {
		w->orphaned_at = now;
		if (victim > 0)
			kill(victim, SIGTERM);
	} else if (now - w->orphaned_at >= GRACE_SECONDS) {
		if (victim > 0)
			kill(victim, SIGKILL);
		kill(child, SIGKILL);
	}
}

/* Waits for `main_pid`, reaping every other child on the way; forwards signals to `target`. */
static int supervise(pid_t main_pid, pid_t target, const sigset_t *set, struct watch *w)
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
		if (w && w->orphaned_at)
			orphan_step(w, main_pid);
		/* A timeout keeps the loop alive across a CRIU restore, which may interrupt the wait. */
		struct timespec timeout = {.tv_sec = 1, .tv_nsec = 0};
		int sig = sigtimedwait(set, NULL, &timeout);
		if (sig == PARENT_DIED) {
			if (w && w->armed && !w->orphaned_at)
				orphan_step(w, main_pid);
		} else if (sig > 0 && sig != SIGCHLD) {
			kill(target, sig);
		}
	}
}

/* Called before forking: from then on the parent's death is noticed, also if it died
 * already. The check after prctl closes the race of a parent dying meanwhile; the
 * expected parent (--parent-pid) closes the one of a parent that died before this
 * process got here: getppid() then already names the reaper it was handed to. */
static void watch_parent(struct watch *w, pid_t expected)
{
	pid_t parent = getppid();
	if (prctl(PR_SET_PDEATHSIG, PARENT_DIED) < 0)
		die("prctl(PR_SET_PDEATHSIG)");
	if (getppid() != parent || (expected > 0 && parent != expected))
		raise(PARENT_DIED);
	w->armed = 1;
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

/* Reopens by path every descriptor that names a file on a mount of the namespace we
 * left (the kernel's log, /dev/null, the --chdir directory): CRIU cannot dump a file
 * whose mount lies outside the dumped mount namespace. Pipes and sockets stay. */
static void reopen_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	if (!d)
		die("/proc/self/fd");
	int own = dirfd(d);
	while ((e = readdir(d)) != NULL) {
		char link[64], path[PATH_MAX];
		struct stat st;
		int fd = atoi(e->d_name);
		if (e->d_name[0] < '0' || e->d_name[0] > '9' || fd == own || fstat(fd, &st) < 0)
			continue;
		if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode) && !S_ISCHR(st.st_mode))
			continue;
		snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
		ssize_t n = readlink(link, path, sizeof(path) - 1);
		if (n <= 0 || path[0] != '/')
			continue;
		path[n] = '\0';
		int flags = fcntl(fd, F_GETFL), fdflags = fcntl(fd, F_GETFD);
		off_t at = S_ISREG(st.st_mode) ? lseek(fd, 0, SEEK_CUR) : -1;
		int again = open(path, (flags & ~(O_CREAT | O_EXCL | O_TRUNC)) | O_NOCTTY);
		if (again < 0)
			continue; /* a deleted or replaced file: CRIU says why if it matters */
		if (at > 0)
			lseek(again, at, SEEK_SET);
		if (dup3(again, fd, (fdflags & FD_CLOEXEC) ? O_CLOEXEC : 0) < 0)
			die("dup3");
		close(again);
	}
	closedir(d);
}

/* As PID 1 of a new PID namespace: a mount namespace with this namespace's /proc, so
 * that PID lookups inside the kernel (psutil.Process(), /proc/<os.getpid()>) find its
 * own processes, not the host's under the same numbers. Mounts made on the host later
 * still show (slave propagation); none made here leave. Then this program runs again
 * (--ns-init), so that its own mappings too are files of the new namespace. */
static void own_proc(char **cmd, const char *chdir_to, char **user_args)
{
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0)
		die("/proc/self/exe");
	self[n] = '\0';
	/* Best effort: where mounts are not allowed (some containers) the kernel runs on,
	 * seeing the host's /proc as before. */
	if (unshare(CLONE_NEWNS) < 0) {
		fprintf(stderr, "cedana-init: no mount namespace (%s): the kernel sees the "
				"host's /proc\n", strerror(errno));
		return;
	}
	if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0 ||
	    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		fprintf(stderr, "cedana-init: cannot mount a /proc (%s): the kernel sees the "
				"host's\n", strerror(errno));
	reopen_fds();
	size_t ncmd = 0;
	while (cmd[ncmd])
		ncmd++;
	size_t nuser = 0;
	while (user_args[nuser])
		nuser++;
	char **args = calloc(ncmd + nuser + 7, sizeof(*args));
	if (!args)
		die("calloc");
	size_t k = 0;
	args[k++] = self;
	args[k++] = "--ns-init";
	if (ignore_sigint)
		args[k++] = "--ignore-sigint";
	if (chdir_to) {
		args[k++] = "--chdir";
		args[k++] = (char *)chdir_to;
	}
	memcpy(&args[k], user_args, nuser * sizeof(*args));
	k += nuser;
	args[k++] = "--";
	memcpy(&args[k], cmd, ncmd * sizeof(*args));
	execv(self, args);
	die(self);
}

struct user {
	int set;
	uid_t uid;
	gid_t gid;
	size_t ngroups;
	gid_t groups[NGROUPS_MAX_HERE];
	const char *cwd;
};

static unsigned long parse_id(const char *s, const char *what)
{
	char *end;
	errno = 0;
	unsigned long v = strtoul(s, &end, 10);
	if (errno || end == s || *end || v >= 0xffffffffUL || s[0] == '-') {
		fprintf(stderr, "cedana-init: bad %s: %s\n", what, s);
		exit(2);
	}
	return v;
}

static void parse_groups(struct user *u, const char *list)
{
	char *copy = strdup(list), *save = NULL;
	if (!copy)
		die("strdup");
	for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (u->ngroups >= NGROUPS_MAX_HERE) {
			fprintf(stderr, "cedana-init: too many --groups\n");
			exit(2);
		}
		u->groups[u->ngroups++] = (gid_t)parse_id(tok, "group");
	}
	free(copy);
}

/* The calling process becomes the user's, with no capability of any kind; see --user.
 * The init calls it once everything that needs root inside the namespace is done, so
 * that the kernel it forks inherits all of it. */
static void drop_to_user(const struct user *u)
{
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0)
		die("clear ambient capabilities");
	for (int cap = 0; cap <= 63; cap++) {
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
			die("drop bounding capabilities");
	}
	if (setgroups(u->ngroups, u->groups) < 0)
		die("setgroups");
	if (setresgid(u->gid, u->gid, u->gid) < 0)
		die("setresgid");
	if (setresuid(u->uid, u->uid, u->uid) < 0)
		die("setresuid");
	/* The uid change clears permitted, effective and ambient, not inheritable. */
	struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
	struct __user_cap_data_struct data[2];
	memset(data, 0, sizeof(data));
	if (syscall(SYS_capset, &hdr, data) < 0)
		die("clear capabilities");
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die("prctl(PR_SET_NO_NEW_PRIVS)");
	uid_t r, e, s;
	if (getresuid(&r, &e, &s) < 0 || r != u->uid || e != u->uid || s != u->uid ||
	    (u->uid != 0 && setuid(0) == 0)) {
		fprintf(stderr, "cedana-init: the uid did not stick\n");
		exit(127);
	}
}

static int run_init(char **argv, const sigset_t *set, int chdir_fd, const struct user *user)
{
	/* Fails with EPERM when already a session leader (no --pidns): that is fine. */
	setsid();
	if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
		die("prctl(PR_SET_CHILD_SUBREAPER)");
	unsetenv("JPY_PARENT_PID");
	/* With --user the kernel starts in --cwd (or where the init started), entered
	 * with the user's permissions; the init's own directory (--chdir) is root's and is
	 * entered before the drop. */
	char start_dir[PATH_MAX];
	if (user->set) {
		if (!user->cwd && !getcwd(start_dir, sizeof(start_dir)))
			die("getcwd");
		if (chdir_fd >= 0) {
			if (fchdir(chdir_fd) < 0)
				die("--chdir");
			close(chdir_fd);
			chdir_fd = -1;
		}
		/* The init is the root of the tree CRIU dumps: every task in it is the
		 * user's, so that a CRIU whose real ids are the user's may read the
		 * resource limits of all of them without CAP_SYS_RESOURCE. It sets no
		 * parent-death signal (a credential change would clear one anyway). */
		drop_to_user(user);
	}
	pid_t kernel = fork();
	if (kernel < 0)
		die("fork");
	if (kernel == 0) {
		setpgid(0, 0);
		reset_signals();
		if (ignore_sigint)
			signal(SIGINT, SIG_IGN);
		if (user->set && chdir(user->cwd ? user->cwd : start_dir) < 0)
			die(user->cwd ? user->cwd : start_dir);
		execvp(argv[0], argv);
		die(argv[0]);
	}
	setpgid(kernel, kernel);
	if (chdir_fd >= 0) {
		if (fchdir(chdir_fd) < 0) {
			kill(-kernel, SIGKILL);
			die("--chdir");
		}
		close(chdir_fd);
	}
	int code = supervise(kernel, -kernel, set, NULL);
	if (getpid() != 1)
		kill_leftovers();
	return code;
}

int main(int argc, char **argv)
{
	int pidns = 0, die_with_parent = 0, ns_init = 0;
	pid_t expected_parent = 0;
	const char *pidfile = NULL, *keeper = NULL;
	const char *chdir_to = NULL;
	struct user user;
	memset(&user, 0, sizeof(user));
	int have_gid = 0;
	/* The user options as given, for the init's run in its mount namespace (own_proc). */
	char *user_args[9] = {NULL};
	size_t nuser_args = 0;
	int i = 1;
	for (; i < argc; i++) {
		if (strcmp(argv[i], "--pidns") == 0) {
			pidns = 1;
		} else if (strcmp(argv[i], "--ns-init") == 0) {
			ns_init = 1; /* internal: PID 1 again, in its mount namespace (own_proc) */
		} else if (strcmp(argv[i], "--die-with-parent") == 0) {
			die_with_parent = 1;
		} else if (strcmp(argv[i], "--ignore-sigint") == 0) {
			ignore_sigint = 1;
		} else if (strcmp(argv[i], "--parent-pid") == 0 && i + 1 < argc) {
			expected_parent = (pid_t)parse_id(argv[++i], "--parent-pid");
		} else if (strcmp(argv[i], "--pidfile") == 0 && i + 1 < argc) {
			pidfile = argv[++i];
		} else if (strcmp(argv[i], "--keeper") == 0 && i + 1 < argc) {
			keeper = argv[++i];
		} else if (strcmp(argv[i], "--chdir") == 0 && i + 1 < argc) {
			chdir_to = argv[++i];
		} else if ((strcmp(argv[i], "--user") == 0 || strcmp(argv[i], "--gid") == 0 ||
			    strcmp(argv[i], "--groups") == 0 || strcmp(argv[i], "--cwd") == 0) &&
			   i + 1 < argc && nuser_args + 2 < sizeof(user_args) / sizeof(*user_args)) {
			const char *opt = argv[i];
			user_args[nuser_args++] = argv[i];
			user_args[nuser_args++] = argv[i + 1];
			const char *val = argv[++i];
			if (strcmp(opt, "--user") == 0) {
				user.uid = (uid_t)parse_id(val, "--user");
				user.set = 1;
			} else if (strcmp(opt, "--gid") == 0) {
				user.gid = (gid_t)parse_id(val, "--gid");
				have_gid = 1;
			} else if (strcmp(opt, "--groups") == 0) {
				parse_groups(&user, val);
			} else {
				user.cwd = val;
			}
		} else if (strcmp(argv[i], "--") == 0) {
			i++;
			break;
		} else {
			break;
		}
	}
	if (i >= argc) {
		fprintf(stderr, "usage: cedana-init [--pidns] [--pidfile PATH] [--die-with-parent] "
				"[--chdir DIR] [--ignore-sigint]\n"
				"                   [--user UID --gid GID [--groups G,...] [--cwd DIR]] "
				"-- CMD [ARGS...]\n"
				"       cedana-init --keeper PIDFILE [--die-with-parent] -- CMD [ARGS...]\n");
		return 2;
	}
	if (user.set != have_gid || (user.cwd && !user.set) || (user.set && keeper)) {
		fprintf(stderr, "cedana-init: --user needs --gid (and --groups, --cwd need --user); "
				"a keeper restores the image's own ids\n");
		return 2;
	}
	char **cmd = &argv[i];
	/* Opened now: a DIR that cannot be used stops us before anything is started. */
	int chdir_fd = -1;
	if (chdir_to && !keeper) {
		chdir_fd = open(chdir_to, O_PATH | O_DIRECTORY | O_CLOEXEC);
		if (chdir_fd < 0)
			die(chdir_to);
	}
	sigset_t set;
	struct watch w = {0, keeper, 0};
	take_signals(&set);
	if (ns_init)
		return run_init(cmd, &set, chdir_fd, &user);
	if (die_with_parent)
		watch_parent(&w, expected_parent);

	/* Without a PID namespace, orphans must come to us, not to the system's init. */
	if (!pidns && prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
		die("prctl(PR_SET_CHILD_SUBREAPER)");

	if (keeper) {
		pid_t child = fork();
		if (child < 0)
			die("fork");
		if (child == 0) {
			prctl(PR_SET_PDEATHSIG, 0);
			reset_signals();
			execvp(cmd[0], cmd);
			die(cmd[0]);
		}
		/* CRIU exits once the tree is restored: its root, now our child (we are a
		 * subreaper, see above), is the kernel from then on. */
		int code = supervise(child, child, &set, &w);
		pid_t root = read_pidfile(keeper);
		if (code == 0)
			code = root > 0 ? supervise(root, root, &set, &w) : 1;
		kill_leftovers();
		return code;
	}
	if (pidns && unshare(CLONE_NEWPID) < 0)
		die("unshare(CLONE_NEWPID)");
	pid_t init = fork();
	if (init < 0)
		die("fork");
	if (init == 0) {
		/* The init is what CRIU dumps: it must carry no parent-death signal. */
		prctl(PR_SET_PDEATHSIG, 0);
		if (pidns)
			own_proc(cmd, chdir_to, user_args);
		return run_init(cmd, &set, chdir_fd, &user);
	}
	if (chdir_fd >= 0)
		close(chdir_fd);
	if (pidfile)
		write_pidfile(pidfile, init);
	int code = supervise(init, init, &set, &w);
	if (!pidns)
		kill_leftovers();
	return code;
}
