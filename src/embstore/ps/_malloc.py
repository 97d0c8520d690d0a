"""Keep freed MiB-sized buffers in the process heap (glibc), so messages stop page-faulting.

Every W1 call allocates several MiB of message buffers (gRPC's slices, the reply's bytes).
With glibc's defaults each is mapped fresh and returned to the kernel when freed, so every
call faults in and zeroes its pages again: about 2,300 page faults a Lookup and push, which
took more than half of the client's transport time on the development VM.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MIB = 1 << 20


def keep_freed_memory(
    mmap_threshold: int = 32 * _MIB, trim_threshold: int = 128 * _MIB, top_pad: int = 16 * _MIB
) -> bool:
    """Tune glibc's allocator for this whole process: allocations below ``mmap_threshold``
    come from the heap (32 MiB: above any W1 message), and the heap keeps up to
    ``trim_threshold`` bytes of freed memory instead of returning it to the kernel. The PS
    command lines call it; call it yourself in a process that embeds a server or a client.
    The price: the process's RSS does not shrink below its peak by more than that.

    Returns False (and changes nothing) where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = (
        (_M_MMAP_THRESHOLD, mmap_threshold),
        (_M_TRIM_THRESHOLD, trim_threshold),
        (_M_TOP_PAD, top_pad),
    )
    return all(libc.mallopt(param, int(value)) == 1 for param, value in settings)
