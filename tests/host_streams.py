"""Test-only stand-in for CUDA streams on a CPU-only host.

Megatron's alltoall token dispatcher creates a `torch.cuda.Stream` when it is built and moves its
split sizes to the host on that stream. Without CUDA those calls fail; here they become no-ops on
the host's one stream (tests/conftest.py, `cpu_cuda_streams`: one process, expert parallel size 1).
The code under test is not patched.
"""

import contextlib

import torch


class HostStream:
    """What the alltoall dispatcher asks of a CUDA stream and of the event it records."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self):
        return self  # an event whose synchronize() returns at once


def cuda_stream_patches():
    """(torch.cuda, name, stand-in) for each stream call the dispatcher makes."""
    stream = HostStream()
    return [(torch.cuda, "Stream", lambda *args, **kwargs: stream),
            (torch.cuda, "current_stream", lambda *args, **kwargs: stream),
            (torch.cuda, "stream", lambda s: contextlib.nullcontext())]
