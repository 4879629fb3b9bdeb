"""The second KV tier: whole pages keyed by their token-prefix hash, bounded, LRU.

A page in the tier is identified by ``page_key``: a hash chain over the namespace and every
token of the prefix up to the end of that page, so one key names one page of one prefix
(whatever the tree looks like when it is stored or found). Payloads are opaque ``bytes`` (the
runtime's page codec writes and reads them); this module never imports torch.

Two stores with one interface (``TierStore``):

- ``HostTierStore``: payloads in host memory (the tier under a CUDA pool, and tests).
- ``FileTierStore``: one file per page under a directory, written by a background thread
  (``tmp`` + ``fsync`` + ``rename``: a reader sees a whole file or none); each file starts with
  a header carrying the store's identity digest, the key, the payload length and a checksum
  over key and payload (the format: ``page_file.py``). ``get`` verifies all of it: a torn,
  truncated, corrupt or foreign file is dropped (deleted) and reported as a miss, never served.
  On start the directory is re-indexed from the headers (warm restart), oldest file first in
  the LRU. A failed write (a full disk: ``OSError``) drops that page and is logged once; the
  store keeps serving.

Invariants (``check_integrity``): ``used_bytes`` is the sum of the indexed payload sizes and
never exceeds ``capacity_bytes`` after a ``put`` returns; the index is in LRU order (oldest
first); a key is indexed at most once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from radixlm.radix.page_file import (
    HEADER_BYTES,
    ID_BYTES,
    KEY_BYTES,
    header_key,
    page_file_header,
    read_page_file,
)

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"


def namespace_key(namespace: Hashable | None) -> bytes:
    """The chain's seed: the namespace (LoRA adapter, cache salt) is part of every key."""
    return hashlib.blake2b(repr(namespace).encode(), digest_size=KEY_BYTES).digest()


def next_key(prev: bytes, page_tokens: Sequence[int]) -> bytes:
    """The key of the page after the one keyed ``prev``, holding ``page_tokens``."""
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
    h.update(array("q", page_tokens).tobytes())
    return h.digest()


def page_keys(
    tokens: Sequence[int], page_size: int, namespace: Hashable | None = None
) -> Iterator[bytes]:
    """Keys of the whole pages of ``tokens``, first page first (lazily: stop when done)."""
    key = namespace_key(namespace)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        key = next_key(key, tokens[start : start + page_size])
        yield key


def identity_digest(identity: dict[str, object]) -> bytes:
    """A stable digest of a store's identity dict (sorted keys)."""
    text = repr(sorted((k, repr(v)) for k, v in identity.items()))
    return hashlib.blake2b(text.encode(), digest_size=ID_BYTES).digest()


@dataclass(frozen=True)
class TierStoreStats:
    """One store's occupancy and fault counters (cumulative since creation)."""

    pages: int
    used_bytes: int
    capacity_bytes: int
    dropped_pages: int  # corrupt / truncated / foreign files dropped on read or re-index
    write_errors: int  # writes that failed (full disk ...): those pages are not in the tier


class TierStore:
    """Bounded LRU of page payloads keyed by ``page_key``; thread-safe.

    Subclasses store payloads; this class keeps the index (key -> payload size) and the bound.
    ``put`` of a payload larger than the capacity stores nothing.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.RLock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> payload bytes, LRU first
        self._used = 0
        self._dropped = 0
        self._write_errors = 0
        # Called with each key the store forgets (LRU, drop, failed verification or write),
        # under the store's lock, from whichever thread forgot it: record, never block.
        self.on_forget: Callable[[bytes], None] | None = None

    # ---- the interface -------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` (LRU-evicting others); False if it cannot fit."""
        size = len(payload)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            while self._used + size > self.capacity_bytes:
                old, _ = next(iter(self._index.items()))
                self._forget(old)
            self._index[key] = size
            self._used += size
            self._store(key, payload)
            return True

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | None:
        """The verified payload of ``key`` (touching it in the LRU), or None (a miss; a
        payload that fails verification is dropped first). ``into``: a writable buffer a page
        file's payload may be read straight into (the result is then a view of it), saving a
        copy into fresh memory; a payload held in memory is returned as it is."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        payload = self._load(key, into)
        if payload is None:
            with self._lock:
                if key in self._index:
                    self._dropped += 1
                    self._forget(key)
        return payload

    def drop(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._forget(key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._index):
                self._forget(key)

    def wait_writes(self) -> None:
        """Return once every page put so far is stored (written or failed)."""

    def close(self) -> None:
        """Finish pending writes and stop background work; the store stays usable (later
        writes are synchronous)."""
        self.wait_writes()

    def keys(self) -> list[bytes]:
        """Indexed keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def stats(self) -> TierStoreStats:
        with self._lock:
            return TierStoreStats(
                len(self._index), self._used, self.capacity_bytes, self._dropped,
                self._write_errors,
            )  # fmt: skip

    def check_integrity(self) -> None:
        with self._lock:
            used = sum(self._index.values())
            if used != self._used:
                raise AssertionError(f"tier used bytes {self._used} != indexed {used}")
            if self._used > self.capacity_bytes:
                raise AssertionError(f"tier holds {self._used} > capacity {self.capacity_bytes}")

    # ---- for subclasses (called with the lock held, except _load) ------------------------------
    def _forget(self, key: bytes) -> None:
        self._used -= self._index.pop(key)
        self._discard(key)
        if self.on_forget is not None:
            self.on_forget(key)

    def _store(self, key: bytes, payload: bytes) -> None:
        raise NotImplementedError

    def _load(self, key: bytes, into: memoryview | None) -> bytes | None:
        raise NotImplementedError

    def _discard(self, key: bytes) -> None:
        raise NotImplementedError


class HostTierStore(TierStore):
    """Payloads in host memory."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._data: dict[bytes, bytes] = {}

    def _store(self, key: bytes, payload: bytes) -> None:
        self._data[key] = bytes(payload)  # its own copy: a view would pin its whole batch

    def _load(self, key: bytes, into: memoryview | None) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def _discard(self, key: bytes) -> None:
        self._data.pop(key, None)


# The background writer's CPU priority (nice), below the forward's threads: on a box whose cores
# all run the forward, a write-back of evicted pages at equal priority slowed the step that
# loads a returning conversation by ~40% (measured in process, 2 cores).
WRITER_NICE = 19


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task with its own nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not permitted: advice only
        pass


class FileTierStore(TierStore):
    """One file per page under ``directory`` (``<key hex>.kv``), written in the background.

    A page is served from memory until its file is written (``_pending``); a ``clear`` or an
    LRU drop before then cancels the write. ``identity`` names what the pages belong to (model
    files, dtype, page size, KV layout, tokenizer, tensor-parallel rank): a file with another
    identity is never served. ``fsync`` off trades crash durability of the newest pages for
    write cost; the checksum still keeps torn files from being served.
    """

    def __init__(
        self, directory: str | os.PathLike[str], capacity_bytes: int, identity: bytes,
        fsync: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(capacity_bytes)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.fsync = fsync
        # key -> [payload]: a fresh one-element list per put, so the writer can tell "the put it
        # read is still the wanted one" by identity even when the same bytes object is put
        # again after a drop (comparing the payloads themselves would confuse the two puts).
        self._pending: dict[bytes, list[bytes]] = {}
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._write_failed_logged = False
        self._reindex()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True)
        self._writer.start()

    def path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + _SUFFIX)

    # ---- TierStore hooks ------------------------------------------------------------------------
    def _store(self, key: bytes, payload: bytes) -> None:
        self._pending[key] = [payload]
        if self._writer.is_alive():
            self._queue.put(key)
        else:
            self._write_one(key)

    def _load(self, key: bytes, into: memoryview | None) -> bytes | None:
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending[0]
        try:
            payload = read_page_file(self.path(key), self.identity, key, into)
        except OSError:
            return None
        if payload is None:
            logger.warning("hicache: dropping corrupt or foreign page file %s", self.path(key))
        return payload

    def _discard(self, key: bytes) -> None:
        self._pending.pop(key, None)
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def wait_writes(self) -> None:
        with self._idle:
            while self._pending and self._writer.is_alive():
                self._idle.wait(timeout=0.1)

    def close(self) -> None:
        self.wait_writes()
        self._queue.put(None)
        self._writer.join()

    # ---- the writer ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        _lower_priority(WRITER_NICE)
        while True:
            key = self._queue.get()
            if key is None:
                return
            self._write_one(key)

    def _write_one(self, key: bytes) -> None:
        """Write ``key``'s pending payload (if still wanted); a failure drops the page."""
        with self._lock:
            entry = self._pending.get(key)
        if entry is None:
            return  # dropped or cleared before it was written
        try:
            self._write_file(key, entry)
            failed = None
        except OSError as exc:
            failed = exc
        with self._idle:
            current = self._pending.get(key) is entry
            if current:
                del self._pending[key]
            if failed is not None:
                self._write_errors += 1
                if current:
                    self._used -= self._index.pop(key)
                    if self.on_forget is not None:
                        self.on_forget(key)
                if not self._write_failed_logged:
                    self._write_failed_logged = True
                    logger.error(
                        "hicache: writing page files under %s failed (%s); pages that cannot "
                        "be written are dropped, serving goes on (logged once)",
                        self.directory, failed,
                    )  # fmt: skip
            self._idle.notify_all()

    def _write_file(self, key: bytes, entry: list[bytes]) -> None:
        tmp = self.directory / f".{key.hex()}.{threading.get_ident()}.tmp"
        header = page_file_header(self.identity, key, entry[0])
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(entry[0])
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                if self._pending.get(key) is entry:  # still wanted (not dropped or cleared)
                    os.replace(tmp, self.path(key))
                    return
        except OSError:
            _unlink(tmp)
            raise
        _unlink(tmp)

    # ---- warm restart --------------------------------------------------------------------------
    def _reindex(self) -> None:
        """Index the directory's page files from their headers in LRU order (file mtimes),
        keeping the newest when they exceed the capacity; drop leftover temporary files and
        files whose header is not whole and ours (truncated, foreign). The payload checksum is
        verified when a page is read."""
        entries: list[tuple[float, bytes, int]] = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):
                _unlink(path)  # a write a crash interrupted
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    head = f.read(HEADER_BYTES)
            except OSError:
                continue
            key = header_key(self.identity, head, st.st_size)
            if key is None or path.name != key.hex() + _SUFFIX:
                self._dropped += 1
                logger.warning("hicache: ignoring and removing bad page file %s", path)
                _unlink(path)
                continue
            entries.append((st.st_mtime, key, st.st_size - HEADER_BYTES))
        entries.sort(key=lambda e: e[0], reverse=True)  # newest first: kept when over capacity
        kept: list[tuple[bytes, int]] = []
        for _, key, size in entries:
            if self._used + size > self.capacity_bytes:
                _unlink(self.path(key))
                continue
            kept.append((key, size))
            self._used += size
        for key, size in reversed(kept):  # the index is in LRU order: oldest first
            self._index[key] = size
        if entries:
            logger.info(
                "hicache: re-indexed %d pages (%.1f MB) under %s",
                len(self._index), self._used / 1e6, self.directory,
            )  # fmt: skip


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


MANIFEST = "manifest.json"


def open_file_store(
    storage_dir: str | os.PathLike[str],
    identity: dict[str, object],
    capacity_bytes: int,
    rank: int = 0,
    fsync: bool = True,
) -> FileTierStore:
    """Tensor-parallel rank ``rank``'s file store of this identity under ``storage_dir``:
    ``<digest>/rank<r>/`` beside a ``<digest>/manifest.json`` naming the identity in words
    (the identity is every rank's; each rank's files also carry its rank). Stores of other
    identities (another model, dtype, page size, KV layout or tokenizer) in the same directory
    are left alone and named in one log line; a manifest that does not match its digest is
    rewritten and its pages dropped."""
    import json

    root = Path(storage_dir)
    root.mkdir(parents=True, exist_ok=True)
    digest = identity_digest(identity)
    mine = root / digest.hex()
    text = json.dumps({k: repr(v) for k, v in sorted(identity.items())}, indent=1)
    for other in sorted(p for p in root.iterdir() if p.is_dir() and p != mine):
        if (other / MANIFEST).exists():
            logger.info(
                "hicache: ignoring %s: its pages belong to another model, dtype, page size, "
                "KV layout or tokenizer (see its %s)", other, MANIFEST,
            )  # fmt: skip
    manifest = mine / MANIFEST
    store_dir = mine / f"rank{rank}"
    if manifest.exists() and manifest.read_text() != text:
        logger.warning("hicache: %s does not match its identity; dropping its pages", manifest)
        for path in store_dir.glob("*"):
            _unlink(path)
    store_dir.mkdir(parents=True, exist_ok=True)
    if not manifest.exists() or manifest.read_text() != text:
        tmp = mine / f".{MANIFEST}.tmp"
        tmp.write_text(text)
        os.replace(tmp, manifest)
    # a rank's files name their rank: another rank's shard copied here is never served
    file_identity = identity_digest({**identity, "rank": rank})
    return FileTierStore(store_dir, capacity_bytes, file_identity, fsync=fsync)
