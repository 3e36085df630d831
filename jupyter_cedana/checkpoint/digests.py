"""The digest of a 4 KiB page, by which an incremental dump knows the pages its base holds
(docs/incremental.md): SHA-256 cut to 128 bits, strong enough that equal digests mean
equal pages, unlike the CRC-32 that guards chunks against damage.

`page_digests` hashes a whole buffer of pages in one call to the shipped
`libcedana-digest.so` (native/cedana-digest.c), which runs without the GIL: while a kernel
is frozen for a delta dump, its every page is hashed, and one page at a time from Python
the interpreter's own work cost as much as SHA-256 itself. Where that library or the
libcrypto it opens cannot be loaded, the same digests come from hashlib, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from typing import Any

from ..package_files import BIN_DIR

PAGE_SIZE = 4096
DIGEST_SIZE = 16
LIBRARY = BIN_DIR / "libcedana-digest.so"

log = logging.getLogger(__name__)
_loading = threading.Lock()
_native: Any = None
_tried = False


def page_digest(page: bytes | memoryview) -> bytes:
    """SHA-256 (hardware-assisted on x86's SHA extensions) cut to 128 bits."""
    return hashlib.sha256(page).digest()[:DIGEST_SIZE]


def native_digests() -> Any:
    """The loaded library's `cedana_page_digests`, or None (said once in the log)."""
    global _native, _tried
    with _loading:
        if not _tried:
            _tried = True
            try:
                lib = ctypes.CDLL(str(LIBRARY))
                if lib.cedana_digest_init() != 0:
                    raise OSError("libcrypto (OpenSSL 3) or its SHA-256 could not be loaded")
                fn = lib.cedana_page_digests
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _native = fn
            except OSError as e:
                log.warning("page digests in Python, slower: %s: %s", LIBRARY.name, e)
    return _native


def page_digests(pages: bytes | bytearray | memoryview | Any) -> bytes:
    """The digests of the whole pages of `pages` (a bytes object, or a writable buffer
    such as an mmap or a slice of one), DIGEST_SIZE bytes each, in order."""
    view = memoryview(pages).cast("B")
    count = len(view) // PAGE_SIZE
    fn = native_digests()
    if fn is None or count == 0:
        return b"".join(
            page_digest(view[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]) for i in range(count)
        )
    out = ctypes.create_string_buffer(count * DIGEST_SIZE)
    # Passed as is (ctypes.cast would tie the export into a reference cycle, and the
    # caller's buffer could not be closed until the collector ran).
    if view.readonly:
        source: Any = view.tobytes() if not isinstance(pages, bytes) else pages
    else:
        source = (ctypes.c_char * len(view)).from_buffer(view)
    try:
        failed = fn(source, count, out)
    finally:
        del source  # ends the export of `view`, which the caller may release
        view.release()
    if failed:
        raise OSError("libcrypto failed to hash a page")
    return out.raw
