/*
 * TEST-ONLY FAKE of libcuda.so.1: cuInit, cuDriverGetVersion, cuGetErrorName/
 * String and the process checkpoint API, scripted by $CEDANA_FAKE_GPU_STATE
 * (see fakegpu_state.h). It implements the driver's per-process state machine
 * RUNNING -> LOCKED -> CHECKPOINTED -> (restore) -> LOCKED -> (unlock) -> RUNNING
 * and writes it back, so the fake NVML sees device memory freed and taken again.
 * Built with -DFAKE_OLD_DRIVER it lacks the checkpoint API (a pre-r570 driver).
 */
#include <dirent.h>
#include <regex.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>

#include "fakegpu_state.h"

typedef int CUresult;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_OPERATING_SYSTEM 304
#define CUDA_ERROR_ILLEGAL_STATE 401

#ifndef FAKE_OLD_DRIVER
/* The name of the calling program (cedana-cuda, cuda-checkpoint, ...), for the log. */
static const char *caller(void)
{
	static char comm[32];
	if (!comm[0]) {
		FILE *f = fopen("/proc/self/comm", "r");
		if (!f || !fgets(comm, sizeof(comm), f))
			snprintf(comm, sizeof(comm), "?");
		if (f)
			fclose(f);
		comm[strcspn(comm, "\n")] = 0;
	}
	return comm;
}

/* The scheduler state letter of a thread (R, S, T, t, ...), or 0 if it is gone. */
static char thread_state(int pid, int tid)
{
	char path[96], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/task/%d/stat", pid, tid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *close = strrchr(buf, ')');
	return close && close[1] == ' ' ? close[2] : 0;
}

static int is_stopped(char state)
{
	return state == 'T' || state == 't';
}

/* The restore thread of a process (see fakegpu_state.h): its thread named cuda<hex>,
 * else its main thread. */
static int restore_thread(int pid)
{
	char path[64];
	regex_t re;
	int found = pid;
	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	DIR *d = opendir(path);
	if (!d)
		return pid;
	regcomp(&re, "^cuda[0-9a-f]+$", REG_EXTENDED | REG_NOSUB);
	struct dirent *de;
	while ((de = readdir(d)) != NULL) {
		int tid = atoi(de->d_name);
		char comm_path[96], comm[32] = "";
		if (tid <= 0)
			continue;
		snprintf(comm_path, sizeof(comm_path), "/proc/%d/task/%d/comm", pid, tid);
		FILE *f = fopen(comm_path, "r");
		if (!f)
			continue;
		if (fgets(comm, sizeof(comm), f))
			comm[strcspn(comm, "\n")] = 0;
		fclose(f);
		if (regexec(&re, comm, 0, NULL, 0) == 0) {
			found = tid;
			break;
		}
	}
	regfree(&re);
	closedir(d);
	return found;
}

/* The process a thread id belongs to (the driver takes any thread of a process for
 * the process, NVIDIA/cuda-checkpoint#41); `tid` itself when unknown. */
static int tgid_of(int tid)
{
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", tid);
	FILE *f = fopen(path, "r");
	int tgid = tid;
	if (!f)
		return tid;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, "Tgid:", 5) == 0)
			tgid = atoi(line + 5);
	fclose(f);
	return tgid > 0 ? tgid : tid;
}

/* 1 when every thread of `pid` but `except` is stopped. */
static int frozen_but(int pid, int except)
{
	char path[64];
	int frozen = 1;
	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	DIR *d = opendir(path);
	if (!d)
		return 0;
	struct dirent *de;
	while ((de = readdir(d)) != NULL) {
		int tid = atoi(de->d_name);
		if (tid > 0 && tid != except && !is_stopped(thread_state(pid, tid)))
			frozen = 0;
	}
	closedir(d);
	return frozen;
}
#endif

static const struct {
	int code;
	const char *name, *text;
} errors[] = {
	{0, "CUDA_SUCCESS", "no error"},
	{1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	{3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	{100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	{304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
	{401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	{500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	{600, "CUDA_ERROR_NOT_READY", "device not ready"},
	{801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	{909, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
	{999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int initialized;

CUresult cuGetErrorName(CUresult r, const char **out)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == r) {
			*out = errors[i].name;
			return CUDA_SUCCESS;
		}
	*out = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult r, const char **out)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == r) {
			*out = errors[i].text;
			return CUDA_SUCCESS;
		}
	*out = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuInit(unsigned int flags)
{
	struct fg_state s;
	CUresult rc = CUDA_SUCCESS;
	if (flags != 0) {
		rc = CUDA_ERROR_INVALID_VALUE;
	} else if (fg_load(&s, NULL) != 0) {
		rc = 100; /* no state file: CUDA_ERROR_NO_DEVICE */
	} else {
		struct fg_err *e = fg_find_err(&s, "init", 0, 0);
		if (e)
			rc = e->code;
		else if (s.ndev == 0)
			rc = 100; /* CUDA_ERROR_NO_DEVICE */
	}
	initialized = rc == CUDA_SUCCESS;
	fg_log("cuda init pid=%d rc=%d", (int)getpid(), rc);
	return rc;
}

CUresult cuDriverGetVersion(int *version)
{
	struct fg_state s;
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = fg_load(&s, NULL) == 0 ? s.cuda : 12080;
	return CUDA_SUCCESS;
}

#ifndef FAKE_OLD_DRIVER

typedef struct {
	char bytes[16];
} CUuuid;

typedef struct {
	CUuuid oldUuid, newUuid;
} CUcheckpointGpuPair;

typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	uint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
	uint64_t reserved[8];
} CUcheckpointOtherArgs; /* checkpoint and unlock */

typedef struct {
	CUcheckpointGpuPair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(CUcheckpointGpuPair *)];
	uint64_t reserved1;
} CUcheckpointRestoreArgs;

static int all_zero(const void *p, size_t n)
{
	const unsigned char *c = p;
	for (size_t i = 0; i < n; i++)
		if (c[i])
			return 0;
	return 1;
}

static void uuid_to_string(const CUuuid *u, char *out, size_t cap)
{
	const unsigned char *b = (const unsigned char *)u->bytes;
	snprintf(out, cap,
		 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
		 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
		 b[14], b[15]);
}

static struct fg_dev *dev_by_uuid(struct fg_state *s, const char *uuid)
{
	for (int i = 0; i < s->ndev; i++)
		if (strcasecmp(s->dev[i].uuid, uuid) == 0)
			return &s->dev[i];
	return NULL;
}

/*
 * Common frame of every checkpoint call: load the state locked, find the process,
 * apply an injected error if one matches, else run `step`, then write back.
 */
typedef CUresult (*step_fn)(struct fg_state *s, struct fg_proc *p, void *arg, char *note,
			    size_t cap);

static CUresult run_op(const char *op, int pid, step_fn step, void *arg)
{
	struct fg_state s;
	int fd = -1;
	char note[256] = "";
	CUresult rc;
	if (!initialized) {
		fg_log("cuda %s pid=%d rc=%d by=%s", op, pid, CUDA_ERROR_NOT_INITIALIZED, caller());
		return CUDA_ERROR_NOT_INITIALIZED;
	}
	if (fg_load(&s, &fd) != 0)
		return CUDA_ERROR_NOT_INITIALIZED;
	struct fg_proc *p = pid > 0 ? fg_find_proc(&s, tgid_of(pid)) : NULL;
	struct fg_err *e = fg_find_err(&s, op, pid, 0);
	if (pid <= 0 || kill(pid, 0) != 0) {
		rc = CUDA_ERROR_INVALID_VALUE; /* no such process */
	} else if (!p) {
		rc = s.noncuda; /* a live process without CUDA state (fakegpu_state.h) */
	} else if (e) {
		rc = e->code;
		if (e->times > 0)
			e->times--;
		if (e->fail_state >= 0)
			p->state = e->fail_state;
		snprintf(note, sizeof(note), " injected=1");
	} else {
		rc = step(&s, p, arg, note, sizeof(note));
	}
	fg_save(&s, fd);
	fg_log("cuda %s pid=%d rc=%d by=%s%s", op, pid, rc, caller(), note);
	return rc;
}

static CUresult step_get_state(struct fg_state *s, struct fg_proc *p, void *arg, char *note,
			       size_t cap)
{
	(void)s;
	*(int *)arg = p->state;
	snprintf(note, cap, " state=%s", fg_state_names[p->state]);
	return CUDA_SUCCESS;
}

static CUresult step_lock(struct fg_state *s, struct fg_proc *p, void *arg, char *note, size_t cap)
{
	(void)s;
	CUcheckpointLockArgs *a = arg;
	if (a && (a->reserved0 || !all_zero(a->reserved1, sizeof(a->reserved1))))
		return CUDA_ERROR_INVALID_VALUE;
	snprintf(note, cap, " timeout_ms=%u", a ? a->timeoutMs : 0);
	if (p->state != FG_RUNNING)
		return CUDA_ERROR_ILLEGAL_STATE;
	p->state = FG_LOCKED;
	return CUDA_SUCCESS;
}

static CUresult step_checkpoint(struct fg_state *s, struct fg_proc *p, void *arg, char *note,
				size_t cap)
{
	(void)s;
	(void)note;
	(void)cap;
	CUcheckpointOtherArgs *a = arg;
	if (a && !all_zero(a, sizeof(*a)))
		return CUDA_ERROR_INVALID_VALUE;
	if (p->state != FG_LOCKED)
		return CUDA_ERROR_ILLEGAL_STATE;
	p->state = FG_CHECKPOINTED; /* device memory released: fg_used() stops counting it */
	return CUDA_SUCCESS;
}

static CUresult step_restore(struct fg_state *s, struct fg_proc *p, void *arg, char *note,
			     size_t cap)
{
	CUcheckpointRestoreArgs *a = arg;
	struct fg_dev *cur = fg_dev_by_index(s, p->dev);
	struct fg_dev *target = cur;
	if (a && (!all_zero(a->reserved, sizeof(a->reserved)) || a->reserved1))
		return CUDA_ERROR_INVALID_VALUE;
	if (p->state != FG_CHECKPOINTED)
		return CUDA_ERROR_ILLEGAL_STATE;
	/* The driver restores through the process's restore thread, which must run. */
	int tid = restore_thread(p->pid);
	for (int i = 0; is_stopped(thread_state(p->pid, tid)); i++) {
		if (i >= 500) {
			snprintf(note, cap, " restore_thread_stopped=%d", tid);
			return CUDA_ERROR_OPERATING_SYSTEM;
		}
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	size_t off = (size_t)snprintf(note, cap, " frozen=%d", frozen_but(p->pid, tid));
	note += off;
	cap -= off;
	/* After a restore that ran out of memory the real driver stays broken. */
	if (p->stuck)
		return CUDA_ERROR_OPERATING_SYSTEM;
	if (a && a->gpuPairsCount) {
		int found = 0;
		size_t off = 0;
		for (unsigned i = 0; i < a->gpuPairsCount; i++) {
			char old[64], new[64];
			uuid_to_string(&a->gpuPairs[i].oldUuid, old, sizeof(old));
			uuid_to_string(&a->gpuPairs[i].newUuid, new, sizeof(new));
			if (off < cap)
				off += (size_t)snprintf(note + off, cap - off, "%s%s>%s",
							i ? "," : " pairs=", old, new);
			if (cur && strcasecmp(cur->uuid, old) == 0) {
				found = 1;
				target = dev_by_uuid(s, new);
			}
		}
		/* every checkpointed GPU must be listed; the new GPU must be the same chip */
		if (!found || !target || !cur || strcmp(target->name, cur->name) != 0)
			return CUDA_ERROR_INVALID_VALUE;
	}
	if (!target)
		return CUDA_ERROR_INVALID_VALUE;
	if (target->total - fg_used(s, target->index) < p->mem) {
		p->stuck = 1;
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	p->dev = target->index;
	p->state = FG_LOCKED;
	return CUDA_SUCCESS;
}

static CUresult step_unlock(struct fg_state *s, struct fg_proc *p, void *arg, char *note,
			    size_t cap)
{
	(void)s;
	(void)note;
	(void)cap;
	CUcheckpointOtherArgs *a = arg;
	if (a && !all_zero(a, sizeof(*a)))
		return CUDA_ERROR_INVALID_VALUE;
	if (p->state != FG_LOCKED)
		return CUDA_ERROR_ILLEGAL_STATE;
	p->state = FG_RUNNING;
	return CUDA_SUCCESS;
}

static CUresult step_tid(struct fg_state *s, struct fg_proc *p, void *arg, char *note, size_t cap)
{
	(void)s;
	*(int *)arg = restore_thread(p->pid);
	snprintf(note, cap, " tid=%d", *(int *)arg);
	return CUDA_SUCCESS;
}

CUresult cuCheckpointProcessGetState(int pid, int *state)
{
	return state ? run_op("get_state", pid, step_get_state, state) : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
	return run_op("lock", pid, step_lock, args);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointOtherArgs *args)
{
	return run_op("checkpoint", pid, step_checkpoint, args);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
	return run_op("restore", pid, step_restore, args);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointOtherArgs *args)
{
	return run_op("unlock", pid, step_unlock, args);
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	return tid ? run_op("restore_tid", pid, step_tid, tid) : CUDA_ERROR_INVALID_VALUE;
}

#endif
