"""The training loop's input pipeline (``train.feed``): collated one step ahead on a thread, the same rows in the same
order as collating on the loop's thread, failures raised where the loop asks."""

from __future__ import annotations

import threading

import pytest
import torch

from distill.data import TokenBlockDataset, collate
from train.feed import StepFeed
from train.loop import BatchOrder


def _dataset(n: int = 24, T: int = 8) -> TokenBlockDataset:
    ids = torch.arange(n * T).view(n, T)
    ones = torch.ones(n, T, dtype=torch.long)
    return TokenBlockDataset(ids, ones, ones.bool())


def test_the_feed_gives_each_step_the_rows_the_batch_order_names():
    data, accum, world, rank = _dataset(), 2, 2, 1
    numbers = lambda s: range((s * world + rank) * accum, (s * world + rank + 1) * accum)
    reference = BatchOrder(len(data), 3, seed=7)
    with StepFeed(data, collate, BatchOrder(len(data), 3, seed=7).indices, numbers, torch.device("cpu"), 6) as feed:
        for step in range(2, 6):  # a resumed run starts past step 0
            batches, waited = feed.get(step)
            assert waited >= 0 and len(batches) == accum
            for number, batch in zip(numbers(step), batches):
                expected = collate([data[i] for i in reference.indices(number)])
                assert torch.equal(batch["input_ids"], expected["input_ids"])


def test_the_next_step_is_collated_on_the_feed_thread_while_the_loop_runs():
    threads = []

    def collate_here(items):
        threads.append(threading.current_thread().name)
        return collate(items)

    data = _dataset()
    with StepFeed(data, collate_here, BatchOrder(len(data), 2, 0).indices, lambda s: [s], torch.device("cpu"),
                  3) as feed:
        feed.get(0)
        feed.get(1)
    assert threads and all(name.startswith("specdraft-feed") for name in threads)


def test_a_collation_error_is_raised_on_the_loop_thread_at_its_step():
    def broken(items):
        raise ValueError("a row is malformed")

    data = _dataset()
    with StepFeed(data, broken, BatchOrder(len(data), 2, 0).indices, lambda s: [s], torch.device("cpu"), 3) as feed:
        with pytest.raises(ValueError, match="a row is malformed"):
            feed.get(0)
