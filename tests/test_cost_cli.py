"""`treadle cluster` and `treadle calibrate` sub-commands, and cluster JSON files as cluster specs."""

import argparse
import json
import os
import re

import pytest

from treadle.cli import cost as cli
from treadle.cost.cluster import ClusterSpec, parse_cluster
from treadle.errors import LayoutError, MeshError


def _run(argv):
    parser = argparse.ArgumentParser(prog="treadle")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cluster_command_tables_and_json(capsys):
    assert _run(["cluster", "2x4:a100", "--meshes"]) == 0
    out = capsys.readouterr().out
    assert "nvlink3" in out and "ib-hdr" in out and "2 x 2 x 2" in out and "dp, fsdp, tp" in out
    assert _run(["cluster", "8x8:h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert ClusterSpec.from_dict(data["cluster"]) == parse_cluster("8x8:h100") and data["meshes"] == []


def test_cluster_json_file_is_a_cluster_spec(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(parse_cluster("2x8:a100:pcie4").to_json())
    assert parse_cluster(str(path)) == parse_cluster("2x8:a100:pcie4")
    with pytest.raises(LayoutError, match=r"cluster file '.*missing.json' does not exist"):
        parse_cluster(str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_calibrate_command_writes_a_usable_spec(tmp_path, capsys):
    out = tmp_path / "gloo.json"
    assert _run(["calibrate", "--mesh", "2", "--rounds", "3", "--chain", "2", "--held-out", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "held-out sizes" in text and f"wrote {out}" in text.replace("\n", "")
    # one row per collective: the all-gather fits the link, every other one names its factor against the model
    rows = [line for line in text.splitlines() if "│" in line]
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert any(op in r for r in rows), (op, text)
    assert any("all_gather" in r and "fitted" in r for r in rows)
    assert any("reduce_scatter" in r and re.search(r"x\d+\.\d\d", r) for r in rows)
    assert "measured on this host" in text and "assumes: " in text
    cluster = parse_cluster(str(out))
    # the ranks' placement on this host is recorded with the links (NOTE [rank device])
    assert (cluster.threads_per_rank, cluster.ranks_per_host, cluster.cores_per_host) == (1, 2, os.cpu_count())
    assert cluster.mesh.shape == (2,) and cluster.mesh.names == ("dp",) and cluster.link("dp").name == "gloo-dp"
    assert cluster.link("dp").bandwidth_bytes_per_s > 0 and cluster.copy_bytes_per_s > 0
    # the other collectives get their measured factor against the model
    assert {op for op, _ in cluster.link("dp").op_scale} == {"reduce_scatter", "all_reduce", "all_to_all"}


def test_calibrate_command_rejects_bad_mesh():
    with pytest.raises(Exception, match=r"calibrate: --mesh '2y2' is not a shape like '2x2' or '4'"):
        _run(["calibrate", "--mesh", "2y2"])
    with pytest.raises(MeshError, match=r"1 sizes \(2,\) but 2 axis names"):
        _run(["calibrate", "--mesh", "2", "--names", "a", "b"])
