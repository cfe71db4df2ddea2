"""Flags -> configs, and start-up refusing bad flags with one line naming the flag."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import subprocess
import sys

import pytest
from absl import flags

from hicache_jax import flags as server_flags
from hicache_jax.config import EngineConfig
from tests.server.conftest import ROOT, server_env
from tests.waits import wait

FLAGFILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.flags")))


@pytest.mark.parametrize("flagfile", FLAGFILES)
def test_every_flagfile_parses(flagfile, monkeypatch):
    monkeypatch.chdir(ROOT)
    engine_cfg, server_cfg = server_flags.parse(["serve", f"--flagfile={flagfile}"])
    assert server_cfg.host == "127.0.0.1"  # no shipped config opens the server to the network


def test_flagfiles_combine_and_later_flags_win(monkeypatch):
    monkeypatch.chdir(ROOT)
    e, s = server_flags.parse(
        [
            "serve",
            "--flagfile=configs/tpu.flags",
            "--flagfile=configs/bamba.flags",
            "--page_size=32",
            "--port=8",
        ]
    )
    assert (e.preset, e.attention_backend, e.page_size, s.platform, s.port) == (
        "tiny-mamba",
        "pallas",
        32,
        "tpu",
        8,
    )


def test_every_engine_field_is_a_flag():
    fv = flags.FlagValues()
    server_flags.define_flags(fv)
    for f in dataclasses.fields(EngineConfig):
        assert f.name in fv, f.name
    e, _ = server_flags.parse(["serve"])
    assert e == EngineConfig()  # flag defaults are the config's defaults


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--page_size=3"], "--page_size=3"),
        (["--chunked_prefill_size=24"], "--chunked_prefill_size"),
        (["--hicache_storage_backend=tensorstore"], "--enable_hierarchical_cache"),
        (["--enable_hierarchical_cache", "--disable_radix_cache"], "--disable_radix_cache"),
        (["--hicache_write_policy=sometimes"], "--hicache_write_policy"),
        (["--hicache_storage_evict_ratio=0"], "--hicache_storage_evict_ratio"),
        (["--hicache_storage_max_gb=-1"], "--hicache_storage_max_gb"),
        (["--hicache_storage_spec=/tmp/x"], "--hicache_storage_backend"),
        (["--port=70000"], "--port"),
        (["--api_key= "], "--api_key"),
        (["--log_level=loud"], "--log_level"),
        (["--page_size=abc"], "--page_size"),
        (["--no_such_flag=1"], "no_such_flag"),
        (["--model_path=/no/such/dir"], "--model_path"),
    ],
)
def test_bad_flags_name_the_flag(argv, named):
    with pytest.raises(server_flags.FlagError, match=named.replace("-", r"\-")):
        server_flags.parse(["serve", *argv])


def test_storage_spec_can_be_unset_on_the_command_line(monkeypatch):
    monkeypatch.chdir(ROOT)
    e, _ = server_flags.parse(
        [
            "serve",
            "--flagfile=configs/hicache_l3_cpu.flags",
            "--hicache_storage_backend=",
            "--hicache_storage_spec=",
        ]
    )
    assert e.hicache_storage_backend is None and e.hicache_storage_spec is None


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--flagfile=configs/cpu.flags", "--page_size=3"], "--page_size=3"),
        (["--hicache_storage_backend=tensorstore"], "--enable_hierarchical_cache"),
        (["--bogus"], "bogus"),
        (["--preset=huge"], "huge"),  # found when the engine is built: still one clean line
    ],
)
def test_binary_stops_with_one_line(argv, named):
    cmd = [sys.executable, "-m", "hicache_jax.serve", "--platform=cpu", *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=wait(120), env=server_env())
    assert r.returncode != 0
    assert named in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        ([], logging.INFO),
        (["--log_level=error"], logging.ERROR),
        (["-v=1"], logging.DEBUG),
        (["--log_level=error", "--verbosity=0"], logging.INFO),
        (["-v=-1"], logging.WARNING),
    ],
)
def test_absl_verbosity_wins_when_given(argv, level):
    from hicache_jax.serve import python_log_level

    fv = flags.FlagValues()
    server_flags.define_flags(fv)
    flags.DEFINE_integer("verbosity", -1, "absl's", short_name="v", flag_values=fv)
    fv(["serve", *argv])
    assert python_log_level(fv, fv["log_level"].value) == level
