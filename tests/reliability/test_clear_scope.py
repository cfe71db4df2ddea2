"""Finding 1 of issue 39, reproduced through the engine: ``clear_storage`` deleted every file
under the store's path. Now it deletes this server's pages only (every tenant of its model),
another model's pages only when asked for all namespaces, and never a file it did not write."""

from __future__ import annotations

from tests.cache.l3_helpers import P, assert_same_as_recompute, prompt, run
from tests.reliability.conftest import kv_keys


def _storage_hit(out) -> int:
    return out["meta_info"]["cached_tokens_details"]["storage"]


def test_clear_storage_keeps_a_users_files_and_other_models_pages(make_llm, tmp_path):
    spec = tmp_path / "l3"
    note = spec / "userdata" / "notes.txt"
    note.parent.mkdir(parents=True)
    note.write_text("x\n")
    mine, other = make_llm(spec), make_llm(spec, random_seed=1)  # two models on one store
    ids = prompt(seed=41)
    first = run(mine, ids)
    run(other, ids)
    for llm in (mine, other):
        assert llm.flush_cache().success  # L1 and L2 empty; the pages are in L3
    store = mine.engine.storage.client.store
    my_pages, other_pages = kv_keys(mine, ids), kv_keys(other, ids)
    assert all(store.exists(my_pages + other_pages))

    assert mine.engine.clear_storage() is True
    assert note.read_text() == "x\n"
    assert not any(store.exists(my_pages)) and all(store.exists(other_pages))
    again = run(mine, ids)
    assert _storage_hit(again) == 0  # its pages are gone ...
    assert_same_as_recompute(again, first)
    assert _storage_hit(run(other, ids)) >= len(ids) - P  # ... the other model's serve on

    assert mine.flush_cache().success and other.flush_cache().success
    assert mine.engine.clear_storage(all_namespaces=True) is True
    assert not any(store.exists(my_pages + other_pages))
    assert note.read_text() == "x\n"
