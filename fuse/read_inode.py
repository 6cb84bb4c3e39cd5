"""Which inode a FUSE READ or READDIRPLUS is for, when the kernel sends no
file handle.

The ``cache=immutable`` mount answers OPEN and OPENDIR with ENOSYS: the
kernel then never sends OPEN, FLUSH, RELEASE, OPENDIR or RELEASEDIR again,
keeps every file's pages (``FOPEN_KEEP_CACHE``) and every directory's
listing (``FOPEN_CACHE_DIR``), and a warm open+read+close or listing costs
no upcall at all (docs/operations.md, "Mount modes and caches"). But its
READs and READDIRPLUSes then carry file handle 0, and pyfuse3 (3.5) hands
the handlers the handle only, not the inode the request names.

`ReadInodes.install` puts a trampoline in front of pyfuse3's C callbacks
for both in the libfuse session's operation table: it records the
request's inode, then calls pyfuse3's callback, which creates the handler's
coroutine; pyfuse3's loop awaits that coroutine at once, before it reads
the next request, so the handler takes the inode (`take`) before anything
else runs.

The same trampoline lets a READ be taken before pyfuse3 sees it: `fast`
(fuse/fast_reads.py, every mount mode) answers it off the event loop, or
declines and pyfuse3 goes on as usual. The fast path needs the READ's file
handle, which it reads from libfuse's ``struct fuse_file_info`` at
`FH_OFFSET`; that offset is checked against the handle pyfuse3 itself hands
the operations for the same READ (`confirm`) before it is relied on.

On a read-write mount the trampoline in front of pyfuse3's ``open`` sets
``noflush`` in the file info of every read-only open (`noflush_read_only`),
which pyfuse3 keeps when it fills in the reply: the kernel then sends no
FLUSH at the close of such a file (``FOPEN_NOFLUSH``, Linux 5.19), one
upcall less per sample for a loader; there is nothing to report at the close
of a file not written through it (its RELEASE still comes, and drains).

The trampolines in front of pyfuse3's ``open``, ``release``, ``lookup`` and
``getattr`` offer each request to fuse/fast_answers.py first, which answers
it right there when the mount's caches can, else pyfuse3 goes on as usual.

The trampoline in front of pyfuse3's ``opendir`` (`dir_flags`, set before
`install`) asks the kernel to cache the directory's listing
(``FOPEN_CACHE_DIR``) and, when the mount knows the listing the kernel
holds is still current, to keep it (``FOPEN_KEEP_CACHE``; without it the
kernel drops the listing at this open): the decision is the mount's
(fuse/listings.py), taken as the OPENDIR arrives, since pyfuse3's opendir
handler returns a handle only.

Where things are is found, not assumed: pyfuse3's session pointer and C
callbacks by their names in the extension's symbol table (pyelftools), the
operation table in the session by the five consecutive callbacks (open,
read, write, flush, release, in `struct fuse_lowlevel_ops` order) it must
hold. Anything not found as expected (a stripped or different build) leaves
the table alone and `install` returns False: the mount then keeps opens
and every READ goes through pyfuse3.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyfuse3

log = logging.getLogger("shufflefs.fuse")

SESSION_SYMBOL = "__pyx_v_7pyfuse3_session"
ANCHOR_SYMBOL = "PyInit_pyfuse3"  # exported: its address gives the load base
# pyfuse3's callbacks for the slots around `read`, in fuse_lowlevel_ops order
SLOTS = ("open", "read", "write", "flush", "release")
OPENDIR = "opendir"  # (req, ino, fi), as open
RELEASEDIR = "releasedir"  # (req, ino, fi), as release
GETATTR = "getattr"  # (req, ino, fi), as open
LOOKUP = "lookup"  # (req, parent, name)
# (req, ino, struct fuse_bufvec *, off, fi): how libfuse hands pyfuse3 a WRITE
WRITE_BUF = "write_buf"
SETATTR = "setattr"  # (req, ino, struct stat *, int to_set, fi)
GETXATTR = "getxattr"  # (req, ino, const char *name, size_t size)
# slots found by their callback's address
FOUND = (OPENDIR, RELEASEDIR, GETATTR, LOOKUP, WRITE_BUF, SETATTR, GETXATTR)
PATCHED = ("read", "readdirplus")  # same signature: (req, ino, size, off, fi)
SCAN_WORDS = 128  # the table starts within the first few words of the session
TABLE_WORDS = 64  # fuse_lowlevel_ops has fewer slots than this
BEFORE_OPEN = 16  # ... and fewer than this before `open` (init ... link: 14)

READ_CALLBACK = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
)
# pyfuse3's own callback runs under the GIL this thread already holds
PYFUSE3_READ = ctypes.PYFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
)
OPEN_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
PYFUSE3_OPEN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
WRITE_CALLBACK = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
)
PYFUSE3_WRITE = ctypes.PYFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
)
SETATTR_CALLBACK = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
)
PYFUSE3_SETATTR = ctypes.PYFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
)
GETXATTR_CALLBACK = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
)
PYFUSE3_GETXATTR = ctypes.PYFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
)
# (the name as a pointer: handed on to pyfuse3 untouched, read only when needed)
LOOKUP_CALLBACK = OPEN_CALLBACK
PYFUSE3_LOOKUP = PYFUSE3_OPEN
# struct fuse_file_info (libfuse 3.14): `int flags`, then the bit fields in a
# 32-bit word, `noflush` the eighth (writepage, direct_io, keep_cache, flush,
# nonseekable, flock_release, cache_readdir, noflush)
BITS_OFFSET = 4
DIRECT_IO_BIT = 1 << 1
KEEP_CACHE_BIT = 1 << 2
CACHE_DIR_BIT = 1 << 6
NOFLUSH_BIT = 1 << 7
WRITES = os.O_WRONLY | os.O_RDWR | os.O_TRUNC


def _callback(slot: str) -> str:
    """The symbol of pyfuse3's C callback for an operation slot."""
    return f"__pyx_f_7pyfuse3_fuse_{slot}"


@functools.cache
def _needed_symbols(path: str) -> dict[str, int] | None:
    """Every symbol `install` needs, from *path*'s symbol table (read once:
    the mount checks before its session opens, then installs), or None."""
    names = {
        SESSION_SYMBOL,
        ANCHOR_SYMBOL,
        *(_callback(s) for s in (*SLOTS, *PATCHED, *FOUND)),
    }
    syms = _symbols(path, names)
    missing = names - syms.keys()
    if missing:
        log.warning("READ hook unavailable: %s has no %s", path, sorted(missing))
        return None
    return syms


def _symbols(path: str, names: set[str]) -> dict[str, int]:
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    found: dict[str, int] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for section in elf.iter_sections():
            if not isinstance(section, SymbolTableSection):
                continue
            for sym in section.iter_symbols():
                if sym.name in names and sym["st_value"]:
                    found[sym.name] = sym["st_value"]
    return found


FastRead = Callable[[int, int, int, int, int], bool]  # (req, ino, size, off, fi) -> taken?
# (req, ino, fi) -> answered? (OPEN, RELEASE, GETATTR); (req, parent, name) for LOOKUP
FastAnswer = Callable[[int, int, int], bool]
FastWrite = Callable[[int, int, int, int, int], bool]  # (req, ino, bufv, off, fi) -> answered?
FastSetattr = Callable[[int, int, int, int], bool]  # (req, ino, struct stat *, to_set)
FastHint = Callable[[int, int, int, int], bool]  # (req, ino, name, size) -> taken?
# offsetof(struct fuse_file_info, fh) in libfuse 3 (an int of flags, two
# 32-bit words of bit fields, then the 64-bit handle). Not trusted blindly:
# `ReadInodes.confirm` checks it against pyfuse3's own reading first.
FH_OFFSET = 16
FH_CHECKS = 4  # READs through pyfuse3 whose handle is compared (the first: before any is used)


@dataclass
class ReadInodes:
    """The inode of the READ being dispatched (0: none recorded); and the
    hook that may take a READ before pyfuse3 sees it (fuse/fast_reads.py)."""

    current: int = 0
    installed: bool = False
    # tried first on every READ: True when it answered (or will answer) it
    fast: FastRead | None = None
    fh_word: int = -1  # the handle as read at FH_OFFSET of the last READ's file info
    fh_checks: int = 0  # READs where that agreed with pyfuse3's handle
    fh_wrong: bool = False  # one disagreed: the offset is wrong for this libfuse
    session: int = 0  # libfuse's struct fuse_session * (once installed)
    # set before `install`: read-only opens ask the kernel for no FLUSH (rw mounts)
    noflush_read_only: bool = False
    # set before `install`: OPEN, RELEASE, LOOKUP and GETATTR get trampolines
    # (else only OPEN, for `noflush_read_only`, and not a call more)
    answering: bool = False
    # tried first on every OPEN and RELEASE once the handle's offset is
    # confirmed, and on every LOOKUP and GETATTR: True when answered
    # (fuse/fast_answers.py)
    fast_open: FastAnswer | None = None
    fast_release: FastAnswer | None = None
    fast_lookup: FastAnswer | None = None
    fast_getattr: FastAnswer | None = None
    fast_write: FastWrite | None = None  # ... and WRITE and FLUSH, as OPEN and RELEASE
    fast_flush: FastAnswer | None = None
    fast_setattr: FastSetattr | None = None  # ... and SETATTR, as GETATTR
    fast_getxattr: FastAnswer | None = None  # ... and GETXATTR: (req, ino, name) -> answered?
    # set before `install`: GETXATTR gets its trampoline (for `fast_hint`)
    hinting: bool = False
    fast_hint: FastHint | None = None  # tried first on every GETXATTR (fuse/fast_hints.py)
    # tried first on every READDIRPLUS: True when answered (fuse/kept_listings.py)
    fast_listing: FastRead | None = None
    # set before `install`: OPENDIR's flags for a directory inode (CACHE_DIR_BIT, KEEP_CACHE_BIT)
    dir_flags: Callable[[int], int] | None = None
    # with `answering`: tried on every OPENDIR (after its flags) and
    # RELEASEDIR once the handle's offset is confirmed (fuse/fast_answers.py)
    fast_opendir: FastAnswer | None = None
    fast_releasedir: FastAnswer | None = None
    naming: bool = False  # the read slot holds the trampoline (READs name their inode)
    # (the operation table, the read slot's index, pyfuse3's callback, the trampoline)
    _read_slot: tuple[Any, int, int, int] | None = None
    _keep: tuple[object, ...] = ()  # the trampoline, alive while the table points at it

    def hook_reads(self, fast: FastRead | None, naming: bool) -> None:
        """Offer READs to *fast* (None: to no one); *naming*: READs must name
        their inode (cache=immutable). With neither, pyfuse3's own callback
        goes back into the table: not even the trampoline's call is paid."""
        self.fast = fast
        if self._read_slot is not None and (fast is not None or naming) != self.naming:
            words, slot, original, trampoline = self._read_slot
            self.naming = fast is not None or naming
            words[slot] = trampoline if self.naming else original

    def take(self) -> int:
        ino, self.current = self.current, 0
        return ino

    @property
    def fh_confirmed(self) -> bool:
        """May the fast path read a READ's handle at FH_OFFSET?"""
        return self.fh_checks > 0 and not self.fh_wrong

    @property
    def checking(self) -> bool:
        """Is the offset still being checked (the first `FH_CHECKS` READs)?"""
        return self.fh_checks < FH_CHECKS and not self.fh_wrong

    def confirm(self, fh: int) -> None:
        """pyfuse3 handed a READ or RELEASE of handle *fh* to the
        operations: check the handle read at FH_OFFSET for that same request."""
        if fh == 0 or self.fh_word < 0 or not self.checking:
            return
        if fh == self.fh_word:
            self.fh_checks += 1
        else:
            self.fh_wrong = True
            log.warning(
                "fast reads and opens off: a file info holds handle %d at offset %d, not %d",
                self.fh_word,
                FH_OFFSET,
                fh,
            )

    def install(self, path: str | None = None) -> bool:
        """Patch the running session's read slot (after `pyfuse3.init`);
        *path*: of the pyfuse3 extension (tests give others)."""
        if self.installed:
            return True
        try:
            return self._install(path or pyfuse3.__file__)
        except Exception as exc:  # any surprise: keep the mount as it is
            log.warning("READ hook unavailable (%s)", exc)
            return False

    def available(self, path: str | None = None) -> bool:
        """Whether the pyfuse3 build has what `install` needs (checked before
        mounting, so the mount can report the mode it will really run in)."""
        try:
            return _needed_symbols(path or pyfuse3.__file__) is not None
        except Exception as exc:
            log.warning("READ hook unavailable (%s)", exc)
            return False

    def _install(self, path: str) -> bool:
        syms = _needed_symbols(path)
        if syms is None:
            return False
        lib = ctypes.PyDLL(path)
        anchor = ctypes.cast(getattr(lib, ANCHOR_SYMBOL), ctypes.c_void_p).value
        if anchor is None:
            return False
        base = anchor - syms[ANCHOR_SYMBOL]
        session = ctypes.c_void_p.from_address(base + syms[SESSION_SYMBOL]).value
        if not session:
            log.warning("READ hook unavailable: no FUSE session yet")
            return False
        address = {slot: base + syms[_callback(slot)] for slot in (*SLOTS, *PATCHED, *FOUND)}
        want = [address[slot] for slot in SLOTS]
        words = (ctypes.c_void_p * (SCAN_WORDS + TABLE_WORDS)).from_address(session)
        at = next(
            (
                i
                for i in range(SCAN_WORDS - len(SLOTS))
                if [words[i + k] for k in range(len(SLOTS))] == want
            ),
            None,
        )
        if at is None:
            log.warning("READ hook unavailable: operation table not found")
            return False
        slots = {}
        for name in (*PATCHED, *FOUND):
            span = range(max(0, at - BEFORE_OPEN), at + TABLE_WORDS)
            found = [i for i in span if words[i] == address[name]]
            if len(found) != 1:
                log.warning("READ hook unavailable: %s slot not found once", name)
                return False
            slots[name] = found[0]
        keep: list[object] = []
        for name in PATCHED:
            slot = slots[name]
            original = PYFUSE3_READ(address[name])
            handler = self._read(original) if name == "read" else self._named(original)
            trampoline = READ_CALLBACK(handler)
            keep.append(trampoline)
            words[slot] = ctypes.cast(trampoline, ctypes.c_void_p).value
            if name == "read":
                self._read_slot = (words, slot, address[name], words[slot] or 0)
        patches: dict[int, Any] = {}
        if self.noflush_read_only or self.answering:
            patches[at] = OPEN_CALLBACK(self._open(PYFUSE3_OPEN(address["open"])))
        if self.answering:
            patches[at + SLOTS.index("release")] = OPEN_CALLBACK(
                self._release(PYFUSE3_OPEN(address["release"]), "fast_release")
            )
            patches[slots[WRITE_BUF]] = WRITE_CALLBACK(
                self._write(PYFUSE3_WRITE(address[WRITE_BUF]))
            )
            patches[at + SLOTS.index("flush")] = OPEN_CALLBACK(
                self._handled(PYFUSE3_OPEN(address["flush"]), "fast_flush")
            )
            patches[slots[GETATTR]] = OPEN_CALLBACK(
                self._offered(PYFUSE3_OPEN(address[GETATTR]), "fast_getattr")
            )
            patches[slots[LOOKUP]] = LOOKUP_CALLBACK(
                self._offered(PYFUSE3_LOOKUP(address[LOOKUP]), "fast_lookup")
            )
            patches[slots[SETATTR]] = SETATTR_CALLBACK(
                self._setattr(PYFUSE3_SETATTR(address[SETATTR]))
            )
        if self.answering or self.hinting:
            patches[slots[GETXATTR]] = GETXATTR_CALLBACK(
                self._getxattr(PYFUSE3_GETXATTR(address[GETXATTR]))
            )
        if self.dir_flags is not None or self.answering:
            patches[slots[OPENDIR]] = OPEN_CALLBACK(
                self._opendir(PYFUSE3_OPEN(address[OPENDIR]), self.dir_flags)
            )
        if self.answering:
            patches[slots[RELEASEDIR]] = OPEN_CALLBACK(
                self._release(PYFUSE3_OPEN(address[RELEASEDIR]), "fast_releasedir")
            )
        for slot, trampoline in patches.items():
            keep.append(trampoline)
            words[slot] = ctypes.cast(trampoline, ctypes.c_void_p).value
        self._keep = tuple(keep)  # alive while the table points at them
        self.naming = True
        self.session = session
        self.installed = True
        log.info("READ and READDIRPLUS name their inode; READs may take the fast path")
        return True

    def _open(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, fi: int) -> None:
            if fi:
                if self.noflush_read_only and not ctypes.c_int.from_address(fi).value & WRITES:
                    bits = ctypes.c_uint32.from_address(fi + BITS_OFFSET)
                    bits.value |= NOFLUSH_BIT
                fast = self.fast_open
                if fast is not None and self.fh_confirmed and fast(req, ino, fi):
                    return
            original(req, ino, fi)

        return trampoline

    def _release(self, original: Callable[..., None], hook: str) -> Callable[..., None]:
        """RELEASE or RELEASEDIR: the handle read for `confirm` while
        checking, then offered to the hook named *hook*."""

        def trampoline(req: int, ino: int, fi: int) -> None:
            if fi:
                if self.checking:
                    self.fh_word = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
                fast = getattr(self, hook)
                if fast is not None and self.fh_confirmed and fast(req, ino, fi):
                    return
            original(req, ino, fi)

        return trampoline

    def _write(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, bufv: int, off: int, fi: int) -> None:
            fast = self.fast_write
            if fi and fast is not None and self.fh_confirmed and fast(req, ino, bufv, off, fi):
                return
            original(req, ino, bufv, off, fi)

        return trampoline

    def _setattr(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, attr: int, to_set: int, fi: int) -> None:
            fast = self.fast_setattr
            if fast is not None and fast(req, ino, attr, to_set):
                return
            original(req, ino, attr, to_set, fi)

        return trampoline

    def _getxattr(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, name: int, size: int) -> None:
            if name:
                hint = self.fast_hint
                if hint is not None and hint(req, ino, name, size):
                    return
                fast = self.fast_getxattr
                if fast is not None and fast(req, ino, name):
                    return
            original(req, ino, name, size)

        return trampoline

    def _handled(self, original: Callable[..., None], hook: str) -> Callable[..., None]:
        """A trampoline for a (req, ino, fi) request that names its handle,
        offered to the hook named *hook* first once the handle's offset is
        confirmed."""

        def trampoline(req: int, ino: int, fi: int) -> None:
            fast = getattr(self, hook)
            if fi and fast is not None and self.fh_confirmed and fast(req, ino, fi):
                return
            original(req, ino, fi)

        return trampoline

    def _offered(self, original: Callable[..., None], hook: str) -> Callable[..., None]:
        """A trampoline that offers its request to the hook named *hook*
        (`fast_getattr`, `fast_lookup`) first."""

        def trampoline(req: int, what: int, arg: int) -> None:
            fast = getattr(self, hook)
            if fast is not None and fast(req, what, arg):
                return
            original(req, what, arg)

        return trampoline

    def _opendir(
        self, original: Callable[..., None], flags: Callable[[int], int] | None
    ) -> Callable[..., None]:
        def trampoline(req: int, ino: int, fi: int) -> None:
            if fi:
                if flags is not None:
                    try:
                        bits = flags(ino)
                    except Exception:  # never into C: list afresh, uncached
                        log.exception("opendir flags of inode %d", ino)
                        bits = 0
                    ctypes.c_uint32.from_address(fi + BITS_OFFSET).value |= bits
                fast = self.fast_opendir
                if fast is not None and self.fh_confirmed and fast(req, ino, fi):
                    return
            original(req, ino, fi)

        return trampoline

    def _named(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, size: int, off: int, fi: int) -> None:
            fast = self.fast_listing
            if fast is not None and fast(req, ino, size, off, fi):
                return
            self.current = ino
            original(req, ino, size, off, fi)

        return trampoline

    def _read(self, original: Callable[..., None]) -> Callable[..., None]:
        def trampoline(req: int, ino: int, size: int, off: int, fi: int) -> None:
            self.current = ino
            if fi and self.checking:
                self.fh_word = ctypes.c_uint64.from_address(fi + FH_OFFSET).value
            fast = self.fast
            if fast is not None and fast(req, ino, size, off, fi):
                return
            original(req, ino, size, off, fi)

        return trampoline


READ_INODES = ReadInodes()
