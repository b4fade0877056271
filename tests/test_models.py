"""Models in both frameworks: one canonical layout, converters each way, identical logits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

from triaccel.backends.jax import models as jm  # noqa: E402
from triaccel.backends.torch import models as tm  # noqa: E402
from triaccel.layout import canonical_shapes, efficientnet_b0_plan, make_divisible, model_layers, resnet18_plan  # noqa: E402

# Tiny variants keep the whole file to a few seconds on 2 CPU cores.
# depth 0.2 keeps one MBConv block per stage (7): with and without expand, stride 1 and 2, and
# (at width 0.25, 8 -> 8 channels) a residual first block.
CASES = [
    ("resnet18", {"width": 0.125}),
    ("efficientnet_b0", {"width": 0.25, "depth": 0.2, "stem_stride": 1}),
    ("efficientnet_b0", {"width": 0.25, "depth": 0.2}),
]
IDS = ["resnet18", "effb0-s1", "effb0-s2"]


def _pair(name: str, kw: dict, seed: int = 0):
    # Different seeds, then the converter: the weights agree only if the converter works.
    t = tm.create_model(name, num_classes=10, seed=seed, **kw)
    j = jm.create_model(name, num_classes=10, seed=seed + 1, **kw)
    jm.load_canonical(j, tm.to_canonical(t))
    return t, j


# One XLA compilation per (mode, shape) instead of one per op: keeps the file fast on 2 cores.
_jax_forward = nnx.jit(lambda m, x: m(x))


def _logits(t, j, x_nhwc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lt = t(torch.from_numpy(x_nhwc).permute(0, 3, 1, 2).contiguous()).detach().numpy()
    lj = np.asarray(_jax_forward(j, jnp.asarray(x_nhwc)))
    return lt, lj


def _randomise_bn(t) -> None:
    # Non-trivial running statistics and affine params, so that eval mode really tests them.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in t.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + torch.rand(n, generator=g))
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))
                m.num_batches_tracked.fill_(7)


@pytest.mark.parametrize("name,kw", CASES[:2], ids=IDS[:2])
def test_same_weights_same_logits_eval_and_train(name: str, kw: dict) -> None:
    t, j = _pair(name, kw)
    _randomise_bn(t)
    jm.load_canonical(j, tm.to_canonical(t))
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)

    t.eval()
    j.eval()
    lt, lj = _logits(t, j, x)
    assert lt.shape == lj.shape == (4, 10)
    np.testing.assert_allclose(lj, lt, atol=1e-4, rtol=1e-4)

    # Train mode: batch statistics in the forward pass, running statistics updated the same way
    # (torch momentum 0.1 == flax 0.9, unbiased running variance, counter incremented).
    t.train()
    j.train()
    lt, lj = _logits(t, j, x)
    np.testing.assert_allclose(lj, lt, atol=1e-4, rtol=1e-4)
    ct, cj = tm.to_canonical(t), jm.to_canonical(j)
    assert list(ct) == list(cj)
    for k in ct:
        if k.endswith("num_batches_tracked"):
            assert ct[k] == cj[k] == 8, k
            assert cj[k].dtype == np.int64
        else:
            np.testing.assert_allclose(cj[k], ct[k], atol=1e-5, rtol=1e-4, err_msg=k)


@pytest.mark.parametrize("name,kw", CASES[:2], ids=IDS[:2])
def test_round_trip_is_identity(name: str, kw: dict) -> None:
    t, j = _pair(name, kw)
    _randomise_bn(t)
    before = tm.to_canonical(t)
    jm.load_canonical(j, before)
    mid = jm.to_canonical(j)
    t2 = tm.create_model(name, seed=99, **kw)
    tm.load_canonical(t2, {k: torch.from_numpy(v) for k, v in mid.items()})  # tensors load too
    after = tm.to_canonical(t2)
    assert list(before) == list(mid) == list(after)
    for k in before:
        assert before[k].shape == after[k].shape and before[k].dtype == after[k].dtype, k
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("name,kw", CASES[:2], ids=IDS[:2])
def test_layer_names_identical_in_both(name: str, kw: dict) -> None:
    t, j = _pair(name, kw)
    torch_layers = [n for n, m in t.named_modules() if any(True for _ in m.parameters(recurse=False))]
    jax_param_owners = []
    for path, _ in nnx.to_flat_state(nnx.state(j, nnx.Param)):
        owner = ".".join(str(p) for p in path[:-1])
        if owner not in jax_param_owners:
            jax_param_owners.append(owner)
    infos = tm.layer_infos(t)
    assert infos == jm.layer_infos(j)
    assert [i.name for i in infos] == torch_layers  # forward/registration order
    assert sorted(jax_param_owners) == sorted(torch_layers)
    assert [n for n, _ in jm.named_layers(j)] == torch_layers
    kinds = {i.name: i.kind for i in infos}
    for n, m in t.named_modules():
        if n in kinds:
            expect = {torch.nn.BatchNorm2d: "norm", torch.nn.Conv2d: "conv", torch.nn.Linear: "linear"}[type(m)]
            assert kinds[n] == expect, n
    # torch state_dict names = canonical names = <layer>.<param>
    assert {k.rsplit(".", 1)[0] for k in tm.to_canonical(t)} == set(torch_layers)


def test_full_size_parameter_counts() -> None:
    # Published sizes: CIFAR ResNet-18 11,173,962 parameters; torchvision's EfficientNet-B0
    # (1000 classes) 5,288,548.
    r = tm.create_model("resnet18")
    assert sum(p.numel() for p in r.parameters()) == 11_173_962
    e = tm.create_model("efficientnet_b0", num_classes=1000)
    assert sum(p.numel() for p in e.parameters()) == 5_288_548  # torchvision efficientnet_b0
    assert len(efficientnet_b0_plan().blocks) == 16


@pytest.mark.parametrize("name,kw", CASES[:2], ids=IDS[:2])
def test_same_seed_same_weights_and_canonical_shapes(name: str, kw: dict) -> None:
    plan = tm.create_model(name, **kw).plan
    ct = tm.to_canonical(tm.create_model(name, seed=4, **kw))
    cj = jm.to_canonical(jm.create_model(name, seed=4, **kw))
    assert {k: v.shape for k, v in ct.items()} == canonical_shapes(plan)
    assert list(ct) == list(cj) == list(canonical_shapes(plan))
    for k in ct:
        np.testing.assert_array_equal(cj[k], ct[k], err_msg=k)
    other = tm.to_canonical(tm.create_model(name, seed=5, **kw))
    assert not np.array_equal(other["fc.weight"], ct["fc.weight"])
    w = ct[[k for k in ct if k.endswith("conv.weight") or k.endswith("conv1.weight")][-1]]
    assert abs(float(w.std()) - (2.0 / (w.shape[0] * w.shape[2] * w.shape[3])) ** 0.5) < 0.2 * float(w.std())


def test_stochastic_depth_and_dropout_are_optional_and_random() -> None:
    kw = {"width": 0.25, "depth": 0.34, "drop_path_rate": 0.5, "dropout": 0.3}
    t, j = _pair("efficientnet_b0", kw)
    assert all(m.drop_path is None for m in jm.create_model(*CASES[2][:1], **CASES[2][1]).blocks)
    assert sum(m.drop_path is not None for m in j.blocks) == sum(b.residual and b.drop_prob > 0 for b in j.plan.blocks) > 0
    x = np.random.default_rng(0).standard_normal((4, 32, 32, 3)).astype(np.float32)
    t.eval()
    assert torch.equal(t(torch.from_numpy(x).permute(0, 3, 1, 2)), t(torch.from_numpy(x).permute(0, 3, 1, 2)))
    t.train()
    torch.manual_seed(0)
    a = t(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())
    assert not torch.allclose(a, t(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()))
    # Flax stochastic depth drops whole samples and rescales the kept ones by 1/(1-p).
    blk = next(b for b in j.blocks if b.drop_path is not None)
    p = blk.drop_path.rate
    h = jnp.ones((64, 2, 2, 3))
    out = np.asarray(blk.drop_path(h))
    per_sample = out.reshape(64, -1)
    assert np.all((per_sample == 0).all(1) | np.isclose(per_sample, 1 / (1 - p)).all(1))
    assert 0 < (per_sample[:, 0] == 0).sum() < 64
    assert not np.array_equal(out, np.asarray(blk.drop_path(h)))  # the stream advances
    j.eval()
    np.testing.assert_array_equal(np.asarray(blk.drop_path(h)), np.ones((64, 2, 2, 3)))


def test_efficientnet_224_input_both() -> None:
    t, j = _pair(*CASES[2])
    t.eval()
    j.eval()
    x = np.random.default_rng(1).standard_normal((1, 224, 224, 3)).astype(np.float32)
    lt, lj = _logits(t, j, x)
    assert lt.shape == (1, 10)
    np.testing.assert_allclose(lj, lt, atol=1e-4, rtol=1e-4)


def test_load_canonical_errors_name_the_key() -> None:
    t, j = _pair("resnet18", {"width": 0.125})
    good = tm.to_canonical(t)
    for load, model in ((tm.load_canonical, t), (jm.load_canonical, j)):
        bad = dict(good)
        del bad["layer2.0.downsample.1.running_var"]
        with pytest.raises(ValueError, match=r"missing key 'layer2.0.downsample.1.running_var'"):
            load(model, bad)
        bad = dict(good, **{"fc.extra": np.zeros(3, np.float32)})
        with pytest.raises(ValueError, match=r"unexpected key 'fc.extra'"):
            load(model, bad)
        bad = dict(good)
        bad["fc.weight"] = bad["fc.weight"].T
        with pytest.raises(ValueError, match=r"'fc.weight' has shape"):
            load(model, bad)
    # A failed load leaves the model untouched.
    np.testing.assert_array_equal(jm.to_canonical(j)["fc.weight"], good["fc.weight"])
    bad = dict(good)
    bad["bn1.num_batches_tracked"] = np.array(2**40, dtype=np.int64)
    with pytest.raises(ValueError, match="bn1.num_batches_tracked"):
        jm.load_canonical(j, bad)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"name": "vgg"}, "model name"),
        ({"name": "resnet18", "width": 0.0}, "width"),
        ({"name": "resnet18", "width": float("nan")}, "width"),
        ({"name": "resnet18", "num_classes": 0}, "num_classes"),
        ({"name": "resnet18", "depth": 2.0}, "resnet18 takes no extra"),
        ({"name": "efficientnet_b0", "stem_stride": 3}, "stem_stride"),
        ({"name": "efficientnet_b0", "drop_path_rate": 1.0}, "drop_path_rate"),
        ({"name": "efficientnet_b0", "depth": -1}, "depth"),
        ({"name": "efficientnet_b0", "bogus": 1}, "unknown arguments"),
    ],
)
def test_factory_rejects_bad_arguments(kwargs: dict, param: str) -> None:
    for create in (tm.create_model, jm.create_model):
        with pytest.raises(ValueError, match=param):
            create(**kwargs)


def test_plans() -> None:
    assert make_divisible(64 * 0.125) == 8 and make_divisible(1.0) == 8 and make_divisible(37.0) == 40
    p = resnet18_plan(width=0.125)
    assert [b.out_channels for b in p.blocks] == [8, 8, 16, 16, 32, 32, 64, 64]
    assert [b.downsample for b in p.blocks] == [False, False, True, False, True, False, True, False]
    e = efficientnet_b0_plan(drop_path_rate=0.2)
    assert e.blocks[0].drop_prob == 0.0 and e.blocks[-1].drop_prob == pytest.approx(0.2 * 15 / 16)
    assert [b.stride for b in e.blocks].count(2) == 4 and e.head_channels == 1280
    names = [i.name for i in model_layers(e)]
    assert names[:2] == ["stem.conv", "stem.bn"] and names[-1] == "fc"
    assert "blocks.0.expand.conv" not in names and "blocks.1.expand.conv" in names


def test_flax_per_layer_dtype_and_jitted_train_step() -> None:
    t, j = _pair("resnet18", {"width": 0.125})
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 32, 32, 3)).astype(np.float32))
    y = jnp.asarray([1, 7])
    # One layer's compute dtype can be switched on its own; params stay float32.
    layers = dict(jm.named_layers(j))
    conv, bn = layers["layer1.0.conv1"], layers["layer1.0.bn1"]
    h = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 4, 8)).astype(np.float32))
    ref = conv(h)
    conv.dtype = jnp.bfloat16
    low = conv(h)
    assert low.dtype == jnp.bfloat16 and conv.kernel[...].dtype == jnp.float32
    assert 0 < float(jnp.max(jnp.abs(low.astype(jnp.float32) - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))
    assert bn(low).dtype == jnp.float32  # a norm layer left at dtype None computes in float32
    conv.dtype = None

    # A jitted train step (BatchNorm in train mode, counters updated through nnx.jit).
    j.train()

    @nnx.jit
    def step(model, x, y):
        def loss_fn(m):
            logits = m(x)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        return loss, grads

    loss, grads = step(j, x, y)
    t.train()
    lt = t(torch.from_numpy(np.asarray(x)).permute(0, 3, 1, 2).contiguous())
    loss_t = torch.nn.functional.cross_entropy(lt, torch.from_numpy(np.asarray(y)).long())
    loss_t.backward()
    assert float(loss) == pytest.approx(float(loss_t), rel=1e-4)
    gj = np.asarray(grads["layer4"][1]["conv2"]["kernel"][...])
    gt = t.layer4[1].conv2.weight.grad.numpy().transpose(2, 3, 1, 0)
    np.testing.assert_allclose(gj, gt, atol=1e-5, rtol=1e-3)
    assert int(jm.to_canonical(j)["bn1.num_batches_tracked"]) == 1


# ---------------------------------------------------------------------------------------------
# Device augmentation (torch and JAX): crop (pad 4) + flip are real, seeded, normalised.

from triaccel.backends.jax import augment as jaug  # noqa: E402
from triaccel.backends.torch import augment as taug  # noqa: E402
from triaccel.data.cifar import normalization  # noqa: E402


def _match_crop_flip(src: np.ndarray, out: np.ndarray, pad: int = 4) -> list[tuple[int, int, bool]]:
    """For each sample, the unique (dy, dx, flipped) with out == crop of the zero-padded source."""
    n, h, w, _ = src.shape
    padded = np.pad(src, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    found = []
    for i in range(n):
        hits = [
            (dy, dx, fl)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            for fl in (False, True)
            if np.array_equal(out[i], (lambda c: c[:, ::-1] if fl else c)(padded[i, dy : dy + h, dx : dx + w]))
        ]
        assert len(hits) == 1, (i, hits)
        found.append(hits[0])
    return found


def _check_params(found: list[tuple[int, int, bool]]) -> None:
    # Offsets spread over 0..8 in both axes, both flips occur (64 samples: chance of failure ~0).
    assert len({dy for dy, _, _ in found}) > 5 and len({dx for _, dx, _ in found}) > 5
    assert {fl for *_, fl in found} == {False, True}


def test_torch_augment_crop_flip_real_seeded_normalised() -> None:
    src = np.random.default_rng(0).integers(0, 256, size=(64, 32, 32, 3), dtype=np.uint8)
    x = torch.from_numpy(src)
    out = taug.random_crop_flip(x, torch.Generator().manual_seed(1))
    assert out.dtype == torch.uint8 and out.shape == x.shape
    _check_params(_match_crop_flip(src, out.numpy()))
    again = taug.random_crop_flip(x, torch.Generator().manual_seed(1))
    assert torch.equal(out, again)
    assert not torch.equal(out, taug.random_crop_flip(x, torch.Generator().manual_seed(2)))

    mean, std = normalization("cifar100")
    y = taug.augment(x[:4], dataset="cifar100", train=False)
    assert y.shape == (4, 3, 32, 32) and y.dtype == torch.float32
    ref = ((src[:4] / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(y.numpy(), ref, atol=1e-5)
    np.testing.assert_allclose(taug.normalize(x[:4], torch.from_numpy(mean), std).numpy(), ref, atol=1e-5)
    z = taug.augment(x[:4], torch.Generator().manual_seed(1), channels_last=True)
    assert z.shape == (4, 3, 32, 32) and z.is_contiguous(memory_format=torch.channels_last)
    w = taug.augment(x, torch.Generator().manual_seed(1))  # same generator seed: same crops
    np.testing.assert_allclose(w.numpy(), taug.normalize(out, *normalization("cifar10")).numpy())
    with pytest.raises(ValueError, match="uint8"):
        taug.augment(x.float())
    with pytest.raises(ValueError, match="pad"):
        taug.random_crop_flip(x, pad=-1)
    with pytest.raises(ValueError, match="std must be 3 finite values > 0"):
        taug.normalize(x, mean, [0.2, 0.0, 0.2])


def test_torch_keyed_crop_flip_depends_on_each_images_key_only() -> None:
    """keyed_crop_flip: real crops and flips, spread like random ones; an image's output depends on its
    key alone (not on the rest of its batch), so ranks and micro-batches agree on every sample's."""
    src = np.random.default_rng(0).integers(0, 256, size=(64, 32, 32, 3), dtype=np.uint8)
    x = torch.from_numpy(src)
    keys = torch.arange(64, dtype=torch.int64) + (5 << 33)   # keys above 2^32 fold in their high half
    out = taug.keyed_crop_flip(x, keys)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    _check_params(_match_crop_flip(src, out.numpy()))
    assert torch.equal(out, taug.keyed_crop_flip(x, keys))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(taug.keyed_crop_flip(x[perm], keys[perm]), out[perm])              # batch order
    assert torch.equal(torch.cat([taug.keyed_crop_flip(x[:20], keys[:20]),
                                  taug.keyed_crop_flip(x[20:], keys[20:])]), out)       # micro-batching
    assert not torch.equal(taug.keyed_crop_flip(x, keys + 64), out)                       # another epoch
    assert torch.equal(taug.keyed_crop_flip(x, keys, pad=0, flip=False), x)
    big = taug._hash32(torch.arange(90_000, dtype=torch.int64)) % 9      # offsets near-uniform over 0..8
    assert torch.bincount(big, minlength=9).min() > 9_500
    for bad in (keys.int(), keys[:3], [0] * 64):
        with pytest.raises(ValueError, match="keys must be an int64 tensor"):
            taug.keyed_crop_flip(x, bad)
    with pytest.raises(ValueError, match="pad"):
        taug.keyed_crop_flip(x, keys, pad=-1)


def test_jax_augment_crop_flip_real_seeded_normalised() -> None:
    src = np.random.default_rng(0).integers(0, 256, size=(64, 32, 32, 3), dtype=np.uint8)
    key = jax.random.key(1)
    out = np.asarray(jaug.random_crop_flip(src, key))
    assert out.dtype == np.uint8 and out.shape == src.shape
    _check_params(_match_crop_flip(src, out))
    np.testing.assert_array_equal(out, np.asarray(jaug.random_crop_flip(src, key)))
    assert not np.array_equal(out, np.asarray(jaug.random_crop_flip(src, jax.random.key(2))))

    mean, std = normalization("cifar10")
    y = jaug.augment(src, None, train=False)  # one batch shape in this test: fewer compilations
    assert y.shape == (64, 32, 32, 3) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), (src / 255.0 - mean) / std, atol=1e-5)
    y2 = np.asarray(jaug.augment(src, key))
    np.testing.assert_allclose(y2, (out / 255.0 - mean) / std, atol=1e-5)  # same key: same crops
    # Inside jit, with device constants (how a training step calls it).
    f = jax.jit(lambda x, k, m, s: jaug.normalize(jaug.random_crop_flip(x, k), m, s))
    np.testing.assert_allclose(np.asarray(f(src, key, jnp.asarray(mean), jnp.asarray(std))), y2, atol=1e-6)
    with pytest.raises(ValueError, match="key"):
        jaug.augment(src, None)
    with pytest.raises(ValueError, match="uint8"):
        jaug.normalize(src.astype(np.float32), mean, std)
    with pytest.raises(ValueError, match="mean must be 3 finite values"):
        jaug.normalize(src, [0.5, 0.5], std)
    with pytest.raises(ValueError, match="name must be one of"):
        jaug.augment(src, key, dataset="svhn")
