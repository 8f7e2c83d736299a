"""How the driver sizes a video-memory allocation (class 0x40 NV01_MEMORY_LOCAL_USER).

Sans-IO driver facts, shared by the emulated backend (what it charges the card) and the broker
core (what it checks against a tenant's quota), so that the check and the charge are computed
the same way (computed apart, a 1-byte allocation with a 135 GiB alignment could be
checked as 1 byte and charged 135 GiB).

What the driver does (open-gpu-kernel-modules, r535/r580):

* **Page size** (`memmgrDeterminePageSize_IMPL`, mem_mgr.c), for video memory with
  `NVOS32_ATTR_PAGE_SIZE` (attr bits 24:23) DEFAULT: HUGE (2 MiB) when the GPU has huge pages
  and ``size >= 2 MiB``; else the GPU's big page (64 KiB on Pascal and later), since a user
  allocation always names a client; 4KB / BIG / HUGE when the attribute asks for them, HUGE
  being 2 MiB or 512 MiB by `NVOS32_ATTR2_PAGE_SIZE_HUGE` (attr2 bits 21:20).
* **Size and alignment** (`memmgrAllocDetermineAlignment_GM107`, mem_mgr_gm107.c): the size is
  rounded up to the *page size*, never to the requested alignment. A requested alignment only
  places the offset, and only if it is a multiple or a divisor of the page size; otherwise the
  offset is page-aligned, or with `NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE` the call fails with
  NV_ERR_INVALID_ARGUMENT.
* Measured on the H200: 2 MiB with a 64 GiB alignment is NV_OK and 2 MiB used.

What a tenant is charged is what the FB heap loses: :func:`charged_size`.
"""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20

PAGE_4K = 4 * KiB
PAGE_BIG = 64 * KiB  # kgmmuGetMaxBigPageSize on Pascal and later (the H200 is Hopper)
PAGE_HUGE = 2 * MiB
PAGE_512M = 512 * MiB

ATTR_PAGE_SIZE_SHIFT, ATTR_PAGE_SIZE_MASK = 23, 0x3  # NVOS32_ATTR_PAGE_SIZE 24:23
ATTR_PAGE_SIZE_DEFAULT, ATTR_PAGE_SIZE_4KB, ATTR_PAGE_SIZE_BIG, ATTR_PAGE_SIZE_HUGE = 0, 1, 2, 3
ATTR2_PAGE_SIZE_HUGE_SHIFT, ATTR2_PAGE_SIZE_HUGE_MASK = 20, 0x3  # NVOS32_ATTR2_PAGE_SIZE_HUGE 21:20
ATTR2_HUGE_DEFAULT, ATTR2_HUGE_2MB, ATTR2_HUGE_512MB, ATTR2_HUGE_256GB = 0, 1, 2, 3
ALLOC_FLAGS_ALIGNMENT_FORCE = 0x100  # NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE


def page_size(size: int, attr: int = 0, attr2: int = 0) -> int | None:
    """The page size the driver backs a video-memory allocation with; None when the
    attributes ask for one this GPU model has not (256 GiB pages): the driver refuses."""
    want = (int(attr) >> ATTR_PAGE_SIZE_SHIFT) & ATTR_PAGE_SIZE_MASK
    if want == ATTR_PAGE_SIZE_4KB:
        return PAGE_4K
    if want == ATTR_PAGE_SIZE_BIG:
        return PAGE_BIG
    if want == ATTR_PAGE_SIZE_HUGE:
        huge = (int(attr2) >> ATTR2_PAGE_SIZE_HUGE_SHIFT) & ATTR2_PAGE_SIZE_HUGE_MASK
        return {ATTR2_HUGE_DEFAULT: PAGE_HUGE, ATTR2_HUGE_2MB: PAGE_HUGE,
                ATTR2_HUGE_512MB: PAGE_512M}.get(huge)
    return PAGE_HUGE if int(size) >= PAGE_HUGE else PAGE_BIG


def charged_size(size: int, attr: int = 0, attr2: int = 0) -> int:
    """Bytes of video memory an allocation of `size` takes from the card: the size rounded
    up to the page size (the requested alignment places the offset and costs nothing).
    0 for a size the driver refuses (0, negative, or an unsupported page size)."""
    size = int(size)
    page = page_size(size, attr, attr2)
    if size <= 0 or page is None:
        return 0
    return (size + page - 1) // page * page


def alignment_usable(alignment: int, page: int) -> bool:
    """Whether the driver honours a requested alignment: 0 (none), or a multiple or a divisor
    of the page size (memmgrAllocDetermineAlignment_GM107)."""
    a = int(alignment)
    if a == 0:
        return True
    if a < 0:
        return False
    return (a > page and a % page == 0) or (a <= page and page % a == 0)


def charged(params: object) -> int:
    """charged_size() of a decoded NV_MEMORY_ALLOCATION_PARAMS (0 when there are none)."""
    if params is None:
        return 0
    return charged_size(int(getattr(params, "size", 0) or 0),
                        int(getattr(params, "attr", 0) or 0),
                        int(getattr(params, "attr2", 0) or 0))
