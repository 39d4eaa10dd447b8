"""Which simulated die each device array belongs to, and a check that every kernel launch reads only arrays of the
die its thread has current.

The simulator has one memory for every die, so a model over several dies computes the right numbers even when
a layer's kernels read another die's arrays, or its weights were allocated while the wrong die was current: on
hardware those are faults (another context's memory, without peer access) that no logits test here can show.
`DieOwnership` makes them visible: while it is active, every array made by `cuda.to_device` or
`cuda.device_array` is tagged with `current_die()` at the time, and every simulated launch compares the tags of
its array arguments (views included: a tag belongs to the array's root buffer) with the die current at launch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


class DieOwnership:
    def __init__(self, monkeypatch: Any) -> None:
        from numba import cuda
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        from numba.cuda.simulator import kernel as simulated
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        from pantheon.kernels.cuda.backend import current_die

        self._tags: dict[int, tuple[np.ndarray, int | None]] = {}  # id(root) -> (root, kept alive; its die)
        self.launches: Counter[int | None] = Counter()
        self.violations: list[str] = []

        def tagging(make: Any) -> Any:
            def made(*args: Any, **kwargs: Any) -> Any:
                array = make(*args, **kwargs)
                root = _root(array._ary)
                self._tags[id(root)] = (root, current_die())
                return array
            return made

        monkeypatch.setattr(cuda, "to_device", tagging(cuda.to_device))
        monkeypatch.setattr(cuda, "device_array", tagging(cuda.device_array))
        launch = FakeCUDAKernel.__call__

        def checked_launch(kernel: Any, *args: Any) -> Any:
            if kernel._device or simulated._kernel_context:  # a device function, called inside a kernel
                return launch(kernel, *args)
            die = current_die()
            self.launches[die] += 1
            for i, arg in enumerate(args):
                if isinstance(arg, FakeCUDAArray):
                    owner = self._tags.get(id(_root(arg._ary)))
                    if owner is not None and owner[1] != die:
                        self.violations.append(f"{kernel.fn.__name__} on die {die}: argument {i} is die {owner[1]}'s")
            return launch(kernel, *args)

        monkeypatch.setattr(FakeCUDAKernel, "__call__", checked_launch)

    def die_of(self, array: Any) -> int | None:
        """The die an array (or a view of it) was made on; None when it was made before the check began."""
        owner = self._tags.get(id(_root(array._ary)))
        return None if owner is None else owner[1]
