"""Peak CPU memory of a callable, from torch's profiler (helpers only, no tests here)."""

from __future__ import annotations

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def peak_cpu_bytes(fn) -> int:
    """Peak of the bytes allocated (and not yet freed) on the CPU while ``fn()`` runs, from torch's profiler.

    With ``profile_memory=True`` torch's CPU allocator reports every allocation and free as a ``[memory]`` event with
    a timestamp (forward and backward; CPU autograd runs on the calling thread). Summing their sizes in time order
    gives the live-memory trajectory, including scratch space inside one kernel call and temporaries freed between
    ops. (Summing each op's ``self_cpu_memory_usage`` instead is not a trajectory: a free made in Python inside an
    autograd Function is booked on the Function's enclosing event, which starts before the allocation it cancels,
    so chunk-sized temporaries went unseen.) Tensors allocated before ``fn`` (the logits themselves, or the whole
    tensor a non-contiguous logits slice views into) are not counted; a view costs nothing, a copy is counted.
    """
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
