"""Hardware for the roofline: a GPU, the link between the GPUs of a node, the network between
nodes, and the assumptions on how much of each datasheet number the work reaches. Presets and
their sources are in ``hardware.yaml`` (next to this file); a user file has the same shape.

    hw = load_hardware("H100")                        # a preset system
    hw = load_hardware("my_cluster.yaml")             # one system, written out
    hw = load_hardware("A800", network="ib400", nics_per_node=8)

Plain data (PyYAML reads the files).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

PRESET_FILE = Path(__file__).resolve().parent / "hardware.yaml"
LINK_KINDS = ("nvlink", "pcie")


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense tensor-core peak (fp16 the same)
    fp32_tflops: float
    memory_gbs: float
    memory_gib: float
    source: str = ""

    def peak_flops(self, dtype: str) -> float:
        return (self.fp32_tflops if dtype == "fp32" else self.bf16_tflops) * 1e12


@dataclass(frozen=True)
class IntraLink:
    name: str
    gbs: float  # GB/s per GPU and direction
    kind: str  # nvlink | pcie
    source: str = ""


@dataclass(frozen=True)
class Network:
    name: str
    gbit: float  # Gbit/s per NIC port and direction
    source: str = ""


@dataclass(frozen=True)
class Assumptions:
    """Fractions of the datasheet numbers the work reaches, NCCL's latency model, the optimizer's
    memory traffic (values and sources: ``hardware.yaml``)."""

    gemm_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    link_efficiency: float
    comm_slowdown: float
    nccl_base_us: float
    nccl_hop_us: dict
    optimizer_bytes_per_param: float

    def __post_init__(self):
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"assumption {name}={getattr(self, name)!r}: a fraction in (0, 1]")
        if self.comm_slowdown < 0 or self.nccl_base_us < 0 or self.optimizer_bytes_per_param < 0:
            raise ValueError("assumptions comm_slowdown, nccl_base_us and optimizer_bytes_per_param must be >= 0")
        missing = {"nvlink", "pcie", "net"} - set(self.nccl_hop_us)
        if missing:
            raise ValueError(f"assumption nccl_hop_us lacks {sorted(missing)}")


@dataclass(frozen=True)
class Hardware:
    """One node design, repeated: ``gpus_per_node`` GPUs joined by ``intra_link``, nodes joined by
    ``nics_per_node`` ports of ``network``."""

    name: str
    gpu: Gpu
    gpus_per_node: int
    intra_link: IntraLink
    network: Network
    nics_per_node: int
    assumptions: Assumptions

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ValueError(
                f"hardware {self.name}: gpus_per_node {self.gpus_per_node} and nics_per_node "
                f"{self.nics_per_node} must be >= 1"
            )
        if self.intra_link.kind not in LINK_KINDS:
            raise ValueError(
                f"intra link {self.intra_link.name}: kind {self.intra_link.kind!r}, choose one of {LINK_KINDS}"
            )

    @property
    def node_network_bps(self) -> float:
        """Bytes/s a node sends to the network (all its ports, one direction), before efficiency."""
        return self.nics_per_node * self.network.gbit * 1e9 / 8

    def describe(self) -> dict:
        """Every number the projection used, with its source (the ``--json`` output's ``hardware``)."""
        return dataclasses.asdict(self)


def _load_yaml(path) -> dict:
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    return data


def presets() -> dict:
    """The preset file: ``gpus``, ``intra_links``, ``networks``, ``systems``, ``assumptions``."""
    return _load_yaml(PRESET_FILE)


def _strict(cls, name: str | None, values, what: str):
    """``cls(name=name, **values)`` (no name when None); ValueError naming unknown or missing keys."""
    if not isinstance(values, dict):
        raise ValueError(f"{what} {name!r}: expected a mapping of its numbers, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)} - {"name"}
    unknown, missing = sorted(set(values) - known), sorted(known - set(values) - _defaulted(cls))
    if unknown or missing:
        raise ValueError(f"{what} {name or ''}: unknown key(s) {unknown}, missing {missing}; keys: {sorted(known)}")
    return cls(**values) if name is None else cls(name=name, **values)


def _defaulted(cls) -> set:
    return {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _named(kind: str, value, table: dict, cls, what: str):
    """A part given by name (a key of ``table``) or written out (a mapping with a ``name``)."""
    if isinstance(value, str):
        if value not in table:
            close = difflib.get_close_matches(value, list(table), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{what} {value!r} is not a preset{hint} presets: {', '.join(table)}")
        return _strict(cls, value, table[value], what)
    if isinstance(value, dict):
        values = dict(value)
        return _strict(cls, str(values.pop("name", f"custom {kind}")), values, what)
    raise ValueError(f"{what}: expected a preset name or a mapping, got {value!r}")


SYSTEM_KEYS = ("gpu", "gpus_per_node", "intra_link", "network", "nics_per_node", "assumptions", "name", "source")


def system_from(name: str, system: dict, tables: dict, overrides: dict) -> Hardware:
    """A ``Hardware`` from one system mapping (names resolved in ``tables``) and the overrides
    (``intra_link``, ``network``, ``nics_per_node``, ``gpus_per_node``; None: keep)."""
    unknown = sorted(set(system) - set(SYSTEM_KEYS))
    if unknown:
        raise ValueError(f"hardware {name!r}: unknown key(s) {unknown}; known: {list(SYSTEM_KEYS)}")
    system = {**system, **{k: v for k, v in overrides.items() if v is not None}}
    missing = [k for k in SYSTEM_KEYS[:5] if k not in system]
    if missing:
        raise ValueError(f"hardware {name!r}: missing {missing}")
    base = dict(tables.get("assumptions") or {})
    base.update(system.get("assumptions") or {})
    return Hardware(
        name=name,
        gpu=_named("gpu", system["gpu"], tables["gpus"], Gpu, "gpu"),
        gpus_per_node=int(system["gpus_per_node"]),
        intra_link=_named("intra link", system["intra_link"], tables["intra_links"], IntraLink, "intra link"),
        network=_named("network", system["network"], tables["networks"], Network, "network"),
        nics_per_node=int(system.get("nics_per_node", 1)),
        assumptions=_strict(Assumptions, None, base, "assumptions"),
    )


def load_hardware(
    spec: str,
    *,
    intra_link: str | None = None,
    network: str | None = None,
    nics_per_node: int | None = None,
    gpus_per_node: int | None = None,
) -> Hardware:
    """A preset system's name (``presets()["systems"]``) or a YAML file holding one system; the
    keyword arguments replace its parts (by preset name, or a number)."""
    tables = presets()
    overrides = {
        "intra_link": intra_link,
        "network": network,
        "nics_per_node": nics_per_node,
        "gpus_per_node": gpus_per_node,
    }
    if spec in tables["systems"]:
        return system_from(spec, tables["systems"][spec], tables, overrides)
    if spec.endswith((".yaml", ".yml")) or os.path.sep in spec:
        if not os.path.isfile(spec):
            raise ValueError(f"--hardware {spec}: no such file")
        data = _load_yaml(spec)
        return system_from(str(data.get("name", Path(spec).stem)), data, tables, overrides)
    close = difflib.get_close_matches(spec, list(tables["systems"]) + ["cpu"], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"--hardware {spec!r}: not a preset ({', '.join(tables['systems'])}, or cpu with --table) "
        f"nor a .yaml file; {hint}presets and their sources: {PRESET_FILE}"
    )
