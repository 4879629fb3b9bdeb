"""The second tier's stores: keys, LRU bound, page files (checksum, identity, re-index,
crash leftovers, failed writes), the manifest."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixlm.radix.page_file import HEADER_BYTES, decode_page_file, encode_page_file
from radixlm.radix.tier import (
    FileTierStore,
    HostTierStore,
    TierStore,
    identity_digest,
    open_file_store,
    page_keys,
)

ID = identity_digest({"model": "m"})


def _key(i: int) -> bytes:
    return next(page_keys([i, i], 2))


@pytest.fixture(params=["host", "file"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path):
    stores: list[TierStore] = []

    def make(capacity: int) -> TierStore:
        if request.param == "host":
            store: TierStore = HostTierStore(capacity)
        else:
            store = FileTierStore(tmp_path / "s", capacity, ID)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


def test_keys_chain_the_whole_prefix() -> None:
    a = list(page_keys([1, 2, 3, 4], 2))
    b = list(page_keys([9, 9, 3, 4], 2))
    assert len(a) == 2 and a[1] != b[1]  # same page tokens, another prefix: another key
    assert list(page_keys([1, 2, 3, 4, 5], 2)) == a  # the partial page has no key
    assert list(page_keys([1, 2], 2, "lora")) != a[:1]  # the namespace is part of the key


def test_put_get_and_lru_bound(make_store) -> None:
    store = make_store(30)
    for i in range(3):
        assert store.put(_key(i), bytes([i]) * 10)
    assert store.get(_key(0)) == bytes(10)  # touch 0: 1 is now the oldest
    assert store.put(_key(3), b"x" * 10)
    assert not store.contains(_key(1)) and store.contains(_key(0))
    assert not store.put(_key(4), b"y" * 31)  # larger than the whole tier
    store.check_integrity()
    s = store.stats()
    assert (s.pages, s.used_bytes) == (3, 30)
    store.drop(_key(0))
    assert store.get(_key(0)) is None
    store.clear()
    assert store.stats().pages == 0 and store.get(_key(3)) is None
    store.check_integrity()


def test_page_file_codec() -> None:
    data = encode_page_file(ID, _key(1), b"payload")
    assert len(data) == HEADER_BYTES + 7
    assert decode_page_file(ID, _key(1), data) == b"payload"
    assert decode_page_file(ID, _key(2), data) is None  # another key
    assert decode_page_file(identity_digest({"model": "n"}), _key(1), data) is None
    assert decode_page_file(ID, _key(1), data[:-1]) is None  # truncated
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert decode_page_file(ID, _key(1), bytes(flipped)) is None  # corrupt


def test_reindex_after_restart_and_crash_leftovers(tmp_path: Path) -> None:
    store = FileTierStore(tmp_path, 1000, ID)
    for i in range(4):
        store.put(_key(i), bytes([i]) * 20)
    store.close()
    (tmp_path / ".deadbeef.1.tmp").write_bytes(b"half a write")  # kill -9 mid-write
    (tmp_path / f"{_key(9).hex()}.kv").write_bytes(encode_page_file(ID, _key(9), b"z" * 50)[:70])
    (tmp_path / f"{_key(8).hex()}.kv").write_bytes(encode_page_file(ID, _key(7), b"w"))  # renamed
    again = FileTierStore(tmp_path, 1000, ID)
    try:
        assert sorted(again.keys()) == sorted(_key(i) for i in range(4))
        assert again.get(_key(2)) == bytes([2]) * 20
        assert again.stats().dropped_pages == 2
        assert not list(tmp_path.glob("*.tmp"))
    finally:
        again.close()


def test_a_page_dropped_and_put_again_while_its_file_is_written_is_kept(tmp_path: Path) -> None:
    """The writer has just written key k's file when k is dropped (its file removed) and put
    again with the very same bytes object: the second put must still be written (the writer
    tells the two puts apart, not by their payloads), so the page survives a restart."""
    store = FileTierStore(tmp_path, 1000, ID, fsync=False)
    k, payload = _key(1), b"p" * 32
    real = store._write_file
    raced: list[bool] = []

    def write_then_race(key: bytes, entry) -> None:
        real(key, entry)
        if not raced:  # on the writer thread, between the rename and forgetting the put
            raced.append(True)
            store.drop(key)
            assert store.put(key, payload)

    store._write_file = write_then_race  # type: ignore[method-assign]
    assert store.put(k, payload)
    store.wait_writes()
    assert raced and store.contains(k) and store.path(k).exists()
    assert store.get(k) == payload
    store.close()
    again = FileTierStore(tmp_path, 1000, ID)
    try:
        assert again.keys() == [k]
    finally:
        again.close()


def test_corrupt_payload_is_dropped_on_read(tmp_path: Path) -> None:
    store = FileTierStore(tmp_path, 1000, ID)
    store.put(_key(1), b"a" * 20)
    store.wait_writes()
    path = store.path(_key(1))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(_key(1)) is None
    assert not store.contains(_key(1)) and not path.exists()
    assert store.stats().dropped_pages == 1
    store.check_integrity()
    store.close()


def test_failed_writes_drop_pages_and_log_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = open

    def enospc(path, mode="r", *a, **kw):  # noqa: ANN001, ANN202
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **kw)

    store = FileTierStore(tmp_path, 1000, ID)
    monkeypatch.setattr("builtins.open", enospc)
    with caplog.at_level(logging.ERROR, logger="radixlm.radix.tier"):
        for i in range(3):
            store.put(_key(i), b"q" * 10)
        store.wait_writes()
    monkeypatch.undo()
    s = store.stats()
    assert (s.pages, s.used_bytes, s.write_errors) == (0, 0, 3)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1
    assert store.put(_key(5), b"ok" * 5)  # the disk has room again: serving goes on
    store.wait_writes()
    assert store.get(_key(5)) == b"ok" * 5
    store.check_integrity()
    store.close()


def test_manifest_separates_identities(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = open_file_store(tmp_path, {"model": "a", "page_size": 16}, 1000)
    a.put(_key(1), b"a" * 10)
    a.close()
    with caplog.at_level(logging.INFO, logger="radixlm.radix.tier"):
        b = open_file_store(tmp_path, {"model": "b", "page_size": 16}, 1000)
    assert b.stats().pages == 0  # another model's pages are not ours
    assert any("another model" in r.getMessage() for r in caplog.records)
    b.close()
    a2 = open_file_store(tmp_path, {"model": "a", "page_size": 16}, 1000)
    assert a2.get(_key(1)) == b"a" * 10  # and they are still there for their model
    assert (a2.directory.parent / "manifest.json").exists()
    a2.close()


_WRITER = """
import sys, hashlib
from radixlm.radix.tier import FileTierStore, identity_digest
store = FileTierStore(sys.argv[1], 1 << 30, identity_digest({"model": "m"}))
i = 0
while True:
    key = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
    store.put(key, key * 4096)  # 64 KB, contents derived from the key
    i += 1
    if i == 20:
        print("ready", flush=True)
"""


def test_kill_9_during_writes_never_serves_a_wrong_page(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    store = FileTierStore(tmp_path, 1 << 30, ID)
    try:
        keys = store.keys()
        assert keys  # some pages made it to disk
        for key in keys:
            payload = store.get(key)
            assert payload is None or payload == key * 4096
        assert not list(tmp_path.glob("*.tmp"))
        probe = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(5)]
        assert all(store.get(k) in (None, k * 4096) for k in probe)
    finally:
        store.close()


def test_reindex_keeps_the_newest_pages_within_a_smaller_capacity(tmp_path: Path) -> None:
    store = FileTierStore(tmp_path, 1000, ID)
    for i in range(4):
        store.put(_key(i), bytes([i]) * 20)
    store.close()
    for i in range(4):
        os.utime(store.path(_key(i)), (1000.0 + i, 1000.0 + i))
    small = FileTierStore(tmp_path, 40, ID)
    try:
        assert small.keys() == [_key(2), _key(3)]  # LRU order: oldest first
        assert not small.path(_key(0)).exists()
        small.check_integrity()
    finally:
        small.close()


def test_get_reads_a_page_file_into_the_given_buffer(tmp_path: Path) -> None:
    """`into`: the payload is read straight into the caller's buffer (a view of it is returned),
    it is the caller's own copy (rewriting the file later does not change it), a too-small
    buffer falls back to a plain read, and a corrupt file read this way is still dropped."""
    store = FileTierStore(tmp_path, 1000, ID)
    for i in (1, 2, 3):
        store.put(_key(i), bytes([i]) * 20)
    store.wait_writes()
    buf = bytearray(64)
    got = store.get(_key(1), memoryview(buf)[8:40])
    assert isinstance(got, memoryview) and got.obj is buf and bytes(got) == b"\x01" * 20
    assert buf[8:28] == b"\x01" * 20
    path = store.path(_key(1))
    path.write_bytes(encode_page_file(ID, _key(1), b"\x09" * 20))  # rewritten in place
    assert bytes(got) == b"\x01" * 20
    assert store.get(_key(2), memoryview(bytearray(10))) == b"\x02" * 20  # too small: plain read
    path = store.path(_key(3))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(_key(3), memoryview(bytearray(64))) is None
    assert not store.contains(_key(3)) and store.stats().dropped_pages == 1
    store.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are Linux's")
def test_the_writer_runs_below_the_forwards_priority(tmp_path: Path) -> None:
    from radixlm.radix.tier import WRITER_NICE

    store = FileTierStore(tmp_path, 1000, ID)
    store.put(_key(1), b"x" * 20)
    store.wait_writes()
    tid = store._writer.native_id
    assert tid is not None and os.getpriority(os.PRIO_PROCESS, tid) == WRITER_NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) < WRITER_NICE  # the rest of the process is not
    store.close()
