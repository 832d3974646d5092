"""The conversion summary printed on stdout."""

from __future__ import annotations

import pytest

from prequant.conversion.summary import Summary


@pytest.mark.parametrize(("input_bytes", "rate"), [(3_500_000, "1.75 MB/s"), (4_200, "2.1 kB/s"), (9e9, "4.5 GB/s")])
def test_rate_reads_in_a_unit_that_shows_it(input_bytes, rate):
    s = Summary(output_dir="out", source="src", device="cpu", input_bytes=int(input_bytes), output_bytes=1,
                tensors_quantized=1, tensors_kept=0, shards=1, seconds=2.0)
    assert f", {rate} of input" in s.to_text() and "0.00 GB/s" not in s.to_text()


def test_unquantized_reasons_read_without_nested_parentheses():
    s = Summary(output_dir="out", source="src", device="cpu", input_bytes=1, output_bytes=1, tensors_quantized=1,
                tensors_kept=1, shards=1, seconds=1.0,
                unquantized_parameters={"skipped (output embedding / tied / last module)": 262_144})
    assert "unquantized: 262,144 parameters: skipped (output embedding / tied / last module)" in s.to_text()
    assert "((" not in s.to_text() and "))" not in s.to_text()
