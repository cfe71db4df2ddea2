"""Mooncake-format traces (``hicache_jax/bench/traces.py``): what the generator writes passes an
independent format check, and the reader names the first line that breaks the format.

The format, as Mooncake's traces and the hashers that make them define it: a line's
``hash_ids`` are a rolling hash over its prompt's 512-token blocks, so a line has
``ceil(input_length / 512)`` ids, an id stands for one content (the same length, at the
same position, after the same id), every block but a prompt's last is full, and a last
partial block's id is not reused by a longer prompt extending it."""

import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.bench import traces

B = traces.MOONCAKE_BLOCK_TOKENS
CHECKED_IN = os.path.join(
    os.path.dirname(__file__), "..", "..", "benchmarks", "traces", "conversations_small.jsonl"
)


def check_format(lines: list[dict]) -> None:
    """The format check, written apart from the reader: asserts on the first breach."""
    content: dict[int, tuple[int, int, int | None]] = {}  # id -> (position, length, previous id)
    uses: dict[int, int] = {}
    for n, d in enumerate(lines, 1):
        ids, length = d["hash_ids"], d["input_length"]
        assert len(ids) == math.ceil(length / B), f"line {n}: {len(ids)} ids for {length} tokens"
        for i, h in enumerate(ids):
            block = (i, min(B, length - i * B), ids[i - 1] if i else None)
            assert content.setdefault(h, block) == block, f"line {n}: id {h} is {block}, was {content[h]}"
            uses[h] = uses.get(h, 0) + 1
    for h, (_, length, _) in content.items():
        assert length == B or uses[h] == 1, f"id {h}: a {length}-token block used {uses[h]} times"


conversations = st.fixed_dictionaries(
    {
        "sessions": st.integers(1, 6),
        "turns": st.integers(1, 6),
        "seed": st.integers(0, 2**16),
        "system_blocks": st.integers(1, 4),
        "num_systems": st.integers(1, 3),
        "turn_blocks": st.tuples(st.integers(1, 3), st.integers(3, 6)),
        "reply_tokens": st.tuples(st.integers(1, 600), st.integers(600, 1500)),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations)
def test_generated_traces_are_valid(tmp_path, conv):
    path = str(tmp_path / "trace.jsonl")
    traces.write_trace(path, traces.synth_conversations(**conv))
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == conv["sessions"] * conv["turns"]
    check_format(lines)
    assert len(traces.read_trace(path)) == len(lines)

    # One session: each turn's prompt extends the previous prompt and its reply, and shares
    # the previous prompt's full blocks.
    one = list(traces.synth_conversations(**{**conv, "sessions": 1}))
    for prev, cur in zip(one, one[1:]):
        assert cur["input_length"] > prev["input_length"] + prev["output_length"]
        full = prev["input_length"] // B
        assert cur["hash_ids"][:full] == prev["hash_ids"][:full]
        if prev["input_length"] % B:
            assert prev["hash_ids"][-1] not in cur["hash_ids"]


def test_checked_in_trace_is_what_the_generator_writes(tmp_path):
    out = str(tmp_path / "t.jsonl")
    traces.main(["--out", out])
    with open(out) as f, open(CHECKED_IN) as g:
        assert f.read() == g.read()
    with open(CHECKED_IN) as f:
        check_format([json.loads(line) for line in f])


def _write(tmp_path, lines: list[dict | str]) -> str:
    path = str(tmp_path / "broken.jsonl")
    with open(path, "w") as f:
        for d in lines:
            f.write((d if isinstance(d, str) else json.dumps(d)) + "\n")
    return path


def _line(length: int, ids: list[int]) -> dict:
    return {"timestamp": 0, "input_length": length, "output_length": 8, "hash_ids": ids}


def test_reader_names_the_first_line_reusing_a_partial_block(tmp_path):
    path = _write(
        tmp_path,
        [
            _line(2 * B + 23, [0, 1, 2]),  # id 2: a 23-token block
            "",
            _line(B + 5, [0, 3]),
            _line(3 * B + 40, [0, 1, 2, 4]),  # line 4: id 2 as a full block
            _line(2 * B + 1, [0, 3, 5]),  # line 5: id 3 again at another length
        ],
    )
    with pytest.raises(
        traces.TraceError, match=rf":4: hash_id 2 is a block of {B} tokens here but of 23 tokens at line 1"
    ):
        traces.read_trace(path)
    assert len(traces.read_trace(path, max_requests=2)) == 2  # the lines before it are fine


def test_reader_checks_the_number_of_blocks(tmp_path):
    path = _write(tmp_path, [_line(B, [0]), _line(B + 1, [1])])
    with pytest.raises(
        traces.TraceError, match=rf":2: 1 hash_ids for input_length {B + 1}, {B}-token blocks need 2"
    ):
        traces.read_trace(path)
    # A replay that reads the trace in other units checks in those units.
    assert len(traces.read_trace(path, block_size=B + 1)) == 2
