"""The paper's networks, written here (no torchvision).

AlexNet, VGG16, ResNet-18/50, MobileNet v1, SqueezeNet 1.0/1.1 and Plain20
(the CSWAP paper's benchmark networks), and a small CNN (cswap-train's
default). Each builds for CIFAR-shaped (3x32x32, 10 classes) or ImageNet-shaped
(3x224x224, 1000 classes) input; each module's docstring gives its source, its
CIFAR adaptation and its parameter counts.

    from cswap import models
    models.names()                                  # ("alexnet", "vgg16", ...)
    net = models.build("resnet50", dataset="imagenet")
"""

from __future__ import annotations

from torch import nn

from .alexnet import AlexNet, alexnet
from .mobilenet import MobileNetV1, mobilenet
from .plain20 import Plain20, plain20
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50
from .small import SmallCNN, small_cnn
from .squeezenet import Fire, SqueezeNet, squeezenet1_0, squeezenet1_1
from .vgg import VGG16, vgg16

__all__ = [
    "AlexNet", "BasicBlock", "Bottleneck", "Fire", "MobileNetV1", "Plain20", "ResNet", "SmallCNN", "SqueezeNet",
    "VGG16", "alexnet", "build", "mobilenet", "names", "plain20", "resnet18", "resnet50", "small_cnn",
    "squeezenet1_0", "squeezenet1_1", "vgg16",
]

_BUILDERS = {
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "mobilenet": mobilenet,
    "squeezenet1_0": squeezenet1_0,
    "squeezenet1_1": squeezenet1_1,
    "plain20": plain20,
    "small_cnn": small_cnn,
}


def names() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build(name: str, dataset: str = "cifar10", num_classes: int | None = None) -> nn.Module:
    """A fresh model: build("resnet18", dataset="cifar10" | "imagenet"); num_classes overrides 10 / 1000."""
    if name not in _BUILDERS:
        raise ValueError(f"cswap.models: unknown model {name!r}; available: {', '.join(_BUILDERS)}")
    return _BUILDERS[name](dataset, num_classes)
