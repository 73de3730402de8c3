"""Pipeline tests describe single-process stages in this process (multi-rank ones spawn their own
ranks): a one-rank group another test file left behind must not turn them into a 1-rank grid."""
import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_in_this_process():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    yield
