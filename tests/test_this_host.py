"""Plans for the host they run on (issue 32): a cpu preset is measured before planning, a file or --nominal is
taken as it is, and every price says what machine it assumes."""

from __future__ import annotations

import json
import os

import pytest

from treadle.cost.calibrate import DEFAULT_ROUNDS, AxisFit, Calibration, HeldOut
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.cost.links import LinkSpec
from treadle.cost.this_host import calibration_mesh, host_clusters, measures_this_host
from treadle.errors import LayoutError, PlanError
from treadle.mesh import Mesh
from treadle.planner.validate import validate_axes


def _link(name: str, latency_s: float, bandwidth_bytes_per_s: float) -> LinkSpec:
    return LinkSpec(name=name, latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)


def test_calibration_mesh_is_the_squarest_two_axes_or_one_for_a_prime_world():
    assert {w: tuple(calibration_mesh(w).shape) for w in (1, 2, 4, 6, 7, 8, 9, 12)} == {
        1: (1,), 2: (2,), 4: (2, 2), 6: (2, 3), 7: (7,), 8: (2, 4), 9: (3, 3), 12: (3, 4)}
    assert tuple(calibration_mesh(8, (4, 2)).shape) == (4, 2)
    with pytest.raises(LayoutError, match=r"calibration_mesh: mesh 2x3 has 6 ranks, not 4"):
        calibration_mesh(4, (2, 3))


def test_only_a_cpu_preset_is_measured():
    cpu = parse_cluster("2x2:cpu")
    assert measures_this_host(cpu, "2x2:cpu")
    assert not measures_this_host(cpu, "2x2:cpu", nominal=True)
    assert not measures_this_host(parse_cluster("2x2:h100"), "2x2:h100")
    assert not measures_this_host(cpu, "cluster.json ")  # a file is taken as it is


def test_host_clusters_add_the_world_group_as_one_axis_first():
    mesh = Mesh((2, 2), ("dp", "tp"))
    fast, slow = _link("gloo-dp", 1e-5, 2e9), _link("gloo-tp", 2e-5, 1e9)
    world = _link("gloo-dp+tp", 4e-5, 5e8)
    measured = ClusterSpec(mesh, (fast, slow), "cpu", group_links=((("dp", "tp"), world),)).with_ranks(
        threads_per_rank=1, ranks_per_host=4, cores_per_host=2)
    flat, same = host_clusters(measured)
    assert same is measured
    assert tuple(flat.mesh.shape) == (4,) and flat.links == (world,)
    assert (flat.threads_per_rank, flat.ranks_per_host, flat.cores_per_host) == (1, 4, 2)  # the placement kept
    one_axis = ClusterSpec.uniform(Mesh((4,), ("dp",)), "loopback")
    assert host_clusters(one_axis) == [one_axis]


def test_assumptions_say_where_the_ranks_run_and_which_links_are_presets():
    nominal = parse_cluster("2x2:cpu").assumptions()
    assert nominal.startswith("assumes: ") and "cores per host not stated, not measured" in nominal
    assert "dp=2 on loopback (preset, not measured)" in nominal
    placed = parse_cluster("2x2:cpu").with_ranks(threads_per_rank=1, ranks_per_host=4, cores_per_host=2)
    assert "4 rank(s) sharing 2 core(s)" in placed.assumptions()
    mesh = Mesh((2, 2), ("dp", "tp"))
    measured = ClusterSpec(mesh, (_link("gloo-dp", 1e-5, 2e9), _link("gloo-tp", 2e-5, 1e9)), "cpu")
    assert "tp=2 on gloo-tp (measured or user-given)" in measured.assumptions()


def test_a_calibration_reads_back_what_it_wrote():
    mesh = Mesh((2, 2), ("dp", "tp"))
    links = (_link("gloo-dp", 1e-5, 2e9), _link("gloo-tp", 2e-5, 1e9))
    cluster = ClusterSpec(mesh, links, "cpu", group_links=((("dp", "tp"), _link("gloo-dp+tp", 4e-5, 5e8)),))
    cluster = cluster.with_ranks(threads_per_rank=1, ranks_per_host=4, cores_per_host=2)
    fit = AxisFit(("dp",), 2, (4096, 65536), (1e-4, 2e-4), 9e-5, 6.5e8)
    flat = AxisFit(("dp", "tp"), 4, (4096, 65536), (2e-4, 5e-4), 1.5e-4, 3e8)
    cal = Calibration(cluster, (fit,), flat, 3e-5, (HeldOut("dp", 16384, 1.2e-4, 1.1e-4),),
                      ("measured on this host",))
    back = Calibration.from_json(cal.to_json())
    assert back == cal
    assert json.loads(cal.to_json())["flat_fit"]["axes"] == ["dp", "tp"]  # apart from the axes' fits


def test_axis_mistakes_are_found_before_the_host_is_measured():
    clusters = [parse_cluster("2x2:cpu")]
    with pytest.raises(PlanError, match=r"pin 'x\.weight' names mesh axis 'zz', which no mesh has"):
        validate_axes(clusters, pins={"x.weight": {"zz": 0}}, forbid_axes=(), dp_axis="auto")
    with pytest.raises(PlanError, match=r"dp_axis 'pp' is not a mesh axis"):
        validate_axes(clusters, pins=None, forbid_axes=(), dp_axis="pp")


def test_treadle_plan_with_a_bad_pin_on_a_cpu_preset_spawns_nothing(monkeypatch, capsys):
    import treadle.cost.this_host as this_host
    from treadle.cli import main

    def boom(*a, **k):
        raise AssertionError("measured the host before checking the arguments")

    monkeypatch.setattr(this_host, "calibrate_this_host", boom)
    assert main(["plan", "tiny-gpt2", "--cluster", "2x2:cpu", "--batch", "4", "--seq", "16",
                 "--pin", "*.c_fc.weight=zz:1"]) == 2
    assert "names mesh axis 'zz'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, shape", [([], (2, 2)), (["--max-axes", "1"], (4,)), (["--mesh", "4"], (4,))])
def test_treadle_plan_measures_the_mesh_it_searches(monkeypatch, capsys, flags, shape):
    """Two axes by default (each axis group and the world group); one axis over every rank with --max-axes 1,
    whose plans use that link alone; the --mesh asked for."""
    import treadle.cost.this_host as this_host
    from treadle.cli import main
    from treadle.errors import PlanError

    asked = []

    def record(mesh, **kw):
        asked.append(tuple(mesh.shape))
        raise PlanError("stop after choosing what to measure")

    monkeypatch.setattr(this_host, "calibrate_this_host", record)
    assert main(["plan", "tiny-gpt2", "--cluster", "4:cpu", "--batch", "4", "--seq", "16", "-q", *flags]) == 2
    assert asked == [shape] and "stop after choosing what to measure" in capsys.readouterr().err


@pytest.mark.slow
def test_treadle_plan_on_a_cpu_preset_measures_this_host_and_records_it(tmp_path, capsys, monkeypatch):
    import functools

    from treadle.cli import main
    from treadle.profile import hardware

    # the core without its framework overheads and kernel rates (about 1 s, not 24: those are measured by
    # test_profile_flops' calibrate_cpu tests); here what counts is that this host is measured and recorded
    monkeypatch.setattr(hardware, "calibrate_cpu", functools.partial(hardware.calibrate_cpu, overheads=False,
                                                                     kernels=False))

    out = tmp_path / "plan.json"
    assert main(["plan", "tiny-gpt2", "--cluster", "2:cpu", "--batch", "4", "--seq", "16", "-q",
                 "-o", str(out)]) == 0
    io = capsys.readouterr()
    assert "treadle plan: links and core measured on this host" in io.err.replace("\n", " ")
    saved = json.loads(out.read_text())
    note = saved["solver"]["cluster_measured"]
    assert note.startswith(f"links and core measured on this host ({os.cpu_count()} cores, 2 gloo ranks of 1 "
                           f"thread)")
    cluster = ClusterSpec.from_dict(saved["cluster"])
    assert (cluster.threads_per_rank, cluster.ranks_per_host, cluster.cores_per_host) == (1, 2, os.cpu_count())
    assert all(link.name.startswith("gloo") for link in cluster.links), cluster.links  # measured, not loopback
    assert "calibrate_cpu" in cluster.hardware().source or "measured" in cluster.hardware().source
    text = " ".join(io.out.split())
    assert "assumes: " in text and "(measured or user-given)" in text and "cluster: links and core" in text
    assert DEFAULT_ROUNDS == 5
