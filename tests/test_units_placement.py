"""The base layer: one placement algebra (codes, conversion, one printer) and one units module."""

import math

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from treadle.errors import LayoutError, TreadleError
from treadle.placement import P, R, code_of, placement_of, placement_str
from treadle.units import (GiB, MiB, UnitError, bytes_unit, fmt_bytes, fmt_bytes_exact, fmt_count, fmt_flops,
                           fmt_ms, fmt_time, parse_bytes)


def test_codes_round_trip_every_form():
    for p, code in ((Replicate(), R), (Partial(), P), (Shard(0), 0), (Shard(3), 3)):
        assert code_of(p) == code
        assert placement_of(code) == p
        assert code_of(placement_str(p)) == code
        assert code_of(placement_str(p, token=True)) == code
    assert [placement_str(c) for c in (R, P, 2)] == ["R", "P", "S(2)"]
    assert [placement_str(c, token=True) for c in (R, P, 2)] == ["R", "P", "S2"]
    assert code_of("replicate") == R and code_of("psum") == P and code_of("s(1)") == 1


def test_bad_placements_name_the_axis():
    with pytest.raises(LayoutError, match=r"axis tp: cannot parse 'X'"):
        code_of("X", "tp")
    with pytest.raises(LayoutError, match=r"only Partial\('sum'\)"):
        code_of(Partial("max"))
    with pytest.raises(LayoutError, match="got 3"):
        code_of(3)  # an int is a code, not a placement
    with pytest.raises(LayoutError, match="code -5 is none of"):
        placement_str(-5)


def test_parse_bytes_and_its_error():
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes(" 80 gb ") == 80e9
    assert parse_bytes("1e9") == 1e9
    for bad in ("lots", "80 parsecs", "1.2.3GB"):
        with pytest.raises(UnitError, match=f"cannot read memory size '{bad}'") as info:
            parse_bytes(bad)
        assert isinstance(info.value, TreadleError) and isinstance(info.value, ValueError)


def test_formatters():
    assert bytes_unit([0.2 * GiB]) == ("GiB", GiB) and bytes_unit([MiB]) == ("MiB", MiB)
    assert fmt_bytes(1.5 * GiB) == "1.50 GiB" and fmt_bytes(512) == "512 B"
    assert fmt_bytes_exact(None) == "unlimited" and fmt_bytes_exact(math.inf) == "inf"
    assert fmt_bytes_exact(GiB) == "1.000 GiB (1073741824 B)" and fmt_bytes_exact(MiB) == "1.000 MiB (1048576 B)"
    assert fmt_flops(3.2e12) == "3.20 TFLOP" and fmt_count(1_200_000) == "1.20M"
    assert fmt_time(2.0) == "2.000 s" and fmt_time(3.1e-3) == "3.10 ms" and fmt_time(12e-6) == "12.0 us"
    assert fmt_ms(0.0125) == "12.500 ms" and fmt_ms(12.0) == "12.00 s"
