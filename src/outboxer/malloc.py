"""glibc malloc settings for outboxer's long-running processes (relay, consume, serve).

asyncio's selector transport reads a socket with ``recv(256 KiB)``: every read allocates a
256 KiB buffer and shrinks it to what arrived. Above glibc's mmap threshold (128 KiB until
a freed mmapped chunk raises it, and a shrunk one never does) each such allocation is its
own ``mmap``, the shrink an ``mremap`` and the free a ``munmap``: three system calls and
fresh zeroed pages for every small database or broker reply, which is most of what a relay
reads (python/cpython#85451). A fixed threshold above 256 KiB serves these buffers from the
heap, reused read after read; the trim threshold is raised with it (a fixed mmap threshold
turns off glibc's dynamic one for trimming too), so the freed buffer is not handed back to
the kernel after every read either.

Only outboxer's own command-line processes call this: a library must not change its host
process's allocator.
"""

from __future__ import annotations

import ctypes
import sys

#: glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Allocations below this come from the heap: above asyncio's 256 KiB read buffer.
MMAP_THRESHOLD = 1 << 20
#: Free memory at the heap's top kept for reuse instead of returned to the kernel.
TRIM_THRESHOLD = 8 << 20


def tune_malloc() -> bool:
    """Set the thresholds in this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
