"""Alpha-beta time of one collective over one mesh axis or several at once. Pure functions; seconds and bytes.

Model (Hockney's alpha-beta, with the algorithms of Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005): a call costs the link's `launch_s` once, then each message
step costs `latency_s` (alpha) plus its bytes over the effective bandwidth (1/beta). Byte conventions, per rank:

=================  ==============================================  =========================================
collective         `nbytes` is                                     algorithm (time)
=================  ==============================================  =========================================
all_reduce         the buffer reduced                              min(ring: 2(n-1) steps of B/n,
                                                                       binomial tree: 2 ceil(log2 n) steps of B)
all_gather         the *gathered* result (n x the local input)     ring: n-1 steps of B/n
reduce_scatter     the *input* (n x the local result)              ring: n-1 steps of B/n
all_to_all         the local buffer (a 1/n slice goes to each)     pairwise exchange: n-1 steps of B/n
broadcast          the buffer                                      min(binomial tree: ceil(log2 n) steps of B,
                                                                       scatter + ring all-gather)
send_recv          the message                                     one step
=================  ==============================================  =========================================

Reduction arithmetic and local copies are not counted (they are memory-bound and small next to the link).
A link's `op_scale` (measured by calibration) multiplies the time of the collective it names. A group of one
rank costs nothing. Over several mesh axes (`*_axes_time_s`) the flattened group of prod(n)
ranks runs the same algorithm with the slowest of its links (a ring crossing both fabrics waits for the slower
hop at every step), and the hierarchical alternative runs one collective per axis; the cheaper is returned
(`algorithm="flat"` or `"hierarchical"` forces one).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, Sequence

from ..errors import LayoutError
from .links import LinkSpec, flat_link

if TYPE_CHECKING:  # (annotations only: the cluster module imports this one's links)
    from .cluster import ClusterSpec

Algorithm = Literal["best", "flat", "hierarchical"]


def _check(nbytes: float, n_ranks: int, what: str) -> None:
    if nbytes < 0 or n_ranks < 1:
        raise LayoutError(f"{what}: needs nbytes >= 0 and n_ranks >= 1; got nbytes={nbytes}, n_ranks={n_ranks}")


def _steps_s(steps: int, step_bytes: float, link: LinkSpec) -> float:
    return steps * (link.latency_s + step_bytes / link.effective_bytes_per_s)


# ------------------------------------------------------------------------------------------- one group
def ring_all_reduce_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps of nbytes/n (Thakur et al. 2005, sec. 4.4)."""
    _check(nbytes, n_ranks, "ring_all_reduce_time_s")
    if n_ranks == 1:
        return 0.0
    return link.launch_s + _steps_s(2 * (n_ranks - 1), nbytes / n_ranks, link)


def tree_all_reduce_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 n) steps of the whole buffer (Thakur et al. 2005)."""
    _check(nbytes, n_ranks, "tree_all_reduce_time_s")
    if n_ranks == 1:
        return 0.0
    return link.launch_s + _steps_s(2 * math.ceil(math.log2(n_ranks)), nbytes, link)


def all_reduce_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Sum a buffer of `nbytes` over `n_ranks` ranks: the cheaper of ring (large buffers) and tree (small)."""
    return link.scale("all_reduce") * min(ring_all_reduce_time_s(nbytes, n_ranks, link),
                                          tree_all_reduce_time_s(nbytes, n_ranks, link))


def all_gather_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Ring all-gather producing `nbytes` on every rank (each contributes nbytes/n): n-1 steps of nbytes/n."""
    _check(nbytes, n_ranks, "all_gather_time_s")
    if n_ranks == 1:
        return 0.0
    return link.scale("all_gather") * (link.launch_s + _steps_s(n_ranks - 1, nbytes / n_ranks, link))


def reduce_scatter_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of an `nbytes` input per rank (each keeps nbytes/n): n-1 steps of nbytes/n."""
    _check(nbytes, n_ranks, "reduce_scatter_time_s")
    if n_ranks == 1:
        return 0.0
    return link.scale("reduce_scatter") * (link.launch_s + _steps_s(n_ranks - 1, nbytes / n_ranks, link))


def all_to_all_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Pairwise-exchange all-to-all of an `nbytes` local buffer: n-1 steps, each sending one nbytes/n slice."""
    _check(nbytes, n_ranks, "all_to_all_time_s")
    if n_ranks == 1:
        return 0.0
    return link.scale("all_to_all") * (link.launch_s + _steps_s(n_ranks - 1, nbytes / n_ranks, link))


def broadcast_time_s(nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """Broadcast `nbytes` from one rank: the cheaper of a binomial tree (ceil(log2 n) steps of nbytes) and
    scatter + ring all-gather (van de Geijn; ceil(log2 n) steps halving from nbytes/2, then n-1 of nbytes/n)."""
    _check(nbytes, n_ranks, "broadcast_time_s")
    if n_ranks == 1:
        return 0.0
    log_n = math.ceil(math.log2(n_ranks))
    tree_s = _steps_s(log_n, nbytes, link)
    scatter_s = log_n * link.latency_s + (n_ranks - 1) / n_ranks * nbytes / link.effective_bytes_per_s
    return link.launch_s + min(tree_s, scatter_s + _steps_s(n_ranks - 1, nbytes / n_ranks, link))


def collective_time_s(kind: str, nbytes: float, n_ranks: int, link: LinkSpec) -> float:
    """The time of one collective by its kind ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "broadcast"); 0 on one rank."""
    if n_ranks <= 1:
        return 0.0
    fn = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s, "reduce_scatter": reduce_scatter_time_s,
          "all_to_all": all_to_all_time_s, "broadcast": broadcast_time_s}[kind]
    return fn(nbytes, n_ranks, link)


def send_recv_time_s(nbytes: float, link: LinkSpec) -> float:
    """One point-to-point message of `nbytes`."""
    _check(nbytes, 2, "send_recv_time_s")
    return link.launch_s + _steps_s(1, nbytes, link)


# ------------------------------------------------------------------------------------------ several axes
def _axes(cluster: "ClusterSpec", axes: Sequence[str] | str) -> tuple[tuple[int, ...], tuple[LinkSpec, ...]]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    if not names:
        raise LayoutError(f"collective over no mesh axes; name one or more of {list(cluster.mesh.names)}")
    if len(set(names)) != len(names):
        raise LayoutError(f"collective over mesh axes {names}: an axis appears twice")
    sizes = tuple(cluster.mesh.size(a) for a in names)
    return sizes, tuple(cluster.link(a) for a in names)


def _pick(flat_s: float, hier_s: float, algorithm: Algorithm) -> float:
    if algorithm == "flat":
        return flat_s
    if algorithm == "hierarchical":
        return hier_s
    if algorithm != "best":
        raise LayoutError(f"algorithm must be 'best', 'flat' or 'hierarchical'; got {algorithm!r}")
    return min(flat_s, hier_s)


def all_gather_axes_time_s(nbytes: float, *, cluster: "ClusterSpec", axes: Sequence[str] | str,
                           algorithm: Algorithm = "best") -> float:
    """All-gather over several mesh axes producing `nbytes` per rank. `axes` run outer to inner (the order
    they shard the dim); hierarchically the innermost axis gathers first, on the smallest buffer."""
    sizes, links = _axes(cluster, axes)
    flat_s = all_gather_time_s(nbytes, math.prod(sizes), flat_link(links))
    hier_s, out_bytes = 0.0, nbytes / math.prod(sizes)
    for n, link in zip(reversed(sizes), reversed(links)):
        out_bytes *= n
        hier_s += all_gather_time_s(out_bytes, n, link)
    return _pick(flat_s, hier_s, algorithm)


def reduce_scatter_axes_time_s(nbytes: float, *, cluster: "ClusterSpec", axes: Sequence[str] | str,
                               algorithm: Algorithm = "best") -> float:
    """Reduce-scatter of an `nbytes` input over several mesh axes (outer to inner; the outermost scatters
    first, on the largest buffer). The adjoint of `all_gather_axes_time_s`, at the same cost."""
    sizes, links = _axes(cluster, axes)
    flat_s = reduce_scatter_time_s(nbytes, math.prod(sizes), flat_link(links))
    hier_s, in_bytes = 0.0, float(nbytes)
    for n, link in zip(sizes, links):
        hier_s += reduce_scatter_time_s(in_bytes, n, link)
        in_bytes /= n
    return _pick(flat_s, hier_s, algorithm)


def all_reduce_axes_time_s(nbytes: float, *, cluster: "ClusterSpec", axes: Sequence[str] | str,
                           algorithm: Algorithm = "best") -> float:
    """All-reduce of `nbytes` over several mesh axes. Hierarchical: the best of one all-reduce per axis in
    turn and reduce-scatter over one axis, all-reduce of the 1/n remainder over the others, all-gather back
    (the two-level scheme NCCL and Horovod use across nodes)."""
    sizes, links = _axes(cluster, axes)
    flat_s = all_reduce_time_s(nbytes, math.prod(sizes), flat_link(links))
    hier_s = _hier_all_reduce_s(float(nbytes), sizes, links)
    return _pick(flat_s, hier_s, algorithm)


@lru_cache(maxsize=4096)
def _hier_all_reduce_s(nbytes: float, sizes: tuple[int, ...], links: tuple[LinkSpec, ...]) -> float:
    if len(sizes) == 1:
        return all_reduce_time_s(nbytes, sizes[0], links[0])
    best = math.inf
    for i, (n, link) in enumerate(zip(sizes, links)):
        rest_sizes, rest_links = sizes[:i] + sizes[i + 1:], links[:i] + links[i + 1:]
        rest_flat = all_reduce_time_s(nbytes / n, math.prod(rest_sizes), flat_link(rest_links))
        rest_s = min(rest_flat, _hier_all_reduce_s(nbytes / n, rest_sizes, rest_links))
        two_level = reduce_scatter_time_s(nbytes, n, link) + rest_s + all_gather_time_s(nbytes, n, link)
        one_by_one = all_reduce_time_s(nbytes, n, link) + min(
            all_reduce_time_s(nbytes, math.prod(rest_sizes), flat_link(rest_links)),
            _hier_all_reduce_s(nbytes, rest_sizes, rest_links))
        best = min(best, two_level, one_by_one)
    return best


def all_to_all_axes_time_s(nbytes: float, *, cluster: "ClusterSpec", axes: Sequence[str] | str) -> float:
    """All-to-all of an `nbytes` local buffer over the flattened group of several axes (flat only: a
    sequence of per-axis all-to-alls is a different data movement)."""
    sizes, links = _axes(cluster, axes)
    return all_to_all_time_s(nbytes, math.prod(sizes), flat_link(links))


def broadcast_axes_time_s(nbytes: float, *, cluster: "ClusterSpec", axes: Sequence[str] | str,
                          algorithm: Algorithm = "best") -> float:
    """Broadcast `nbytes` over several mesh axes: flat, or one broadcast per axis in turn."""
    sizes, links = _axes(cluster, axes)
    flat_s = broadcast_time_s(nbytes, math.prod(sizes), flat_link(links))
    hier_s = sum(broadcast_time_s(nbytes, n, link) for n, link in zip(sizes, links))
    return _pick(flat_s, hier_s, algorithm)
