"""Golden bytes of the on-disk formats (docs/FORMAT.md). If one of these fails, the format changed: bump
FORMAT_VERSION, update docs/FORMAT.md, then the expected bytes here."""

from __future__ import annotations

from cachefs.base.checksum import block_checksum
from cachefs.base.types import Entry, dataset_id, object_key
from cachefs.index import FORMAT_VERSION, ObjectRecord
from cachefs.index.records import BLOCK, DIR_HEAT, DS_STATS, PACKED, TOTALS, PackRecord, pack_key
from cachefs.manifest.store import _key, _pack


def test_format_version():
    assert FORMAT_VERSION == 2


DS_ID_GOLDEN = "95bc3e8b61afdbf4"


OKEY_GOLDEN = "989a2b5dd0c480df759b93c37609907a"


def test_object_key_and_dataset_id():
    assert dataset_id("s3://bucket/ds") == DS_ID_GOLDEN
    assert object_key("ds", "a/b.bin", "etag1").hex() == OKEY_GOLDEN
    # length-prefixed fields: ("ab", "c") and ("a", "bc") must differ
    assert object_key("x", "ab", "c") != object_key("x", "a", "bc")


GOLDEN_OBJECT = bytes.fromhex(
    "0a00000000000000" "0400000000000000" "0000000000804540" "0300000000000000" "00000100"
) + b"ds\0a/b\0v1"


def test_object_record_golden():
    rec = ObjectRecord("ds", "a/b", "v1", size=10, cached_bytes=4, last_access=43.0, hits=3, block_size=65536)
    assert rec.pack() == GOLDEN_OBJECT
    assert ObjectRecord.unpack(GOLDEN_OBJECT) == rec


def test_block_stats_totals_golden():
    assert BLOCK.pack(0x0102030405060708, 4096) == bytes.fromhex("0807060504030201" "00100000")
    assert DS_STATS.pack(1, 2, 3) == bytes.fromhex("0100000000000000" "0200000000000000" "0300000000000000")
    assert TOTALS.pack(5, 6) == bytes.fromhex("0500000000000000" "0600000000000000")


def test_manifest_entry_golden():
    assert _key("0123456789abcdef", 2, "train/x.jpg") == b"0123456789abcdef\x00\x00\x00\x02train\x00x.jpg"
    assert _key("0123456789abcdef", 1, "top") == b"0123456789abcdef\x00\x00\x00\x01\x00top"
    assert _pack(Entry("train/x.jpg", 7, "etag", 1.5)) == bytes.fromhex("00" "0700000000000000" "000000000000f83f") + b"etag"
    assert _pack(Entry("train", 0, "", 2.0, True)) == bytes.fromhex("01" "0000000000000000" "0000000000000040")


def test_checksum_is_xxh3_64():
    assert block_checksum(b"") == 0x2D06800538D394C2
    assert block_checksum(b"cachefs") == block_checksum(memoryview(b"cachefs"))


def test_pack_records_golden():
    assert PACKED.pack(0x0102030405060708, 16, 5, 0xAB) == bytes.fromhex(
        "0807060504030201" "1000000000000000" "0500000000000000" "ab00000000000000")
    assert pack_key("0123456789abcdef", 0x0A0B) == b"0123456789abcdef" + bytes.fromhex("0000000000000a0b")
    rec = PackRecord("0123456789abcdef", 0x0A0B, size=100, live_bytes=90, members=3, last_access=2.0, hits=7)
    raw = bytes.fromhex("6400000000000000" "5a00000000000000" "03000000" "0000000000000040" "0700000000000000")
    assert rec.pack() == raw and PackRecord.unpack(rec.key(), raw) == rec
    assert DIR_HEAT.pack(1.5, 2.0) == bytes.fromhex("000000000000f83f" "0000000000000040")
