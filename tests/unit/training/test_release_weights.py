"""``release_weights``: what the end of a run frees before Lightning's teardown."""

import torch
from tiny import tiny_model_config

from recipes_lib.models import Transformer
from recipes_lib.training.outputs import release_weights


def test_plain_tensors_and_gradients_are_freed_once_each():
    model = Transformer(tiny_model_config(tie_embeddings=True))
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    params = sum(p.numel() for p in model.parameters())  # the tied head counted once
    buffers = sum(b.numel() for b in model.buffers())
    assert release_weights(model) == params + buffers
    assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
    assert all(b.numel() == 0 for b in model.buffers())
    assert model.output.weight is model.tok_embeddings.weight  # still one parameter
    assert release_weights(model) == 0  # nothing left


def test_tensors_of_other_kinds_keep_their_storage():
    model = torch.nn.Linear(4, 4)
    model.weight.ds_id = 7  # a DeepSpeed-partitioned parameter: its engine owns it
    model.weight.grad = torch.ones(4, 4)
    assert release_weights(model) == 4  # the bias only
    assert model.weight.numel() == 16 and model.weight.grad is None
