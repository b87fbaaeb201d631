"""Interconnect links as alpha-beta data (latency seconds, bandwidth bytes/s per direction), with presets.

A link is what one mesh axis communicates over. Presets give the unidirectional bandwidth one device can
drive on that link and a small-message latency, as vendors publish them and NCCL-tests show them (numbers
and sources beside each preset); `efficiency` scales the peak to what collectives reach in practice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

from ..errors import LayoutError

GB = 10**9


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One interconnect: `latency_s` per message step, `bandwidth_bytes_per_s` per direction per device.

    `efficiency` (0, 1] is the fraction of peak bandwidth collectives reach (NCCL bus bandwidth / peak).
    `launch_s` is the fixed software cost of one collective call on this link, paid once per call whatever
    its number of steps (kernel launch and proxy setup for NCCL, op dispatch for gloo); it is what makes one
    collective over a flattened group cheaper than two over its axes. Default 0 (pure alpha-beta).
    `op_scale` holds measured deviations of single collectives from their textbook algorithm, as pairs
    (collective name, time factor), e.g. ``(("reduce_scatter", 1.7),)`` where a backend implements
    reduce-scatter worse than a ring (gloo); calibration fills it, presets leave it empty (factor 1).
    `skew_s` is the part of each call's time that is the ranks' drift apart over `skew_lead_s` seconds of
    compute since their group last synchronised (NOTE [lead-dependent skew] in `treadle.cost.calibrate`): the
    cost functions price a call after at least that much compute, as calibration timed it; a blocking call
    issued sooner after the previous one pays ``skew_s * lead / skew_lead_s`` of it (`treadle.cost.overlap`).
    Default 0 (no drift: presets, GPUs). Raises LayoutError on a negative latency, launch cost, skew or skew
    lead, a skew without a positive lead, a non-positive bandwidth, an efficiency outside (0, 1], or a
    non-positive scale.
    """

    name: str = "custom"
    latency_s: float
    bandwidth_bytes_per_s: float
    efficiency: float = 1.0
    launch_s: float = 0.0
    op_scale: tuple[tuple[str, float], ...] = ()
    skew_s: float = 0.0
    skew_lead_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0 or not 0 < self.efficiency <= 1
                or self.launch_s < 0 or self.skew_s < 0 or self.skew_lead_s < 0
                or (self.skew_s > 0 and self.skew_lead_s <= 0)):
            raise LayoutError(f"LinkSpec needs latency_s >= 0, launch_s >= 0, bandwidth_bytes_per_s > 0, "
                              f"0 < efficiency <= 1, skew_s >= 0 and skew_lead_s > 0 where skew_s > 0; got {self!r}")
        object.__setattr__(self, "op_scale", tuple(sorted((str(k), float(v)) for k, v in self.op_scale)))
        if any(v <= 0 for _, v in self.op_scale):
            raise LayoutError(f"LinkSpec op_scale factors must be > 0; got {self.op_scale}")

    def scale(self, op: str) -> float:
        """Measured time factor of collective `op` on this link (1.0 when not calibrated)."""
        for k, v in self.op_scale:
            if k == op:
                return v
        return 1.0

    def short_lead_saving_s(self, lead_s: float) -> float:
        """Seconds a call issued `lead_s` seconds of compute after its group last synchronised pays less than
        the cost functions' price (which assumes a lead of at least `skew_lead_s`): the undrifted part of
        `skew_s`, ``skew_s * (1 - lead_s / skew_lead_s)`` for a shorter lead, else 0."""
        if self.skew_s <= 0 or lead_s >= self.skew_lead_s:
            return 0.0
        return self.skew_s * (1.0 - max(lead_s, 0.0) / self.skew_lead_s)

    def __str__(self) -> str:
        """'ib-ndr(10.0 us, 42.5 GB/s = 85% of 50)': the bandwidth collectives reach (`effective_bytes_per_s`,
        the one figure every table shows), and the peak it comes from when the efficiency is below 1."""
        peak = "" if self.efficiency >= 1 else f" = {self.efficiency:.0%} of {self.bandwidth_bytes_per_s / GB:.3g}"
        return f"{self.name}({self.latency_s * 1e6:.1f} us, {self.effective_bytes_per_s / GB:.3g} GB/s{peak})"

    @property
    def effective_bytes_per_s(self) -> float:
        """Bandwidth collectives actually reach: peak times efficiency."""
        return self.bandwidth_bytes_per_s * self.efficiency

    def to_dict(self) -> dict:
        d = asdict(self)
        d["op_scale"] = dict(self.op_scale)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LinkSpec":
        d = dict(d)
        d["op_scale"] = tuple(sorted(dict(d.get("op_scale", {})).items()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


# Per-direction, per-GPU peak bandwidths. Efficiencies are typical NCCL bus-bandwidth fractions.
# launch_s: one NCCL collective call costs a kernel launch (~3-5 us, CUDA launch overhead) plus proxy setup
# before its first step; 5 us is the round figure used for every GPU link.
_NCCL_LAUNCH_S = 5e-6
LINK_PRESETS: dict[str, LinkSpec] = {
    # V100 SXM2: 6 NVLink2 links x 25 GB/s per direction = 150 GB/s (NVIDIA V100 datasheet, 300 GB/s bidirectional)
    "nvlink2": LinkSpec(name="nvlink2", latency_s=3e-6, bandwidth_bytes_per_s=150 * GB, efficiency=0.8,
                        launch_s=_NCCL_LAUNCH_S),
    # A100 SXM: 12 NVLink3 links, 600 GB/s bidirectional -> 300 GB/s per direction (A100 datasheet)
    "nvlink3": LinkSpec(name="nvlink3", latency_s=3e-6, bandwidth_bytes_per_s=300 * GB, efficiency=0.8,
                        launch_s=_NCCL_LAUNCH_S),
    # H100 SXM: 18 NVLink4 links, 900 GB/s bidirectional -> 450 GB/s per direction (H100 datasheet)
    "nvlink4": LinkSpec(name="nvlink4", latency_s=2.5e-6, bandwidth_bytes_per_s=450 * GB, efficiency=0.8,
                        launch_s=_NCCL_LAUNCH_S),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b -> 31.5 GB/s per direction (PCI-SIG)
    "pcie4": LinkSpec(name="pcie4", latency_s=8e-6, bandwidth_bytes_per_s=31.5 * GB, efficiency=0.75,
                        launch_s=_NCCL_LAUNCH_S),
    # PCIe 5.0 x16: 63 GB/s per direction (PCI-SIG)
    "pcie5": LinkSpec(name="pcie5", latency_s=8e-6, bandwidth_bytes_per_s=63 * GB, efficiency=0.75,
                        launch_s=_NCCL_LAUNCH_S),
    # InfiniBand HDR: 200 Gb/s per NIC = 25 GB/s per direction, one NIC per GPU (NVIDIA ConnectX-6)
    "ib-hdr": LinkSpec(name="ib-hdr", latency_s=10e-6, bandwidth_bytes_per_s=25 * GB, efficiency=0.85,
                        launch_s=_NCCL_LAUNCH_S),
    # InfiniBand NDR: 400 Gb/s per NIC = 50 GB/s per direction, one NIC per GPU (NVIDIA ConnectX-7)
    "ib-ndr": LinkSpec(name="ib-ndr", latency_s=10e-6, bandwidth_bytes_per_s=50 * GB, efficiency=0.85,
                        launch_s=_NCCL_LAUNCH_S),
    # gloo over the loopback interface of one host (CPU ranks, this project's 2-core test VM): calibrated
    # all-gather on 2 ranks gives an intercept launch + latency of ~0.3 ms and ~1 GB/s (treadle.cost.calibrate,
    # 4 KiB..8 MiB). On 2x2 one all-gather over 4 ranks ran faster than two over 2 (medians 3.6 vs 4.3 ms at
    # 4 KiB on the loaded VM), so launch > latency; 2:1 is a rough split. Calibrate for real figures.
    "loopback": LinkSpec(name="loopback", latency_s=100e-6, bandwidth_bytes_per_s=1 * GB, efficiency=1.0,
                         launch_s=200e-6),
}


def link_preset(name: str) -> LinkSpec:
    """A preset by name. Raises LayoutError listing the known presets."""
    key = name.lower()
    if key not in LINK_PRESETS:
        raise LayoutError(f"unknown link preset {name!r}; known: {sorted(LINK_PRESETS)}")
    return LINK_PRESETS[key]


def flat_link(links: Sequence[LinkSpec]) -> LinkSpec:
    """The link a collective over the flattened group of several axes sees: the largest latency, launch cost and
    skew and the smallest effective bandwidth of its axes (every ring step waits for its slowest hop)."""
    if not links:
        raise LayoutError("flat_link: needs at least one link")
    if len(links) == 1:
        return links[0]
    return _flat_link(tuple(links))


@lru_cache(maxsize=1024)
def _flat_link(links: tuple[LinkSpec, ...]) -> LinkSpec:
    ops = sorted({k for link in links for k, _ in link.op_scale})
    return LinkSpec(name="+".join(link.name for link in links),
                    latency_s=max(link.latency_s for link in links),
                    bandwidth_bytes_per_s=min(link.effective_bytes_per_s for link in links),
                    efficiency=1.0, launch_s=max(link.launch_s for link in links),
                    op_scale=tuple((k, max(link.scale(k) for link in links)) for k in ops),
                    skew_s=max(link.skew_s for link in links),
                    skew_lead_s=max(link.skew_lead_s for link in links))
