"""Per-step MoE numbers: tokens per expert per layer, dropped copies, the load-balancing loss.

The router and loss ops write them while a step runs (tensors stay on the device, no host sync);
``DhelixMoeEngine`` resets them before a step, reduces them over the data-parallel group after it
and logs them.
"""

from __future__ import annotations

import torch


class MoeMetrics:
    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.reset()

    def reset(self) -> None:
        self.load: torch.Tensor | None = None  # [layers, experts] token copies routed (before capacity)
        self.dropped: torch.Tensor | None = None  # [layers] copies dropped by capacity
        self.aux: list[torch.Tensor] = []  # load-balancing loss (unscaled) per micro-batch
        self.a2a_busy_s = 0.0  # dispatch/combine all-to-alls: launch to completion
        self.a2a_exposed_s = 0.0  # ... time the executor was blocked on them

    def record_route(self, layer: int, counts: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """``counts [E]`` copies routed to each expert; ``dropped``: copies capacity dropped (None: dropless)."""
        if self.load is None:
            self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=counts.device)
            self.dropped = torch.zeros(self.num_layers, dtype=torch.long, device=counts.device)
        self.load[layer] += counts.to(torch.float64)
        if dropped is not None:
            self.dropped[layer] += dropped

    def record_comm(self, busy_s: float, waited_s: float) -> None:
        self.a2a_busy_s += busy_s
        self.a2a_exposed_s += waited_s

    def record_aux(self, value: torch.Tensor) -> None:
        self.aux.append(value.detach().float())

    def aux_mean(self) -> torch.Tensor | None:
        return torch.stack(self.aux).mean() if self.aux else None
