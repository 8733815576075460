"""Dispatch and combine kernels of the MoE ops (``"dhelix": {"moe": {"kernels": ...}}``).

*Encode* (inside ``moe.router``) turns a micro-batch's token rows into the send buffer, each token
copy at the row ``Route.copy_row`` gives it (dropless: copies sorted by expert; capacity mode:
``C`` slots per expert, copies past ``C`` dropped). *Decode* (inside ``moe.add``) brings the expert
outputs back to their tokens, each copy weighted by its routing weight and summed per token::

    torch   index_select / index_copy; weighted sum over the copies (the default)
    tutel   tutel's fast_encode / fast_decode (JIT kernels, CPU and CUDA) fed the same rows

The router stays the family's own in both (its weights and choices are what the kernels are
fed), so every family's routing is served and only the data movement changes. Tutel sees one
flat buffer of ``rows`` slots: expert 0 of capacity ``rows`` with each copy's row as its location,
which is exactly the send buffer's layout (sorted by expert, or ``C`` slots per expert). A
dropped copy's row is ``rows`` itself, past the buffer, which tutel's kernels skip.

Forward values are the same in both (encode copies rows; decode weighs in float32 and sums the
copies slot by slot); backward sums differ in rounding only (tutel reduces each weight's gradient
in its own order), see ``docs/guides/moe.md``.
"""

from __future__ import annotations

import torch

from .router import Route, combine_copies, encode_rows

KERNELS = ("torch", "tutel")
"""Valid values of ``dhelix.moe.kernels``."""

TUTEL_COMMIT = "82af7aad9fc3ec981395ba97e7242a480984a55e"
"""The tutel commit the ``tutel`` extra installs (tutel is not on the package index)."""

TUTEL_INSTALL = (
    f"install tutel: pip install ../shared/wheels/tutel-*.whl where that folder exists (make venv does), "
    f"else pip install 'ds_dhelix[tutel]' (tutel's repository at commit {TUTEL_COMMIT[:7]}, built "
    f"with the installed torch)"
)


def tutel_missing() -> str | None:
    """Why tutel's dispatch kernels cannot be imported here (None: they can)."""
    try:
        from tutel.impls import fast_dispatch  # noqa: F401
    except Exception as err:  # ImportError, or its compiled extension failing to load
        return f"tutel is not importable ({type(err).__name__}: {err})"
    return None


def check_kernels(name: str, *, moe: bool, fp16: bool, device: str, hidden_size: int | None = None) -> None:
    """``ValueError`` before any model is built for kernels that cannot serve this run: tutel on a
    model without experts, tutel not installed, fp16 where tutel has no fp16 kernel (CPU), an odd
    hidden size in fp16 (tutel packs two halves per element)."""
    if name == "torch":
        return
    if name not in KERNELS:
        raise ValueError(f"dhelix.moe.kernels {name!r}: choose one of {', '.join(KERNELS)}")
    if not moe:
        raise ValueError(
            f"dhelix.moe.kernels {name!r} with a model without experts: the kernels move MoE token "
            f"copies; remove the key or use an MoE model (e.g. tiny-mixtral)"
        )
    missing = tutel_missing()
    if missing:
        raise ValueError(f"dhelix.moe.kernels 'tutel': {missing}; {TUTEL_INSTALL}; or use kernels 'torch'")
    if fp16 and device == "cpu":
        raise ValueError(
            "dhelix.moe.kernels 'tutel' with fp16 on CPU: tutel's CPU kernels take float32 only (bf16 "
            "is computed in float32 by tutel itself); use bf16, or kernels 'torch'"
        )
    if fp16 and hidden_size is not None and hidden_size % 2:
        raise ValueError(
            f"dhelix.moe.kernels 'tutel' with fp16 and hidden_size {hidden_size}: tutel's fp16 kernels "
            f"move two halves per element and need an even hidden size; use bf16, or kernels 'torch'"
        )


class TorchKernels:
    """``index_select`` / ``index_copy`` and a weighted sum (``router.combine_copies``)."""

    name = "torch"

    @staticmethod
    def encode(x: torch.Tensor, route: Route) -> torch.Tensor:
        """Token rows ``x [N, h]`` -> the send buffer ``[rows, h]`` (``router.encode_rows``)."""
        return encode_rows(x, route)

    @staticmethod
    def decode(ys: torch.Tensor, weights: torch.Tensor, route: Route) -> torch.Tensor:
        """Expert outputs in the send layout ``ys [rows, h]`` -> per-token weighted sums ``[N, h]``."""
        return combine_copies(ys, weights, route)


class TutelKernels:
    """tutel's ``fast_encode`` / ``fast_decode`` on the send buffer's rows (see the module docstring)."""

    name = "tutel"

    def __init__(self):
        from tutel.impls.fast_dispatch import fast_decode, fast_encode

        self._encode, self._decode = fast_encode, fast_decode

    @staticmethod
    def _critical(route: Route, weights: torch.Tensor | None) -> tuple:
        """tutel's routing tuple ``(experts, indices per slot, locations per slot, gates per slot,
        capacity, counts)`` for one flat expert of ``route.rows`` slots."""
        rows = route.copy_row.view(route.num_tokens, route.top_k)
        zeros = torch.zeros(route.num_tokens, dtype=torch.int32, device=rows.device)
        locations = [rows[:, s].to(torch.int32).contiguous() for s in range(route.top_k)]
        gates = (
            [weights[:, s].contiguous() for s in range(route.top_k)]
            if weights is not None
            else [torch.ones(route.num_tokens, device=rows.device)] * route.top_k
        )
        return 1, [zeros] * route.top_k, locations, gates, route.rows, None

    def encode(self, x: torch.Tensor, route: Route) -> torch.Tensor:
        return self._encode(x.contiguous(), self._critical(route, None)).view(route.rows, x.shape[-1])

    def decode(self, ys: torch.Tensor, weights: torch.Tensor, route: Route) -> torch.Tensor:
        return self._decode(ys.contiguous(), self._critical(route, weights)).view(route.num_tokens, ys.shape[-1])


def make_kernels(name: str = "torch"):
    """The kernels object of ``dhelix.moe.kernels`` (``encode`` / ``decode``)."""
    if name == "torch":
        return TorchKernels()
    if name == "tutel":
        return TutelKernels()
    raise ValueError(f"dhelix.moe.kernels {name!r}: choose one of {', '.join(KERNELS)}")
