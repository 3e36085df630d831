/*
 * TEST-ONLY FAKE GPU: the shared state of the fake libcuda.so.1 and the fake
 * libnvidia-ml.so.1 built from this folder. Nothing here talks to hardware.
 *
 * The state is a plain text file named by $CEDANA_FAKE_GPU_STATE, re-read on
 * every call (so a test and the processes under test see one GPU world) and
 * written back, under an exclusive flock, when the fake libcuda changes it.
 * One record per line, `kind key=value ...`; a `name=` value runs to the end
 * of the line. Lines starting with # are ignored (and not written back).
 *
 *   driver version=570.86.10 cuda=12080 noncuda=801
 *          (noncuda: the CUresult the checkpoint calls answer for a live process that
 *          has no CUDA state; see "Processes that never used CUDA" below)
 *   device index=0 uuid=GPU-... total=BYTES reserved=BYTES minor=0 mig=0 gpu_util=0
 *          mem_util=0 name=NVIDIA H100 80GB HBM3
 *   proc pid=HOSTPID dev=0 mem=BYTES state=running|locked|checkpointed|failed
 *        nvml_pid=PID (as NVML reports it, default = pid) mps=0 stuck=0
 *        id=TAG nspid=N (optional: an identity that survives a CRIU restore, below)
 *   util pid=NVMLPID dev=0 sm=PERCENT mem=PERCENT
 *   error op=lock|checkpoint|restore|unlock|get_state|init pid=PID|0 code=CUresult
 *         times=N (-1: always) fail_state=failed (optional: state after failing)
 *   nvml_error fn=nvmlDeviceGetProcessUtilization code=NVML_ERROR
 *
 * Calls are appended to $CEDANA_FAKE_GPU_STATE.log (`cuda OP pid=N rc=N by=COMM ...`,
 * COMM being the calling program: cedana-cuda, or cuda-checkpoint when CRIU's cuda
 * plugin runs the helper under that name).
 *
 * Processes that never used CUDA. The CUDA 13 header lists CUDA_ERROR_INVALID_VALUE,
 * CUDA_ERROR_NOT_INITIALIZED and CUDA_ERROR_NOT_SUPPORTED as what
 * cuCheckpointProcessGetState may return; which one a real driver gives for a live
 * process without CUDA is not documented (bench/gpu_check.py records it on a GPU).
 * The fake answers `noncuda` (default 801, CUDA_ERROR_NOT_SUPPORTED, the answer that
 * broke CPU-only kernels) for such a process and CUDA_ERROR_INVALID_VALUE for a pid
 * that does not exist; tests set `noncuda` to each candidate.
 *
 * A thread id given for a pid stands for its process, as with the real driver
 * (NVIDIA/cuda-checkpoint#41: "threads are listed in /proc ... and can be used").
 *
 * The restore thread. A real CUDA process has a driver thread (named cuda + hex
 * digits) through which cuCheckpointProcessRestore acts: the call cannot complete
 * while that thread is stopped, which is why CRIU's cuda plugin (and the helper's
 * thaw) let that one thread run while the rest of a restored process stays frozen.
 * The fake's restore thread of a process is its thread whose name matches
 * ^cuda[0-9a-f]+$ (test kernels start one), else its main thread. A restore waits up
 * to 5 s for that thread to run, then fails with CUDA_ERROR_OPERATING_SYSTEM (the
 * real driver would just wait), and logs `frozen=1` when every other thread of the
 * process was stopped meanwhile, `frozen=0` otherwise.
 *
 * Process identity across a CRIU restore. The real driver keeps a process's
 * checkpoint state inside that process's memory, so CRIU carries it along and a
 * restored process with a NEW host pid is still "the checkpointed process". The
 * fake keeps its state in the file instead, so a record may name its process by
 * what CRIU also restores: `id=TAG nspid=N` matches a live process whose initial
 * environment (/proc/PID/environ, part of the process memory CRIU restores)
 * holds CEDANA_FAKE_GPU_ID=TAG and whose innermost PID-namespace pid (last
 * field of NSpid in /proc/PID/status, kept by CRIU's pidns restore) is N. A
 * record with an id matches ONLY that way (never by a stale pid that the kernel
 * may have handed to another process); when it matches, the fake libcuda moves
 * the record's pid (and nvml_pid, when it followed pid) to the caller's pid and
 * writes that back, so the fake NVML then reports the process under its new pid.
 * Records without an id match by `pid` alone.
 */
#ifndef FAKEGPU_STATE_H
#define FAKEGPU_STATE_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#define FG_MAX_DEV 16
#define FG_MAX_PROC 512
#define FG_MAX_UTIL 512
#define FG_MAX_ERR 32

enum { FG_RUNNING = 0, FG_LOCKED = 1, FG_CHECKPOINTED = 2, FG_FAILED = 3 };

struct fg_dev {
	int index;
	char uuid[96];
	char name[96];
	unsigned long long total, reserved;
	int minor, mig, gpu_util, mem_util;
};

struct fg_proc {
	int pid, nvml_pid, dev, state, mps, stuck;
	unsigned long long mem;
	char id[64]; /* CEDANA_FAKE_GPU_ID of the process ("" = match by pid) */
	int nspid;   /* its innermost namespace pid, with id */
};

struct fg_util {
	int pid, dev, sm, mem;
};

struct fg_err {
	char op[64];
	int pid, code, times, fail_state;
	int nvml; /* 1: an nvml_error record */
};

struct fg_state {
	char driver[80];
	int cuda;
	int noncuda; /* CUresult for a live process without CUDA */
	int ndev, nproc, nutil, nerr;
	struct fg_dev dev[FG_MAX_DEV];
	struct fg_proc proc[FG_MAX_PROC];
	struct fg_util util[FG_MAX_UTIL];
	struct fg_err err[FG_MAX_ERR];
};

static const char *fg_state_names[] = {"running", "locked", "checkpointed", "failed"};

static __attribute__((unused)) int fg_parse_state(const char *v)
{
	for (int i = 0; i < 4; i++)
		if (strcmp(v, fg_state_names[i]) == 0)
			return i;
	return FG_RUNNING;
}

static __attribute__((unused)) const char *fg_path(void)
{
	const char *p = getenv("CEDANA_FAKE_GPU_STATE");
	return (p && *p) ? p : NULL;
}

static __attribute__((unused)) void fg_log(const char *fmt, ...)
{
	const char *p = fg_path();
	if (!p)
		return;
	char path[4096];
	snprintf(path, sizeof(path), "%s.log", p);
	FILE *f = fopen(path, "a");
	if (!f)
		return;
	va_list ap;
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fputc('\n', f);
	fclose(f);
}

static __attribute__((unused)) void fg_parse_line(struct fg_state *s, char *line)
{
	char *kind = strtok(line, " \t\n");
	if (!kind || kind[0] == '#')
		return;
	struct fg_dev *d = NULL;
	struct fg_proc *p = NULL;
	struct fg_util *u = NULL;
	struct fg_err *e = NULL;
	if (strcmp(kind, "device") == 0 && s->ndev < FG_MAX_DEV) {
		d = &s->dev[s->ndev];
		memset(d, 0, sizeof(*d));
		d->index = s->ndev;
		d->minor = -1;
		s->ndev++;
	} else if (strcmp(kind, "proc") == 0 && s->nproc < FG_MAX_PROC) {
		p = &s->proc[s->nproc++];
		memset(p, 0, sizeof(*p));
		p->nvml_pid = -1;
	} else if (strcmp(kind, "util") == 0 && s->nutil < FG_MAX_UTIL) {
		u = &s->util[s->nutil++];
		memset(u, 0, sizeof(*u));
	} else if ((strcmp(kind, "error") == 0 || strcmp(kind, "nvml_error") == 0) &&
		   s->nerr < FG_MAX_ERR) {
		e = &s->err[s->nerr++];
		memset(e, 0, sizeof(*e));
		e->times = -1;
		e->fail_state = -1;
		e->nvml = kind[0] == 'n';
	} else if (strcmp(kind, "driver") != 0) {
		return;
	}
	char *tok;
	while ((tok = strtok(NULL, " \t\n")) != NULL) {
		char *eq = strchr(tok, '=');
		if (!eq)
			continue;
		*eq = 0;
		const char *k = tok, *v = eq + 1;
		long long n = strtoll(v, NULL, 10);
		if (d) {
			if (strcmp(k, "name") == 0) {
				/* the name runs to the end of the line */
				char *rest = strtok(NULL, "\n");
				snprintf(d->name, sizeof(d->name), "%s%s%s", v, rest ? " " : "",
					 rest ? rest : "");
				break;
			}
			if (strcmp(k, "index") == 0) d->index = (int)n;
			else if (strcmp(k, "uuid") == 0) snprintf(d->uuid, sizeof(d->uuid), "%s", v);
			else if (strcmp(k, "total") == 0) d->total = (unsigned long long)n;
			else if (strcmp(k, "reserved") == 0) d->reserved = (unsigned long long)n;
			else if (strcmp(k, "minor") == 0) d->minor = (int)n;
			else if (strcmp(k, "mig") == 0) d->mig = (int)n;
			else if (strcmp(k, "gpu_util") == 0) d->gpu_util = (int)n;
			else if (strcmp(k, "mem_util") == 0) d->mem_util = (int)n;
		} else if (p) {
			if (strcmp(k, "pid") == 0) p->pid = (int)n;
			else if (strcmp(k, "nvml_pid") == 0) p->nvml_pid = (int)n;
			else if (strcmp(k, "dev") == 0) p->dev = (int)n;
			else if (strcmp(k, "mem") == 0) p->mem = (unsigned long long)n;
			else if (strcmp(k, "state") == 0) p->state = fg_parse_state(v);
			else if (strcmp(k, "mps") == 0) p->mps = (int)n;
			else if (strcmp(k, "stuck") == 0) p->stuck = (int)n;
			else if (strcmp(k, "id") == 0) snprintf(p->id, sizeof(p->id), "%s", v);
			else if (strcmp(k, "nspid") == 0) p->nspid = (int)n;
		} else if (u) {
			if (strcmp(k, "pid") == 0) u->pid = (int)n;
			else if (strcmp(k, "dev") == 0) u->dev = (int)n;
			else if (strcmp(k, "sm") == 0) u->sm = (int)n;
			else if (strcmp(k, "mem") == 0) u->mem = (int)n;
		} else if (e) {
			if (strcmp(k, "op") == 0 || strcmp(k, "fn") == 0)
				snprintf(e->op, sizeof(e->op), "%s", v);
			else if (strcmp(k, "pid") == 0) e->pid = (int)n;
			else if (strcmp(k, "code") == 0) e->code = (int)n;
			else if (strcmp(k, "times") == 0) e->times = (int)n;
			else if (strcmp(k, "fail_state") == 0) e->fail_state = fg_parse_state(v);
		} else {
			if (strcmp(k, "version") == 0) snprintf(s->driver, sizeof(s->driver), "%s", v);
			else if (strcmp(k, "cuda") == 0) s->cuda = (int)n;
			else if (strcmp(k, "noncuda") == 0) s->noncuda = (int)n;
		}
	}
	if (d && d->minor < 0)
		d->minor = d->index;
	if (p && p->nvml_pid < 0)
		p->nvml_pid = p->pid;
}

static __attribute__((unused)) void fg_parse(struct fg_state *s, FILE *f)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->driver, sizeof(s->driver), "570.00.00");
	s->cuda = 12080;
	s->noncuda = 801; /* CUDA_ERROR_NOT_SUPPORTED */
	char line[1024];
	while (fgets(line, sizeof(line), f))
		fg_parse_line(s, line);
}

/* Read the state; with `lock_fd` non-NULL keep the file open and exclusively
 * locked for a later fg_save(). Returns 0 on success. */
static __attribute__((unused)) int fg_load(struct fg_state *s, int *lock_fd)
{
	const char *path = fg_path();
	memset(s, 0, sizeof(*s));
	if (!path)
		return -1;
	int fd = open(path, lock_fd ? O_RDWR : O_RDONLY);
	if (fd < 0)
		return -1;
	flock(fd, lock_fd ? LOCK_EX : LOCK_SH);
	FILE *f = fdopen(dup(fd), "r");
	if (!f) {
		close(fd);
		return -1;
	}
	fg_parse(s, f);
	fclose(f);
	if (lock_fd)
		*lock_fd = fd;
	else
		close(fd); /* drops the shared lock */
	return 0;
}

static __attribute__((unused)) void fg_save(const struct fg_state *s, int fd)
{
	/* reading moved the shared offset to the end: rewind before rewriting */
	FILE *f = lseek(fd, 0, SEEK_SET) == 0 ? fdopen(dup(fd), "w") : NULL;
	if (f) {
		if (ftruncate(fd, 0) == 0) {
			fprintf(f, "driver version=%s cuda=%d noncuda=%d\n", s->driver, s->cuda,
				s->noncuda);
			for (int i = 0; i < s->ndev; i++) {
				const struct fg_dev *d = &s->dev[i];
				fprintf(f,
					"device index=%d uuid=%s total=%llu reserved=%llu minor=%d "
					"mig=%d gpu_util=%d mem_util=%d name=%s\n",
					d->index, d->uuid, d->total, d->reserved, d->minor, d->mig,
					d->gpu_util, d->mem_util, d->name);
			}
			for (int i = 0; i < s->nproc; i++) {
				const struct fg_proc *p = &s->proc[i];
				fprintf(f,
					"proc pid=%d nvml_pid=%d dev=%d mem=%llu state=%s mps=%d "
					"stuck=%d",
					p->pid, p->nvml_pid, p->dev, p->mem, fg_state_names[p->state],
					p->mps, p->stuck);
				if (p->id[0])
					fprintf(f, " id=%s nspid=%d", p->id, p->nspid);
				fputc('\n', f);
			}
			for (int i = 0; i < s->nutil; i++)
				fprintf(f, "util pid=%d dev=%d sm=%d mem=%d\n", s->util[i].pid,
					s->util[i].dev, s->util[i].sm, s->util[i].mem);
			for (int i = 0; i < s->nerr; i++) {
				const struct fg_err *e = &s->err[i];
				if (e->times == 0)
					continue; /* used up */
				fprintf(f, "%s %s=%s pid=%d code=%d times=%d", e->nvml ? "nvml_error" : "error",
					e->nvml ? "fn" : "op", e->op, e->pid, e->code, e->times);
				if (e->fail_state >= 0)
					fprintf(f, " fail_state=%s", fg_state_names[e->fail_state]);
				fputc('\n', f);
			}
		}
		fflush(f);
		fclose(f);
	}
	flock(fd, LOCK_UN);
	close(fd);
}

/* Memory in use on a device: reserved plus every process that still holds memory. */
static __attribute__((unused)) unsigned long long fg_used(const struct fg_state *s, int dev)
{
	unsigned long long used = 0;
	for (int i = 0; i < s->ndev; i++)
		if (s->dev[i].index == dev)
			used = s->dev[i].reserved;
	for (int i = 0; i < s->nproc; i++) {
		const struct fg_proc *p = &s->proc[i];
		if (p->dev == dev && (p->state == FG_RUNNING || p->state == FG_LOCKED))
			used += p->mem;
	}
	return used;
}

static __attribute__((unused)) struct fg_dev *fg_dev_by_index(struct fg_state *s, int index)
{
	for (int i = 0; i < s->ndev; i++)
		if (s->dev[i].index == index)
			return &s->dev[i];
	return NULL;
}

/* CEDANA_FAKE_GPU_ID of a live process ("" if none) and its innermost NSpid (0 if unknown). */
static __attribute__((unused)) void fg_identity(int pid, char *id, size_t cap, int *nspid)
{
	char path[64], buf[1 << 16];
	id[0] = 0;
	*nspid = 0;
	snprintf(path, sizeof(path), "/proc/%d/environ", pid);
	int fd = open(path, O_RDONLY);
	if (fd >= 0) {
		ssize_t n = read(fd, buf, sizeof(buf) - 1);
		close(fd);
		const char *key = "CEDANA_FAKE_GPU_ID=";
		buf[n > 0 ? n : 0] = 0;
		for (ssize_t i = 0; i < n; i += (ssize_t)strlen(buf + i) + 1) {
			if (strncmp(buf + i, key, strlen(key)) == 0) {
				snprintf(id, cap, "%s", buf + i + strlen(key));
				break;
			}
		}
	}
	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	char line[512];
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, "NSpid:", 6) == 0) {
			char *last = NULL, *tok = strtok(line + 6, " \t\n");
			for (; tok; tok = strtok(NULL, " \t\n"))
				last = tok;
			if (last)
				*nspid = atoi(last);
		}
	fclose(f);
}

/* The record of the process `pid` is (see "Process identity" above), or NULL. A match
 * through id/nspid rebinds the record to `pid` (the caller saves the state). */
static __attribute__((unused)) struct fg_proc *fg_find_proc(struct fg_state *s, int pid)
{
	char id[64];
	int nspid = -1;
	for (int i = 0; i < s->nproc; i++) {
		struct fg_proc *p = &s->proc[i];
		if (!p->id[0]) {
			if (p->pid == pid)
				return p;
			continue;
		}
		if (nspid < 0)
			fg_identity(pid, id, sizeof(id), &nspid);
		if (id[0] && strcmp(id, p->id) == 0 && nspid == p->nspid) {
			if (p->nvml_pid == p->pid)
				p->nvml_pid = pid;
			p->pid = pid;
			return p;
		}
	}
	return NULL;
}

/* An injected error for (op, pid): returns its code (consuming one use) or 0. */
static __attribute__((unused)) struct fg_err *fg_find_err(struct fg_state *s, const char *op, int pid, int nvml)
{
	for (int i = 0; i < s->nerr; i++) {
		struct fg_err *e = &s->err[i];
		if (e->nvml == nvml && e->times != 0 && strcmp(e->op, op) == 0 &&
		    (e->pid == 0 || e->pid == pid))
			return e;
	}
	return NULL;
}

#endif
