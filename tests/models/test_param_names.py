"""Parameter-name facts: one canonical name however a model is wrapped, and one set of roles."""

import pytest

from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.roles import ROLES, canonical_name
from torchtitan.optim.adam_mini import partition


@pytest.mark.parametrize(
    "wrapped, expected",
    [
        ("layers.0._checkpoint_wrapped_module.attention.wq.weight", "layers.0.attention.wq.weight"),  # checkpointing
        ("_orig_mod.layers.0.attention.wq.weight", "layers.0.attention.wq.weight"),  # torch.compile of the whole model
        ("layers.0._orig_mod.feed_forward.w1.weight", "layers.0.feed_forward.w1.weight"),  # compile per block
        ("_fsdp_wrapped_module.layers.0.ffn_norm.weight", "layers.0.ffn_norm.weight"),  # FSDP1
        ("module.tok_embeddings.weight", "tok_embeddings.weight"),  # DDP
        (
            "module._orig_mod.layers.1._checkpoint_wrapped_module._fsdp_wrapped_module.attention.wo.weight",
            "layers.1.attention.wo.weight",
        ),  # all of them at once
        ("layers.0.attention.wq._orig_mod", "layers.0.attention.wq"),  # a wrapper segment at the end of the name
        ("layers.3.attention.wq.weight", "layers.3.attention.wq.weight"),  # nothing to strip
    ],
)
def test_canonical_name_strips_every_wrapper_segment(wrapped, expected):
    assert canonical_name(wrapped) == expected


@pytest.mark.parametrize(
    "name",
    [
        "layers.0.my_orig_mod.weight",  # a module whose name merely ends like a wrapper's
        "layers.0.x_checkpoint_wrapped_module.weight",
        "encoder.module.weight",  # "module" away from the front is a real module name
        "module",  # a parameter named "module" keeps its name
    ],
)
def test_canonical_name_leaves_segments_that_only_look_like_wrappers(name):
    assert canonical_name(name) == name


def test_the_roles_llama_declares_are_the_roles_its_names_give():
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=8, multiple_of=8))
    declared = model.named_param_roles()
    assert set(declared) == {name for name, _ in model.named_parameters()}
    assert set(declared.values()) <= set(ROLES)
    for name, role in declared.items():
        assert partition.role_from_name(name) == role, name
        assert partition.role_from_name("module._orig_mod." + name) == role, name
