"""Session blobs: the state precision a restore converts to (snapshot.in_precision)."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine import snapshot


def _snap(*arrays: np.ndarray) -> snapshot.Snapshot:
    return snapshot.Snapshot("llama", {}, 1, [1, 2], [(f"k{i}", a) for i, a in enumerate(arrays)])


def test_state_is_converted_to_the_models_precision() -> None:
    wide = np.array([[0.5, -3.25], [65504.0, -1e-3]], dtype=np.float32)
    same = np.ones(3, dtype=np.float16)
    out = snapshot.in_precision(_snap(wide, same), np.dtype(np.float16))
    assert [a.dtype for _, a in out.arrays] == [np.float16, np.float16]
    np.testing.assert_array_equal(out.arrays[0][1], wide.astype(np.float16))
    assert out.arrays[1][1] is same  # already in that precision: not copied


@pytest.mark.parametrize("value", [1e6, -7e4, 3.4e38])
def test_a_finite_value_past_the_models_precision_is_refused(value: float) -> None:
    """Finite in the blob's float32, inf in the float16 state: the session's next step would turn it to NaN."""
    state = np.zeros(8, dtype=np.float32)
    state[5] = value
    with pytest.raises(snapshot.BadBlob, match="past the range"):
        snapshot.in_precision(_snap(np.zeros(2, np.float32), state), np.dtype(np.float16))
    assert snapshot.in_precision(_snap(state), np.dtype(np.float32)).arrays[0][1] is state
