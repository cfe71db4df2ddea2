"""--api_key: every route but /health needs 'Authorization: Bearer <key>', the admin routes
(/flush_cache, /pause_generation, /continue_generation, /start_profile, /stop_profile) too."""

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
        ("GET", "/flush_cache"),
        ("POST", "/clear_storage"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/start_profile"),
        ("POST", "/stop_profile"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("GET", "/model_info"),
        ("GET", "/get_model_info"),
        ("GET", "/v1/models/tiny"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
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


def test_admin_routes_work_with_the_key(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/pause_generation", "/continue_generation", "/flush_cache"):
        r = httpx.post(keyed.url + path, headers=auth)
        assert r.status_code == 200, (path, r.text)
    r = httpx.post(keyed.url + "/stop_profile", headers=auth)
    assert r.status_code == 400 and "no profile is running" in r.text  # reached the handler
