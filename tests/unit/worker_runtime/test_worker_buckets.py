"""Assignment of parameters to buckets, and the flat buffers whose views are the gradients."""

import pytest
import torch

from distune.worker_runtime.buckets import Bucket, assign_buckets

F32 = (torch.float32, "cpu")
F16 = (torch.float16, "cpu")


def test_a_bucket_per_parameter_when_buckets_are_tiny():
    assert assign_buckets([40, 8, 40], [F32] * 3, [2, 1, 0], 1) == ((2,), (1,), (0,))


def test_one_bucket_when_it_holds_everything():
    assert assign_buckets([40, 8, 40], [F32] * 3, [2, 1, 0], 2**20) == ((2, 1, 0),)


def test_buckets_never_exceed_the_cap_except_single_large_parameters():
    sizes = [100, 30, 30, 30, 500, 10, 60]
    order = list(reversed(range(len(sizes))))
    buckets = assign_buckets(sizes, [F32] * len(sizes), order, 100)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(sizes)))
    for bucket in buckets:
        total = sum(sizes[i] for i in bucket)
        assert total <= 100 or len(bucket) == 1, (bucket, total)
    assert (4,) in buckets  # 500 bytes: alone
    position = {index: pos for pos, index in enumerate(order)}
    for bucket in buckets:  # members keep the expected-ready order
        assert [position[i] for i in bucket] == sorted(position[i] for i in bucket)
    # Launched in the order they complete.
    assert [position[b[-1]] for b in buckets] == sorted(position[b[-1]] for b in buckets)


def test_small_parameters_around_large_ones_share_a_bucket():
    # weight, bias, weight, bias of two layers, biases first as they are ready first.
    sizes = [9000, 40, 20000, 40]
    buckets = assign_buckets(sizes, [F32] * 4, [3, 2, 1, 0], 8192)
    assert buckets == ((2,), (3, 1), (0,))  # not four buckets: the biases travel together


def test_one_dtype_per_bucket_and_launch_order_is_completion_order():
    keys = [F32, F16, F32, F16]
    buckets = assign_buckets([4, 2, 4, 2], keys, [3, 2, 1, 0], 2**10)
    assert buckets == ((3, 1), (2, 0))  # the fp16 bucket completes (param 1) before the fp32 one
    for bucket in buckets:
        assert len({keys[i] for i in bucket}) == 1


@pytest.mark.parametrize(
    ("order", "size", "message"),
    [([0, 0], 8, "permutation"), ([0], 8, "permutation"), ([1, 0], 0, "positive")],
)
def test_bad_arguments_are_refused(order, size, message):
    with pytest.raises(ValueError, match=message):
        assign_buckets([4, 4], [F32, F32], order, size)


def test_bucket_views_are_gradient_shaped_slices_of_one_buffer():
    params = [torch.empty(3, 4), torch.empty(5), torch.empty(2, 2, dtype=torch.float32)]
    bucket = Bucket(params)
    # Gradients, then one used flag per parameter, padded to a multiple of 16 elements.
    assert bucket.flat.numel() == 32  # 12 + 5 + 4 + 3 -> 32
    assert bucket.nbytes == (12 + 5 + 4) * 4
    assert bucket.flags.numel() == 3
    for view, param in zip(bucket.views, params, strict=True):
        assert view.shape == param.shape
        assert view.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    bucket.grads.fill_(2.0)
    assert all(bool((view == 2.0).all()) for view in bucket.views)
    assert bool((bucket.flags == 0).all())
