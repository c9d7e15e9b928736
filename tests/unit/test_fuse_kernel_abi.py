"""Golden bytes for the FUSE structs we exchange with the kernel (sizes and layouts of uapi fuse.h 7.42)."""

from __future__ import annotations

from cachefs.fuse import kernel_abi as abi


def test_struct_sizes_match_the_kernel_header():
    sizes = {"IN_HEADER": 40, "OUT_HEADER": 16, "INIT_IN": 64, "INIT_OUT": 64, "ATTR": 88, "OPEN_IN": 8,
             "OPEN_OUT": 16, "READ_IN": 40, "RELEASE_IN": 24, "KSTATFS": 80, "BACKING_MAP": 16, "GETATTR_IN": 16,
             "FORGET_ONE": 16, "DIRENT_HEAD": 24, "NOTIFY_STORE_OUT": 24}
    assert {k: getattr(abi, k).size for k in sizes} == sizes
    assert abi.ENTRY_OUT_SIZE == 128
    assert len(abi.pack_attr_out(abi.pack_attr(1, 0, 0o40555, 0), 1.0)) == 104


def test_golden_bytes():
    attr = abi.pack_attr(7, 1000, 0o100444, 1_500_000_000_250_000_000, nlink=1)
    assert attr.hex() == (
        "0700000000000000" "e803000000000000" "0200000000000000"  # ino, size, blocks (512-byte units)
        + "002f685900000000" * 3  # atime, mtime, ctime seconds
        + "80b2e60e" * 3  # nanoseconds
        + "24810000" "01000000" "00000000" "00000000" "00000000" "00100000" "00000000")  # mode nlink uid gid rdev blksize flags
    entry = abi.pack_entry(7, attr, 3600.5, 10.0)
    assert entry[:40].hex() == ("0700000000000000" "0000000000000000" "100e000000000000" "0a00000000000000"
                                "0065cd1d" "00000000")
    assert abi.pack_dirent(9, 3, b"abc", abi.DT_REG).hex() == (
        "0900000000000000" "0300000000000000" "03000000" "08000000" "6162630000000000")
    assert abi.OPEN_OUT.pack(5, abi.OpenFlag.PASSTHROUGH, 2).hex() == "0500000000000000" "80000000" "02000000"
    assert abi.FUSE_DEV_IOC_BACKING_OPEN == (1 << 30) | (16 << 16) | (229 << 8) | 1  # _IOW(229, 1, 16)
    assert int(abi.InitFlag.PASSTHROUGH) >> 32 == 0x20  # flags2 bit 5
    assert abi.dirent_size(b"abc") == 32 and abi.dirent_size(b"abc", plus=True) == 160
    # FUSE_NOTIFY_STORE of 5 bytes at offset 0 of inode 7: out header (error = the notify code, unique 0), then
    # fuse_notify_store_out; the data follows.
    assert abi.pack_notify_store(7, 0, 5).hex() == (
        "2d000000" "04000000" "0000000000000000" "0700000000000000" "0000000000000000" "05000000" "00000000")
