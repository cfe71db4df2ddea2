"""Model identity in L3 keys: a checkpoint that differs from another in ONE weight value,
anywhere, never reads the other's L3 pages; an identical copy still does."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from hicache_jax.models import file_digest, orbax_io
from hicache_jax.models.fingerprint import checkpoint_fingerprint
from hicache_jax.models.hf.safetensors_io import SafetensorsFile
from hicache_jax.models.loader import load_hf, model_fingerprint
from tests.cache.l3_helpers import P, assert_same_as_recompute, hicache_llm, prompt, run, two_pass

OLD_SAMPLE = 64 << 10  # fingerprint v1 hashed four windows this long: start, 1/3, 2/3, end


def _old_windows(size: int) -> list[tuple[int, int]]:
    starts = [max(0, min(size - OLD_SAMPLE, int(frac * size))) for frac in (0.0, 1 / 3, 2 / 3, 1.0)]
    return [(s, s + OLD_SAMPLE) for s in starts]


def change_one_value(model_dir: str) -> tuple[str, int]:
    """Flip one float32 at ~40% of a tensor from the middle of the file, at a byte no window
    of the old sampled fingerprint covered. Returns (tensor name, file offset)."""
    path = os.path.join(model_dir, "model.safetensors")
    f = SafetensorsFile(path)
    windows = _old_windows(f.size)
    by_offset = sorted(f.header, key=lambda n: f.header[n]["data_offsets"][0])
    middle = by_offset[len(by_offset) // 3 :] + by_offset[: len(by_offset) // 3]  # mid-file first
    for name in middle:
        info = f.header[name]
        if info["dtype"] != "F32" or len(info["shape"]) != 2:
            continue
        begin, end = info["data_offsets"]
        count = (end - begin) // 4
        offset = f.data_start + begin + 4 * int(0.4 * count)
        if any(lo <= offset < hi for lo, hi in windows):
            continue
        with open(path, "r+b") as fh:
            fh.seek(offset)
            (old,) = struct.unpack("<f", fh.read(4))
            fh.seek(offset)
            fh.write(struct.pack("<f", -old - 1.0))
        return name, offset
    raise AssertionError("no mid-file tensor element outside the old sampled windows")


@pytest.fixture
def copies(checkpoint_dir, tmp_path):
    """(original, identical copy, copy with one value changed)."""
    src = checkpoint_dir("mistral")
    same, tuned = str(tmp_path / "same"), str(tmp_path / "tuned")
    shutil.copytree(src, same)
    shutil.copytree(src, tuned)
    change_one_value(tuned)
    return src, same, tuned


def test_one_changed_value_gets_no_storage_hits(copies, tmp_path):
    src, same, tuned = copies
    l3 = tmp_path / "l3"
    ids = prompt(seed=7)

    llm = hicache_llm(l3, model_path=src, dtype="float32")
    first, second = two_pass(llm, ids)  # fills L3, and shows it serves this prompt
    assert second["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P
    llm.close()

    llm = hicache_llm(l3, model_path=tuned, dtype="float32")
    out = run(llm, ids)
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 0, out["meta_info"]
    assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
    llm.close()

    llm = hicache_llm(l3, model_path=same, dtype="float32")
    out = run(llm, ids)
    assert out["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P, out["meta_info"]
    assert_same_as_recompute(out, first)
    llm.close()


def test_fingerprint_covers_every_byte_and_only_the_bytes(copies):
    src, same, tuned = copies
    assert checkpoint_fingerprint(same) == checkpoint_fingerprint(src)
    assert checkpoint_fingerprint(tuned) != checkpoint_fingerprint(src)
    assert model_fingerprint(tuned) == checkpoint_fingerprint(tuned)


def test_remembered_digest_is_reused_until_the_file_changes(copies, monkeypatch):
    _, same, _ = copies
    hashed = []
    real_hash = file_digest.hash_file
    monkeypatch.setattr(file_digest, "hash_file", lambda p, *a: hashed.append(p) or real_hash(p, *a))
    file_digest.forget(same)
    fp = checkpoint_fingerprint(same)
    assert len(hashed) == 1 and os.path.isfile(os.path.join(same, file_digest.SIDECAR))
    file_digest.forget()  # as a new process would: only the sidecar remembers
    assert checkpoint_fingerprint(same) == fp and len(hashed) == 1

    # Change one value, then put the old mtime back: the ctime still moves, so it is rehashed.
    path = os.path.join(same, "model.safetensors")
    st = os.stat(path)
    change_one_value(same)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    file_digest.forget()
    assert checkpoint_fingerprint(same) != fp and len(hashed) == 2


def test_unwritable_checkpoint_dir_remembers_in_the_user_cache(copies, monkeypatch, tmp_path):
    _, same, _ = copies
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    file_digest.forget(same)
    os.mkdir(os.path.join(same, file_digest.SIDECAR))  # the sidecar cannot be written there
    fp = checkpoint_fingerprint(same)
    cached = [n for _, _, names in os.walk(tmp_path / "cache") for n in names]
    assert len(cached) == 1, cached
    hashed = []
    real_hash = file_digest.hash_file
    monkeypatch.setattr(file_digest, "hash_file", lambda p, *a: hashed.append(p) or real_hash(p, *a))
    file_digest.forget()
    assert checkpoint_fingerprint(same) == fp and not hashed


def test_orbax_checkpoint_carries_its_source_fingerprint(copies, tmp_path):
    src, _, tuned = copies
    for source, out in ((src, str(tmp_path / "orbax")), (tuned, str(tmp_path / "orbax_tuned"))):
        orbax_io.save(load_hf(source), out, source=source)
        assert model_fingerprint(out) == checkpoint_fingerprint(source)
    assert model_fingerprint(str(tmp_path / "orbax")) != model_fingerprint(str(tmp_path / "orbax_tuned"))

    # A checkpoint converted under the old sampled fingerprint is not trusted: no fingerprint,
    # so the engine keys L3 by a hash of the restored parameters instead.
    meta_path = os.path.join(tmp_path / "orbax", orbax_io.META)
    with open(meta_path) as f:
        meta = json.load(f)
    meta.pop("fingerprint_version")
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert model_fingerprint(str(tmp_path / "orbax")) is None


def test_change_one_value_really_lands_outside_the_old_windows(copies):
    """The fixture's premise: the changed byte is one the old scheme never read."""
    src, _, tuned = copies
    a = np.fromfile(os.path.join(src, "model.safetensors"), np.uint8)
    b = np.fromfile(os.path.join(tuned, "model.safetensors"), np.uint8)
    diff = np.flatnonzero(a != b)
    assert 1 <= diff.size <= 4
    assert not any(lo <= d < hi for d in diff for lo, hi in _old_windows(a.size))
