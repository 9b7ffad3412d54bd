"""The demo decodes through graphs with no step differing from eager."""

from __future__ import annotations

from graphslot.demo import format_demo_table, run_demo


def test_short_demo_matches_eager_and_prints_a_table():
    result = run_demo(steps=30, progress=False)
    assert result["backend"] == "cpu" and result["check"] == "torch.equal"
    assert result["mismatching_steps"] == 0
    assert result["decode_steps"] >= 25 and len(result["batch_sizes"]) >= 4
    assert result["captured_sizes"] == sorted(result["captured_sizes"], reverse=True)
    assert result["fill_us_generated"] > 0 and result["fill_us_interpreted"] > 0
    assert result["static_bytes"] > 0
    table = format_demo_table(result)
    header = table.splitlines()[0]
    assert "metric" in header and "value" in header
    for row in ("captured sizes", "mismatching steps", "fill_from generated", "static buffers"):
        assert row in table
