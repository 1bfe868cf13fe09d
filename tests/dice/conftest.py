"""Shared fixtures of the DICE tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread in every DICE test, as in the ranks: on a busy CI machine multi-threaded
    tiny ops crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
