"""`HiCache.fetch`'s reusable buffers: a conversation's page files are read into one buffer,
which stays the fetch's own until the `load` that consumes it hands it back for the next fetch
(never while another fetch's payloads still live in it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from radixlm.radix import BlockPool, FileTierStore, HiCache, RadixCache
from radixlm.radix.tier import identity_digest, page_keys

ID = identity_digest({"model": "fetch-test"})


class KeyIO:
    """Pool pages whose contents are the 16-byte key of the prefix they hold; copies on write."""

    page_bytes = 16

    def __init__(self, num_pages: int) -> None:
        self.contents: list[bytes | None] = [None] * num_pages

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [self.contents[p] or b"" for p in pages]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        for p, c in zip(pages, payloads, strict=True):
            self.contents[p] = bytes(c)


def test_fetch_buffers_are_reused_only_after_their_load(tmp_path: Path) -> None:
    pool = BlockPool(8, 1)
    io = KeyIO(8)
    store = FileTierStore(tmp_path, 64 * 16, ID, fsync=False)
    hc = HiCache(RadixCache(pool), store, io, str(tmp_path), False, None)
    a, b = [1, 2, 3], [7, 8, 9]  # the same size: either could take the other's buffer
    keys = {tuple(t): list(page_keys(t, 1, None)) for t in (a, b)}
    for ks in keys.values():
        for k in ks:
            store.put(k, k)
    store.wait_writes()  # the payloads come from the files, read into the fetch's buffer

    fa, fb = hc.fetch(a, None, 0), hc.fetch(b, None, 0)
    assert fa.buffer is not None and fb.buffer is not None and fa.buffer is not fb.buffer
    assert all(isinstance(v, memoryview) and v.obj is fa.buffer for v in fa.values())
    buf_a = fa.buffer
    pages = hc.load(a, None, 0, prefetched=fa)
    assert [io.contents[p] for p in pages] == keys[(1, 2, 3)]
    assert not fa and fa.buffer is None  # consumed

    fc = hc.fetch(a, None, 0)
    assert fc.buffer is buf_a  # handed back by the load, reused
    assert [bytes(v) for v in fb.values()] == keys[(7, 8, 9)]  # b's still its own
    pool.decref(pages)
    pages = hc.load(b, None, 0, prefetched=fb)
    assert [io.contents[p] for p in pages] == keys[(7, 8, 9)]
    hc.close()
