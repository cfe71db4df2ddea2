"""A SeaweedFS S3 server for the L3 tests that need a real object store (one per session)."""

import pytest

from tests.reliability.weed import Weed, require_weed


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """A running ``weed server`` with S3 and one bucket; fails (never skips) without weed."""
    require_weed()
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ACCESS_KEY_ID", "hicache-test")  # any key: weed runs without auth
    mp.setenv("AWS_SECRET_ACCESS_KEY", "hicache-test")
    server = Weed(str(tmp_path_factory.mktemp("weed")))
    yield server
    server.kill()
    mp.undo()
