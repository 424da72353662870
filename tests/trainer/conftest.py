"""Fixtures of the trainer's tests."""

import pytest

from megatron_dapo.queue import TransferQueue
from megatron_dapo.trainer.queue_trainer import TRAIN


@pytest.fixture
def queue(tmp_path):
    """An empty TransferQueue in the test's directory, with the trainer's partition."""
    q = TransferQueue(tmp_path / "q.sqlite")
    q.create_partition(TRAIN)
    yield q
    q.close()
