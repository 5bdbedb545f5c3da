"""`prefixserve kv-store stats|ls|clear URL`, run as a command against stores an engine filled.

Oracle: the store's own medium (the files in the directory, the keys in Redis)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from kv_store_helpers import documents, run_child
from redis_server import RedisServer


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixserve", "kv-store", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


def test_stats_ls_and_clear_a_file_store(tmp_path, model):
    url = f"file://{tmp_path}"
    run_child(documents(2, 70, seed=9), [url], model=model, blocks=64, close=True)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    stats = cli("stats", url)
    assert stats.returncode == 0, stats.stderr
    scope_line, total_line = stats.stdout.splitlines()[1], stats.stdout.splitlines()[-1]
    scope = files[0].parent.name
    assert scope_line.split() == [scope, str(len(files)), str(sum(f.stat().st_size for f in files))]
    assert total_line.split()[1] == str(len(files))
    ls = cli("ls", url, "--limit", "1000")
    assert sorted(line.split()[0] for line in ls.stdout.splitlines()) == sorted(
        f"{f.parent.name}/{f.stem}" for f in files)
    assert cli("ls", url, "--scope", "ab" * 16).stdout == ""
    cleared = cli("clear", url, "--scope", scope)
    assert cleared.stdout.strip() == f"deleted {len(files)} records"
    assert not list(tmp_path.rglob("*.kvb"))


def test_stats_and_clear_a_redis_store(tmp_path, model):
    server = RedisServer(tmp_path)
    server.start()
    try:
        run_child(documents(2, 70, seed=9), [server.url], model=model, blocks=64, close=True)
        client = redis.Redis.from_url(server.url)
        keys = list(client.scan_iter(match="prefixserve:kv:*"))
        assert keys
        stats = cli("stats", server.url)
        assert stats.stdout.splitlines()[-1].split()[1] == str(len(keys))
        assert cli("clear", server.url).stdout.strip() == f"deleted {len(keys)} records"
        assert not list(client.scan_iter(match="prefixserve:kv:*"))
    finally:
        server.kill()


@pytest.mark.parametrize("args, mention", [
    (("stats", "mem://"), "mem://"),
    (("ls", "ftp://host/x"), "scheme"),
    (("clear", "file://{tmp}", "--scope", "../etc"), "hex"),
    # /tmp itself: everyone can write there, so records could be planted
    (("stats", "file:///tmp"), "other users can write"),
])
def test_bad_stores_are_clear_errors(args, mention, tmp_path):
    proc = cli(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2 and mention in proc.stderr
