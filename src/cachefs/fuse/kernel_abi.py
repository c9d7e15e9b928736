"""The kernel FUSE protocol's wire format: opcodes, flags and the structs our servers exchange (little-endian,
layouts of ``include/uapi/linux/fuse.h`` protocol 7.42; the kernel accepts our minor and speaks its own): the
read-only dataset's, and the write side's for checkpoint volumes. Every struct has a ``struct.Struct`` here and
nowhere else; golden-bytes tests pin them.
"""

from __future__ import annotations

import enum
import struct

# Protocol version we answer INIT with.
KERNEL_VERSION = 7
KERNEL_MINOR_VERSION = 42


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


#: Operations that would modify the file system: answered EROFS.
WRITE_OPS = frozenset({Op.SETATTR, Op.SYMLINK, Op.MKNOD, Op.MKDIR, Op.UNLINK, Op.RMDIR, Op.RENAME, Op.LINK,
                       Op.WRITE, Op.SETXATTR, Op.REMOVEXATTR, Op.CREATE, Op.FALLOCATE, Op.RENAME2,
                       Op.COPY_FILE_RANGE, Op.TMPFILE})


class InitFlag(enum.IntFlag):
    """``fuse_init_in/out.flags`` (low 32 bits) and ``flags2`` (bits 32–63, sent shifted down)."""

    ASYNC_READ = 1 << 0
    ATOMIC_O_TRUNC = 1 << 3
    BIG_WRITES = 1 << 5
    AUTO_INVAL_DATA = 1 << 12
    DO_READDIRPLUS = 1 << 13
    READDIRPLUS_AUTO = 1 << 14
    ASYNC_DIO = 1 << 15
    WRITEBACK_CACHE = 1 << 16
    PARALLEL_DIROPS = 1 << 18
    MAX_PAGES = 1 << 22
    CACHE_SYMLINKS = 1 << 23
    NO_OPENDIR_SUPPORT = 1 << 24
    EXPLICIT_INVAL_DATA = 1 << 25
    INIT_EXT = 1 << 30
    DIRECT_IO_ALLOW_MMAP = 1 << 36
    PASSTHROUGH = 1 << 37
    OVER_IO_URING = 1 << 41  # requests through io_uring (fuse/uring.py)


class OpenFlag(enum.IntFlag):
    """``fuse_open_out.open_flags``."""

    DIRECT_IO = 1 << 0
    KEEP_CACHE = 1 << 1
    CACHE_DIR = 1 << 3
    NOFLUSH = 1 << 5
    PASSTHROUGH = 1 << 7


#: Largest WRITE payload we accept (INIT's max_write); a request buffer must hold it plus the headers, or the
#: kernel answers the read with EINVAL.
MAX_WRITE = 1 << 20
MAX_REQUEST = MAX_WRITE + 4096 + 8192
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
INIT_IN = struct.Struct("<IIIII44x")  # major, minor, max_readahead, flags, flags2, unused[11]
INIT_IN_OLD = struct.Struct("<IIII")  # before 7.36: no flags2
#: major, minor, max_readahead, flags, max_background, congestion_threshold, max_write, time_gran, max_pages,
#: map_alignment, flags2, max_stack_depth, unused[6]
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec×3 mode nlink uid gid rdev blksize flags
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags, dummy, fh
OPEN_IN = struct.Struct("<II")  # flags, open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, padding
RELEASE_IN = struct.Struct("<QIIQ")  # fh, flags, release_flags, lock_owner
FORGET_IN = struct.Struct("<Q")  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")  # count, dummy
FORGET_ONE = struct.Struct("<QQ")  # nodeid, nlookup
INTERRUPT_IN = struct.Struct("<Q")  # unique of the interrupted request
GETXATTR_IN = struct.Struct("<II")  # size, padding
GETXATTR_OUT = struct.Struct("<II")  # size, padding
ACCESS_IN = struct.Struct("<II")  # mask, padding
KSTATFS = struct.Struct("<QQQQQIII4x24x")  # blocks bfree bavail files ffree bsize namelen frsize (+padding, spare[6])
DIRENT_HEAD = struct.Struct("<QQII")  # ino, off, namelen, type
BACKING_MAP = struct.Struct("<iIQ")  # fd, flags, padding
# The write side (checkpoint volumes).
#: valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, unused4, uid,
#: gid, unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
WRITE_IN = struct.Struct("<QQIIQII")  # fh, offset, size, write_flags, lock_owner, flags, padding (data follows)
WRITE_OUT = struct.Struct("<II")  # size, padding
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags (name follows)
MKDIR_IN = struct.Struct("<II")  # mode, umask (name follows)
MKNOD_IN = struct.Struct("<IIII")  # mode, rdev, umask, padding
RENAME_IN = struct.Struct("<Q")  # newdir (old and new names follow)
RENAME2_IN = struct.Struct("<QII")  # newdir, flags, padding
FLUSH_IN = struct.Struct("<QIIQ")  # fh, unused, padding, lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh, fsync_flags, padding
FALLOCATE_IN = struct.Struct("<QQQII")  # fh, offset, length, mode, padding
SETXATTR_IN = struct.Struct("<II")  # size, flags (without FUSE_SETXATTR_EXT; name and value follow)
#: SETATTR_IN.valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
#: RENAME2_IN.flags (renameat2)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1 << 0, 1 << 1

ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size  # 128
#: ioctls on the /dev/fuse descriptor (magic 229).
FUSE_DEV_IOC_CLONE = 0x8004E500
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502
#: ``fuse_notify_code`` (sent as the error of an unsolicited message, unique 0): put bytes into an inode's
#: page cache; resend unanswered requests.
NOTIFY_STORE = 4
NOTIFY_RESEND = 7
NOTIFY_STORE_OUT = struct.Struct("<QQII")  # nodeid, offset, size, padding
#: Kernel limit for passthrough stacking: 1 = backing files on a plain local file system.
MAX_STACK_DEPTH = 1

# d_type values for dirents (from <dirent.h>).
DT_DIR = 4
DT_REG = 8
DT_LNK = 10


def pack_attr(ino: int, size: int, mode: int, mtime_ns: int, nlink: int = 1, uid: int = 0, gid: int = 0,
              blksize: int = 4096) -> bytes:
    sec, nsec = divmod(max(0, mtime_ns), 1_000_000_000)
    return ATTR.pack(ino, size, (size + 511) // 512, sec, sec, sec, nsec, nsec, nsec, mode, nlink, uid, gid, 0,
                     blksize, 0)


def pack_entry(nodeid: int, attr: bytes, entry_valid: float, attr_valid: float, generation: int = 0) -> bytes:
    es, ens = _split(entry_valid)
    as_, ans = _split(attr_valid)
    return ENTRY_OUT_HEAD.pack(nodeid, generation, es, as_, ens, ans) + attr


def pack_attr_out(attr: bytes, attr_valid: float) -> bytes:
    s, ns = _split(attr_valid)
    return ATTR_OUT_HEAD.pack(s, ns, 0) + attr


def pack_dirent(ino: int, off: int, name: bytes, dtype: int) -> bytes:
    head = DIRENT_HEAD.pack(ino, off, len(name), dtype)
    rec = head + name
    return rec + b"\0" * (-len(rec) % 8)


def dirent_size(name: bytes, plus: bool = False) -> int:
    n = DIRENT_HEAD.size + len(name)
    return (ENTRY_OUT_SIZE if plus else 0) + n + (-n % 8)


def _split(seconds: float) -> tuple[int, int]:
    s = int(seconds)
    return s, int((seconds - s) * 1e9)


def pack_notify_store(nodeid: int, offset: int, size: int) -> bytes:
    """The header of a FUSE_NOTIFY_STORE message whose ``size`` bytes of data follow it."""
    return OUT_HEADER.pack(OUT_HEADER.size + NOTIFY_STORE_OUT.size + size, NOTIFY_STORE, 0) + \
        NOTIFY_STORE_OUT.pack(nodeid, offset, size, 0)
