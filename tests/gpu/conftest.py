import pytest
import torch


@pytest.fixture(autouse=True)
def _sync():
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
