"""One model over several dies: its layers in contiguous segments, one cuda backend per die.

A model loaded with several dies (`--dies 0,1`, or `dies` on a load) gets a `DieSegments` as its backend. Layer
li lives on die `segment_of(li, n_layers, n_dies)`: contiguous runs of as equal a length as the count allows,
in the order the dies were named. The embedding is on the first die, the output norm and matrix on the last;
each layer's weights, and its KV rings, on its own die. A forward pass runs each segment on its die and hands
the activations (the residual stream, the normed input, the step's positions and slots) to the next die
through host memory, a copy of a few rows per step. The model asks `for_layer` which backend a layer uses; only
the llama architecture does (ModelManager refuses several dies for the others).

To the rest of the server this is one backend: `graphs` and `attention_residency` add up the dies' counters,
`close` gives every die its bytes back, and anything else (`upload`, `embed`, `to_host` ...) is the first die's.
A decode step runs through the same plan as on one die (decode_step.py), each layer on its die through that
die's graph slots, filed under the class "segment"; the hand-over between dies happens outside the graphs.
Prefill chunks launch directly, through the model's own forward.
"""

from __future__ import annotations

from typing import Any

from pantheon.kernels.cuda import decode_step


def segment_of(layer: int, n_layers: int, n_dies: int) -> int:
    """The die index (into the model's list) of layer `layer`: contiguous segments, sizes differing by one at most."""
    return layer * n_dies // max(n_layers, 1)


def _added(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Counter objects added key by key (nested objects too); a key missing from one part counts as zero."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                out[key] = _added([out.get(key, {}), value])
            else:
                out[key] = out.get(key, 0) + value
    return out


class _AddedGraphs:
    def __init__(self, dies: list[Any]) -> None:
        self._dies = dies

    def summary(self) -> dict[str, Any] | None:
        parts = [p for p in (be.graphs.summary() for be in self._dies) if p is not None]
        return _added(parts) if parts else None

    def counters(self) -> dict[str, Any] | None:
        parts = [p for p in (be.graphs.counters() for be in self._dies) if p is not None]
        return _added(parts) if parts else None


class _AddedAttention:
    def __init__(self, dies: list[Any]) -> None:
        self._dies = dies

    def counters(self, operator: bool = False) -> dict[str, Any] | None:
        parts = [p for p in (be.attention_residency.counters(operator) for be in self._dies) if p is not None]
        return _added(parts) if parts else None


class DieSegments:
    """The backends of one model's dies, in the order named, and which layer runs on which."""

    name = "cuda"
    accelerator = True

    def __init__(self, dies: list[Any]) -> None:
        if len(dies) < 2:
            raise ValueError("DieSegments needs two dies or more")
        self.dies = dies
        self.die = dies[0].die
        self.kv_dtype = dies[0].kv_dtype
        self.graphs = _AddedGraphs(dies)
        self.attention_residency = _AddedAttention(dies)

    @property
    def first(self) -> Any:
        return self.dies[0]

    @property
    def last(self) -> Any:
        return self.dies[-1]

    def for_layer(self, layer: int, n_layers: int) -> Any:
        return self.dies[segment_of(layer, n_layers, len(self.dies))]

    def hand_over(self, arrays: tuple[Any, ...], source: Any, target: Any) -> tuple[Any, ...]:
        """Arrays of `source`'s die as copies on `target`'s, which becomes the thread's current die."""
        host = [source.to_host(a) for a in arrays]
        target.begin_step()
        return tuple(target.upload(h) for h in host)

    def begin_step(self) -> None:
        self.first.begin_step()

    def decode_plan(self, blocks: list[Any], output_norm: Any, head_dim: int, tok_embd: Any = None,
                    output: Any = None) -> decode_step.CudaDecodePlan | None:
        if tok_embd is None or output is None:
            return None
        layers = [self.for_layer(li, len(blocks)) for li in range(len(blocks))]
        return decode_step.CudaDecodePlan(blocks, output_norm, head_dim, tok_embd, output, layer_backends=layers,
                                          output_backend=self.last)

    def heal_rings(self, k_pools: list[Any], v_pools: list[Any]) -> None:
        """Each die retries its own layers' host rings (with its context current)."""
        n_layers = len(k_pools)
        for die in self.dies:
            layers = [li for li in range(n_layers) if self.for_layer(li, n_layers) is die]
            ks, vs = [k_pools[li] for li in layers], [v_pools[li] for li in layers]
            die.begin_step()
            die.heal_rings(ks, vs)
            for li, k, v in zip(layers, ks, vs):
                k_pools[li], v_pools[li] = k, v
        self.first.begin_step()

    def close(self) -> None:
        for die in self.dies:
            die.close()

    def synchronize(self) -> None:
        for die in self.dies:
            die.synchronize()

    def __getattr__(self, name: str) -> Any:
        # Everything else (upload, embed, to_host, vector ...) is the first die's, `decode_step` included: the plan
        # it is given says which die runs which layers. Not the hybrid decode plan: only llama models are split
        # over dies (registry.SEGMENTED_ARCHITECTURES).
        if name in ("dies", "hybrid_decode_plan"):
            raise AttributeError(name)
        return getattr(self.dies[0], name)


__all__ = ["DieSegments", "segment_of"]
