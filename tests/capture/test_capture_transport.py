"""gockpt.capture.transport: bf16 images of the consumed gradients, checked exact per step."""

import torch

from gockpt.capture.transport import Bf16Transport


def bf16_valued(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).bfloat16().float()


def test_bf16_values_times_a_coefficient_are_carried_as_images_and_the_coefficient():
    coef = torch.tensor(0.37, dtype=torch.float32)
    grads = {0: bf16_valued(1000, 0) * coef, 3: bf16_valued(7, 1) * coef}
    images, mul = Bf16Transport(lambda: coef).encode(grads)
    assert mul == float(coef) and set(images) == {0, 3}
    for si, g in grads.items():
        assert images[si].dtype == torch.bfloat16
        assert torch.equal((images[si].float() * coef).view(torch.int32), g.view(torch.int32))


def test_without_a_multiplier_the_gradients_must_be_bf16_values():
    transport = Bf16Transport()
    images, mul = transport.encode({0: bf16_valued(100, 2)})
    assert mul == 1.0 and torch.equal(images[0].float(), bf16_valued(100, 2))
    g = bf16_valued(100, 3)
    g[17] += g[17] * 2 ** -12  # one element that bf16 cannot hold
    assert transport.encode({0: g}) is None and transport.fallbacks == 1


def test_a_wrong_multiplier_or_a_special_value_it_cannot_rebuild_falls_back():
    coef = torch.tensor(0.37, dtype=torch.float32)
    g = bf16_valued(100, 4) * coef
    assert Bf16Transport(lambda: torch.tensor(0.38)).encode({0: g}) is None
    g[5] = 1e-44  # a float32 subnormal: no bf16 image times 0.37 gives it back
    assert Bf16Transport(lambda: coef).encode({0: g}) is None


def test_negative_zero_inf_and_bf16_nan_are_carried_bit_for_bit():
    # a NaN of bf16 gradients (what the training made float32) crosses as it is; a float32 NaN
    # with another payload has no bf16 image and that step falls back to fp32
    g = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0]).bfloat16()
    g = g.float()
    images, _ = Bf16Transport().encode({0: g})
    assert torch.equal(images[0].float().view(torch.int32), g.view(torch.int32))
    assert Bf16Transport().encode({0: torch.tensor([float("nan")])}) is None


def test_the_cpu_images_are_the_ones_torch_makes():
    # on the CPU one C++ pass makes and checks each image (not six torch ops on the training
    # thread): the same rounding -- to nearest even, ties included, NaN as torch gives it --
    # and the same verdict; a gradient that is not contiguous goes through torch
    coef = torch.tensor(0.37, dtype=torch.float32)
    g = bf16_valued(4099, 5) * coef
    images, _ = Bf16Transport(lambda: coef).encode({0: g})
    assert torch.equal(images[0].view(torch.int16), (g / coef).to(torch.bfloat16).view(torch.int16))
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), float("nan")])
    transport = Bf16Transport()
    assert transport.encode({0: ties}) is None and transport.fallbacks == 1
    from gockpt import _C
    out = torch.empty(4, dtype=torch.bfloat16)
    assert not _C.bf16_images(ties.data_ptr(), out.data_ptr(), 4, False, 1.0)
    assert torch.equal(out.view(torch.int16), ties.to(torch.bfloat16).view(torch.int16))
    strided = bf16_valued(200, 6).reshape(20, 10).t()
    images, _ = Bf16Transport().encode({0: strided})
    assert torch.equal(images[0].float(), strided)


def test_only_the_copied_range_of_a_gradient_is_made_and_checked():
    # a window's step copies the blocks captured so far: the images of the rest are not made,
    # and an element outside the range that bf16 cannot hold does not send the step in fp32
    coef = torch.tensor(0.37, dtype=torch.float32)
    g = bf16_valued(1000, 7) * coef
    g[900] += g[900] * 2 ** -12
    strided = bf16_valued(200, 8).reshape(20, 10).t() * coef
    # C++'s pass (contiguous CPU gradients), then torch's ops (a strided one beside it)
    for grads in ({0: g}, {0: g, 1: strided}):
        images, mul = Bf16Transport(lambda: coef).encode(grads, {0: (100, 700)})
        back = images[0][100:700].float() * coef
        assert torch.equal(back.view(torch.int32), g[100:700].view(torch.int32))
        assert torch.equal(images[1].float() * coef, strided) if 1 in grads else True
        assert Bf16Transport(lambda: coef).encode(grads, {0: (100, 950)}) is None
        assert Bf16Transport(lambda: coef).encode(grads) is None
