"""The flag table of docs/flags.md is generated from the config fields, and says what ``--helpfull`` says:
one row per flag that exists, each row's meaning that flag's absl help."""

import collections
import dataclasses
import re

import pytest
from absl import flags

from hicache_jax import flag_table
from hicache_jax.config import EngineConfig
from hicache_jax.flags import define_flags
from hicache_jax.server.config import ServerConfig

FIX = "docs/flags.md's flag table is stale: run `python -m hicache_jax.flag_table --write`"


def doc_rows() -> list[tuple[str, str, str]]:
    """(flag name, default, meaning) for each row of docs/flags.md's marked table."""
    with open(flag_table.FLAGS_DOC, encoding="utf-8") as fh:
        block = flag_table.marked_block(fh.read())
    rows = []
    for line in block.splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [flag_table.uncell(c.strip()) for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 3, line
        name = re.fullmatch(r"`--(\w+)`", cells[0])
        assert name, line
        rows.append((name.group(1), cells[1], cells[2]))
    return rows


@pytest.fixture(scope="module")
def fv():
    fv = flags.FlagValues()  # fresh: only the flags define_flags defines
    define_flags(fv)
    return fv


def test_doc_table_is_generated():
    with open(flag_table.FLAGS_DOC, encoding="utf-8") as fh:
        assert flag_table.marked_block(fh.read()) == flag_table.block(), FIX


def test_one_row_per_flag_and_no_other(fv):
    counts = collections.Counter(name for name, _, _ in doc_rows())
    assert set(counts) == set(fv), FIX
    assert [name for name, n in counts.items() if n > 1] == []


def test_each_row_says_what_helpfull_says(fv):
    for name, _, meaning in doc_rows():
        assert name in fv and meaning == fv[name].help, f"--{name}: {FIX}"


def test_every_field_has_help_and_a_shown_default():
    for f in [*dataclasses.fields(EngineConfig), *dataclasses.fields(ServerConfig)]:
        assert f.metadata.get("help", "").strip(), f.name
        assert flag_table.default_text(f).strip(), f.name


def test_cells_survive_markdown():
    text = "a | b <key> c"
    assert flag_table.uncell(flag_table.cell(text)) == text
    assert re.split(r"(?<!\\)\|", flag_table.cell(text)) == [flag_table.cell(text)]


def test_write_rewrites_only_the_block(tmp_path):
    path = tmp_path / "flags.md"
    stale = f"before\n{flag_table.BEGIN}\n| `--gone` | 1 | old |\n{flag_table.END}\nafter\n"
    path.write_text(stale, encoding="utf-8")
    assert flag_table.write(str(path))
    assert path.read_text(encoding="utf-8") == f"before\n{flag_table.block()}\nafter\n"
    assert not flag_table.write(str(path))
