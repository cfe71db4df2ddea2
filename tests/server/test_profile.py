"""``/start_profile`` and ``/stop_profile`` on the shared tiny server: the trace files appear
where asked (under ``--profile_dir``, never elsewhere), with the model's named scopes in them,
and misuse is a 400, not a crash."""

from __future__ import annotations

import glob
import gzip
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax.server.profiler import ProfileError, confine


def _trace_files(out_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "plugins", "profile", "*", "*")))


def test_profile_captures_a_trace(server):
    prompt = {"text": "profile me", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    server.generate(**prompt)  # compiled before the trace: it records steps, not compiles
    r = server.client.post("/start_profile", json={"output_dir": "trace"})
    assert r.status_code == 200, r.text
    out = r.json()["output_dir"]
    assert out == os.path.join(os.path.realpath(server.profile_dir), "trace")
    again = server.client.post("/start_profile", json={"output_dir": "trace"})
    assert again.status_code == 400 and "already running" in again.text
    server.generate(**prompt)
    r = server.client.post("/stop_profile")
    assert r.status_code == 200, r.text
    files = r.json()["files"]
    assert files == _trace_files(out)
    xplane = [f for f in files if f.endswith(".xplane.pb")]
    perfetto = [f for f in files if f.endswith("perfetto_trace.json.gz")]
    assert xplane and perfetto, files
    with gzip.open(perfetto[0], "rt") as f:
        assert "PjitFunction(_step)" in f.read()  # the engine's step ran while it recorded
    with open(xplane[0], "rb") as f:
        ops = f.read()  # TensorBoard maps each op to its scope through the HLO metadata here
    for scope in (b"/attention/", b"/kv_write/", b"/mlp/", b"/sampling/"):
        assert scope in ops, scope

    gone = server.client.post("/stop_profile")
    assert gone.status_code == 400 and "no profile is running" in gone.text


def test_profile_num_steps_stops_by_itself(server):
    r = server.client.post("/start_profile", json={"output_dir": "runs/steps", "num_steps": 1})
    assert r.status_code == 200, r.text
    out = r.json()["output_dir"]
    server.generate(text="one step", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert server.client.post("/stop_profile").status_code == 400  # it stopped after its step
    assert any(f.endswith(".xplane.pb") for f in _trace_files(out))


def test_profile_bad_body(server):
    r = server.client.post("/start_profile", json={"num_steps": 0})
    assert r.status_code == 400 and "num_steps" in r.text
    r = server.client.post("/start_profile", json={"output_dirr": "/tmp/x"})
    assert r.status_code == 400 and "output_dirr" in r.text


@pytest.mark.parametrize("name", ["{tmp}/elsewhere", "..", "../escape", "a/../../b", "a\x00b"])
def test_profile_output_dir_stays_under_profile_dir(server, tmp_path, name):
    """The client picks the directory and the server writes there: a name that leaves
    --profile_dir is a 400, and nothing is created."""
    name = name.format(tmp=tmp_path)
    before = sorted(os.listdir(os.path.dirname(server.profile_dir)))
    r = server.client.post("/start_profile", json={"output_dir": name, "num_steps": 1})
    assert r.status_code == 400, r.text
    assert "output_dir" in r.json()["error"]["message"]
    assert sorted(os.listdir(os.path.dirname(server.profile_dir))) == before
    assert os.listdir(tmp_path) == []


def test_profile_symlink_out_is_refused(server, tmp_path):
    os.makedirs(server.profile_dir, exist_ok=True)
    link = os.path.join(server.profile_dir, "out-link")
    if not os.path.islink(link):
        os.symlink(tmp_path, link)
    r = server.client.post("/start_profile", json={"output_dir": "out-link/trace"})
    assert r.status_code == 400 and "outside --profile_dir" in r.text
    assert os.listdir(tmp_path) == []


# ---- confine alone -------------------------------------------------------------------------------
ROOT = os.path.realpath(tempfile.mkdtemp(prefix="confine-"))
PARTS = st.sampled_from(["a", "b", "..", ".", "", "/", "//", "c d", "\u00e9", "..."])


@settings(max_examples=300, deadline=None)
@given(st.lists(PARTS, max_size=6).map("/".join) | st.text(max_size=30))
def test_confine_accepts_exactly_the_names_inside(name):
    """Whatever the name: the answer is under the root, or a ProfileError; and a name is
    refused only if it leaves the root (by ``..``, an absolute path or a NUL byte)."""
    inside = None
    if "\x00" not in name:
        joined = os.path.normpath(os.path.join(ROOT, name))
        inside = joined == ROOT or joined.startswith(ROOT + "/")
    try:
        got = confine(ROOT, name)
    except ProfileError:
        assert not inside, name
        return
    assert inside, name
    assert got == ROOT or got.startswith(ROOT + "/")


def test_confine_default_is_the_root():
    assert confine(ROOT, None) == confine(ROOT, "") == ROOT
