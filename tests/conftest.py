"""Shared fixtures: tiny checkpoints are written once per test session (they take about a second each)."""
import os

import pytest
import torch

import dspark

if os.environ.get("PYTEST_XDIST_WORKER"):   # one thread per xdist worker: 2 workers x 2 threads thrash 2 cores
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # and for the servers and ranks a test starts as subprocesses


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    "A `tiny` checkpoint in the official layout, fp32, with a DSpark drafter under mtp.*."
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    return dspark.load_target(tiny_ckpt, device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
