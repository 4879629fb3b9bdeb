"""The second KV tier on the HTTP surface (in-process app, tiny model): `/metrics`,
`/get_server_info` and `/dashboard/snapshot` show it, `usage.prompt_tokens_details
.cached_tokens` counts its hits, `/flush_cache` clears it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx


def test_tier_on_metrics_info_dashboard_and_flush(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from radixlm import Engine
    from radixlm.server import ServerConfig, create_app

    engine = Engine(
        str(tiny_llama_dir), dtype="float32", num_pages=16, page_size=4, num_threads=1,
        max_model_len=128, hicache_storage_dir=str(tmp_path / "tier"),
    )  # fmt: skip
    system = list(range(100, 116))
    prompts = [system + [200 + 30 * i + j for j in range(24)] for i in range(3)]

    async def scenario() -> dict[str, Any]:
        app = create_app(engine, ServerConfig())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            usages = []
            for p in [*prompts, prompts[0]]:
                r = await c.post(
                    "/v1/completions",
                    json={"prompt": p, "max_tokens": 4, "temperature": 0, "model": "m"},
                )
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
            info = (await c.get("/get_server_info")).json()
            metrics = (await c.get("/metrics")).text
            snap = (await c.get("/dashboard/snapshot")).json()
            flushed = (await c.post("/flush_cache")).json()
            after = (await c.get("/get_server_info")).json()
        return dict(usages=usages, info=info, metrics=metrics, snap=snap, flushed=flushed,
                    after=after)  # fmt: skip

    try:
        out = asyncio.run(scenario())
    finally:
        engine.shutdown()
    stats = out["info"]["engine_stats"]
    assert stats["hicache_hit_tokens"] > 0 and stats["hicache_pages"] > 0
    assert stats["hicache_bytes"] > 0 and stats["hicache_load_seconds"] > 0
    assert out["info"]["engine_config"]["cache"]["hicache_storage_dir"].endswith("tier")
    returning = out["usages"][-1]["prompt_tokens_details"]["cached_tokens"]
    assert returning >= 32  # the pool's 16 system tokens + the tier's pages
    for name in ("radixlm_hicache_hit_tokens_total", "radixlm_hicache_pages",
                 "radixlm_hicache_bytes", "radixlm_hicache_load_seconds_total"):  # fmt: skip
        assert name in out["metrics"]
    tier = out["snap"]["tier"]
    assert tier["pages"] > 0 and tier["hit_tokens"] > 0 and tier["storage"].endswith("rank0")
    assert out["flushed"]["success"]
    assert out["after"]["engine_stats"]["hicache_pages"] == 0
    assert out["after"]["engine_stats"]["kv_pages_free"] == 16


def test_hicache_flags_and_one_directory_per_replica(monkeypatch) -> None:  # noqa: ANN001
    import radixlm.cli as cli
    from radixlm.cli import main as cli_main
    from radixlm.server.data_parallel import replica_argv, replica_engine_kwargs
    from radixlm.server.server_config import ServerConfig

    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.update(cli.engine_kwargs(args)) or 0)
    argv = ["serve", "--enable-hierarchical-cache", "--hicache-size", "0.5"]
    argv += ["--hicache-storage-dir", "/tmp/kv", "--hicache-write-policy", "write_through"]
    assert cli_main(argv) == 0
    assert seen["enable_hierarchical_cache"] is True and seen["hicache_size"] == 0.5
    assert seen["hicache_storage_dir"] == "/tmp/kv"
    assert seen["hicache_write_policy"] == "write_through"

    args = replica_argv(replica_engine_kwargs(seen, 1), ServerConfig(), 1234)
    assert args[args.index("--hicache-storage-dir") + 1] == "/tmp/kv/dp1"
    assert replica_engine_kwargs({"hicache_storage_dir": None}, 0) == {"hicache_storage_dir": None}
