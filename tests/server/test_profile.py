"""``/start_profile`` and ``/stop_profile`` on the shared tiny server: the trace files appear
where asked, with the model's named scopes in them, and misuse is a 400, not a crash."""

from __future__ import annotations

import glob
import gzip
import os


def _trace_files(out_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "plugins", "profile", "*", "*")))


def test_profile_captures_a_trace(server, tmp_path):
    out = str(tmp_path / "trace")
    prompt = {"text": "profile me", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    server.generate(**prompt)  # compiled before the trace: it records steps, not compiles
    r = server.client.post("/start_profile", json={"output_dir": out})
    assert r.status_code == 200, r.text
    again = server.client.post("/start_profile", json={"output_dir": out})
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


def test_profile_num_steps_stops_by_itself(server, tmp_path):
    out = str(tmp_path / "steps")
    r = server.client.post("/start_profile", json={"output_dir": out, "num_steps": 1})
    assert r.status_code == 200, r.text
    server.generate(text="one step", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert server.client.post("/stop_profile").status_code == 400  # it stopped after its step
    assert any(f.endswith(".xplane.pb") for f in _trace_files(out))


def test_profile_bad_body(server):
    r = server.client.post("/start_profile", json={"num_steps": 0})
    assert r.status_code == 400 and "num_steps" in r.text
    r = server.client.post("/start_profile", json={"output_dirr": "/tmp/x"})
    assert r.status_code == 400 and "output_dirr" in r.text
