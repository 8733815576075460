"""``StepStats``: what one training step measured (compute, communication, exposure, memory)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """Per training step: compute seconds, comm seconds (launch to observed completion),
    exposed comm seconds (time blocked waiting), number of collectives."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    num_comms: int = 0
    num_deferred: int = 0  # weight-gradient passes run after their op's input gradient
    peak_activation_bytes: int = 0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    # CUDA: the same from CUDA events (``comm.DeviceEvents``): collective launch to completion, and
    # the time the compute stream stalled waiting on one (None on CPU, where the host waits)
    device_comm_s: float | None = None
    device_exposed_s: float | None = None
    # CUDA: compute ops launched, and those launched onto an empty compute stream (the device had
    # run out of work: the host was behind; ``starved_share``)
    launches: int = 0
    idle_launches: int = 0
    # the data-parallel gradient reduction (DeepSpeed's, ``engine/grad_reduction.py``): its time,
    # and the part of it the step waited for after the last backward (all of it when not overlapped);
    # None where not measured (one data-parallel rank, the folded pipeline)
    dp_reduce_s: float | None = None
    dp_exposed_s: float | None = None

    @property
    def starved_share(self) -> float | None:
        """Share of the step's compute ops that found the device idle at launch (CUDA; None on CPU,
        where ops run on the calling thread). Near 0: the host keeps ahead of the GPU; near 1: the
        step is host-bound, and exposure figures say little (nothing waits on a collective when the
        GPU already waits on Python)."""
        return self.idle_launches / self.launches if self.launches else None

    @property
    def hidden_fraction(self) -> float:
        """Share of this step's own communication time that did not block compute (device-true on CUDA)."""
        comm, exposed = self.comm_and_exposed
        return 0.0 if comm <= 0 else max(0.0, 1.0 - exposed / comm)

    @property
    def comm_and_exposed(self) -> tuple[float, float]:
        """(comm, exposed) seconds: from CUDA events where measured, else the host's."""
        if self.device_comm_s is not None:
            return self.device_comm_s, self.device_exposed_s
        return self.comm_s, self.exposed_s
