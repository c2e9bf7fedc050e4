import dataclasses

import pytest
import torch

from tests.helpers import SEQ_LEN, TINY
from torchtitan.models.llama import ModelArgs, Transformer, llama3_configs
from torchtitan.models.llama.model import apply_rope, rope_table
from torchtitan.models.roles import canonical_name


def count(args):
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())


def expected_count(a: ModelArgs) -> int:
    attn = a.dim * a.dim * 2 + 2 * a.dim * a.kv_heads * a.head_dim
    ffn = 3 * a.dim * a.ffn_hidden_dim
    return 2 * a.vocab_size * a.dim + a.n_layers * (attn + ffn + 2 * a.dim) + a.dim


@pytest.mark.parametrize("flavor, published", [("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9)])
def test_flavor_parameter_counts_on_meta(flavor, published):
    args = llama3_configs[flavor]
    n = count(args)
    assert n == expected_count(args)
    assert abs(n - published) / published < 0.001


@pytest.mark.parametrize(
    "flavor, published",
    # Parameter counts of the published checkpoints (safetensors), the tied output projection counted once.
    [("3.2-1B", 1_235_814_400), ("3.2-3B", 3_212_749_824), ("3.1-8B", 8_030_261_248)],
)
def test_published_flavors_have_the_published_parameter_counts(flavor, published):
    args = llama3_configs[flavor]
    tied_share = args.vocab_size * args.dim if args.enable_weight_tying else 0
    assert count(args) == expected_count(args) - tied_share == published


def test_existing_flavors_keep_their_meaning():
    for flavor in ("debugmodel", "debugmodel_gqa", "1B", "8B", "70B", "405B"):
        args = llama3_configs[flavor]
        assert (args.rope_scaling, args.enable_weight_tying) == ("none", False)
    for flavor in ("1B", "8B", "70B", "405B"):
        scaled = llama3_configs["3.2-1B" if flavor == "1B" else f"3.1-{flavor}"]
        shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "rope_theta", "vocab_size")
        assert [getattr(scaled, key) for key in shape] == [getattr(llama3_configs[flavor], key) for key in shape]


def test_a_tied_model_has_one_parameter_for_embedding_and_output_after_to_empty():
    tied = dataclasses.replace(TINY, enable_weight_tying=True)
    with torch.device("meta"):
        model = Transformer(tied)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert [name for name, _ in model.named_parameters()].count("tok_embeddings.weight") == 1
    assert not any(name == "output.weight" for name, _ in model.named_parameters())
    # Drawn as an output projection (std dim**-0.5), not as an embedding (std 1).
    assert model.tok_embeddings.weight.std().item() < 2 * TINY.dim**-0.5
    assert model.tied_weights() == {"output.weight": "tok_embeddings.weight"}


def test_8b_shapes():
    args = llama3_configs["8B"]
    assert args.ffn_hidden_dim == 14336 and args.head_dim == 128 and args.kv_heads == 8
    assert llama3_configs["70B"].ffn_hidden_dim == 28672
    assert llama3_configs["405B"].ffn_hidden_dim == 53248


def test_parameter_names_follow_torchtitan():
    names = {n for n, _ in Transformer(TINY).named_parameters()}
    assert {
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        "layers.0.attention.wq.weight",
        "layers.1.attention.wk.weight",
        "layers.1.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
    } <= names


def test_forward_shapes_and_gqa_weight_shapes():
    args = TINY
    model = Transformer(args)
    model.init_weights(seed=0)
    assert model.layers["0"].attention.wk.weight.shape == (args.kv_heads * args.head_dim, args.dim)
    logits = model(torch.randint(0, args.vocab_size, (3, SEQ_LEN)))
    assert logits.shape == (3, SEQ_LEN, args.vocab_size)


def test_roles_cover_every_parameter():
    model = Transformer(TINY)
    roles = model.named_param_roles()
    assert set(roles) == {n for n, _ in model.named_parameters()}
    assert roles["layers.1.attention.wq.weight"] == "query"
    assert roles["layers.1.attention.wk.weight"] == "key"
    assert roles["layers.1.attention.wv.weight"] == "value"
    assert roles["layers.1.attention.wo.weight"] == "attn_out"
    assert roles["layers.1.feed_forward.w2.weight"] == "mlp"
    assert roles["layers.1.ffn_norm.weight"] == "norm"
    assert roles["tok_embeddings.weight"] == "embedding" and roles["output.weight"] == "output"


def test_causal():
    model = Transformer(TINY)
    model.init_weights(seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (1, SEQ_LEN))
    changed = tokens.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_rope_rotates_pairs_and_keeps_norm():
    table = rope_table(ModelArgs(dim=8, n_heads=1, max_seq_len=16))
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    y = apply_rope(x, table)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    # Relative-position property: <R_m q, R_n k> depends only on m - n.
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def rot(v, pos):
        return apply_rope(v.expand(1, 16, 1, 8).clone(), table)[0, pos, 0]

    torch.testing.assert_close(rot(q, 5) @ rot(k, 3), rot(q, 9) @ rot(k, 7))


def test_init_is_seeded_and_dtype_independent():
    a, b, c = Transformer(TINY), Transformer(TINY), Transformer(TINY)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    c.init_weights(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    d = Transformer(TINY).to(torch.float64)
    d.init_weights(seed=3)
    for pa, pd in zip(a.parameters(), d.parameters()):
        assert torch.equal(pa.double(), pd)
    assert a.layers["0"].attention.wo.weight.std() > a.layers["1"].attention.wo.weight.std()  # depth init


def test_invalid_shapes_are_rejected():
    with pytest.raises(ValueError, match="not divisible by n_kv_heads"):
        Transformer(dataclasses.replace(TINY, n_kv_heads=3))
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(dataclasses.replace(TINY, vocab_size=-1))


def test_canonical_name():
    assert (
        canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )


def test_debug_flavor_is_small():
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2256)
    assert count(args) < 10_000_000


LADDER_SIZES = {
    "ladder-3M": 3e6,
    "ladder-9M": 9e6,
    "ladder-30M": 30e6,
    "ladder-60M": 60e6,
    "ladder-130M": 130e6,
    "ladder-300M": 300e6,
    "ladder-520M": 520e6,
    "ladder-1.2B": 1.2e9,
}


def test_the_ladder_is_llama_3_shaped_and_named_by_its_non_embedding_parameters():
    from torchtitan.models.llama import LADDER, non_embedding_params

    assert list(LADDER) == list(LADDER_SIZES)
    for flavor, size in LADDER_SIZES.items():
        args = llama3_configs[flavor]
        assert args is LADDER[flavor]
        assert args.kv_heads < args.n_heads and args.head_dim in (64, 128), flavor  # grouped-query attention
        assert args.vocab_size == -1 and args.rope_theta == 500000 and args.norm_type == "rmsnorm", flavor
        # Every weight but the embedding and output rows: an arithmetic count of the shapes.
        embedding_rows = 2 * args.dim  # the embedding and output of a one-token vocabulary
        assert non_embedding_params(args) == expected_count(dataclasses.replace(args, vocab_size=1)) - embedding_rows
        assert abs(non_embedding_params(args) - size) / size < 0.1, flavor


def test_the_docs_list_the_ladder_exact_counts():
    import re
    from pathlib import Path

    from torchtitan.models.llama import LADDER, non_embedding_params

    page = (Path(__file__).resolve().parents[2] / "docs" / "study-runs.md").read_text()
    rows = dict(re.findall(r"^\| `(ladder-[^`]+)` \|[^\n]*?\| ([\d,]+) \|$", page, flags=re.M))
    assert rows == {flavor: f"{non_embedding_params(args):,}" for flavor, args in LADDER.items()}
