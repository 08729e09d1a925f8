"""cswap.models: the paper's networks, their parameter counts, shapes and candidates.

ImageNet-shaped checks build and run on the meta device (no memory, no
compute); real forward passes use CIFAR shapes, plus ImageNet for two small nets.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cswap import models
from cswap.runtime.candidates import SPARSE_PRODUCERS, producer

SIDE = {"cifar10": 32, "imagenet": 224}
CLASSES = {"cifar10": 10, "imagenet": 1000}

# Published ImageNet parameter counts (torchvision's figures for AlexNet, VGG16,
# ResNet and SqueezeNet; MobileNet v1 1.0 with a 1000-way FC). Ours match exactly.
PUBLISHED = {
    "alexnet": 61_100_840,
    "vgg16": 138_357_544,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "mobilenet": 4_231_976,
    "squeezenet1_0": 1_248_424,
    "squeezenet1_1": 1_235_496,
}

# Our own counts, as the modules' docstrings give them: the CIFAR adaptations
# (Plain20's is ResNet-20's published 0.27M) and Plain20 on ImageNet.
OURS = {
    ("alexnet", "cifar10"): 7_706_442,
    ("vgg16", "cifar10"): 15_245_130,
    ("resnet18", "cifar10"): 11_173_962,
    ("resnet50", "cifar10"): 23_520_842,
    ("mobilenet", "cifar10"): 3_217_226,
    ("squeezenet1_0", "cifar10"): 729_034,
    ("squeezenet1_1", "cifar10"): 727_626,
    ("plain20", "cifar10"): 269_722,
    ("plain20", "imagenet"): 334_072,
}

PAPER_NETS = ["alexnet", "vgg16", "resnet18", "resnet50", "mobilenet", "squeezenet1_0", "squeezenet1_1", "plain20"]
DATASETS = ["cifar10", "imagenet"]


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _meta(name: str, dataset: str, num_classes: int | None = None) -> nn.Module:
    with torch.device("meta"):
        return models.build(name, dataset, num_classes)


def test_registry_names():
    assert set(models.names()) == {*PAPER_NETS, "small_cnn"}
    for name in models.names():
        assert name in models.__all__


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_imagenet_parameter_count_is_published(name):
    n = _params(_meta(name, "imagenet"))
    assert abs(n - PUBLISHED[name]) <= 0.01 * PUBLISHED[name]
    assert n == PUBLISHED[name]


@pytest.mark.parametrize(("name", "dataset"), sorted(OURS))
def test_own_parameter_counts(name, dataset):
    assert _params(_meta(name, dataset)) == OURS[(name, dataset)]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("name", models.names())
def test_output_shape_on_meta(name, dataset):
    side = SIDE[dataset]
    with torch.device("meta"):
        model = models.build(name, dataset)
        y = model(torch.empty(2, 3, side, side))
    assert tuple(y.shape) == (2, CLASSES[dataset])


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("name", models.names())
def test_num_classes_override(name, dataset):
    side = SIDE[dataset]
    with torch.device("meta"):
        model = models.build(name, dataset, num_classes=7)
        y = model(torch.empty(2, 3, side, side))
    assert tuple(y.shape) == (2, 7)


def test_builders_default_to_imagenet():
    for name in PAPER_NETS:
        builder = getattr(models, name)
        with torch.device("meta"):
            default, imagenet = builder(), builder("imagenet")
        assert _params(default) == _params(imagenet)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'resnet34'.*alexnet.*plain20"):
        models.build("resnet34")


@pytest.mark.parametrize("name", models.names())
def test_unknown_dataset_names_the_choices(name):
    with pytest.raises(ValueError, match=r"'imagenet' or 'cifar10', got 'mnist'"):
        models.build(name, "mnist")
    with pytest.raises(ValueError, match=r"'imagenet' or 'cifar10'"):
        getattr(models, name)("cifar100")


def test_squeezenet_unknown_version():
    with pytest.raises(ValueError, match="'1_0' or '1_1'"):
        models.SqueezeNet("1_2")


@pytest.mark.parametrize("name", models.names())
def test_cifar_forward_backward_saves_candidates(name):
    """A real CIFAR-shaped step: right output, every parameter gets a gradient
    (in-place ReLUs do not break autograd), and some saved tensors come from
    ReLU/pooling, so cswap has something to offload."""
    model = models.build(name, "cifar10")
    model.train()
    producers: list[str | None] = []

    def pack(t):
        producers.append(producer(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(torch.randn(2, 3, 32, 32))
    assert y.shape == (2, 10)
    assert torch.isfinite(y).all()
    sparse = [p for p in producers if p in SPARSE_PRODUCERS]
    assert len(sparse) >= 3, f"{name}: saved tensors came from {sorted(set(map(str, producers)))}"
    y.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{name}: no gradient for {missing[:5]}"


@pytest.mark.parametrize("name", ["squeezenet1_1", "mobilenet"])
def test_imagenet_forward_small_models(name):
    model = models.build(name, "imagenet").eval()
    with torch.no_grad():
        y = model(torch.randn(2, 3, 224, 224))
    assert y.shape == (2, 1000)
    assert torch.isfinite(y).all()


def test_plain20_is_20_layers_without_shortcuts():
    for dataset in DATASETS:
        model = _meta("plain20", dataset)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert (len(convs), len(fcs)) == (19, 1)
        assert [c.out_channels for c in convs] == [16] * 7 + [32] * 6 + [64] * 6
        # No shortcuts: a plain chain, every conv followed by BatchNorm and ReLU.
        kinds = [type(m) for m in model.features]
        assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU] * 19


def test_resnet_shortcuts_and_inplace_relu():
    r18, r50 = _meta("resnet18", "imagenet"), _meta("resnet50", "imagenet")
    assert sum(isinstance(m, models.BasicBlock) for m in r18.modules()) == 8
    assert sum(isinstance(m, models.Bottleneck) for m in r50.modules()) == 16
    for model in (r18, r50, _meta("squeezenet1_0", "imagenet")):
        relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
        assert relus and all(m.inplace for m in relus)


def test_cifar_adaptations_keep_resolution():
    """The CIFAR stems do not downsample 32x32 the way the ImageNet ones do 224."""
    r18 = _meta("resnet18", "cifar10")
    assert r18.conv1.stride == (1, 1) and isinstance(r18.maxpool, nn.Identity)
    assert _meta("mobilenet", "cifar10").features[0].stride == (1, 1)
    assert _meta("mobilenet", "imagenet").features[0].stride == (2, 2)
