/*
 * TEST-ONLY FAKE of libnvidia-ml.so.1: the NVML calls pynvml makes for
 * jupyter_cedana.gpu.monitor, answered from $CEDANA_FAKE_GPU_STATE (fakegpu_state.h).
 * Struct layouts follow pynvml's ctypes definitions (nvmlProcessInfo_v2/v3,
 * nvmlMemory[_v2], nvmlUtilization, nvmlProcessUtilizationSample).
 * Device handles are (index + 1) cast to a pointer.
 */
#include <stdint.h>
#include <time.h>

#include "fakegpu_state.h"

typedef int nvmlReturn_t;
typedef void *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9

typedef struct {
	unsigned int pid;
	unsigned long long usedGpuMemory;
	unsigned int gpuInstanceId;
	unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
	unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
	unsigned int version;
	unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
	unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
	unsigned int pid;
	unsigned long long timeStamp;
	unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

/* Like the real NVML, init/shutdown are reference counted: a library in one process
 * (e.g. the GPU monitor) stays initialised when another user shuts its own session. */
static int inited;

/* Load the state; apply an injected nvml_error for `fn`. Returns NVML_SUCCESS or an error. */
static nvmlReturn_t begin(const char *fn, struct fg_state *s)
{
	if (!inited)
		return NVML_ERROR_UNINITIALIZED;
	if (fg_load(s, NULL) != 0)
		return NVML_ERROR_DRIVER_NOT_LOADED;
	struct fg_err *e = fg_find_err(s, fn, 0, 1);
	return e ? e->code : NVML_SUCCESS;
}

static struct fg_dev *dev_of(struct fg_state *s, nvmlDevice_t h)
{
	return fg_dev_by_index(s, (int)((uintptr_t)h) - 1);
}

static nvmlReturn_t init_common(const char *fn)
{
	struct fg_state s;
	if (fg_load(&s, NULL) != 0)
		return NVML_ERROR_DRIVER_NOT_LOADED; /* no state file: "no driver" */
	struct fg_err *e = fg_find_err(&s, fn, 0, 1);
	if (!e)
		e = fg_find_err(&s, "nvmlInit", 0, 1);
	if (e)
		return e->code;
	inited++;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
	(void)flags;
	return init_common("nvmlInitWithFlags");
}

nvmlReturn_t nvmlInit_v2(void) { return init_common("nvmlInit_v2"); }
nvmlReturn_t nvmlInit(void) { return init_common("nvmlInit"); }

nvmlReturn_t nvmlShutdown(void)
{
	if (inited > 0)
		inited--;
	return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
	switch (r) {
	case 0: return "Success";
	case 1: return "Uninitialized";
	case 2: return "Invalid Argument";
	case 3: return "Not Supported";
	case 4: return "Insufficient Permissions";
	case 6: return "Not Found";
	case 7: return "Insufficient Size";
	case 9: return "Driver Not Loaded";
	case 15: return "GPU is lost";
	default: return "Unknown Error";
	}
}

static nvmlReturn_t copy_str(const char *src, char *dst, unsigned int len)
{
	if (!dst)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (strlen(src) + 1 > len)
		return NVML_ERROR_INSUFFICIENT_SIZE;
	memcpy(dst, src, strlen(src) + 1);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int len)
{
	struct fg_state s;
	nvmlReturn_t r = begin("nvmlSystemGetDriverVersion", &s);
	return r ? r : copy_str(s.driver, version, len);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
	struct fg_state s;
	nvmlReturn_t r = begin("nvmlSystemGetCudaDriverVersion", &s);
	if (!r)
		*v = s.cuda;
	return r;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
	struct fg_state s;
	nvmlReturn_t r = begin("nvmlDeviceGetCount_v2", &s);
	if (!r)
		*count = (unsigned)s.ndev;
	return r;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *h)
{
	struct fg_state s;
	nvmlReturn_t r = begin("nvmlDeviceGetHandleByIndex_v2", &s);
	if (r)
		return r;
	if (!fg_dev_by_index(&s, (int)index))
		return NVML_ERROR_INVALID_ARGUMENT;
	*h = (nvmlDevice_t)(uintptr_t)(index + 1);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *h)
{
	return nvmlDeviceGetHandleByIndex_v2(index, h);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *h)
{
	struct fg_state s;
	nvmlReturn_t r = begin("nvmlDeviceGetHandleByUUID", &s);
	if (r)
		return r;
	for (int i = 0; i < s.ndev; i++)
		if (strcmp(s.dev[i].uuid, uuid) == 0) {
			*h = (nvmlDevice_t)(uintptr_t)(s.dev[i].index + 1);
			return NVML_SUCCESS;
		}
	return NVML_ERROR_NOT_FOUND;
}

#define DEVICE_CALL(fn, body)                              \
	struct fg_state s;                                 \
	nvmlReturn_t r = begin(fn, &s);                    \
	if (r)                                             \
		return r;                                  \
	struct fg_dev *d = dev_of(&s, h);                  \
	if (!d)                                            \
		return NVML_ERROR_INVALID_ARGUMENT;        \
	body

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int len)
{
	DEVICE_CALL("nvmlDeviceGetUUID", return copy_str(d->uuid, uuid, len);)
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int len)
{
	DEVICE_CALL("nvmlDeviceGetName", return copy_str(d->name, name, len);)
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index)
{
	DEVICE_CALL("nvmlDeviceGetIndex", *index = (unsigned)d->index; return NVML_SUCCESS;)
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor)
{
	DEVICE_CALL("nvmlDeviceGetMinorNumber", *minor = (unsigned)d->minor; return NVML_SUCCESS;)
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m)
{
	DEVICE_CALL("nvmlDeviceGetMemoryInfo", {
		m->total = d->total;
		m->used = fg_used(&s, d->index);
		m->free = m->used > m->total ? 0 : m->total - m->used;
		return NVML_SUCCESS;
	})
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
	DEVICE_CALL("nvmlDeviceGetMemoryInfo_v2", {
		m->total = d->total;
		m->reserved = d->reserved;
		m->used = fg_used(&s, d->index) - d->reserved;
		m->free = m->total - m->used - m->reserved;
		return NVML_SUCCESS;
	})
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u)
{
	DEVICE_CALL("nvmlDeviceGetUtilizationRates", {
		u->gpu = (unsigned)d->gpu_util;
		u->memory = (unsigned)d->mem_util;
		return NVML_SUCCESS;
	})
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *cur, unsigned int *pending)
{
	DEVICE_CALL("nvmlDeviceGetMigMode", {
		*cur = (unsigned)d->mig;
		*pending = (unsigned)d->mig;
		return NVML_SUCCESS;
	})
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t h, int *mode)
{
	DEVICE_CALL("nvmlDeviceGetComputeMode", *mode = 0; return NVML_SUCCESS;)
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode)
{
	DEVICE_CALL("nvmlDeviceGetPersistenceMode", *mode = 1; return NVML_SUCCESS;)
}

/* Processes holding memory on the device (checkpointed ones hold none). */
static nvmlReturn_t list_procs(const char *fn, nvmlDevice_t h, unsigned int *count,
			       nvmlProcessInfo_t *out, int want_mps)
{
	DEVICE_CALL(fn, {
		unsigned n = 0;
		for (int i = 0; i < s.nproc; i++) {
			struct fg_proc *p = &s.proc[i];
			if (p->dev != d->index || p->mps != want_mps ||
			    !(p->state == FG_RUNNING || p->state == FG_LOCKED))
				continue;
			if (out && n < *count) {
				out[n].pid = (unsigned)p->nvml_pid;
				out[n].usedGpuMemory = p->mem;
				out[n].gpuInstanceId = d->mig ? 0 : 0xFFFFFFFFu;
				out[n].computeInstanceId = d->mig ? 0 : 0xFFFFFFFFu;
			}
			n++;
		}
		if (n == 0) {
			*count = 0;
			return NVML_SUCCESS;
		}
		if (!out || *count < n) {
			*count = n;
			return NVML_ERROR_INSUFFICIENT_SIZE;
		}
		*count = n;
		return NVML_SUCCESS;
	})
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
						     nvmlProcessInfo_t *infos)
{
	return list_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *count,
						     nvmlProcessInfo_t *infos)
{
	return list_procs("nvmlDeviceGetComputeRunningProcesses_v2", h, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
							nvmlProcessInfo_t *infos)
{
	return list_procs("nvmlDeviceGetMPSComputeRunningProcesses_v3", h, count, infos, 1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
						      nvmlProcessInfo_t *infos)
{
	(void)infos;
	DEVICE_CALL("nvmlDeviceGetGraphicsRunningProcesses_v3", *count = 0; return NVML_SUCCESS;)
}

/* One sample per `util` record of a process that can run (not checkpointed). */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h,
					     nvmlProcessUtilizationSample_t *samples,
					     unsigned int *count, unsigned long long lastSeen)
{
	(void)lastSeen;
	DEVICE_CALL("nvmlDeviceGetProcessUtilization", {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		unsigned long long now = (unsigned long long)ts.tv_sec * 1000000ull +
					 (unsigned long long)ts.tv_nsec / 1000ull;
		unsigned n = 0;
		for (int i = 0; i < s.nutil; i++) {
			struct fg_util *u = &s.util[i];
			int runs = 0;
			for (int j = 0; j < s.nproc; j++)
				if (s.proc[j].nvml_pid == u->pid && s.proc[j].state == FG_RUNNING)
					runs = 1;
			if (u->dev != d->index || !runs)
				continue;
			if (samples && n < *count) {
				samples[n].pid = (unsigned)u->pid;
				samples[n].timeStamp = now;
				samples[n].smUtil = (unsigned)u->sm;
				samples[n].memUtil = (unsigned)u->mem;
				samples[n].encUtil = 0;
				samples[n].decUtil = 0;
			}
			n++;
		}
		if (n == 0)
			return NVML_ERROR_NOT_FOUND; /* NVML: no samples since lastSeen */
		if (!samples || *count < n) {
			*count = n;
			return NVML_ERROR_INSUFFICIENT_SIZE;
		}
		*count = n;
		return NVML_SUCCESS;
	})
}
