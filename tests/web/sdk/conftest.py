"""One loopback server over the small test worlds, shared by the gym, record and rollout tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.web.conftest import serving_in_thread
from web.server import Server


@pytest.fixture(scope="package")
def server(worlds) -> Iterator[Server]:
    # 9 sessions batch together: a vector env of 8 plus the env it is compared with
    with serving_in_thread(worlds, debug_hooks=True, max_batch=8, max_sessions=32) as server:
        yield server
