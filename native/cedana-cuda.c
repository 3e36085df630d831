/*
 * cedana-cuda: drive the CUDA driver's process checkpoint API
 * (cuCheckpointProcess{GetState,Lock,Checkpoint,Restore,Unlock}).
 *
 * The API is declared here rather than taken from cuda.h so that the helper
 * builds on machines without a CUDA toolkit; libcuda.so.1 is dlopen()ed at run
 * time (override the path with CEDANA_LIBCUDA). `make check-decls` compiles this
 * file against the real cuda.h and checks that the layouts agree.
 *
 * Two modes:
 *   - command line compatible with NVIDIA's cuda-checkpoint
 *     (--get-state, --action lock|checkpoint|restore|unlock, --toggle, --pid,
 *     --timeout, --device-map, --get-restore-tid), so CRIU's cuda plugin can use it;
 *   - --serve: line-delimited JSON requests on stdin, one JSON response per line
 *     on stdout. cuInit is paid once for the life of the process instead of once
 *     per call (~2.7 s each with cuda-checkpoint).
 *
 * "thaw": a process that CRIU restored stays stopped until its GPU memory is back
 * (code touching device mappings before that would crash). The driver restores
 * through the process's own restore thread, so that one thread must run meanwhile:
 * with "thaw":1 the helper ptrace-seizes it out of the group stop for the call and
 * puts it back after, as CRIU's cuda plugin does for the threads it holds.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the driver API, declared locally (names prefixed to avoid clashing with cuda.h) ---- */

typedef int cc_result;
#define CC_SUCCESS 0
#define CC_ERROR_INVALID_VALUE 1
#define CC_ERROR_NOT_INITIALIZED 3
#define CC_ERROR_NOT_FOUND 500
#define CC_ERROR_NOT_SUPPORTED 801
/* Pseudo-results of this helper (outside the driver's range). */
#define CC_HELPER_NO_LIBRARY -1
#define CC_HELPER_NO_SYMBOL -2
#define CC_HELPER_PTRACE -3

enum cc_state {
	CC_STATE_RUNNING = 0,
	CC_STATE_LOCKED = 1,
	CC_STATE_CHECKPOINTED = 2,
	CC_STATE_FAILED = 3,
};

typedef struct {
	char bytes[16];
} cc_uuid;

typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	uint64_t reserved1[7];
} cc_lock_args;

typedef struct {
	uint64_t reserved[8];
} cc_checkpoint_args;

typedef struct {
	cc_uuid oldUuid;
	cc_uuid newUuid;
} cc_gpu_pair;

typedef struct {
	cc_gpu_pair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(cc_gpu_pair *)];
	uint64_t reserved1;
} cc_restore_args;

typedef struct {
	uint64_t reserved[8];
} cc_unlock_args;

_Static_assert(sizeof(cc_lock_args) == 64, "CUcheckpointLockArgs is 64 bytes");
_Static_assert(sizeof(cc_checkpoint_args) == 64, "CUcheckpointCheckpointArgs is 64 bytes");
_Static_assert(sizeof(cc_restore_args) == 64, "CUcheckpointRestoreArgs is 64 bytes");
_Static_assert(sizeof(cc_unlock_args) == 64, "CUcheckpointUnlockArgs is 64 bytes");
_Static_assert(sizeof(cc_gpu_pair) == 32, "CUcheckpointGpuPair is 32 bytes");

#ifdef CEDANA_CHECK_DECLS
/* Built by `make check-decls`: compare the local declarations with cuda.h. */
#include <cuda.h>
#define SAME_LAYOUT(a, b) _Static_assert(sizeof(a) == sizeof(b), #a " vs " #b)
#define SAME_OFFSET(a, b, f) \
	_Static_assert(offsetof(a, f) == offsetof(b, f), #a "." #f " offset")
SAME_LAYOUT(cc_lock_args, CUcheckpointLockArgs);
SAME_OFFSET(cc_lock_args, CUcheckpointLockArgs, timeoutMs);
SAME_OFFSET(cc_lock_args, CUcheckpointLockArgs, reserved1);
SAME_LAYOUT(cc_checkpoint_args, CUcheckpointCheckpointArgs);
SAME_LAYOUT(cc_restore_args, CUcheckpointRestoreArgs);
SAME_OFFSET(cc_restore_args, CUcheckpointRestoreArgs, gpuPairs);
SAME_OFFSET(cc_restore_args, CUcheckpointRestoreArgs, gpuPairsCount);
SAME_OFFSET(cc_restore_args, CUcheckpointRestoreArgs, reserved);
SAME_OFFSET(cc_restore_args, CUcheckpointRestoreArgs, reserved1);
SAME_LAYOUT(cc_unlock_args, CUcheckpointUnlockArgs);
SAME_LAYOUT(cc_gpu_pair, CUcheckpointGpuPair);
SAME_OFFSET(cc_gpu_pair, CUcheckpointGpuPair, newUuid);
SAME_LAYOUT(cc_uuid, CUuuid);
_Static_assert((int)CC_STATE_RUNNING == (int)CU_PROCESS_STATE_RUNNING, "state");
_Static_assert((int)CC_STATE_LOCKED == (int)CU_PROCESS_STATE_LOCKED, "state");
_Static_assert((int)CC_STATE_CHECKPOINTED == (int)CU_PROCESS_STATE_CHECKPOINTED, "state");
_Static_assert((int)CC_STATE_FAILED == (int)CU_PROCESS_STATE_FAILED, "state");
_Static_assert(CC_ERROR_INVALID_VALUE == CUDA_ERROR_INVALID_VALUE, "code");
_Static_assert(CC_ERROR_NOT_INITIALIZED == CUDA_ERROR_NOT_INITIALIZED, "code");
_Static_assert(CC_ERROR_NOT_FOUND == CUDA_ERROR_NOT_FOUND, "code");
_Static_assert(CC_ERROR_NOT_SUPPORTED == CUDA_ERROR_NOT_SUPPORTED, "code");
/* The function signatures: assigning the real functions to our pointer types
 * would warn (-Werror) if parameters differed in more than the enum/int names. */
_Static_assert(sizeof(CUresult) == sizeof(cc_result), "CUresult is an int-sized enum");
#endif

typedef cc_result (*fn_init)(unsigned int);
typedef cc_result (*fn_driver_version)(int *);
typedef cc_result (*fn_error_str)(cc_result, const char **);
typedef cc_result (*fn_get_state)(int, int *);
typedef cc_result (*fn_lock)(int, cc_lock_args *);
typedef cc_result (*fn_checkpoint)(int, cc_checkpoint_args *);
typedef cc_result (*fn_restore)(int, cc_restore_args *);
typedef cc_result (*fn_unlock)(int, cc_unlock_args *);
typedef cc_result (*fn_restore_tid)(int, int *);

static char ptrace_error[256];

static struct {
	void *lib;
	char lib_path[PATH_MAX];
	char load_error[512];
	int initialized;
	cc_result init_result;
	fn_init init;
	fn_driver_version driver_version;
	fn_error_str error_name;
	fn_error_str error_string;
	fn_get_state get_state;
	fn_lock lock;
	fn_checkpoint checkpoint;
	fn_restore restore;
	fn_unlock unlock;
	fn_restore_tid restore_tid;
} cu;

/* dlsym returns void *; converting that to a function pointer is what POSIX
 * guarantees works, but ISO C does not, so go through memcpy. */
static void load_sym(void *dst, const char *name)
{
	void *p = dlsym(cu.lib, name);
	memcpy(dst, &p, sizeof(p));
}

/* Load libcuda and call cuInit once. Returns CC_SUCCESS or the failing result. */
static cc_result cuda_setup(void)
{
	if (cu.initialized)
		return cu.init_result;
	cu.initialized = 1;
	const char *path = getenv("CEDANA_LIBCUDA");
	if (!path || !*path)
		path = "libcuda.so.1";
	snprintf(cu.lib_path, sizeof(cu.lib_path), "%s", path);
	cu.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!cu.lib) {
		const char *e = dlerror();
		snprintf(cu.load_error, sizeof(cu.load_error), "%s", e ? e : "dlopen failed");
		cu.init_result = CC_HELPER_NO_LIBRARY;
		return cu.init_result;
	}
	load_sym(&cu.init, "cuInit");
	load_sym(&cu.driver_version, "cuDriverGetVersion");
	load_sym(&cu.error_name, "cuGetErrorName");
	load_sym(&cu.error_string, "cuGetErrorString");
	load_sym(&cu.get_state, "cuCheckpointProcessGetState");
	load_sym(&cu.lock, "cuCheckpointProcessLock");
	load_sym(&cu.checkpoint, "cuCheckpointProcessCheckpoint");
	load_sym(&cu.restore, "cuCheckpointProcessRestore");
	load_sym(&cu.unlock, "cuCheckpointProcessUnlock");
	load_sym(&cu.restore_tid, "cuCheckpointProcessGetRestoreThreadId");
	if (!cu.init) {
		snprintf(cu.load_error, sizeof(cu.load_error), "%s has no cuInit", path);
		cu.init_result = CC_HELPER_NO_SYMBOL;
		return cu.init_result;
	}
	/* Restore needs persistence mode or a prior cuInit in the calling process. */
	cu.init_result = cu.init(0);
	return cu.init_result;
}

static int have_checkpoint_api(void)
{
	return cu.get_state && cu.lock && cu.checkpoint && cu.restore && cu.unlock;
}

/* The CUresult's name (CUDA_ERROR_...) and description. */
static void describe(cc_result r, const char **name, const char **text)
{
	*name = NULL;
	*text = NULL;
	if (r == CC_HELPER_NO_LIBRARY) {
		*name = "LIBCUDA_NOT_FOUND";
		*text = cu.load_error;
		return;
	}
	if (r == CC_HELPER_PTRACE) {
		*name = "PTRACE_FAILED";
		*text = ptrace_error;
		return;
	}
	if (r == CC_HELPER_NO_SYMBOL) {
		*name = "CHECKPOINT_API_MISSING";
		*text = cu.load_error[0] ? cu.load_error
					 : "the driver has no CUDA checkpoint API (needs driver r570+)";
		return;
	}
	if (cu.error_name && cu.error_name(r, name) != CC_SUCCESS)
		*name = NULL;
	if (cu.error_string && cu.error_string(r, text) != CC_SUCCESS)
		*text = NULL;
	if (!*name)
		*name = "CUDA_ERROR_UNKNOWN";
	if (!*text)
		*text = "unknown error";
}

static const char *state_name(int s)
{
	switch (s) {
	case CC_STATE_RUNNING:
		return "running";
	case CC_STATE_LOCKED:
		return "locked";
	case CC_STATE_CHECKPOINTED:
		return "checkpointed";
	case CC_STATE_FAILED:
		return "failed";
	default:
		return "unknown";
	}
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (the "GPU-"/"MIG-" prefix optional). */
static int parse_uuid(const char *s, size_t len, cc_uuid *out)
{
	if (len > 4 && (strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0)) {
		s += 4;
		len -= 4;
	}
	int n = 0;
	int hi = -1;
	for (size_t i = 0; i < len; i++) {
		char c = s[i];
		int v;
		if (c == '-')
			continue;
		if (c >= '0' && c <= '9')
			v = c - '0';
		else if (c >= 'a' && c <= 'f')
			v = c - 'a' + 10;
		else if (c >= 'A' && c <= 'F')
			v = c - 'A' + 10;
		else
			return -1;
		if (hi < 0) {
			hi = v;
		} else {
			if (n >= 16)
				return -1;
			out->bytes[n++] = (char)((hi << 4) | v);
			hi = -1;
		}
	}
	return (n == 16 && hi < 0) ? 0 : -1;
}

#define MAX_PAIRS 64

/* "OLD=NEW,OLD=NEW" (cuda-checkpoint's --device-map syntax). */
static int parse_device_map(const char *s, cc_gpu_pair *pairs, unsigned *count)
{
	*count = 0;
	while (s && *s) {
		const char *comma = strchr(s, ',');
		size_t len = comma ? (size_t)(comma - s) : strlen(s);
		const char *eq = memchr(s, '=', len);
		if (!eq || *count >= MAX_PAIRS)
			return -1;
		cc_gpu_pair *p = &pairs[*count];
		memset(p, 0, sizeof(*p));
		if (parse_uuid(s, (size_t)(eq - s), &p->oldUuid) ||
		    parse_uuid(eq + 1, len - (size_t)(eq - s) - 1, &p->newUuid))
			return -1;
		(*count)++;
		s = comma ? comma + 1 : NULL;
	}
	return 0;
}

/* ---- the operations, shared by both modes ---- */

static cc_result op_get_state(int pid, int *state)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.get_state)
		return CC_HELPER_NO_SYMBOL;
	*state = -1; /* the driver may leave it untouched on error */
	return cu.get_state(pid, state);
}

static cc_result op_lock(int pid, unsigned timeout_ms)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.lock)
		return CC_HELPER_NO_SYMBOL;
	cc_lock_args args;
	memset(&args, 0, sizeof(args)); /* reserved fields must be zero */
	args.timeoutMs = timeout_ms;
	return cu.lock(pid, &args);
}

static cc_result op_checkpoint(int pid)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.checkpoint)
		return CC_HELPER_NO_SYMBOL;
	cc_checkpoint_args args;
	memset(&args, 0, sizeof(args));
	return cu.checkpoint(pid, &args);
}

static cc_result op_restore(int pid, cc_gpu_pair *pairs, unsigned npairs)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.restore)
		return CC_HELPER_NO_SYMBOL;
	cc_restore_args args;
	memset(&args, 0, sizeof(args));
	if (npairs) {
		args.gpuPairs = pairs;
		args.gpuPairsCount = npairs;
	}
	/* No pairs: pass NULL args, as cuda-checkpoint does, so drivers that
	 * predate remapping are not handed a struct they might not accept. */
	return cu.restore(pid, npairs ? &args : NULL);
}

static cc_result op_unlock(int pid)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.unlock)
		return CC_HELPER_NO_SYMBOL;
	cc_unlock_args args;
	memset(&args, 0, sizeof(args));
	return cu.unlock(pid, &args);
}

static cc_result op_restore_tid(int pid, int *tid)
{
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return r;
	if (!cu.restore_tid)
		return CC_HELPER_NO_SYMBOL;
	return cu.restore_tid(pid, tid);
}

/* ---- thaw: let a stopped process's restore thread run for one driver call ---- */

struct thawed {
	int tid;
	int seized;
};

static char thread_state(int tid)
{
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", tid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *close = strrchr(buf, ')');
	return close && close[1] == ' ' ? close[2] : 0;
}

static cc_result ptrace_fail(const char *what, int tid)
{
	snprintf(ptrace_error, sizeof(ptrace_error), "%s of thread %d: %s", what, tid,
		 strerror(errno));
	return CC_HELPER_PTRACE;
}

/* Wait for the next stop of a seized thread; returns the stopping signal or -1. */
static int wait_stop(int tid)
{
	int status;
	for (;;) {
		if (waitpid(tid, &status, __WALL) < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		if (WIFSTOPPED(status))
			return WSTOPSIG(status);
		if (WIFEXITED(status) || WIFSIGNALED(status)) {
			errno = ESRCH;
			return -1;
		}
	}
}

/* Seize the restore thread of `pid` and let it run, even if its process is in a group
 * stop; the other threads stay stopped. */
static cc_result thaw(int pid, struct thawed *t)
{
	memset(t, 0, sizeof(*t));
	cc_result r = op_restore_tid(pid, &t->tid);
	if (r != CC_SUCCESS)
		return r;
	/* CRIU may not have detached from every thread yet: EPERM until it has. */
	for (int i = 0; ptrace(PTRACE_SEIZE, t->tid, NULL, NULL) != 0; i++) {
		if (errno != EPERM || i >= 500)
			return ptrace_fail("PTRACE_SEIZE", t->tid);
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	t->seized = 1;
	char st = thread_state(t->tid);
	/* A thread of a process in its group stop (the main thread in state T) that is not
	 * stopped yet is on its way there: just let go by CRIU, or by this helper's last
	 * call (a detached thread rejoins the group stop). Seized, it will trap when it
	 * gets there, so wait for that too; else it would stop for good after this check. */
	int stopping = st != 'T' && st != 't' && thread_state(pid) == 'T';
	if (st == 'T' || st == 't' || stopping) {
		/* seizing a thread in group stop makes it trap: collect that, then continue */
		if (wait_stop(t->tid) < 0)
			return ptrace_fail("waiting for the trap", t->tid);
		if (ptrace(PTRACE_CONT, t->tid, NULL, NULL) != 0)
			return ptrace_fail("PTRACE_CONT", t->tid);
	}
	return CC_SUCCESS;
}

/* Stop the thread again and detach: it rejoins its process's group stop, if any. */
static void refreeze(struct thawed *t)
{
	if (!t->seized)
		return;
	int sig = 0;
	if (ptrace(PTRACE_INTERRUPT, t->tid, NULL, NULL) == 0) {
		sig = wait_stop(t->tid);
		/* a signal that arrived meanwhile is passed on, not swallowed */
		if (sig == SIGTRAP || sig == SIGSTOP || sig < 0)
			sig = 0;
	}
	ptrace(PTRACE_DETACH, t->tid, NULL, (void *)(long)sig);
	t->seized = 0;
}

/* ---- --serve mode: a deliberately tiny JSON reader for flat requests ---- */

/* Find "key": in a flat object and return a pointer to its value. */
static const char *json_find(const char *line, const char *key)
{
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\"", key);
	const char *p = line;
	while ((p = strstr(p, pat)) != NULL) {
		p += strlen(pat);
		while (*p == ' ' || *p == '\t')
			p++;
		if (*p == ':') {
			p++;
			while (*p == ' ' || *p == '\t')
				p++;
			return p;
		}
	}
	return NULL;
}

static int json_int(const char *line, const char *key, long long *out)
{
	const char *p = json_find(line, key);
	if (!p)
		return -1;
	char *end;
	errno = 0;
	long long v = strtoll(p, &end, 10);
	if (end == p || errno)
		return -1;
	*out = v;
	return 0;
}

/* Copy a string value (no escapes are needed by our requests; reject them). */
static int json_str(const char *line, const char *key, char *out, size_t cap)
{
	const char *p = json_find(line, key);
	if (!p || *p != '"')
		return -1;
	p++;
	size_t n = 0;
	while (*p && *p != '"') {
		if (*p == '\\' || n + 1 >= cap)
			return -1;
		out[n++] = *p++;
	}
	if (*p != '"')
		return -1;
	out[n] = 0;
	return 0;
}

static void json_escape(FILE *f, const char *s)
{
	fputc('"', f);
	for (; s && *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20)
			fprintf(f, "\\u%04x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void reply_error(long long id, cc_result r, const char *context)
{
	const char *name, *text;
	describe(r, &name, &text);
	printf("{\"id\":%lld,\"ok\":false,\"code\":%d,\"error\":", id, r);
	json_escape(stdout, name);
	printf(",\"message\":");
	char msg[1024];
	snprintf(msg, sizeof(msg), "%s: %s", context, text);
	json_escape(stdout, msg);
	printf("}\n");
}

static void reply_bad(long long id, const char *msg)
{
	printf("{\"id\":%lld,\"ok\":false,\"code\":%d,\"error\":\"BAD_REQUEST\",\"message\":", id,
	       CC_ERROR_INVALID_VALUE);
	json_escape(stdout, msg);
	printf("}\n");
}

static void serve_info(long long id)
{
	cc_result r = cuda_setup();
	int version = 0;
	if (cu.driver_version)
		cu.driver_version(&version);
	printf("{\"id\":%lld,\"ok\":true,\"loaded\":%s,\"library\":", id, cu.lib ? "true" : "false");
	json_escape(stdout, cu.lib_path);
	printf(",\"driver_version\":%d,\"checkpoint_api\":%s,\"restore_tid_api\":%s,"
	       "\"init_result\":%d",
	       version, have_checkpoint_api() ? "true" : "false", cu.restore_tid ? "true" : "false",
	       r);
	if (r != CC_SUCCESS) {
		const char *name, *text;
		describe(r, &name, &text);
		printf(",\"init_error\":");
		json_escape(stdout, name);
		printf(",\"init_message\":");
		json_escape(stdout, text);
	}
	printf(",\"pid\":%d}\n", (int)getpid());
}

#define CC_REPLIED -100 /* serve_op answered by itself (outside the driver's range) */

/* Run one pid operation; returns its result, or CC_REPLIED when it has answered. */
static cc_result serve_op(long long id, const char *line, const char *op, int pid)
{
	cc_result r;
	if (strcmp(op, "get_state") == 0) {
		int state = -1;
		r = op_get_state(pid, &state);
		if (r == CC_SUCCESS) {
			printf("{\"id\":%lld,\"ok\":true,\"state\":\"%s\"}\n", id, state_name(state));
			return CC_REPLIED;
		}
		return r;
	}
	if (strcmp(op, "lock") == 0) {
		long long timeout = 0;
		if (json_int(line, "timeout_ms", &timeout) || timeout < 0 || timeout > UINT_MAX)
			timeout = 0;
		return op_lock(pid, (unsigned)timeout);
	}
	if (strcmp(op, "checkpoint") == 0)
		return op_checkpoint(pid);
	if (strcmp(op, "restore") == 0) {
		char map[MAX_PAIRS * 96];
		cc_gpu_pair pairs[MAX_PAIRS];
		unsigned npairs = 0;
		if (json_str(line, "device_map", map, sizeof(map)) == 0 &&
		    parse_device_map(map, pairs, &npairs)) {
			reply_bad(id, "bad \"device_map\" (expected OLD=NEW,OLD=NEW with GPU UUIDs)");
			return CC_REPLIED;
		}
		return op_restore(pid, pairs, npairs);
	}
	if (strcmp(op, "unlock") == 0)
		return op_unlock(pid);
	if (strcmp(op, "restore_tid") == 0) {
		int tid = 0;
		r = op_restore_tid(pid, &tid);
		if (r == CC_SUCCESS) {
			printf("{\"id\":%lld,\"ok\":true,\"tid\":%d}\n", id, tid);
			return CC_REPLIED;
		}
		return r;
	}
	reply_bad(id, "unknown op");
	return CC_REPLIED;
}

static void serve_one(const char *line)
{
	long long id = 0, pid = 0, want_thaw = 0;
	char op[32];
	json_int(line, "id", &id);
	if (json_str(line, "op", op, sizeof(op))) {
		reply_bad(id, "request needs a string \"op\"");
		return;
	}
	if (strcmp(op, "info") == 0) {
		serve_info(id);
		return;
	}
	if (strcmp(op, "ping") == 0) {
		printf("{\"id\":%lld,\"ok\":true}\n", id);
		return;
	}
	if (json_int(line, "pid", &pid) || pid <= 0 || pid > INT_MAX) {
		reply_bad(id, "request needs a positive integer \"pid\"");
		return;
	}
	char context[64];
	snprintf(context, sizeof(context), "%s pid %lld", op, pid);
	json_int(line, "thaw", &want_thaw);
	if (want_thaw && strcmp(op, "get_state") && strcmp(op, "restore") && strcmp(op, "unlock")) {
		reply_bad(id, "\"thaw\" applies to get_state, restore and unlock");
		return;
	}
	struct thawed th = {0, 0};
	cc_result r = want_thaw ? thaw((int)pid, &th) : CC_SUCCESS;
	double t0 = now_s();
	if (r == CC_SUCCESS)
		r = serve_op(id, line, op, (int)pid);
	double t1 = now_s();
	refreeze(&th);
	if (r == CC_SUCCESS)
		printf("{\"id\":%lld,\"ok\":true,\"elapsed_s\":%.6f}\n", id, t1 - t0);
	else if (r != CC_REPLIED)
		reply_error(id, r, context);
}

static int serve(void)
{
	/* Load the driver up front so the first real request does not pay for it. */
	cuda_setup();
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;
	while ((n = getline(&line, &cap, stdin)) >= 0) {
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			line[--n] = 0;
		if (n == 0)
			continue;
		serve_one(line);
		fflush(stdout);
	}
	free(line);
	return 0;
}

/* ---- cuda-checkpoint compatible command line ---- */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: cedana-cuda --get-state --pid PID\n"
		"       cedana-cuda --action lock|checkpoint|restore|unlock --pid PID\n"
		"                   [--timeout MS] [--device-map OLD=NEW,...]\n"
		"       cedana-cuda --toggle --pid PID [--timeout MS]\n"
		"       cedana-cuda --get-restore-tid --pid PID\n"
		"       cedana-cuda --driver-info\n"
		"       cedana-cuda --serve   (JSON lines on stdin/stdout)\n"
		"Environment: CEDANA_LIBCUDA overrides the driver library (libcuda.so.1).\n");
}

static int fail(cc_result r, const char *what)
{
	const char *name, *text;
	describe(r, &name, &text);
	fprintf(stderr, "cedana-cuda: %s failed: %s (%s, %d)\n", what, text, name, r);
	return 1;
}

static int cli(int pid, const char *action, int get_state, int toggle, int restore_tid,
	       unsigned timeout, const char *device_map)
{
	cc_gpu_pair pairs[MAX_PAIRS];
	unsigned npairs = 0;
	if (device_map && parse_device_map(device_map, pairs, &npairs)) {
		fprintf(stderr, "cedana-cuda: bad --device-map (expected OLD=NEW,...)\n");
		return 2;
	}
	cc_result r = cuda_setup();
	if (r != CC_SUCCESS)
		return fail(r, "initializing CUDA");
	if (get_state) {
		int state;
		r = op_get_state(pid, &state);
		if (r != CC_SUCCESS)
			return fail(r, "get-state");
		printf("%s\n", state_name(state));
		return 0;
	}
	if (restore_tid) {
		int tid;
		r = op_restore_tid(pid, &tid);
		if (r != CC_SUCCESS)
			return fail(r, "get-restore-tid");
		printf("%d\n", tid);
		return 0;
	}
	if (toggle) {
		int state;
		r = op_get_state(pid, &state);
		if (r != CC_SUCCESS)
			return fail(r, "get-state");
		if (state == CC_STATE_RUNNING) {
			if ((r = op_lock(pid, timeout)) != CC_SUCCESS)
				return fail(r, "lock");
			if ((r = op_checkpoint(pid)) != CC_SUCCESS) {
				/* leave the process as it was */
				op_unlock(pid);
				return fail(r, "checkpoint");
			}
			return 0;
		}
		if (state == CC_STATE_CHECKPOINTED) {
			if ((r = op_restore(pid, pairs, npairs)) != CC_SUCCESS)
				return fail(r, "restore");
			if ((r = op_unlock(pid)) != CC_SUCCESS)
				return fail(r, "unlock");
			return 0;
		}
		fprintf(stderr, "cedana-cuda: cannot toggle a process in state %s\n",
			state_name(state));
		return 1;
	}
	if (strcmp(action, "lock") == 0)
		r = op_lock(pid, timeout);
	else if (strcmp(action, "checkpoint") == 0)
		r = op_checkpoint(pid);
	else if (strcmp(action, "restore") == 0)
		r = op_restore(pid, pairs, npairs);
	else if (strcmp(action, "unlock") == 0)
		r = op_unlock(pid);
	else {
		fprintf(stderr, "cedana-cuda: unknown action %s\n", action);
		return 2;
	}
	return r == CC_SUCCESS ? 0 : fail(r, action);
}

int main(int argc, char **argv)
{
	int pid = 0, get_state = 0, toggle = 0, restore_tid = 0, info = 0;
	unsigned timeout = 0;
	const char *action = NULL, *device_map = NULL;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *next = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--serve") == 0) {
			return serve();
		} else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			usage(stdout);
			return 0;
		} else if (strcmp(a, "--get-state") == 0) {
			get_state = 1;
		} else if (strcmp(a, "--toggle") == 0) {
			toggle = 1;
		} else if (strcmp(a, "--get-restore-tid") == 0) {
			restore_tid = 1;
		} else if (strcmp(a, "--driver-info") == 0) {
			info = 1;
		} else if ((strcmp(a, "--pid") == 0 || strcmp(a, "-p") == 0) && next) {
			char *end;
			long v = strtol(next, &end, 10);
			if (*end || v <= 0 || v > INT_MAX) {
				fprintf(stderr, "cedana-cuda: bad pid %s\n", next);
				return 2;
			}
			pid = (int)v;
			i++;
		} else if ((strcmp(a, "--action") == 0 || strcmp(a, "-a") == 0) && next) {
			action = next;
			i++;
		} else if (strcmp(a, "--timeout") == 0 && next) {
			char *end;
			unsigned long v = strtoul(next, &end, 10);
			if (*end || v > UINT_MAX) {
				fprintf(stderr, "cedana-cuda: bad timeout %s\n", next);
				return 2;
			}
			timeout = (unsigned)v;
			i++;
		} else if (strcmp(a, "--device-map") == 0 && next) {
			device_map = next;
			i++;
		} else {
			fprintf(stderr, "cedana-cuda: unknown or incomplete argument %s\n", a);
			usage(stderr);
			return 2;
		}
	}
	if (info) {
		serve_info(0);
		return cu.init_result == CC_SUCCESS ? 0 : 1;
	}
	if (!pid || (!action && !get_state && !toggle && !restore_tid)) {
		usage(stderr);
		return 2;
	}
	return cli(pid, action, get_state, toggle, restore_tid, timeout, device_map);
}
