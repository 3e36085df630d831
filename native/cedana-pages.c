/*
 * cedana-pages: serves the memory of a lazily restored kernel from its checkpoint image,
 * checking each chunk's CRC-32 before any page of it reaches the process.
 *
 *   cedana-pages --images DIR --map FILE --pidfile FILE --holder-fd FD [--pause-file PATH]
 *                [--hold-events-file PATH] [--copiers N]
 *
 * It runs in the work directory of `criu restore --lazy-pages` (the restore's -W) and
 * stands in for `criu lazy-pages`, speaking its protocol on lazy-pages.socket there: CRIU
 * sends, per restored process, an int (its pid in the image) and then its userfaultfd (a
 * negative pid, without an fd, for a zombie), and 0x52535446 once the restore is finished.
 *
 * Each userfaultfd is also passed to the holder (FD: a unix socket to the server), which
 * keeps a copy: should this daemon die, the process then blocks on its next missing page
 * (instead of reading zeros, which is what a closed userfaultfd gives) until the server
 * kills it.
 *
 * The map (written by jupyter_cedana/checkpoint/lazy.py from the image) gives the chunk size, the
 * page files with their chunk CRC tables, and per process the lazily restored page runs:
 * address range, page file, offset. The main thread serves page faults, each with the
 * chunk that holds the page, and keeps the runs up to date through fork, mremap, munmap
 * and madvise(DONTNEED) events, as CRIU's daemon does. Meanwhile the remaining pages come
 * in file order, a block at a time: a reader thread reads and checks blocks ahead while
 * copier threads (--copiers, 2) copy the ones before, each its own block (the disk, the
 * checksums and the copies overlap). They continue from the last fault, so a cell that
 * walks through its memory finds it coming in ahead of it.
 *
 * Several copiers because a copy into memory that is new to the process mostly waits: on
 * a VM each new page can cost a fault on the host, and where the host has taken the
 * guest's free memory back (free page reporting) that is most of a copy's time; copies
 * running side by side overlap those waits (measured on 2 vCPUs, 8 GB into such memory:
 * 11.5 s with one copier, 4.8-5.6 s with two, 4.9-5.3 s with four).
 *
 * Locks: `mu` over the runs and the slots; `placing` between copying and the runs
 * changing under events: copiers hold it shared while they copy (outside mu), the main
 * thread exclusively while it reads events and serves faults, so that a copy and an event
 * never interleave (a page copied into an area madvise(DONTNEED) just emptied would bring
 * back stale data). Copiers copy disjoint blocks, so their copies need no more than that.
 * Order: placing, then mu.
 *
 * A chunk whose CRC differs, a short read (a truncated file) or a read error: nothing of
 * it is copied, "error ..." is reported and the daemon stops serving but keeps its
 * userfaultfds: the process cannot run on with wrong memory (it blocks at its next
 * missing page) until the server kills it, then this daemon. Every page in: "done".
 *
 * Once the restore has finished, the restored tree's root (--pidfile, written by CRIU) is
 * watched: should it end before every page is in (the kernel shut down, or killed with a
 * server that died), there is nothing left to serve.
 *
 * --pause-file PATH: hold the background transfer while PATH exists (faults are still
 * served); for debugging and for tests that need a transfer held mid-way.
 * --hold-events-file PATH: leave the processes' events (and so their faults) unread while
 * PATH exists: a process that munmaps, mremaps or forks then waits in the kernel, its
 * areas marked as changing, and every copy into it is refused (EAGAIN); for tests.
 *
 * stdout, a line each: "ready", "task PID BYTES", "restored", "progress DONE TOTAL",
 * "done BYTES SECONDS", "exited" (every process ended before all its pages were in),
 * "error MESSAGE". Exit status: 0 done, 3 exited, 2 usage, 1 other failures.
 *
 * CRC-32 is zlib's (the tables were computed by Python's zlib module): folded with
 * PCLMULQDQ where the CPU has it (several times faster), checked against zlib's own
 * crc32, loaded at run time from libz.so.1 (so building needs no zlib headers), at start.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#define SOCKET_NAME "lazy-pages.socket"
#define RESTORE_FINISHED 0x52535446
#define PAGE 4096ULL
#define BLOCK (4ULL << 20) /* background transfer: bytes read per step */
#define STEP (1ULL << 20)  /* and copied per hold of `placing`: what a fault may wait for */
#define SLOTS 8		   /* blocks read and checked ahead of the copies, or being copied */
#define MAX_COPIERS SLOTS
#define PROGRESS_EVERY (64ULL << 20)
/* EAGAIN/ENOENT this often in a row, and for this long, means an area changed without an
 * event. Both bounds: the kernel clears its "mappings changing" mark only once the thread
 * whose munmap/mremap/fork sent the event runs again after we read it, which on a loaded
 * machine can take far more than a thousand 1 ms retries. */
#define MAX_STRIKES 1000
#define STRIKE_S 10.0
#define ORPHAN_GRACE_S 10 /* failed and the server gone: give its keeper time to kill */

/* -- CRC-32 ------------------------------------------------------------------------------ */

typedef unsigned long (*zcrc32_fn)(unsigned long, const unsigned char *, unsigned int);
static zcrc32_fn zcrc32;
static int use_clmul;

#if defined(__x86_64__)
/* CRC-32 (zlib's polynomial, reflected) of a buffer of a multiple of 16 bytes, at least
 * 64, by folding with carry-less multiplication: "Fast CRC Computation for Generic
 * Polynomials Using PCLMULQDQ Instruction", Gopal et al., Intel, 2009; the constants are
 * those of Linux's and Chromium zlib's implementations of it. `crc` is pre-inverted. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc32_clmul(const unsigned char *buf,
								       size_t len, uint32_t crc)
{
	static const uint64_t __attribute__((aligned(16))) k1k2[] = {0x0154442bd4, 0x01c6e41596};
	static const uint64_t __attribute__((aligned(16))) k3k4[] = {0x01751997d0, 0x00ccaa009e};
	static const uint64_t __attribute__((aligned(16))) k5[] = {0x0163cd6124, 0x0000000000};
	static const uint64_t __attribute__((aligned(16))) poly[] = {0x01db710641, 0x01f7011641};
	__m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

	x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
	x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
	x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
	x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
	x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
	x0 = _mm_load_si128((const __m128i *)k1k2);
	buf += 64;
	len -= 64;
	while (len >= 64) {
		x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
		x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
		x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
		x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
		x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
		x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
		x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
		x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
		y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
		y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
		y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
		y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
		x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
		x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
		x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
		x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
		buf += 64;
		len -= 64;
	}
	/* Fold the four lanes into one. */
	x0 = _mm_load_si128((const __m128i *)k3k4);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
	x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
	x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
	while (len >= 16) {
		x2 = _mm_loadu_si128((const __m128i *)buf);
		x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
		x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
		x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
		buf += 16;
		len -= 16;
	}
	/* 128 bits to 64, then Barrett reduction to 32. */
	x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
	x3 = _mm_setr_epi32(~0, 0, ~0, 0);
	x1 = _mm_srli_si128(x1, 8);
	x1 = _mm_xor_si128(x1, x2);
	x0 = _mm_loadl_epi64((const __m128i *)k5);
	x2 = _mm_srli_si128(x1, 4);
	x1 = _mm_and_si128(x1, x3);
	x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
	x1 = _mm_xor_si128(x1, x2);
	x0 = _mm_load_si128((const __m128i *)poly);
	x2 = _mm_and_si128(x1, x3);
	x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
	x2 = _mm_and_si128(x2, x3);
	x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
	x1 = _mm_xor_si128(x1, x2);
	return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uint32_t crc32_of(const unsigned char *buf, uint64_t len)
{
#if defined(__x86_64__)
	if (use_clmul && len >= 64 && len % 16 == 0)
		return ~crc32_clmul(buf, len, ~0U);
#endif
	return (uint32_t)zcrc32(0, buf, (unsigned)len);
}

static int crc_setup(void)
{
	void *libz = dlopen("libz.so.1", RTLD_NOW);
	zcrc32 = libz ? (zcrc32_fn)dlsym(libz, "crc32") : NULL;
	if (!zcrc32)
		return -1;
#if defined(__x86_64__)
	unsigned a, b, c, d;
	if (__get_cpuid(1, &a, &b, &c, &d) && (c & bit_PCLMUL) && (c & bit_SSE4_1)) {
		/* Trust it only where it agrees with zlib. */
		static unsigned char probe[8192];
		uint32_t x = 2463534242u;
		for (size_t i = 0; i < sizeof(probe); i++) {
			x ^= x << 13, x ^= x >> 17, x ^= x << 5;
			probe[i] = (unsigned char)x;
		}
		use_clmul = 1;
		for (size_t len = 64; len <= sizeof(probe) && use_clmul; len += 16 * 37)
			use_clmul = crc32_of(probe, len) == (uint32_t)zcrc32(0, probe, (unsigned)len);
	}
#endif
	return 0;
}

/* -- state ------------------------------------------------------------------------------- */

struct pfile {
	int fd;
	uint64_t size;
	uint64_t ncrc;
	uint32_t *crc;
	char name[256];
};

struct run {
	uint64_t start, end; /* addresses in the process now (mremap moves them) */
	uint64_t off;	     /* offset of start in the page file */
	int file;
};

struct task {
	int pid;
	int uffd;
	int gone;
	struct run *runs; /* sorted by (file, off): image order, whatever the remaps */
	size_t n, cap;
	uint64_t *faults; /* pages whose fault could not be served yet (EAGAIN) */
	size_t nfaults, capfaults;
	unsigned strikes; /* EAGAIN/ENOENT in a row */
	double strikes_since;
};

struct span {
	int file;
	uint64_t lo, hi;
};

/* Everything below is under `mu`, but the page files and the chunk size (read-only). */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_rwlock_t placing; /* see the top: shared to copy, exclusive for events */
static int ncopiers = 2;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static uint64_t chunk_size;
static struct pfile *files;
static int nfiles;
static struct task **templates; /* the map's runs, by pid, until CRIU sends the fd */
static int ntemplates;
static struct task **tasks;
static int ntasks;
static int epfd, wakefd, holder_fd = -1, client = -1;
static int finished, failed;
static const char *pause_file, *hold_events_file, *pidfile;
static int rootfd = -1;
static uint64_t bytes_done, bytes_total, last_progress;
static struct span cursor;	     /* where the reader claims its next block */
static struct span claimed[SLOTS]; /* blocks being read or copied (hi == 0: a free slot) */
static int ready[SLOTS];	   /* read and checked, no copier on it yet */
static uint64_t claim_seq[SLOTS], next_seq;
static unsigned char *slot_buf[SLOTS];
static double t_start, t_read, t_crc, t_copy; /* where the time went, for the log */
static uint64_t n_faults, n_fork, n_remap, n_remove, n_unmap;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void say(const char *fmt, ...)
{
	va_list ap;
	flockfile(stdout);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	fflush(stdout);
	funlockfile(stdout);
}

static void die(const char *what)
{
	say("error %s: %s", what, strerror(errno));
	exit(1);
}

static void *xrealloc(void *p, size_t size)
{
	void *q = realloc(p, size ? size : 1);
	if (!q)
		die("out of memory");
	return q;
}

static void wake_main(void)
{
	uint64_t one = 1;
	if (write(wakefd, &one, sizeof(one)) < 0 && errno != EAGAIN)
		fprintf(stderr, "cedana-pages: eventfd: %s\n", strerror(errno));
}

/* A damaged image or a failed read (under mu): copy nothing more, keep the userfaultfds. */
static void fail(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	if (failed)
		return;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	say("error %s", msg);
	failed = 1;
	pthread_cond_broadcast(&cv);
	wake_main();
}

/* -- the map ----------------------------------------------------------------------------- */

static struct task *task_new(int pid)
{
	struct task *t = calloc(1, sizeof(*t));
	if (!t)
		die("out of memory");
	t->pid = pid;
	t->uffd = -1;
	return t;
}

static void runs_reserve(struct task *t, size_t n)
{
	if (n > t->cap) {
		t->cap = n * 2 + 16;
		t->runs = xrealloc(t->runs, t->cap * sizeof(*t->runs));
	}
}

static uint64_t task_bytes(const struct task *t)
{
	uint64_t sum = 0;
	for (size_t i = 0; i < t->n; i++)
		sum += t->runs[i].end - t->runs[i].start;
	return sum;
}

/* A file of the image directory, or of one of its bases (incremental images keep their
 * base in "base/", which may have its own): "base/"* then a plain name, nothing else. */
static int image_file_name(const char *name)
{
	while (strncmp(name, "base/", 5) == 0)
		name += 5;
	return *name && !strchr(name, '/') && strcmp(name, ".") && strcmp(name, "..");
}

static int open_in(const char *dir, const char *name)
{
	char full[4096];
	snprintf(full, sizeof(full), "%s/%s", dir, name);
	int fd = open(full, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		die(full);
	return fd;
}

/* A page file's chunk table (integrity.py's format: "CDNCHNK1", u32 chunk size, u32 0,
 * u64 file size, a u32 CRC per chunk, little-endian), itself checked against the CRC the
 * manifest has for it. */
static void load_table(const char *images, struct pfile *pf, const char *name, uint32_t want)
{
	int fd = open_in(images, name);
	struct stat st;
	unsigned char *data;
	if (fstat(fd, &st) < 0)
		die(name);
	data = xrealloc(NULL, st.st_size);
	if (pread(fd, data, st.st_size, 0) != st.st_size)
		die(name);
	close(fd);
	uint32_t csize, pad;
	uint64_t size;
	if (st.st_size < 24 || memcmp(data, "CDNCHNK1", 8) != 0 || (uint32_t)zcrc32(0, data, st.st_size) != want) {
		say("error %s is damaged (checksum or format)", name);
		exit(1);
	}
	memcpy(&csize, data + 8, 4);
	memcpy(&pad, data + 12, 4);
	memcpy(&size, data + 16, 8);
	pf->ncrc = (st.st_size - 24) / 4;
	if (csize != chunk_size || size != pf->size || pf->ncrc != (size + csize - 1) / csize) {
		say("error %s does not describe %s", name, pf->name);
		exit(1);
	}
	pf->crc = xrealloc(NULL, pf->ncrc * sizeof(*pf->crc));
	memcpy(pf->crc, data + 24, pf->ncrc * sizeof(*pf->crc));
	free(data);
}

static void load_map(const char *images, const char *path)
{
	FILE *f = fopen(path, "re");
	char word[32];
	int version;
	if (!f)
		die(path);
	if (fscanf(f, "cedana-pages-map %d chunk %" SCNu64, &version, &chunk_size) != 2 ||
	    version != 1 || chunk_size < PAGE || chunk_size % PAGE)
		goto bad;
	while (fscanf(f, " %31s", word) == 1) {
		if (strcmp(word, "file") == 0) {
			struct pfile *pf;
			char table[256];
			uint32_t table_crc;
			files = xrealloc(files, (nfiles + 1) * sizeof(*files));
			pf = &files[nfiles++];
			if (fscanf(f, " %" SCNu64 " %255s %255s %" SCNx32, &pf->size, pf->name, table,
				   &table_crc) != 4 ||
			    !image_file_name(pf->name) || !image_file_name(table))
				goto bad;
			load_table(images, pf, table, table_crc);
			pf->fd = open_in(images, pf->name);
			/* One sequential stream of reads: the kernel reads ahead of it (measured
			 * faster, and cheaper in CPU, than O_DIRECT reads or readahead asked for). */
			posix_fadvise(pf->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
		} else if (strcmp(word, "task") == 0) {
			int pid;
			size_t n;
			struct task *t;
			if (fscanf(f, " %d %zu", &pid, &n) != 2)
				goto bad;
			t = task_new(pid);
			runs_reserve(t, n);
			for (size_t i = 0; i < n; i++) {
				struct run *r = &t->runs[i];
				if (fscanf(f, " %" SCNx64 " %" SCNx64 " %d %" SCNx64, &r->start, &r->end,
					   &r->file, &r->off) != 4 ||
				    r->file < 0 || r->file >= nfiles || r->end <= r->start ||
				    (r->start | r->end | r->off) % PAGE ||
				    r->off + (r->end - r->start) > files[r->file].size)
					goto bad;
				if (i && (r->file < r[-1].file ||
					  (r->file == r[-1].file && r->off < r[-1].off + (r[-1].end - r[-1].start))))
					goto bad;
			}
			t->n = n;
			templates = xrealloc(templates, (ntemplates + 1) * sizeof(*templates));
			templates[ntemplates++] = t;
		} else {
			goto bad;
		}
	}
	fclose(f);
	return;
bad:
	say("error malformed map %s", path);
	exit(1);
}

/* -- runs -------------------------------------------------------------------------------- */

/* Remove [a, b) (addresses now) from run i, which contains it. */
static void cut(struct task *t, size_t i, uint64_t a, uint64_t b)
{
	struct run r = t->runs[i];
	if (a > r.start && b < r.end) {
		runs_reserve(t, t->n + 1);
		memmove(&t->runs[i + 1], &t->runs[i], (t->n - i) * sizeof(*t->runs));
		t->n++;
		t->runs[i].end = a;
		t->runs[i + 1].start = b;
		t->runs[i + 1].off = r.off + (b - r.start);
	} else if (a > r.start) {
		t->runs[i].end = a;
	} else if (b < r.end) {
		t->runs[i].start = b;
		t->runs[i].off = r.off + (b - r.start);
	} else {
		memmove(&t->runs[i], &t->runs[i + 1], (t->n - i - 1) * sizeof(*t->runs));
		t->n--;
	}
}

/* Split run i at address `at` (inside it): two runs, in file order. */
static void split(struct task *t, size_t i, uint64_t at)
{
	struct run r = t->runs[i];
	runs_reserve(t, t->n + 1);
	memmove(&t->runs[i + 1], &t->runs[i], (t->n - i) * sizeof(*t->runs));
	t->n++;
	t->runs[i].end = at;
	t->runs[i + 1].start = at;
	t->runs[i + 1].off = r.off + (at - r.start);
}

static void drop_range(struct task *t, uint64_t a, uint64_t b)
{
	for (size_t i = 0; i < t->n;) {
		struct run r = t->runs[i];
		uint64_t lo = a > r.start ? a : r.start, hi = b < r.end ? b : r.end;
		if (lo >= hi) {
			i++;
			continue;
		}
		size_t before = t->n;
		cut(t, i, lo, hi);
		if (t->n >= before) /* a piece is left at i (and maybe one after it) */
			i += 1 + (t->n > before);
	}
}

static void remap(struct task *t, uint64_t from, uint64_t to, uint64_t len)
{
	uint64_t end = from + len;
	for (size_t i = 0; i < t->n; i++) {
		struct run *r = &t->runs[i];
		if (r->end <= from || r->start >= end)
			continue;
		if (r->start < from) {
			split(t, i, from);
			continue; /* the next iteration meets the part inside */
		}
		if (r->end > end)
			split(t, i, end);
		r = &t->runs[i];
		r->start = r->start - from + to;
		r->end = r->end - from + to;
	}
}

static int find_run(const struct task *t, uint64_t addr)
{
	for (size_t i = 0; i < t->n; i++)
		if (addr >= t->runs[i].start && addr < t->runs[i].end)
			return (int)i;
	return -1;
}

/* -- reading and checking (no lock) ----------------------------------------------------- */

/* Read [lo, hi) of a page file (lo chunk-aligned) into buf and check every chunk; on a
 * failure, write why into `why` and return -1. */
static int load(int file, uint64_t lo, uint64_t hi, unsigned char *buf, char *why, size_t whylen)
{
	struct pfile *pf = &files[file];
	uint64_t got = 0;
	double t0 = now_s(), t1;
	while (got < hi - lo) {
		ssize_t n = pread(pf->fd, buf + got, hi - lo - got, (off_t)(lo + got));
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			snprintf(why, whylen, "read error in %s at offset %" PRIu64 ": %s", pf->name,
				 lo + got, strerror(errno));
			return -1;
		}
		if (n == 0) {
			snprintf(why, whylen, "%s is truncated: it ends at offset %" PRIu64 ", not %" PRIu64,
				 pf->name, lo + got, pf->size);
			return -1;
		}
		got += n;
	}
	t1 = now_s();
	for (uint64_t off = lo; off < hi; off += chunk_size) {
		uint64_t idx = off / chunk_size, len = hi - off < chunk_size ? hi - off : chunk_size;
		if (crc32_of(buf + (off - lo), len) != pf->crc[idx]) {
			snprintf(why, whylen, "checksum mismatch in %s at offset %" PRIu64 " (chunk %" PRIu64 ")",
				 pf->name, idx * chunk_size, idx);
			return -1;
		}
	}
	double t2 = now_s();
	pthread_mutex_lock(&mu);
	t_read += t1 - t0;
	t_crc += t2 - t1;
	pthread_mutex_unlock(&mu);
	return 0;
}

/* -- copying into the process (under mu) ------------------------------------------------ */

/* The process ended (its memory is gone): nothing of it is left to serve. Said in the log
 * with what was still to come, as it is what decides between "done" and "exited". */
static void gone(struct task *t, const char *why, int err)
{
	if (t->gone)
		return;
	fprintf(stderr, "cedana-pages: process %d gone (%s: %s) with %" PRIu64 " bytes to come\n",
		t->pid, why, strerror(err), task_bytes(t));
	t->gone = 1;
	t->n = 0;
	t->nfaults = 0;
	epoll_ctl(epfd, EPOLL_CTL_DEL, t->uffd, NULL);
}

enum { COPIED, RETRY, GONE };

/* UFFDIO_COPY of [dst, dst+len) (inside one run) from src; what lands leaves the runs.
 * Called with mu and `placing` held (either way); mu is let go during each copy, so that
 * the other copiers copy meanwhile: only they change the runs then, each in its own block. */
static int copy(struct task *t, uint64_t dst, const unsigned char *src, uint64_t len)
{
	uint64_t try = len;
	while (len) {
		struct uffdio_copy c = {.dst = dst, .src = (uint64_t)(uintptr_t)src, .len = try};
		int uffd = t->uffd;
		double t0 = now_s();
		pthread_mutex_unlock(&mu);
		int rc = ioctl(uffd, UFFDIO_COPY, &c);
		int saved = errno;
		pthread_mutex_lock(&mu);
		errno = saved;
		t_copy += now_s() - t0;
		if (t->gone)
			return GONE;
		uint64_t landed = rc == 0 ? try : (c.copy > 0 ? (uint64_t)c.copy : 0);
		int err = rc == 0 ? 0 : (c.copy < 0 ? (int)-c.copy : errno);
		if (landed) {
			int i = find_run(t, dst);
			if (i >= 0)
				cut(t, (size_t)i, dst, dst + landed);
			bytes_done += landed;
			dst += landed;
			src += landed;
			len -= landed;
			try = len;
			t->strikes = 0;
			continue; /* a partial copy stopped at a page that needs a look of its own */
		}
		if (err == ESRCH || err == ENOSPC) {
			gone(t, "UFFDIO_COPY", err);
			return GONE;
		}
		if (err == EEXIST) {
			/* The process populated this page itself: it is not ours to fill. */
			int i = find_run(t, dst);
			if (i >= 0)
				cut(t, (size_t)i, dst, dst + PAGE);
			dst += PAGE;
			src += PAGE;
			len -= PAGE;
			try = len;
			continue;
		}
		if (err == ENOENT && try > PAGE) {
			/* The range crosses into another area (mprotect splits areas): smaller. */
			try = (try / 2 + PAGE - 1) & ~(PAGE - 1);
			continue;
		}
		if (err == EAGAIN || err == ENOENT) {
			/* The areas are changing: an event waits to be read. Retry after it. */
			if (t->strikes++ == 0)
				t->strikes_since = now_s();
			if (t->strikes == MAX_STRIKES)
				fprintf(stderr, "cedana-pages: process %d: %u copies refused in a row in "
					"%.3f s (its areas are changing)\n", t->pid, t->strikes,
					now_s() - t->strikes_since);
			if (t->strikes > MAX_STRIKES && now_s() - t->strikes_since > STRIKE_S)
				fail("cannot place the page at 0x%" PRIx64 " of process %d: its area "
				     "changed without an event", dst, t->pid);
			return RETRY;
		}
		fail("UFFDIO_COPY into process %d failed: %s", t->pid, strerror(err));
		return RETRY;
	}
	return COPIED;
}

/* Copy every piece of the task's runs that lies in [lo, hi) of `file`, held in buf. */
static int serve(struct task *t, int file, uint64_t lo, uint64_t hi, const unsigned char *buf)
{
	while (!t->gone && !failed) {
		struct run *r = NULL;
		for (size_t i = 0; i < t->n; i++) {
			struct run *q = &t->runs[i];
			if (q->file > file || (q->file == file && q->off >= hi))
				break;
			if (q->file == file && q->off + (q->end - q->start) > lo) {
				r = q;
				break;
			}
		}
		if (!r)
			return COPIED;
		uint64_t rlen = r->end - r->start;
		uint64_t a = r->off > lo ? r->off : lo, b = r->off + rlen < hi ? r->off + rlen : hi;
		int rc = copy(t, r->start + (a - r->off), buf + (a - lo), b - a);
		if (rc != COPIED)
			return rc;
	}
	return t->gone ? GONE : RETRY;
}

static void report_progress(int force)
{
	if (force || bytes_done - last_progress >= PROGRESS_EVERY) {
		last_progress = bytes_done;
		say("progress %" PRIu64 " %" PRIu64, bytes_done, bytes_total);
	}
}

/* -- page faults (main thread) ---------------------------------------------------------- */

static void add_fault(struct task *t, uint64_t page)
{
	for (size_t i = 0; i < t->nfaults; i++)
		if (t->faults[i] == page)
			return;
	if (t->nfaults == t->capfaults) {
		t->capfaults = t->capfaults * 2 + 8;
		t->faults = xrealloc(t->faults, t->capfaults * sizeof(*t->faults));
	}
	t->faults[t->nfaults++] = page;
}

static int in_claimed(int file, uint64_t off)
{
	for (int i = 0; i < SLOTS; i++)
		if (claimed[i].hi && claimed[i].file == file && off >= claimed[i].lo && off < claimed[i].hi)
			return 1;
	return 0;
}

/* Serve a fault at `page` (called and returning with mu held): its chunk if that is still
 * to come, else a zero page (memory never touched before the dump). 0: resolved. */
static int fault(struct task *t, uint64_t page, unsigned char *buf)
{
	int i = find_run(t, page);
	if (i < 0) {
		struct uffdio_zeropage z = {.range = {.start = page, .len = PAGE}};
		if (ioctl(t->uffd, UFFDIO_ZEROPAGE, &z) == 0 || errno == EEXIST || errno == ENOENT)
			return 0;
		if (errno == ESRCH || errno == ENOSPC) {
			gone(t, "UFFDIO_ZEROPAGE", errno);
			return 0;
		}
		if (errno == EAGAIN)
			return -1;
		fail("UFFDIO_ZEROPAGE in process %d failed: %s", t->pid, strerror(errno));
		return 0;
	}
	struct run r = t->runs[i];
	uint64_t at = r.off + (page - r.start);
	uint64_t lo = at - at % chunk_size, hi = lo + chunk_size;
	if (hi > files[r.file].size)
		hi = files[r.file].size;
	/* The reader has this chunk in hand already: its copy wakes the faulting thread. */
	if (in_claimed(r.file, lo))
		return 0;
	/* The reader goes on from here: a walk through memory finds it coming in ahead. */
	if (!in_claimed(r.file, hi))
		cursor = (struct span){r.file, hi, hi};
	pthread_mutex_unlock(&mu);
	char why[512];
	int ok = load(r.file, lo, hi, buf, why, sizeof(why));
	pthread_mutex_lock(&mu);
	if (ok < 0) {
		fail("%s", why);
		return 0;
	}
	pthread_cond_broadcast(&cv);
	if (serve(t, r.file, lo, hi, buf) == RETRY && !failed)
		return find_run(t, page) < 0 ? 0 : -1;
	return 0;
}

static void retry_faults(struct task *t, unsigned char *buf)
{
	size_t keep = 0;
	for (size_t i = 0; i < t->nfaults && !failed && !t->gone; i++)
		if (fault(t, t->faults[i], buf) < 0)
			t->faults[keep++] = t->faults[i];
	if (!failed)
		t->nfaults = t->gone ? 0 : keep;
}

/* -- events (main thread, under mu) ----------------------------------------------------- */

static void hold(int fd, int pid)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {.iov_base = &pid, .iov_len = sizeof(pid)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof(cbuf)};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	if (holder_fd >= 0 && sendmsg(holder_fd, &mh, MSG_NOSIGNAL) < 0)
		fprintf(stderr, "cedana-pages: cannot hand fd to the holder: %s\n", strerror(errno));
}

static void watch(struct task *t)
{
	struct epoll_event ev = {.events = EPOLLIN, .data.ptr = t};
	if (epoll_ctl(epfd, EPOLL_CTL_ADD, t->uffd, &ev) < 0)
		die("epoll_ctl");
	tasks = xrealloc(tasks, (ntasks + 1) * sizeof(*tasks));
	tasks[ntasks++] = t;
	hold(t->uffd, t->pid);
}

static void on_fork(struct task *parent, int uffd)
{
	struct task *child = task_new(parent->pid);
	child->uffd = uffd;
	runs_reserve(child, parent->n);
	memcpy(child->runs, parent->runs, parent->n * sizeof(*parent->runs));
	child->n = parent->n;
	bytes_total += task_bytes(child);
	watch(child);
}

/* Read and handle the task's events; each message is read and handled under mu, so that
 * no copy slips in between an event and the update of the runs. */
static void drain(struct task *t, unsigned char *buf)
{
	struct uffd_msg msg;
	while (!t->gone && !failed) {
		ssize_t n = read(t->uffd, &msg, sizeof(msg));
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return;
		if (n != (ssize_t)sizeof(msg)) {
			gone(t, n < 0 ? "reading its events" : "a short event", n < 0 ? errno : EIO);
			return;
		}
		switch (msg.event) {
		case UFFD_EVENT_PAGEFAULT: {
			uint64_t page = msg.arg.pagefault.address & ~(PAGE - 1);
			n_faults++;
			if (fault(t, page, buf) < 0)
				add_fault(t, page);
			break;
		}
		case UFFD_EVENT_FORK:
			n_fork++;
			on_fork(t, (int)msg.arg.fork.ufd);
			break;
		case UFFD_EVENT_REMAP:
			n_remap++;
			remap(t, msg.arg.remap.from, msg.arg.remap.to, msg.arg.remap.len);
			break;
		case UFFD_EVENT_REMOVE: {
			/* The area stays; later faults in it must see zeros, not the old pages. */
			struct uffdio_range r = {.start = msg.arg.remove.start,
						 .len = msg.arg.remove.end - msg.arg.remove.start};
			n_remove++;
			ioctl(t->uffd, UFFDIO_UNREGISTER, &r);
			drop_range(t, msg.arg.remove.start, msg.arg.remove.end);
			break;
		}
		case UFFD_EVENT_UNMAP:
			n_unmap++;
			drop_range(t, msg.arg.remove.start, msg.arg.remove.end);
			break;
		default:
			fail("unexpected userfaultfd event %u", msg.event);
		}
	}
}

/* -- CRIU's side (main thread) ---------------------------------------------------------- */

static int recv_exact(int fd, void *buf, size_t len)
{
	size_t got = 0;
	while (got < len) {
		ssize_t n = recv(fd, (char *)buf + got, len - got, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return -1;
		got += n;
	}
	return 0;
}

static int recv_fd(int sock)
{
	char dummy, cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {.iov_base = &dummy, .iov_len = 1};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
			    .msg_controllen = sizeof(cbuf)};
	int fd;
	if (recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) <= 0)
		return -1;
	struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
	if (!cm || cm->cmsg_type != SCM_RIGHTS)
		return -1;
	memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	return fd;
}

/* CRIU wrote the root's PID before it said the restore was finished. */
static void watch_root(void)
{
	FILE *f = pidfile ? fopen(pidfile, "re") : NULL;
	int pid = 0;
	if (f) {
		if (fscanf(f, "%d", &pid) != 1)
			pid = 0;
		fclose(f);
	}
	rootfd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
	if (rootfd < 0) {
		fprintf(stderr, "cedana-pages: not watching the restored root (%d): %s\n", pid,
			strerror(errno));
		return;
	}
	struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &rootfd};
	if (epoll_ctl(epfd, EPOLL_CTL_ADD, rootfd, &ev) < 0)
		die("epoll_ctl");
}

static void from_criu(void)
{
	int32_t word;
	int uffd = -1;
	if (recv_exact(client, &word, sizeof(word)) < 0) {
		epoll_ctl(epfd, EPOLL_CTL_DEL, client, NULL);
		pthread_mutex_lock(&mu);
		int done = finished;
		pthread_mutex_unlock(&mu);
		if (!done) {
			say("error the restore ended before it finished");
			exit(1);
		}
		return;
	}
	if ((uint32_t)word != RESTORE_FINISHED && word > 0) {
		uffd = recv_fd(client);
		if (uffd < 0)
			die("receiving a userfaultfd");
		fcntl(uffd, F_SETFL, O_NONBLOCK);
	}
	pthread_mutex_lock(&mu);
	if ((uint32_t)word == RESTORE_FINISHED) {
		finished = 1;
		say("restored");
		watch_root();
		pthread_cond_broadcast(&cv);
	} else if (uffd >= 0) {
		struct task *t = NULL;
		for (int i = 0; i < ntemplates; i++)
			if (templates[i] && templates[i]->pid == word) {
				t = templates[i];
				templates[i] = NULL;
				break;
			}
		if (!t)
			t = task_new(word); /* nothing lazy: its faults get zero pages */
		t->uffd = uffd;
		bytes_total += task_bytes(t);
		say("task %d %" PRIu64, t->pid, task_bytes(t));
		fprintf(stderr, "cedana-pages: process %d: %zu runs, %" PRIu64 " bytes%s\n", t->pid,
			t->n, task_bytes(t), t->n ? "" : " (none lazy)");
		watch(t);
	} /* else a zombie: no memory */
	pthread_mutex_unlock(&mu);
}

/* -- background transfer (reader and copier threads) ---------------------------------- */

static int paused(void)
{
	return pause_file && access(pause_file, F_OK) == 0;
}

static int work_left(void)
{
	for (int i = 0; i < ntasks; i++)
		if (!tasks[i]->gone && (tasks[i]->n || tasks[i]->nfaults))
			return 1;
	return 0;
}

static int busy_slots(void)
{
	int n = 0;
	for (int i = 0; i < SLOTS; i++)
		n += claimed[i].hi != 0;
	return n;
}

/* The next block to load: the first piece of any task's runs at or after the cursor
 * that no slot holds; wrapping to the start once nothing is left after it. */
static int claim(int me, struct span *out)
{
	for (int pass = 0; pass < 2; pass++) {
		const struct run *best = NULL;
		uint64_t best_off = 0;
		for (int k = 0; k < ntasks; k++) {
			const struct task *t = tasks[k];
			for (size_t i = 0; i < t->n && !t->gone; i++) {
				const struct run *r = &t->runs[i];
				uint64_t end = r->off + (r->end - r->start), from = r->off;
				if (r->file < cursor.file || (r->file == cursor.file && end <= cursor.lo))
					continue;
				if (r->file == cursor.file && from < cursor.lo)
					from = cursor.lo;
				from -= from % chunk_size;
				while (from < end && in_claimed(r->file, from))
					from += chunk_size;
				if (from >= end)
					continue;
				if (!best || r->file < best->file || (r->file == best->file && from < best_off))
					best = r, best_off = from;
				break; /* runs are in file order: this task has nothing earlier */
			}
		}
		if (best) {
			uint64_t hi = best_off + BLOCK;
			if (hi > files[best->file].size)
				hi = files[best->file].size;
			for (int i = 0; i < SLOTS; i++) /* stop short of another slot's block */
				if (claimed[i].hi && claimed[i].file == best->file && claimed[i].lo > best_off &&
				    claimed[i].lo < hi)
					hi = claimed[i].lo;
			*out = (struct span){best->file, best_off, hi};
			claimed[me] = *out;
			cursor = (struct span){best->file, hi, hi};
			return 1;
		}
		if (cursor.file == 0 && cursor.lo == 0)
			break;
		cursor = (struct span){0, 0, 0};
	}
	return 0;
}

static void wait_a_little(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_nsec += 20 * 1000 * 1000;
	if (ts.tv_nsec >= 1000000000)
		ts.tv_sec++, ts.tv_nsec -= 1000000000;
	pthread_cond_timedwait(&cv, &mu, &ts);
}

/* Reads and checks blocks in file order into free slots: one reader, one sequential
 * stream for the kernel's readahead. */
static void *reader(void *arg)
{
	char why[512];
	(void)arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		struct span b;
		int s = 0;
		if (failed)
			break;
		while (s < SLOTS && claimed[s].hi)
			s++;
		if (s == SLOTS || !finished || paused() || !claim(s, &b)) {
			wait_a_little();
			continue;
		}
		claim_seq[s] = next_seq++;
		pthread_mutex_unlock(&mu);
		int ok = load(b.file, b.lo, b.hi, slot_buf[s], why, sizeof(why));
		pthread_mutex_lock(&mu);
		if (ok < 0) {
			fail("%s", why);
			break;
		}
		ready[s] = 1;
		pthread_cond_broadcast(&cv);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

/* Copies the read blocks into the processes, oldest first, while the next are read; each
 * copier takes the oldest block no other copier has taken. */
static void *copier(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		int s = -1;
		if (failed)
			break;
		for (int i = 0; i < SLOTS; i++)
			if (ready[i] && (s < 0 || claim_seq[i] < claim_seq[s]))
				s = i;
		if (s < 0) {
			wait_a_little();
			continue;
		}
		ready[s] = 0;
		struct span b = claimed[s];
		for (int k = 0; k < ntasks && !failed; k++) {
			struct task *t = tasks[k];
			for (uint64_t lo = b.lo; lo < b.hi && !t->gone && !failed; lo += STEP) {
				uint64_t hi = b.hi - lo < STEP ? b.hi : lo + STEP;
				int rc = RETRY;
				while (rc == RETRY && !t->gone && !failed) {
					pthread_mutex_unlock(&mu);
					pthread_rwlock_rdlock(&placing);
					pthread_mutex_lock(&mu);
					rc = serve(t, b.file, lo, hi, slot_buf[s] + (lo - b.lo));
					pthread_mutex_unlock(&mu);
					pthread_rwlock_unlock(&placing);
					if (rc == RETRY) /* an event is pending: let the main thread read it */
						usleep(200);
					pthread_mutex_lock(&mu);
				}
			}
		}
		claimed[s].hi = 0;
		/* Served to every process: its page cache is of no more use (a fork later
		 * reads it again), and a restore should not hold the kernel's memory twice. */
		posix_fadvise(files[b.file].fd, (off_t)b.lo, (off_t)(b.hi - b.lo), POSIX_FADV_DONTNEED);
		report_progress(0);
		pthread_cond_broadcast(&cv);
		wake_main();
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

/* -- main -------------------------------------------------------------------------------- */

static int all_gone(void)
{
	for (int i = 0; i < ntasks; i++)
		if (!tasks[i]->gone)
			return 0;
	return ntasks > 0;
}

/* Failed: serve nothing, hold the userfaultfds until the server kills us (it kills the
 * kernel first). If the server is gone, its keeper kills the kernel: then leave. */
static void wait_for_the_end(void)
{
	char c;
	while (holder_fd >= 0) {
		ssize_t n = recv(holder_fd, &c, 1, 0);
		if (n == 0 || (n < 0 && errno != EINTR))
			break;
	}
	sleep(ORPHAN_GRACE_S);
	exit(1);
}

static int listen_here(void)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		die("socket");
	strcpy(sa.sun_path, SOCKET_NAME);
	unlink(SOCKET_NAME);
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		die("bind " SOCKET_NAME);
	if (listen(fd, 1) < 0)
		die("listen");
	return fd;
}

int main(int argc, char **argv)
{
	const char *map = NULL, *images = NULL;
	unsigned char *fault_buf;
	pid_t parent_pid = 0;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--map") == 0 && i + 1 < argc)
			map = argv[++i];
		else if (strcmp(argv[i], "--images") == 0 && i + 1 < argc)
			images = argv[++i];
		else if (strcmp(argv[i], "--holder-fd") == 0 && i + 1 < argc)
			holder_fd = atoi(argv[++i]);
		else if (strcmp(argv[i], "--pause-file") == 0 && i + 1 < argc)
			pause_file = argv[++i];
		else if (strcmp(argv[i], "--hold-events-file") == 0 && i + 1 < argc)
			hold_events_file = argv[++i];
		else if (strcmp(argv[i], "--pidfile") == 0 && i + 1 < argc)
			pidfile = argv[++i];
		else if (strcmp(argv[i], "--copiers") == 0 && i + 1 < argc)
			ncopiers = atoi(argv[++i]);
		else if (strcmp(argv[i], "--parent-pid") == 0 && i + 1 < argc)
			parent_pid = (pid_t)atoi(argv[++i]);
		else
			break;
	}
	/* A server killed mid-restore must not leave its page server behind, blocked in
	 * accept() or serving a kernel that died with it (cedana-init --die-with-parent);
	 * a parent that died before the signal was armed shows as another parent pid. */
	if (parent_pid > 0) {
		if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
			die("prctl(PR_SET_PDEATHSIG)");
		if (getppid() != parent_pid)
			return 1;
	}
	if (!map || !images || ncopiers < 1 || ncopiers > MAX_COPIERS) {
		fprintf(stderr, "usage: cedana-pages --images DIR --map FILE [--pidfile FILE] "
				"[--holder-fd FD] [--pause-file PATH] [--hold-events-file PATH] "
				"[--copiers 1-%d] [--parent-pid PID] (in the restore's work directory)\n", MAX_COPIERS);
		return 2;
	}
	pthread_rwlockattr_t rwa;
	pthread_rwlockattr_init(&rwa);
	/* The main thread serves the page faults: copiers must not keep it waiting. */
	pthread_rwlockattr_setkind_np(&rwa, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
	pthread_rwlock_init(&placing, &rwa);
	signal(SIGPIPE, SIG_IGN);
	if (crc_setup() < 0) {
		say("error cannot load crc32 from libz.so.1: %s", dlerror());
		return 1;
	}
	t_start = now_s();
	load_map(images, map);
	if (posix_memalign((void **)&fault_buf, PAGE, chunk_size))
		die("out of memory");
	epfd = epoll_create1(EPOLL_CLOEXEC);
	wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (epfd < 0 || wakefd < 0)
		die("epoll/eventfd");
	struct epoll_event wev = {.events = EPOLLIN, .data.ptr = &wakefd};
	if (epoll_ctl(epfd, EPOLL_CTL_ADD, wakefd, &wev) < 0)
		die("epoll_ctl");

	int lsk = listen_here();
	say("ready");
	client = accept4(lsk, NULL, NULL, SOCK_CLOEXEC);
	if (client < 0)
		die("accept");
	close(lsk);
	unlink(SOCKET_NAME);
	struct epoll_event cev = {.events = EPOLLIN, .data.ptr = NULL};
	if (epoll_ctl(epfd, EPOLL_CTL_ADD, client, &cev) < 0)
		die("epoll_ctl");
	for (int i = 0; i < SLOTS; i++)
		if (posix_memalign((void **)&slot_buf[i], PAGE, BLOCK))
			die("out of memory");
	pthread_t th;
	if (pthread_create(&th, NULL, reader, NULL))
		die("pthread_create");
	pthread_detach(th);
	for (int i = 0; i < ncopiers; i++) {
		if (pthread_create(&th, NULL, copier, NULL))
			die("pthread_create");
		pthread_detach(th);
	}

	for (;;) {
		struct epoll_event evs[32];
		int pending = 0;
		pthread_mutex_lock(&mu);
		if (failed) {
			pthread_mutex_unlock(&mu);
			wait_for_the_end();
		}
		for (int i = 0; i < ntasks; i++)
			pending |= tasks[i]->nfaults > 0;
		if (finished && ntasks && all_gone()) {
			say("exited");
			exit(3);
		}
		if (finished && !work_left() && !busy_slots()) {
			double secs = now_s() - t_start;
			report_progress(1);
			for (int i = 0; i < ntasks; i++)
				fprintf(stderr, "cedana-pages: process %d %s\n", tasks[i]->pid,
					tasks[i]->gone ? "gone" : "has all its pages");
			struct rusage ru;
			getrusage(RUSAGE_SELF, &ru);
			fprintf(stderr, "cedana-pages: %" PRIu64 " bytes in %.3f s: read %.3f s, crc %.3f s "
				"(%s), copy %.3f s, %" PRIu64 " faults; events: %" PRIu64 " fork, %" PRIu64
				" remap, %" PRIu64 " remove, %" PRIu64 " unmap; cpu %.3f s\n", bytes_done, secs,
				t_read, t_crc, use_clmul ? "pclmul" : "zlib", t_copy, n_faults, n_fork, n_remap,
				n_remove, n_unmap,
				ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
					ru.ru_stime.tv_usec / 1e6);
			say("done %" PRIu64 " %.3f", bytes_done, secs);
			exit(0);
		}
		pthread_mutex_unlock(&mu);
		int n = epoll_wait(epfd, evs, 32, pending ? 1 : -1);
		if (n < 0 && errno != EINTR)
			die("epoll_wait");
		for (int i = 0; i < n; i++) {
			if (evs[i].data.ptr == NULL) {
				from_criu();
			} else if (evs[i].data.ptr == &rootfd) {
				pthread_mutex_lock(&mu);
				if (work_left()) {
					say("exited");
					exit(3);
				}
				epoll_ctl(epfd, EPOLL_CTL_DEL, rootfd, NULL);
				pthread_mutex_unlock(&mu);
			} else if (evs[i].data.ptr == &wakefd) {
				uint64_t v;
				if (read(wakefd, &v, sizeof(v)) < 0 && errno != EAGAIN)
					die("eventfd");
			} else if (hold_events_file && access(hold_events_file, F_OK) == 0) {
				usleep(1000); /* level-triggered: the events are still there after */
			} else {
				pthread_rwlock_wrlock(&placing);
				pthread_mutex_lock(&mu);
				drain(evs[i].data.ptr, fault_buf);
				pthread_mutex_unlock(&mu);
				pthread_rwlock_unlock(&placing);
			}
		}
		pthread_mutex_lock(&mu);
		pending = 0;
		for (int i = 0; i < ntasks; i++)
			pending |= tasks[i]->nfaults > 0;
		pthread_mutex_unlock(&mu);
		if (!pending)
			continue;
		pthread_rwlock_wrlock(&placing);
		pthread_mutex_lock(&mu);
		for (int i = 0; i < ntasks && !failed; i++)
			if (tasks[i]->nfaults)
				retry_faults(tasks[i], fault_buf);
		pthread_mutex_unlock(&mu);
		pthread_rwlock_unlock(&placing);
	}
}
