"""HBM bytes a compiled TPU program moves, read from its scheduled HLO.

``cost_analysis()["bytes accessed"]`` sums every operand and result of every op, wherever
it lives. After XLA:TPU's memory-space assignment many live in VMEM: a weight prefetched
into VMEM counts three times (the copy's read and write, then the matmul's read), and so
a decode step, which reads little but its weights, shows about 2.5x its floor with no
byte moved twice in HBM. This count keeps only what lies in HBM (memory space 0, shapes
without ``S(n)`` in their layout), per instruction of the entry computation:

- a fusion or other op: its HBM operands read and its HBM results written, whole (a fusion
  that reads a slice of an operand is counted as reading all of it, an upper bound);
- a scatter or dynamic-update-slice fusion (XLA names fusions by their root), which
  updates its first operand in place: its other operands, read and then written;
- an async copy (``copy-start``): its source read and its destination written, where each
  is in HBM; an async slice (``slice-start``, which XLA uses to prefetch a weight into VMEM
  in parts): the slice read from its HBM source, and written where it is in HBM;
- a gather fusion (``gather_fusion``: its table, then the indices): the rows it gathers
  read from the table (as many bytes as it writes), its other operands whole;
- a Pallas kernel (``tpu_custom_call``): the bytes its ``pl.CostEstimate`` declares (its
  operands are whole page pools that it reads a few pages of, by DMA);
- bitcasts, tuples, parameters, constants and the ``-done`` halves move nothing.

Conditionals are counted once, as their operands and results, and loops (``while``) not at
all; neither's body is walked. A loop updates its carried buffers in place, and the serving
step's loops run per item of work, usually none: the recurrent-state copies (one slot read
and written per copy, ``runner.copy_states``) and the sampler's reference cuts (only for
rows the candidates cannot settle). A conditional with a branch that hands its operands on
unchanged (its root a tuple of its parameters: XLA aliases them, nothing moves) counts as
nothing: those are the serving step's skips, penalties for a batch without any
(``runtime/penalties.py``), taken every step such a batch runs; with a penalty the step moves those
rows and counts besides. The other conditional is the sampler's draw, a few rows of the
vocabulary.
"""

from __future__ import annotations

import json
import re

import numpy as np

FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all"}
FREE |= {"copy-done", "slice-done"}  # their -start halves count the bytes
FREE |= {"while"}  # in place, per item of work (the module docstring)
_ITEM = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEM |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"\s*(?:ROOT )?(%[\w.-]+) = (.*?) ([\w-]+)\((.*)$")
_IN_PLACE = re.compile(r"scatter|dynamic.update.slice")  # fusions XLA names by their root
_GATHER = re.compile(r"^%gather_fusion")
_COST = re.compile(r'\\?"cost_estimate\\?":\s*(\{[^}]*\})')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _arrays(shape_text: str) -> list[tuple[float, bool]]:
    """``(bytes, in_hbm)`` of each array in a (possibly tuple) shape."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape_text):
        if dtype not in _ITEM:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((n * _ITEM[dtype], "S(" not in (layout or "")))
    return out


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction: the ``%names`` before its attributes."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%[\w.-]+", rest[:end])


def _passes_through(text: str, computation: str) -> bool:
    """Whether ``computation`` returns its parameters unchanged (a tuple of them, or of the
    elements of a tuple parameter)."""
    start = text.find(f"\n{computation} ")
    if start < 0:
        return False
    body = text[start : text.find("\n}", start)]
    params, root = set(), None
    for line in body.splitlines()[1:]:
        m = _LINE.match(line)
        if not m:
            continue
        name, _, op, rest = m.groups()
        if op == "parameter" or (op == "get-tuple-element" and set(_operands(rest)) <= params):
            params.add(name)
        if line.lstrip().startswith("ROOT"):
            root = (op, _operands(rest))
    if root is None:
        return False
    op, operands = root
    return (op == "tuple" and set(operands) <= params) or (op == "parameter")


def hbm_bytes(compiled) -> float:
    """HBM bytes read and written by one run of ``compiled`` (the module docstring's count)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    shapes: dict[str, str] = {}
    total = 0.0
    for line in entry.splitlines()[1:]:
        m = _LINE.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in FREE:
            continue
        if op == "custom-call" and "tpu_custom_call" in rest:
            cost = _COST.search(rest)
            if cost:
                total += float(json.loads(cost.group(1).replace('\\"', '"')).get("bytes_accessed", 0))
                continue
        if op in ("copy-start", "slice-start"):
            src = sum(b for b, hbm in _arrays(shapes.get(_operands(rest)[0], "")) if hbm)
            # copy-start gives (destination, source, context); slice-start ((source), destination, context)
            parts = _arrays(shape)
            dst = parts[0] if op == "copy-start" else parts[1]
            if op == "slice-start":
                src = dst[0] if src else 0  # reads the slice only
            total += src + (dst[0] if dst[1] else 0)
            continue
        if op == "conditional":
            branches = _BRANCHES.search(rest)
            names = re.findall(r"%[\w.-]+", branches.group(1)) if branches else []
            if any(_passes_through(text, b) for b in names):
                continue
        hbm_in = [sum(b for b, hbm in _arrays(shapes.get(o, "")) if hbm) for o in _operands(rest)]
        if _GATHER.match(name) and hbm_in:
            hbm_in[0] = min(hbm_in[0], sum(b for b, _ in _arrays(shape)))  # the rows gathered
        if _IN_PLACE.search(name) and hbm_in:  # updates the first operand where it lies
            total += 2 * sum(hbm_in[1:])
            continue
        total += sum(hbm_in) + sum(b for b, hbm in _arrays(shape) if hbm)
    return total


def in_vmem(compiled, shapes: set[tuple[int, ...]]) -> list[str]:
    """Entry instructions of ``compiled`` that place an array of one of ``shapes`` in VMEM
    (memory space 1): for the page and state pools, which kernels read a few pages of by DMA
    and which must stay in HBM (``models/kernels/vmem.in_hbm``)."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    found = []
    for line in entry.splitlines()[1:]:
        m = _LINE.match(line)
        if not m:
            continue
        for _, dims, layout in _ARRAY.findall(m.group(2)):
            if "S(1)" in (layout or "") and tuple(int(d) for d in dims.split(",") if d) in shapes:
                found.append(m.group(1))
                break
    return found
