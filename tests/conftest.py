"""Shared fixtures: an in-process fake world for rank-logic tests, torn down after each test.

Without a GPU, Triton kernels run in Triton's interpreter; TRITON_INTERPRET must be set before triton is
imported by anything (torch.export imports it in some tests), so it is set here, first.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Inductor's FX-graph and AOTAutograd caches in a folder of the project's own (git-ignored): a program compiled by one
# test (or rank, or run) is not compiled again by the next
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                              ".cache", "inductor"))
# the cost model's choices (fusion, collective matmul, ...) from the built-in uncalibrated CPU profile, not from a
# calibration this machine may have written to ~/.cache/meshc (a path that does not exist selects cpu-default)
os.environ["MESHC_HARDWARE"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no-calibration.json")


@pytest.fixture
def fake_mesh():
    """`fake_mesh(dp=2, tp=1, pp=1, rank=0)` -> a Mesh on torch's fake process group in this process."""
    from meshc.runtime.mesh import simulated_mesh

    def make(**sizes):
        if dist.is_initialized():
            dist.destroy_process_group()
        return simulated_mesh(**sizes)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def single_mesh():
    """The world-of-one mesh meshc.mesh() builds without torchrun."""
    import meshc

    if dist.is_initialized():
        dist.destroy_process_group()
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    yield meshc.mesh()
    dist.destroy_process_group()
    os.environ.update(env)


def pytest_collection_finish(session):
    """Every test module is imported (torch, transformers, meshc): move those objects out of the collector's reach, so
    that this process's full collections during the tests do not walk them again (as the rank forkserver does:
    tests/rank_warmup.py)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Back within the collector's reach before the interpreter exits, so that extension objects are freed as they
    would be (nanobind, in triton, reports every object still alive at exit as a leak)."""
    import gc

    gc.unfreeze()
    gc.collect()
