"""Depth up-scaling of the demo target: the grown model computes the same function, then trains on."""

import pytest
import torch

from workers.demo.train import ModelRecipe, grow_depth, llama_config, new_model, train_steps

RECIPE = ModelRecipe(
    num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64,
    num_steps=3, learning_rate=1e-2, warmup_steps=1, batch_size=2, seq_len=16,
)  # fmt: skip


def _trained_model() -> torch.nn.Module:
    model = new_model(llama_config(RECIPE, vocab_size=97, eos_token_id=0, max_position_embeddings=64), init_seed=0)
    token_ids = torch.randint(1, 97, (400,), generator=torch.Generator().manual_seed(1))  # [400]
    train_steps(model, RECIPE, token_ids, torch.Generator().manual_seed(2))
    return model


def test_grown_model_computes_the_same_logits() -> None:
    model = _trained_model()
    ids = torch.randint(1, 97, (3, 20), generator=torch.Generator().manual_seed(3))  # [3, 20]

    grown = grow_depth(model, num_layers=6)
    with torch.inference_mode():
        before = model(input_ids=ids).logits  # [3, 20, 97]
        after = grown(input_ids=ids).logits  # [3, 20, 97]

    assert grown.config.num_hidden_layers == 6
    assert torch.allclose(before, after, atol=1e-5, rtol=0)
    assert grown.lm_head.weight.data_ptr() == grown.model.embed_tokens.weight.data_ptr()  # still tied


def test_grown_copies_start_as_identity_blocks_and_then_learn() -> None:
    model = _trained_model()
    grown = grow_depth(model, num_layers=4)
    copy_layer = grown.model.layers[1]  # the copy of original layer 0
    assert torch.equal(copy_layer.self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert not copy_layer.self_attn.o_proj.weight.any() and not copy_layer.mlp.down_proj.weight.any()
    assert torch.equal(grown.model.layers[2].mlp.down_proj.weight, model.model.layers[1].mlp.down_proj.weight)

    token_ids = torch.randint(1, 97, (400,), generator=torch.Generator().manual_seed(4))  # [400]
    train_steps(grown, RECIPE, token_ids, torch.Generator().manual_seed(5))

    assert copy_layer.self_attn.o_proj.weight.abs().sum() > 0  # the copies join in once trained
    assert copy_layer.mlp.down_proj.weight.abs().sum() > 0


def test_growth_must_be_a_whole_multiple() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        grow_depth(_trained_model(), num_layers=3)
