import pytest

from tests.runs import build_shards


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Tiny one-sample-per-shard token shards for the trainer's tests (see tests/runs.py)."""
    return build_shards(tmp_path_factory)
