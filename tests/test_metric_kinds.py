"""``Metrics``: kinds travel with the numbers through copies, prefixes and updates."""

import logging

from hicache_jax.metric_kinds import COUNTER, GAUGE, Metrics
from hicache_jax.server import metrics as exporter


def test_kinds_follow_their_keys():
    inner = Metrics().counters({"writes": 3}).gauges({"pending_writes": 1})
    out = Metrics().counters({"steps": 0}).add(inner, prefix="l3_")
    out["steps"] += 2  # item assignment keeps the declared kind
    copy = out.copy()
    copy.gauges({"num_running_reqs": 4})
    assert out == {"steps": 2, "l3_writes": 3, "l3_pending_writes": 1}
    assert copy.kinds == {
        "steps": COUNTER,
        "l3_writes": COUNTER,
        "l3_pending_writes": GAUGE,
        "num_running_reqs": GAUGE,
    }
    assert "num_running_reqs" not in out.kinds  # the copy is its own
    assert out.undeclared() == []


def test_a_number_nobody_declared_goes_out_untyped_and_is_named(caplog):
    out = Metrics().counters({"steps": 1}).add({"new_thing": 1.5})  # a plain dict declares nothing
    assert out.undeclared() == ["new_thing"]
    out["other"] = 2
    assert out.undeclared() == ["new_thing", "other"]
    with caplog.at_level(logging.WARNING):
        text = exporter.render(out).decode()
    assert "# TYPE hicache_new_thing untyped" in text and "# TYPE hicache_other untyped" in text
    assert "# TYPE hicache_steps_total counter" in text, "a declared kind is kept"
    assert "['new_thing', 'other']" in caplog.text
