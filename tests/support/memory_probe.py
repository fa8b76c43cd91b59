"""Peak CPU memory of a callable, from torch's profiler (helpers only, no tests here)."""

from __future__ import annotations

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def peak_cpu_bytes(fn) -> int:
    """Peak of the bytes allocated (and not yet freed) on the CPU while ``fn()`` runs.

    With ``profile_memory=True`` torch's CPU allocator reports every allocation and free as a ``[memory]`` event;
    summing their sizes in time order gives the live-memory trajectory (forward and backward: CPU autograd runs on
    the calling thread). Tensors allocated before ``fn`` are not counted (the method of
    tests/unit/test_algorithms_logprobs.py's probe)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
