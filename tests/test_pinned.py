"""The pinned host buffers a draft's held prompts reuse (runtime.layer.pinned), on the CPU: pinning
itself needs a GPU build, so the pool allocates plain host memory here."""

import pytest
import torch

from kvtool.runtime.layer import pinned


@pytest.fixture
def pool(monkeypatch):
    allocated = []

    def allocate(nbytes):
        allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pinned.PinnedPool, "_allocate", staticmethod(allocate))
    pool = pinned.PinnedPool()
    pool.allocated = allocated
    return pool


def test_a_draft_reuses_the_last_drafts_buffers(pool):
    cpu = torch.device("cpu")
    shape = torch.Size([2, 3, 40, 8])
    first = [pool.take(shape, torch.bfloat16) for _ in range(4)]
    assert all(t.shape == shape and t.dtype == torch.bfloat16 for t in first)
    first[0].fill_(1.5)
    assert pool.allocated == [2 * 3 * 40 * 8 * 2] * 4 and pool.free_bytes == 0
    pool.give_back(first, cpu)
    assert pool.free_bytes == 4 * 3840
    again = [pool.take(shape, torch.bfloat16) for _ in range(4)]
    assert len(pool.allocated) == 4  # nothing new
    assert {t.untyped_storage().data_ptr() for t in again} == {t.untyped_storage().data_ptr() for t in first}
    # A shorter prompt fits in the same buffers (within SLACK), a much shorter or a longer one does not.
    pool.give_back(again, cpu)
    assert pool.take(torch.Size([2, 3, 25, 8]), torch.bfloat16).shape == (2, 3, 25, 8)
    assert len(pool.allocated) == 4
    pool.take(torch.Size([2, 3, 10, 8]), torch.bfloat16)
    pool.take(torch.Size([2, 3, 41, 8]), torch.bfloat16)
    assert len(pool.allocated) == 6


def test_the_pool_holds_what_the_last_draft_held_no_more(pool):
    cpu = torch.device("cpu")
    small = [pool.take(torch.Size([100]), torch.float32) for _ in range(3)]
    pool.give_back(small, cpu)
    large = [pool.take(torch.Size([1000]), torch.float32)]  # none of the small ones fit
    pool.give_back(large, cpu)
    assert pool.free_bytes == 4000  # the small ones were let go
    pool.clear()
    assert pool.free_bytes == 0
