"""Where the proxy's API keys come from, and safe by default: a non-loopback ``--host``
without a key is refused before anything binds, as a one-line error with exit status 2."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kvpool.errors import ConfigError
from kvpool.proxy import ProxyConfig
from kvpool.proxy.auth import resolve_api_keys, resolve_upstream_key
from tests.proxy.harness import proxy_over, proxy_process, proxy_stack, run
from tests.proxy.stub_upstream import StubUpstream

KEY = "sk-kvpool-0123456789abcdef0123"
ENV_KEY = "sk-from-the-environment-0001"
URLS = {"prefill": ("http://127.0.0.1:1",), "decode": ("http://127.0.0.1:2",)}


def _key_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "proxy.key"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "::", "proxy.example"])
def test_non_loopback_without_a_key_is_refused_before_binding(host: str) -> None:
    with pytest.raises(ConfigError) as refused:
        ProxyConfig(**URLS, host=host, port=0)  # a ProxyServer is never even built
    message = str(refused.value)
    assert message.startswith(f"--host {host}: ")
    assert "--api-key-file" in message and "--insecure" in message
    assert "\n" not in message
    # with a key, or told --insecure, the same host is accepted
    assert ProxyConfig(**URLS, host=host, api_keys=(KEY,)).api_keys == (KEY,)
    assert ProxyConfig(**URLS, host=host, insecure=True).api_keys == ()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_needs_no_key(host: str) -> None:
    assert ProxyConfig(**URLS, host=host).effective_upstream_key is None


def test_keys_are_checked_and_kept_out_of_repr() -> None:
    for bad, why in (("short-key", "fewer than 16"), ("has a space in it 1234", "printable")):
        with pytest.raises(ConfigError, match=f"--api-key: .*{why}"):
            ProxyConfig(**URLS, api_keys=(bad,))
    cfg = ProxyConfig(**URLS, api_keys=(KEY,), upstream_api_key="up")
    assert KEY not in repr(cfg) and "'up'" not in repr(cfg)
    assert cfg.effective_upstream_key == "up"
    assert ProxyConfig(**URLS, api_keys=(KEY,)).effective_upstream_key == KEY


def test_sources_in_order(tmp_path: Path) -> None:
    env_file = _key_file(tmp_path, f"# the proxy's keys\n{ENV_KEY}\n\n{KEY}\n")
    env = {"KVPOOL_API_KEY_FILE": env_file, "KVPOOL_API_KEY": "sk-env-variable-key-0002"}
    assert resolve_api_keys([KEY], "", env) == (KEY,)  # the flag first
    assert resolve_api_keys([], "", env) == (ENV_KEY, KEY)  # then the env's file
    assert resolve_api_keys([], "", {"KVPOOL_API_KEY": ENV_KEY}) == (ENV_KEY,)
    assert resolve_api_keys([], "", {}) == ()
    with pytest.raises(ConfigError, match="give the key one way, not both"):
        resolve_api_keys([KEY], env_file, {})
    assert resolve_upstream_key("", "", {}) is None  # the default: the proxy's own key
    assert resolve_upstream_key("", "", {"KVPOOL_UPSTREAM_API_KEY": "v"}) == "v"
    assert resolve_upstream_key("x", "", {"KVPOOL_UPSTREAM_API_KEY": "v"}) == "x"
    with pytest.raises(ConfigError, match="several keys"):
        resolve_upstream_key("", env_file, {})


def test_key_files_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_api_keys([], _key_file(tmp_path, KEY, mode=0o644), {})
    with pytest.raises(ConfigError, match="holds no API key"):
        resolve_api_keys([], _key_file(tmp_path, "# nothing\n"), {})
    with pytest.raises(ConfigError, match="KVPOOL_API_KEY_FILE: cannot read"):
        resolve_api_keys([], "", {"KVPOOL_API_KEY_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # 10.0.0.1 is on no interface here: a bind would fail otherwise (EADDRNOTAVAIL)
        (["--host", "10.0.0.1"], "--host 10.0.0.1: a proxy reachable from other hosts"),
        (["--host", "10.0.0.1", "--api-key", "short"], "--api-key: the API key has 5 char"),
        (["--api-key-file", "/nonexistent/proxy.key"], "--api-key-file: cannot read the key"),
    ],
    ids=["no-key", "short-key", "missing-file"],
)
def test_cli_refuses_with_one_line_and_exit_2(args: list[str], says: str) -> None:
    async def scenario() -> None:
        proc, line = await proxy_process(
            [*args, "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], {}
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 2
        assert line == ""  # it never listened
        lines = err.decode().strip().splitlines()
        assert len(lines) == 1, lines
        assert says in lines[0]

    run(scenario())


def test_cli_proxy_with_a_key_from_the_environment(tmp_path: Path) -> None:
    async def scenario() -> None:
        p, d = StubUpstream(name="p0", api_key=KEY), StubUpstream(name="d0", api_key=KEY)
        env = {"KVPOOL_API_KEY_FILE": _key_file(tmp_path, KEY + "\n")}
        async with proxy_over(p, d, [], env) as (proc, line):
            assert line.startswith("kvpool proxy listening on "), line
            assert "auth=api-key" in line and KEY not in line
            url = line.split()[4] + "/v1/completions"
            body = {"prompt": "from a file", "max_tokens": 3}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                async with s.post(url, json=body) as resp:
                    assert resp.status == 401
                headers = {"Authorization": f"Bearer {KEY}"}
                async with s.post(url, json=body, headers=headers) as resp:
                    assert resp.status == 200
            assert len(p.received) == len(d.received) == 1
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 20) == 0

    run(scenario())


def test_in_process_server_refuses_nothing_it_was_not_told() -> None:
    """``kvpool up`` builds the proxy on loopback with no key: unchanged, open."""

    async def scenario() -> None:
        async with proxy_stack() as stack:  # the proxy's defaults, one prefill, one decode
            body = {"prompt": "open on loopback", "max_tokens": 2}
            async with stack.session.post(stack.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200

    run(scenario())
