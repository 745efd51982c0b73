"""The serving tests run torch on one thread: on a shared 2-core machine, intra-op threads of
tiny matmuls fight each other and slow these tests several-fold."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
