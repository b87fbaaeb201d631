"""A cluster as the planner sees it: a logical N-d mesh, the link of each mesh axis, and the device kind.

Built from a physical description (nodes x devices per node, an intra-node and an inter-node link): ranks are
laid out row-major with the devices of one node consecutive, so a mesh axis whose groups stay inside one node
communicates over the intra-node link and any other axis over the inter-node link. 8 nodes x 8 H100 gives the
(8, 8) mesh ("dp" over InfiniBand NDR, "tp" over NVLink 4). `enumerate_meshes` lists every logical mesh shape
a physical cluster admits, each with its links.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..errors import LayoutError
from ..mesh import Mesh
from .links import LINK_PRESETS, LinkSpec, flat_link, link_preset

logger = logging.getLogger(__name__)

# Short device names of `parse_cluster` -> (hardware preset, intra-node link, inter-node link), after each
# vendor's reference system (DGX-1 V100, DGX A100, DGX H100/H200: NVLink inside, one IB NIC per GPU).
DEVICE_ALIASES: dict[str, tuple[str, str, str]] = {
    "v100": ("v100-32gb", "nvlink2", "ib-hdr"),
    "a100": ("a100-80gb", "nvlink3", "ib-hdr"),
    "a100-40gb": ("a100-40gb", "nvlink3", "ib-hdr"),
    "a100-80gb": ("a100-80gb", "nvlink3", "ib-hdr"),
    "h100": ("h100-sxm", "nvlink4", "ib-ndr"),
    "h100-sxm": ("h100-sxm", "nvlink4", "ib-ndr"),
    # Meta's Grand Teton hosts (torchtitan's benchmark tables): NVSwitch inside, 400 Gb/s RoCE per GPU across
    "h100-96gb": ("h100-hbm2e-500w", "nvlink4", "ib-ndr"),
    "h100-hbm2e-500w": ("h100-hbm2e-500w", "nvlink4", "ib-ndr"),
    "h200": ("h200", "nvlink4", "ib-ndr"),
    "cpu": ("cpu", "loopback", "loopback"),
}

_DEFAULT_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "fsdp", "tp")}


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """("dp",), ("dp", "tp"), ("dp", "fsdp", "tp"), then ("a0", "a1", ...)."""
    return _DEFAULT_NAMES.get(ndim, tuple(f"a{i}" for i in range(ndim)))


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A logical mesh with one `LinkSpec` per axis and the device kind.

    `device` is a hardware preset name (see `treadle.profile.hardware.hardware_preset`) or a HardwareSpec.
    `copy_bytes_per_s` is how fast a device copies a buffer locally (bytes copied per second), which prices
    the packing copies around collectives in layout conversion; None leaves them unpriced. The constructors
    derive it from a GPU preset's memory bandwidth; `calibrate_cluster` measures it.
    How fast one rank computes (NOTE [rank device]): a CPU device spec is per core; a rank gets
    ``cores_per_rank = threads_per_rank`` cores, or ``min(threads_per_rank, cores_per_host / ranks_per_host)``
    when `cores_per_host` is given (gloo ranks sharing a host's cores). `ranks_per_host` defaults to the
    world size for a CPU device (every rank on one host) and to 1 otherwise. A GPU is one device per rank
    and these fields do not change it. Nothing is read from the calling process: what is not given is
    assumed as stated here, and `rank_device` records it in every plan and price.
    Raises LayoutError when the number of links differs from the number of mesh axes, a non-positive
    copy rate, thread or core count.
    """

    mesh: Mesh
    links: tuple[LinkSpec, ...]
    device: Any = "cpu"  # str preset name or treadle.profile.hardware.HardwareSpec
    copy_bytes_per_s: float | None = None
    threads_per_rank: int = 1
    ranks_per_host: int | None = None
    cores_per_host: int | None = None
    # links measured for process groups that flatten several axes ((axis names in mesh order), LinkSpec), e.g.
    # DDP over every rank of a 2-D mesh; `group_link` falls back to `flat_link` of the axes' links without one
    group_links: tuple[tuple[tuple[str, ...], LinkSpec], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "group_links", tuple((tuple(a), link) for a, link in self.group_links))
        for axes, _ in self.group_links:
            for a in axes:
                self.mesh.axis_index(a)
        if self.copy_bytes_per_s is not None and not self.copy_bytes_per_s > 0:
            raise LayoutError(f"ClusterSpec: copy_bytes_per_s must be > 0 or None; got {self.copy_bytes_per_s}")
        for name in ("threads_per_rank", "ranks_per_host", "cores_per_host"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise LayoutError(f"ClusterSpec: {name} must be a positive int (or None); got {v!r}")
        if len(self.links) != self.mesh.ndim:
            raise LayoutError(f"ClusterSpec: {len(self.links)} links for {self.mesh} with {self.mesh.ndim} axes; "
                              f"give one link per mesh axis")
        if not all(isinstance(link, LinkSpec) for link in self.links):
            raise LayoutError(f"ClusterSpec: links must be LinkSpec; got {[type(x).__name__ for x in self.links]}")

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s} over {link}" for n, s, link in zip(self.mesh.names, self.mesh.shape, self.links))
        return f"Cluster({axes}; {self.device_name})"

    @property
    def device_name(self) -> str:
        return self.device if isinstance(self.device, str) else getattr(self.device, "name", str(self.device))

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def link(self, axis: str | int) -> LinkSpec:
        """The link of a mesh axis, by name or index. Raises MeshError/LayoutError naming the valid axes."""
        if isinstance(axis, int):
            if not 0 <= axis < self.mesh.ndim:
                raise LayoutError(f"mesh axis index {axis} out of range for {self.mesh}")
            return self.links[axis]
        return self.links[self.mesh.axis_index(axis)]

    def group_link(self, axes: Sequence[str]) -> LinkSpec:
        """The link of one process group over several mesh `axes` (flattened; e.g. data parallelism over all of
        them): the measured `group_links` entry for those axes (size-1 axes ignored) when there is one, else
        `flat_link` of their links (every ring step waits for its slowest hop)."""
        live = tuple(a for a in self.mesh.names if a in axes and self.mesh.size(a) > 1)
        for a in axes:
            self.mesh.axis_index(a)
        if len(live) <= 1:
            return self.link(live[0] if live else axes[0])
        for key, link in self.group_links:
            if key == live:
                return link
        return flat_link([self.link(a) for a in live])

    def hardware(self):  # -> treadle.profile.hardware.HardwareSpec
        """The device's HardwareSpec (resolves a preset name through treadle.profile.hardware)."""
        if not isinstance(self.device, str):
            return self.device
        from ..profile.hardware import hardware_preset

        return hardware_preset(self.device)

    def is_cpu(self) -> bool:
        return self.device_name.lower().startswith("cpu")

    def rank_device(self) -> "RankDevice":
        """How one rank's compute rate is derived (NOTE [rank device] in the class doc)."""
        hw = self.hardware()
        if not self.is_cpu():
            return RankDevice(hw.name, dict(hw.peak_flops_per_s), hw.hbm_bytes_per_s, self.threads_per_rank,
                              self.ranks_per_host or 1, self.cores_per_host, None, True,
                              f"one {hw.name} per rank ({hw.source})")
        rph = self.ranks_per_host or self.world_size
        cores = float(self.threads_per_rank)
        if self.cores_per_host is not None:
            cores = min(cores, self.cores_per_host / rph)
        # a rank overlaps communication with compute only when its host has a core to spare for the
        # communication thread (gloo runs collectives on its own threads)
        overlap = self.cores_per_host is not None and self.cores_per_host >= rph * (self.threads_per_rank + 1)
        scaled = {k: v * cores for k, v in hw.peak_flops_per_s.items()}
        placement = (f"{rph} rank(s) sharing {self.cores_per_host} core(s)" if self.cores_per_host is not None
                     else f"{rph} rank(s), assumed each on cores of its own (cores per host not stated, not "
                          f"measured)")
        return RankDevice(f"{hw.name} x{cores:.3g} core", scaled, hw.hbm_bytes_per_s * cores, self.threads_per_rank,
                          rph, self.cores_per_host, cores, overlap,
                          f"{cores:.3g} core(s) per rank: {self.threads_per_rank} thread(s), {placement}; per "
                          f"core: {hw.source}")

    def assumptions(self) -> str:
        """One line: the machine this cluster describes, as priced (each rank's device and where its rates come
        from, each axis' link and whether it was measured or is a preset)."""
        def origin(link: LinkSpec) -> str:
            return "preset, not measured" if LINK_PRESETS.get(link.name) == link else "measured or user-given"

        links = "; ".join(f"{a}={n} on {link.name} ({origin(link)})"
                          for a, n, link in zip(self.mesh.names, self.mesh.shape, self.links))
        return f"assumes: {self.rank_device().source}; links: {links}"

    def rank_hardware(self):  # -> treadle.profile.hardware.HardwareSpec
        """The HardwareSpec one rank computes at (`rank_device`'s rates, the device's efficiencies)."""
        hw = self.hardware()
        if not self.is_cpu():
            return hw
        d = self.rank_device()
        from ..profile.hardware import HardwareSpec

        from ..profile.hardware import _OVERHEADS

        per_core = {k: getattr(hw, k) / (d.cores_per_rank or 1.0) for k in _OVERHEADS}  # host work: scales too
        return HardwareSpec(name=d.name, peak_flops_per_s=d.peak_flops_per_s, hbm_bytes_per_s=d.hbm_bytes_per_s,
                            memory_bytes=hw.memory_bytes, compute_efficiency=hw.compute_efficiency,
                            memory_efficiency=hw.memory_efficiency, optimizer_foreach=hw.optimizer_foreach,
                            optimizer_fused=hw.optimizer_fused,
                            matmul_curve=hw.matmul_curve, attention_efficiency=hw.attention_efficiency,
                            elementwise_s_per_elem={k: v / (d.cores_per_rank or 1.0)
                                                    for k, v in hw.elementwise_s_per_elem.items()},
                            **per_core, source=d.source)

    def with_ranks(self, *, threads_per_rank: int = 1, ranks_per_host: int | None = None,
                   cores_per_host: int | None = None) -> "ClusterSpec":
        """The same cluster with the rank placement of NOTE [rank device] stated."""
        return ClusterSpec(self.mesh, self.links, self.device, self.copy_bytes_per_s, threads_per_rank,
                           ranks_per_host, cores_per_host, self.group_links)

    def for_mesh(self, mesh: Mesh) -> "ClusterSpec":
        """This cluster seen through another logical `mesh` of the same world size (e.g. a schedule's): an
        axis keeps the link of the same-named axis here, else it gets the slowest of this cluster's links
        (it may cross every link). Raises LayoutError when the world sizes differ."""
        if tuple(mesh.shape) == tuple(self.mesh.shape) and tuple(mesh.names) == tuple(self.mesh.names):
            return self
        if mesh.world_size != self.world_size:
            raise LayoutError(f"ClusterSpec.for_mesh: {mesh} has {mesh.world_size} ranks but {self} has "
                              f"{self.world_size}; give a cluster of the schedule's world size")
        slow = flat_link(self.links)
        links = tuple(self.link(a) if a in self.mesh.names and self.mesh.size(a) == mesh.size(a) else slow
                      for a in mesh.names)
        return ClusterSpec(mesh, links, self.device, self.copy_bytes_per_s, self.threads_per_rank,
                           self.ranks_per_host or (self.world_size if self.is_cpu() else None), self.cores_per_host)

    def with_links(self, links: Sequence[LinkSpec], *, copy_bytes_per_s: float | None = None) -> "ClusterSpec":
        """The same cluster with other links (e.g. calibrated ones) and, when given, another copy rate."""
        return ClusterSpec(self.mesh, tuple(links), self.device,
                           self.copy_bytes_per_s if copy_bytes_per_s is None else copy_bytes_per_s,
                           self.threads_per_rank, self.ranks_per_host, self.cores_per_host, self.group_links)

    def restrict(self, axes: Sequence[str]) -> "ClusterSpec":
        """The cluster over a subset of mesh axes (in the given order), keeping their links, the device and
        the copy rate: e.g. the tensor-parallel axes a planner prices conversions on. Raises MeshError
        naming an unknown axis, LayoutError on a repeated one."""
        axes = tuple(axes)
        if len(set(axes)) != len(axes):
            raise LayoutError(f"ClusterSpec.restrict: axes {axes} repeat an axis of {self.mesh}")
        return ClusterSpec(Mesh(tuple(self.mesh.size(a) for a in axes), axes), tuple(self.link(a) for a in axes),
                           self.device, self.copy_bytes_per_s, self.threads_per_rank,
                           self.ranks_per_host or (self.world_size if self.is_cpu() else None), self.cores_per_host)

    # ------------------------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, mesh: Mesh, link: LinkSpec | str, *, device: Any = "cpu") -> "ClusterSpec":
        """Every axis of `mesh` on the same link (e.g. gloo ranks on one host: ``"loopback"``)."""
        link = link_preset(link) if isinstance(link, str) else link
        return cls(mesh, (link,) * mesh.ndim, device, device_copy_bytes_per_s(device))

    @classmethod
    def from_physical(cls, nodes: int = 8, devices_per_node: int = 8, *, intra: LinkSpec | str = "nvlink4",
                      inter: LinkSpec | str = "ib-ndr", device: Any = "h100-sxm",
                      names: Sequence[str] = ("dp", "tp")) -> "ClusterSpec":
        """The (nodes, devices_per_node) mesh: axis 0 across nodes on `inter`, axis 1 inside a node on `intra`.

        A one-node cluster keeps the outer axis with size 1 (it costs nothing), so axis names stay stable.
        Raises LayoutError on non-positive counts or a `names` that is not two names."""
        if nodes < 1 or devices_per_node < 1:
            raise LayoutError(f"from_physical: nodes and devices_per_node must be >= 1; "
                              f"got {nodes} x {devices_per_node}")
        if len(names) != 2:
            raise LayoutError(f"from_physical: names must name the two axes (across nodes, inside a node); got {names}")
        intra_l = link_preset(intra) if isinstance(intra, str) else intra
        inter_l = link_preset(inter) if isinstance(inter, str) else inter
        return cls(Mesh((nodes, devices_per_node), tuple(names)), (inter_l, intra_l), device,
                   device_copy_bytes_per_s(device))

    # ------------------------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        dev = self.device if isinstance(self.device, str) else {"hardware": json.loads(self.device.to_json())}
        return {"mesh": {"shape": list(self.mesh.shape), "names": list(self.mesh.names)},
                "links": [link.to_dict() for link in self.links], "device": dev,
                "copy_bytes_per_s": self.copy_bytes_per_s, "threads_per_rank": self.threads_per_rank,
                "ranks_per_host": self.ranks_per_host, "cores_per_host": self.cores_per_host,
                "group_links": [{"axes": list(a), "link": link.to_dict()} for a, link in self.group_links]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        dev = d.get("device", "cpu")
        if isinstance(dev, dict):
            from ..profile.hardware import HardwareSpec

            dev = HardwareSpec.from_json(json.dumps(dev["hardware"]))
        return cls(Mesh(tuple(d["mesh"]["shape"]), tuple(d["mesh"]["names"])),
                   tuple(LinkSpec.from_dict(x) for x in d["links"]), dev, d.get("copy_bytes_per_s"),
                   d.get("threads_per_rank", 1), d.get("ranks_per_host"), d.get("cores_per_host"),
                   tuple((tuple(g["axes"]), LinkSpec.from_dict(g["link"])) for g in d.get("group_links", ())))

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        return cls.from_dict(json.loads(text))


@dataclass(slots=True)
class RankDevice:
    """The device one rank computes on, as priced (`ClusterSpec.rank_device`): its rates (FLOP/s per dtype,
    bytes/s), the placement facts they come from, and whether it overlaps communication with compute."""

    name: str
    peak_flops_per_s: dict[str, float]
    hbm_bytes_per_s: float
    threads_per_rank: int
    ranks_per_host: int
    cores_per_host: int | None
    cores_per_rank: float | None
    overlap: bool
    source: str


def device_copy_bytes_per_s(device: Any) -> float | None:
    """Local copy rate of a device: half its effective memory bandwidth (a copy reads and writes each byte).

    From a HardwareSpec or a GPU preset name; None for "cpu" (measure it with `calibrate_cluster`: this
    function never measures) and for names the hardware presets do not know."""
    if device == "cpu":
        return None
    if isinstance(device, str):
        from ..errors import ProfileError
        from ..profile.hardware import hardware_preset

        try:
            device = hardware_preset(device)
        except ProfileError:
            logger.info("no memory bandwidth known for device %r: local copies in conversions are not priced",
                        device)
            return None
    return device.hbm_bytes_per_s * device.memory_efficiency / 2


def parse_cluster(text: str, *, names: Sequence[str] = ("dp", "tp")) -> ClusterSpec:
    """A cluster from a short spec: ``"NODESxDEVICES:device[:intra[:inter]]"`` or ``"DEVICES:device"`` (one node),
    or the path of a ClusterSpec JSON file (e.g. written by ``treadle calibrate``).

    Examples: ``"8x8:h100"`` (8 nodes of 8 H100, NVLink 4 inside, IB NDR across), ``"2x8:a100:pcie4"``,
    ``"2x2:cpu"`` (4 gloo ranks on one host). Known devices: the keys of DEVICE_ALIASES or any hardware preset
    name (then give the links). Raises LayoutError naming the part that did not parse and the valid forms."""
    if text.strip().endswith(".json"):
        path = Path(text.strip())
        if not path.is_file():
            raise LayoutError(f"parse_cluster: cluster file {text!r} does not exist; give a JSON file written by "
                              f"ClusterSpec.to_json (e.g. by 'treadle calibrate') or a spec like '8x8:h100'")
        return ClusterSpec.from_json(path.read_text())
    parts = text.strip().lower().split(":")
    if len(parts) < 2 or len(parts) > 4:
        raise LayoutError(f"parse_cluster: cannot read {text!r}; write NODESxDEVICES:device[:intra[:inter]], "
                          f"e.g. '8x8:h100' or '2x8:a100:pcie4'")
    counts = parts[0].split("x")
    try:
        sizes = [int(c) for c in counts]
    except ValueError:
        raise LayoutError(f"parse_cluster: {parts[0]!r} in {text!r} is not NODESxDEVICES (e.g. '8x8') "
                          f"or DEVICES (e.g. '8')") from None
    if len(sizes) == 1:
        sizes = [1, sizes[0]]
    if len(sizes) != 2:
        raise LayoutError(f"parse_cluster: {parts[0]!r} in {text!r} must be NODESxDEVICES (two numbers)")
    dev = parts[1]
    if dev in DEVICE_ALIASES:
        hw, intra, inter = DEVICE_ALIASES[dev]
    elif len(parts) == 4:
        hw, intra, inter = dev, parts[2], parts[3]
    else:
        raise LayoutError(f"parse_cluster: unknown device {dev!r} in {text!r}; known: {sorted(DEVICE_ALIASES)} "
                          f"(or give intra and inter links: 'NxM:device:intra:inter')")
    intra = parts[2] if len(parts) >= 3 else intra
    inter = parts[3] if len(parts) == 4 else inter
    return ClusterSpec.from_physical(sizes[0], sizes[1], intra=intra, inter=inter, device=hw, names=names)


def axis_crosses_nodes(mesh_shape: Sequence[int], axis: int, devices_per_node: int) -> bool:
    """Whether the groups of mesh axis `axis` span more than one node (row-major ranks, nodes consecutive).

    A group is ranks base + k * stride for k < n, stride the product of the inner axes; it stays inside a
    node exactly when stride * n divides devices_per_node."""
    stride = math.prod(mesh_shape[axis + 1:])
    span = stride * mesh_shape[axis]
    return mesh_shape[axis] > 1 and devices_per_node % span != 0


def _ordered_factorizations(n: int, parts: int, min_factor: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if n >= min_factor:
            yield (n,)
        return
    for f in range(min_factor, n + 1):
        if n % f == 0:
            for rest in _ordered_factorizations(n // f, parts - 1, min_factor):
                yield (f, *rest)


def enumerate_meshes(nodes: int, devices_per_node: int, *, intra: LinkSpec | str = "nvlink4",
                     inter: LinkSpec | str = "ib-ndr", device: Any = "h100-sxm", max_ndim: int = 3,
                     min_axis_size: int = 2) -> list[ClusterSpec]:
    """Every logical mesh the physical cluster admits: each ordered factorisation of nodes * devices_per_node
    into 1..`max_ndim` axes of size >= `min_axis_size`, each axis on the intra-node link when its groups stay
    inside a node and on the inter-node link otherwise (see `axis_crosses_nodes`). Axis names follow
    `default_axis_names`. 2 x 4 gives (8,), (2, 4), (4, 2), (2, 2, 2), ...; on (4, 2) axis "dp" crosses nodes.
    Raises LayoutError on non-positive counts."""
    if nodes < 1 or devices_per_node < 1 or max_ndim < 1:
        raise LayoutError(f"enumerate_meshes: counts must be >= 1; got nodes={nodes}, "
                          f"devices_per_node={devices_per_node}, max_ndim={max_ndim}")
    intra_l = link_preset(intra) if isinstance(intra, str) else intra
    inter_l = link_preset(inter) if isinstance(inter, str) else inter
    world = nodes * devices_per_node
    copy_s = device_copy_bytes_per_s(device)
    out: list[ClusterSpec] = []
    for ndim in range(1, max_ndim + 1):
        for shape in _ordered_factorizations(world, ndim, min(min_axis_size, world)):
            links = tuple(inter_l if axis_crosses_nodes(shape, i, devices_per_node) else intra_l
                          for i in range(ndim))
            out.append(ClusterSpec(Mesh(shape, default_axis_names(ndim)), links, device, copy_s))
    logger.debug("enumerate_meshes: %d x %d -> %d meshes", nodes, devices_per_node, len(out))
    return out

