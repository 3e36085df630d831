/*
 * cedana-digest: the digest of every 4 KiB page of a buffer, in one call.
 *
 * An incremental dump (docs/incremental.md) hashes every page of the kernel while the
 * kernel is frozen, to write only the pages its base does not hold. Hashed one page at
 * a time from Python, the interpreter's own work per page (and the GIL between the
 * capture's two hashing threads) costs as much as the hash; here a whole buffer is one
 * call that ctypes makes without the GIL, so both threads hash at once.
 *
 * The digest is SHA-256 cut to its first `DIGEST_SIZE` bytes, the same bytes as
 * `hashlib.sha256(page).digest()[:16]`, from the same library: OpenSSL's libcrypto,
 * which Python's hashlib links too, opened with dlopen so that building needs no
 * OpenSSL headers. An index written by either path is read by the other.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#define PAGE_SIZE 4096
#define DIGEST_SIZE 16
#define SHA256_SIZE 32

typedef struct evp_md_st EVP_MD;
typedef struct evp_md_ctx_st EVP_MD_CTX;

static EVP_MD *(*md_fetch)(void *libctx, const char *name, const char *props);
static EVP_MD_CTX *(*ctx_new)(void);
static void (*ctx_free)(EVP_MD_CTX *ctx);
static int (*digest_init)(EVP_MD_CTX *ctx, const EVP_MD *md, void *engine);
static int (*digest_update)(EVP_MD_CTX *ctx, const void *data, size_t n);
static int (*digest_final)(EVP_MD_CTX *ctx, unsigned char *md, unsigned int *n);
static EVP_MD *sha256;

/* Loads libcrypto and fetches SHA-256 once. Returns 0, or -1 with nothing usable (the
 * caller then hashes in Python). Called once, before any thread hashes. */
int cedana_digest_init(void)
{
	static const char *const names[] = {"libcrypto.so.3", "libcrypto.so"};
	void *lib = NULL;

	if (sha256)
		return 0;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !lib; i++)
		lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!lib)
		return -1;
	*(void **)&md_fetch = dlsym(lib, "EVP_MD_fetch");
	*(void **)&ctx_new = dlsym(lib, "EVP_MD_CTX_new");
	*(void **)&ctx_free = dlsym(lib, "EVP_MD_CTX_free");
	*(void **)&digest_init = dlsym(lib, "EVP_DigestInit_ex");
	*(void **)&digest_update = dlsym(lib, "EVP_DigestUpdate");
	*(void **)&digest_final = dlsym(lib, "EVP_DigestFinal_ex");
	if (!md_fetch || !ctx_new || !ctx_free || !digest_init || !digest_update || !digest_final)
		return -1;
	sha256 = md_fetch(NULL, "SHA256", NULL);
	return sha256 ? 0 : -1;
}

/* Writes the digest of each of the `pages` pages at `buf` to `out` (DIGEST_SIZE bytes
 * a page, in order). Returns 0, or -1 if libcrypto failed (out is then incomplete). */
int cedana_page_digests(const unsigned char *buf, size_t pages, unsigned char *out)
{
	unsigned char md[SHA256_SIZE];
	unsigned int n;
	EVP_MD_CTX *ctx;
	int rc = 0;

	if (!sha256)
		return -1;
	ctx = ctx_new();
	if (!ctx)
		return -1;
	for (size_t i = 0; i < pages; i++) {
		if (digest_init(ctx, sha256, NULL) != 1 ||
		    digest_update(ctx, buf + i * PAGE_SIZE, PAGE_SIZE) != 1 ||
		    digest_final(ctx, md, &n) != 1 || n != SHA256_SIZE) {
			rc = -1;
			break;
		}
		memcpy(out + i * DIGEST_SIZE, md, DIGEST_SIZE);
	}
	ctx_free(ctx);
	return rc;
}
