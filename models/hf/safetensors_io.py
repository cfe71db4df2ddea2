"""Reading ``*.safetensors`` checkpoints (single file or sharded with an index), lazily.

Tensors are memory-mapped, so a checkpoint costs no copy until a tensor is used. Every
failure names the file and, where one is involved, the tensor.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # block-scaled FP8 weights (fp8_blocks.py)
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # their scales as powers of two (DeepSeek V4's ue8m0)
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or does not match the model."""


def _read_header(path: str) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} > file size)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        self.header, self.data_start = _read_header(path)
        self.size = os.path.getsize(path)
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - begin != nbytes or self.data_start + end > self.size:
            raise CheckpointError(
                f"{self.path}: tensor {name} is truncated or corrupt "
                f"(needs {nbytes} bytes at {begin}..{end}, file has {self.size - self.data_start})"
            )
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.data_start + begin
        return self._mmap[start : start + nbytes].view(dtype).reshape(shape)


class Checkpoint:
    """All tensors of a Hugging Face checkpoint directory, by name."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from e
            files = sorted(set(weight_map.values()))
            self.files = {fn: SafetensorsFile(os.path.join(model_dir, fn)) for fn in files}
            self.where = {}
            for name, fn in weight_map.items():
                if name not in self.files[fn].header:
                    raise CheckpointError(
                        f"{os.path.join(model_dir, fn)}: tensor {name} listed in {index} is missing"
                    )
                self.where[name] = fn
        elif os.path.exists(single):
            f = SafetensorsFile(single)
            self.files = {"model.safetensors": f}
            self.where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            found = [n for n in os.listdir(model_dir) if n.endswith(".safetensors")]
            if len(found) == 1:
                f = SafetensorsFile(os.path.join(model_dir, found[0]))
                self.files = {found[0]: f}
                self.where = dict.fromkeys(f.keys(), found[0])
            else:
                raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self.model_dir = model_dir

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def file_of(self, name: str) -> str:
        fn = self.where.get(name)
        return os.path.join(self.model_dir, fn or "model.safetensors")

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        return self.files[self.where[name]].get(name)
