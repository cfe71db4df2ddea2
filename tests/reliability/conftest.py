"""The reliability tests share ``tests/server``'s server process (one per session)."""

import pytest

from tests.server.conftest import shared_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    yield from shared_server(tmp_path_factory)
