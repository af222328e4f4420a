"""The checkpoint round trip compares tensors by a fingerprint of their bytes: one changed
byte anywhere changes it, in any dtype."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.launch_check.live import tensor_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_equal_bytes_give_equal_fingerprints_and_any_change_another(dtype):
    base = (torch.arange(3000) % 251).to(dtype).reshape(30, 100)
    assert tensor_fingerprint(base) == tensor_fingerprint(base.clone())
    seen = {tensor_fingerprint(base)}
    for index in (0, 1234, 2999):
        changed = base.clone().reshape(-1)
        changed[index] += 1
        seen.add(tensor_fingerprint(changed.reshape(30, 100)))
    assert len(seen) == 4
    swapped = base.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tensor_fingerprint(swapped) != tensor_fingerprint(base.reshape(-1))  # positions count


def test_fingerprints_of_views_scalars_and_empty_tensors():
    matrix = torch.randn(8, 6)
    assert tensor_fingerprint(matrix.t()) == tensor_fingerprint(matrix.t().contiguous())
    assert tensor_fingerprint(torch.tensor(3.0)) != tensor_fingerprint(torch.tensor(4.0))
    assert tensor_fingerprint(torch.tensor([True, False])) != tensor_fingerprint(
        torch.tensor([False, True])
    )
    assert tensor_fingerprint(torch.empty(0)) == tensor_fingerprint(torch.empty(0, 5))
