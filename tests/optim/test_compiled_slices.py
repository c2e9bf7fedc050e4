"""Slicing an optimizer's parameter list so that compiled graphs are shared between layers."""

import torch

from torchtitan.optim.compiled_slices import CompiledStep, repeating_slices

LAYER = ["attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]
# Signatures as a Llama's parameters have them: both norms of a layer and the final norm share one shape, and so
# do the embedding and the output projection (tied shapes, not tied weights).
SHAPE = {"attention_norm": "norm", "ffn_norm": "norm", "norm": "norm", "tok_embeddings": "vocab", "output": "vocab"}


def _llama(n_layers: int) -> list[str]:
    return ["tok_embeddings"] + [name for _ in range(n_layers) for name in LAYER] + ["norm", "output"]


def test_every_parameter_lands_in_exactly_one_slice_and_most_slices_repeat():
    for n_layers in (1, 2, 8, 48):
        names = _llama(n_layers)
        signatures = [SHAPE.get(name, name) for name in names]
        slices = repeating_slices(list(range(len(names))), signatures)
        assert sorted(i for part in slices for i in part) == list(range(len(names)))
        assert len(slices) == n_layers  # one compiled call per layer
        distinct = {tuple(signatures[i] for i in part) for part in slices}
        assert len(distinct) <= 3, (n_layers, distinct)  # graphs to compile, whatever the depth


def test_unrelated_shapes_get_one_slice_and_nothing_gives_none():
    assert repeating_slices([4, 7, 9], ["a", "b", "c"]) == [[4, 7, 9]]
    assert repeating_slices([], []) == []


def test_compiled_step_runs_meta_tensors_eagerly_slice_by_slice():
    calls = []

    def add_one(tensors):
        calls.append(len(tensors))
        for t in tensors:
            t.add_(1)

    step = CompiledStep(add_one, "test")
    tensors = [torch.empty(2, device="meta") for _ in range(3)]
    torch._dynamo.utils.counters.clear()
    step.run([[0, 1], [2]], lambda part: ([tensors[i] for i in part],), tensors)
    assert calls == [2, 1]  # Python ran it (a compiled graph would not append), once per slice
    assert not dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs")
