"""--api_key: every route but /health needs 'Authorization: Bearer <key>'."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import TEST_FLAGS, Server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    s = Server("cpu.flags", *TEST_FLAGS, f"--api_key={KEY}", log_path=str(tmp / "server.log"))
    yield s
    s.close()


def test_health_is_open(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/generate"),
        ("POST", "/flush_cache"),
        ("GET", "/get_server_info"),
    ],
)
def test_routes_need_the_key(keyed, method, path):
    r = httpx.request(method, keyed.url + path, json={"text": "a"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.request(method, keyed.url + path, headers={"Authorization": "Bearer wrong"}, json={"text": "a"})
    assert r.status_code == 401


def test_right_key_works(keyed):
    r = httpx.get(keyed.url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.json()["server_config"]["api_key"] == "<set>"  # never echoed
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
