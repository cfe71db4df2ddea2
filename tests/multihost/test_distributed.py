"""The multi-host flags are checked where they are parsed. Two processes serving one model
through the server binary: ``tests/server/test_multihost.py``."""

import pytest

from hicache_jax.config import ConfigError, EngineConfig


def test_dist_flags_are_checked():
    with pytest.raises(ConfigError, match="dist_coordinator=None: must be set"):
        EngineConfig(dist_num_processes=2)
    with pytest.raises(ConfigError, match=r"dist_process_id=2: must be in \[0, dist_num_processes=2\)"):
        EngineConfig(dist_coordinator="127.0.0.1:1", dist_num_processes=2, dist_process_id=2)
