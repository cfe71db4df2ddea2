"""``--model_path=org/name`` through the Hub cache, offline: a cache laid out as
``huggingface_hub`` lays it out (``models--org--name/refs/<ref>`` naming a commit,
``snapshots/<commit>/...``) under ``HF_HOME``, read with ``HF_HUB_OFFLINE=1``. A subprocess,
because huggingface_hub reads those variables when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hicache_jax import hub
from hicache_jax.flags import FlagError, parse
from tests.waits import wait

MAIN, V2 = "a" * 40, "b" * 40

SCRIPT = """
import json, sys
from hicache_jax.hub import resolve_model_path
out = {}
for name, rev in json.loads(sys.argv[1]):
    try:
        out[f"{name}@{rev}"] = resolve_model_path(name, rev)
    except OSError as e:
        out[f"{name}@{rev}"] = "error: " + str(e)
print(json.dumps(out))
"""


def _snapshot(cache: str, repo: str, commit: str, files: dict[str, str], ref: str | None = None) -> str:
    root = os.path.join(cache, "hub", "models--" + repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(snap, name), "w") as f:
            f.write(text)
    if ref:
        os.makedirs(os.path.join(root, "refs"), exist_ok=True)
        with open(os.path.join(root, "refs", ref), "w") as f:
            f.write(commit)
    return snap


def test_model_id_from_offline_hub_cache(tmp_path):
    home = str(tmp_path / "hf")
    main = _snapshot(home, "org/tiny", MAIN, {"config.json": '{"v": 1}', "tokenizer.json": "{}"}, ref="main")
    v2 = _snapshot(home, "org/tiny", V2, {"config.json": '{"v": 2}'}, ref="v2")
    local = tmp_path / "org" / "tiny"  # a directory of the same name ...
    local.mkdir(parents=True)
    asks = [
        ["org/tiny", None],
        ["org/tiny", "v2"],
        ["org/tiny", V2],
        ["org/missing", None],
        ["org/tiny", "v3"],
    ]
    env = dict(os.environ, HF_HOME=home, HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(asks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=wait(60),
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["org/tiny@None"] == main
    assert got["org/tiny@v2"] == v2 and got[f"org/tiny@{V2}"] == v2
    with open(os.path.join(got["org/tiny@v2"], "config.json")) as f:
        assert json.load(f) == {"v": 2}
    for key in ("org/missing@None", "org/tiny@v3"):
        err = got[key]
        assert err.startswith("error: --model_path=org/") and "HF_HUB_OFFLINE is set" in err, err
        assert "\n" not in err
    # ... wins over the Hub when it exists (relative to the working directory)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([["org/tiny", None]])],
        env=env,
        capture_output=True,
        text=True,
        timeout=wait(60),
        cwd=str(tmp_path),
    )
    assert json.loads(run.stdout)["org/tiny@None"] == "org/tiny"


def _raising(exc_type):
    def fake(*args, **kwargs):
        e = exc_type.__new__(exc_type)  # the Hub's answer, without an HTTP response behind it
        Exception.__init__(e, "401 Client Error")
        raise e

    return fake


@pytest.mark.parametrize(
    ("error", "says"),
    [("GatedRepoError", "is gated"), ("RepositoryNotFoundError", "not found on the Hugging Face Hub")],
)
def test_hub_refusals_are_one_clear_line(monkeypatch, error, says):
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(getattr(errors, error)))
    hub._snapshot.cache_clear()
    with pytest.raises(hub.ModelNotFound) as info:
        hub.resolve_model_path("meta-llama/Secret-7B")
    msg = str(info.value)
    assert msg.startswith("--model_path=meta-llama/Secret-7B: model ") and says in msg and "\n" not in msg
    assert "HF_TOKEN" in msg


def test_flags_accept_model_ids_and_refuse_missing_paths():
    cfg, _ = parse(["serve", "--model_path=org/name", "--revision=v1"])
    assert (cfg.model_path, cfg.revision) == ("org/name", "v1")
    for bad in ("./no/such/dir", "/no/such/dir", "a/b/c"):
        with pytest.raises(FlagError, match="no such directory, and not a Hugging Face model id"):
            parse(["serve", f"--model_path={bad}"])
