"""bench/attention_parts.py: its `real` variant is ops.py's decode attention, bit for bit, and a variant without a
part computes something else (the part really is left out), on tiny shapes. Every variant's statement is found in
ops.py; two of them run (each compiles its own copy of the attention, ~14 s)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.attention_parts import VARIANTS, attend, load_variants, make_inputs, measure
from pantheon.kernels.cpu import ops

pytestmark = pytest.mark.slow


def test_variants_time_the_real_attention_and_leave_their_part_out(tmp_path: Path) -> None:
    modules = load_variants(list(VARIANTS), tmp_path)
    inputs = make_inputs(batch=2, position=40, q_heads=4, kv_heads=2, head_dim=16)
    assert set(modules) == set(VARIANTS)
    got = measure({name: modules[name] for name in ("real", "no_scores")}, inputs, rounds=1, calls=2)
    want = attend(ops, inputs, np.empty_like(inputs["q"]))
    np.testing.assert_array_equal(got["outputs"]["real"], want)
    assert not np.array_equal(got["outputs"]["no_scores"], want)
    assert got["ns_per_call"]["real"] > 0 and got["ns_per_call"]["no_scores"] > 0


def test_a_statement_ops_py_no_longer_has_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(VARIANTS, "no_scores", ("a statement ops.py does not have", ""))
    with pytest.raises(SystemExit, match="no longer has the statement no_scores replaces"):
        load_variants(["no_scores"], tmp_path)
