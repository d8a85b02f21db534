"""GPS tests run torch single-threaded: on a loaded 2-core box torch's intra-op thread pool makes even a
small `torch.full` take tens of ms, which would dominate (and time-skew) the I/O being tested."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_threaded_torch():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
