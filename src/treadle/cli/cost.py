"""`treadle cluster` (show a cluster and the logical meshes it admits) and `treadle calibrate` (fit links on gloo).

    treadle cluster 8x8:h100 --meshes          # links per axis, then every logical mesh shape
    treadle calibrate --mesh 2x2 --cpu -o cluster.json  # a core, then 4 gloo ranks: links per collective, saved
    treadle calibrate --mesh 2x2 --emulate-nodes 2 --inter-node-rate 200mbit  # dp across 2 emulated nodes (root)

A saved spec is accepted wherever a cluster string is (`parse_cluster("cluster.json")`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TreadleError
from .output import add_quiet_flag, is_quiet, progress
from .output import console as table_console

if TYPE_CHECKING:
    from rich.table import Table

    from ..cost.calibrate import Calibration
    from ..cost.cluster import ClusterSpec
    from ..mesh import Mesh

logger = logging.getLogger(__name__)

# `treadle calibrate`'s defaults, as treadle.cost.calibrate defines them (read there when the command runs; a
# test checks they agree): the parser is built without the cost model
LEAD_MS_DEFAULT = 2.0  # DEFAULT_LEAD_COMPUTE_S * 1e3
CHAIN_DEFAULT = 8  # DEFAULT_CHAIN
ROUNDS_DEFAULT = 5  # DEFAULT_ROUNDS


def cluster_table(cluster: ClusterSpec) -> Table:
    """One row per mesh axis: size, link, latency, launch cost, effective bandwidth."""
    from rich.table import Table

    t = Table("axis", "size", "link", "latency us", "launch us", "GB/s (effective)",
              title=f"{cluster.device_name} cluster")
    for name, size, link in zip(cluster.mesh.names, cluster.mesh.shape, cluster.links):
        t.add_row(name, str(size), link.name, f"{link.latency_s * 1e6:.1f}", f"{link.launch_s * 1e6:.1f}",
                  f"{link.effective_bytes_per_s / 1e9:.1f}")
    return t


def meshes_table(specs: list[ClusterSpec]) -> Table:
    """One row per logical mesh: shape, axis names, link of each axis."""
    from rich.table import Table

    t = Table("mesh shape", "axes", "links")
    for s in specs:
        t.add_row(" x ".join(map(str, s.mesh.shape)), ", ".join(s.mesh.names), ", ".join(x.name for x in s.links))
    return t


def calibration_table(cal: Calibration) -> Table:
    """One row per process group and collective: the group (a mesh axis, or the world group flattening every
    axis), the collective, the all-gather's fitted latency, launch cost and bandwidth (the link), each other
    collective's measured time factor against its model on that link (`LinkSpec.op_scale`), and the group's
    drift (`LinkSpec.skew_s`)."""
    from rich.table import Table

    from ..cost.timing import COLLECTIVES

    t = Table("group", "ranks", "collective", "latency us", "launch us", "GB/s", "time vs model", "drift us",
              title=f"links measured on {cal.cluster.world_size} gloo ranks")
    cluster = cal.cluster
    groups = [(name, n, link) for name, n, link in zip(cluster.mesh.names, cluster.mesh.shape, cluster.links)
              if n > 1]
    groups += [("+".join(axes) + " (world)", cluster.world_size, link) for axes, link in cluster.group_links]
    for name, n, link in groups:
        for k, op in enumerate(COLLECTIVES):
            fitted = op == "all_gather"
            t.add_row(name if k == 0 else "", str(n) if k == 0 else "", op,
                      f"{link.latency_s * 1e6:.0f}" if fitted else "", f"{link.launch_s * 1e6:.0f}" if fitted else "",
                      f"{link.bandwidth_bytes_per_s / 1e9:.2f}" if fitted else "",
                      "fitted" if fitted else f"x{link.scale(op):.2f}",
                      f"{link.skew_s * 1e6:.0f}" if k == 0 else "")
    return t


def held_out_table(cal: Calibration) -> Table:
    """The held-out sizes (measured, not fitted): each collective's measured time beside the model's."""
    from rich.table import Table

    t = Table("axis", "collective", "KiB", "measured us", "predicted us", "error", title="held-out sizes")
    for h in cal.held_out:
        t.add_row(h.axis, h.op, f"{h.nbytes >> 10}", f"{h.measured_s * 1e6:.0f}", f"{h.predicted_s * 1e6:.0f}",
                  f"{h.rel_error:+.0%}")
    return t


def _parse_mesh(text: str, names: list[str] | None) -> Mesh:
    from ..cost.cluster import default_axis_names
    from ..mesh import Mesh

    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise TreadleError(f"calibrate: --mesh {text!r} is not a shape like '2x2' or '4'") from None
    return Mesh(shape, tuple(names) if names else default_axis_names(len(shape)))


def _cmd_cluster(args: argparse.Namespace) -> int:
    from ..cost.cluster import enumerate_meshes, parse_cluster

    cluster = parse_cluster(args.spec)
    specs = []
    if args.meshes:
        nodes, per_node = cluster.mesh.shape if cluster.mesh.ndim == 2 else (1, cluster.mesh.world_size)
        specs = enumerate_meshes(nodes, per_node, intra=cluster.links[-1], inter=cluster.links[0],
                                 device=cluster.device, max_ndim=args.max_ndim)
    if args.json:
        print(json.dumps({"cluster": cluster.to_dict(), "meshes": [s.to_dict() for s in specs]}, indent=2))
        return 0
    console = table_console()
    console.print(cluster_table(cluster))
    if specs:
        console.print(meshes_table(specs))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    mesh = _parse_mesh(args.mesh, args.names)
    from ..cost.this_host import calibrate_this_host
    from ..testing import check_process_count

    check_process_count(mesh.world_size, where=f"calibrate --mesh {args.mesh}")  # before measuring the CPU
    if args.rounds < 1 or args.chain < 1 or args.lead_ms < 0:
        raise TreadleError(f"calibrate: --rounds and --chain must be >= 1 and --lead-ms >= 0; got {args.rounds}, "
                           f"{args.chain}, {args.lead_ms}")
    nodes = contextlib.nullcontext()
    if args.emulate_nodes:
        from ..emulated_nodes import emulated_nodes

        if args.emulate_nodes < 2 or mesh.world_size % args.emulate_nodes:
            raise TreadleError(f"calibrate: --emulate-nodes {args.emulate_nodes} must be >= 2 and divide the "
                               f"{mesh.world_size} ranks of --mesh {args.mesh}")
        nodes = emulated_nodes(args.emulate_nodes, mesh.world_size // args.emulate_nodes, rate=args.inter_node_rate)
    with nodes as cluster, progress(f"calibrating {mesh} on {mesh.world_size} gloo processes"
                                    + (f" ({cluster})" if cluster else ""), quiet=is_quiet(args)):
        # the core (with --cpu) is measured before any rank starts; nothing is cached: it lands in the file
        cal = calibrate_this_host(mesh, rounds=args.rounds, held_out=args.held_out, lead_compute_s=args.lead_ms / 1e3,
                                  chain=args.chain, cpu=args.cpu, timeout_s=args.timeout, nodes=cluster)
    if args.output:
        Path(args.output).write_text(cal.cluster.to_json())
    if args.json:
        print(cal.to_json())
        return 0
    console = table_console()
    console.print(calibration_table(cal))
    if cal.held_out:
        console.print(held_out_table(cal))
    for note in cal.notes:
        console.print(f"note: {note}")
    console.print(cal.cluster.assumptions())
    if args.output:
        console.print(f"wrote {args.output}")
    return 0


def register(subparsers) -> None:
    """Add `cluster` and `calibrate` to the treadle command line."""
    p = subparsers.add_parser("cluster", help="show a cluster spec and the logical meshes it admits")
    p.add_argument("spec", help="e.g. 8x8:h100, 2x8:a100:pcie4, 2x2:cpu, or a cluster JSON file")
    p.add_argument("--meshes", action="store_true", help="list every logical mesh shape with its links")
    p.add_argument("--max-ndim", type=int, default=3, help="most mesh axes to enumerate (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_cmd_cluster)

    c = subparsers.add_parser("calibrate", help="measure alpha/beta per mesh axis on gloo ranks of this host")
    c.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 (4 ranks) or 2 (default 2x2)")
    c.add_argument("--names", nargs="+", help="axis names (default dp tp for two axes)")
    c.add_argument("--rounds", type=int, default=ROUNDS_DEFAULT,
                   help="timing sweeps per size (their mean: NOTE [a step pays the mean]; NOTE [calibration "
                        "rounds]; default %(default)s)")
    c.add_argument("--held-out", action="store_true",
                   help="also time the held-out sizes and print the model's error on them (about twice as long)")
    c.add_argument("--lead-ms", type=float, default=LEAD_MS_DEFAULT,
                   help="compute before each timed collective, as a step issues it (NOTE [in-step collectives]; "
                        "0: right after a barrier; default %(default)s)")
    c.add_argument("--chain", type=int, default=CHAIN_DEFAULT,
                   help="(compute, collective) pairs timed back to back per sample, as a step pays them, and the "
                        "links' drift measured (NOTE [collectives in a chain]; 1: each call alone after a barrier; "
                        "default %(default)s)")
    c.add_argument("--emulate-nodes", type=int, default=0, metavar="N",
                   help="run the ranks as N emulated nodes of this host (network namespaces, root; the ranks of a "
                        "node consecutive, so the first mesh axes cross nodes): treadle.emulated_nodes")
    c.add_argument("--inter-node-rate", default="100mbit",
                   help="with --emulate-nodes: the tc rate between nodes (default %(default)s)")
    c.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    c.add_argument("-o", "--output", help="write the calibrated ClusterSpec JSON here")
    c.add_argument("--cpu", action="store_true",
                   help="also measure one CPU core (calibrate_cpu) and record this host's cores shared by the "
                        "ranks (1 thread each) in the file")
    c.add_argument("--json", action="store_true", help="print the full calibration as JSON")
    add_quiet_flag(c)
    c.set_defaults(func=_cmd_calibrate)
