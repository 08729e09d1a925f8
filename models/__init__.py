"""The paper's networks, written here (no torchvision).

So far: VGG16, and a small CNN (cswap-train's default). AlexNet, ResNet, MobileNet, SqueezeNet and Plain20 arrive with
the end-to-end benchmark issue.
"""

from __future__ import annotations

from torch import nn

from .small import SmallCNN, small_cnn
from .vgg import VGG16, vgg16

__all__ = ["SmallCNN", "VGG16", "build", "names", "small_cnn", "vgg16"]

_BUILDERS = {"small_cnn": small_cnn, "vgg16": vgg16}


def names() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build(name: str, dataset: str = "cifar10", num_classes: int | None = None) -> nn.Module:
    """A fresh model: build("vgg16", dataset="cifar10" | "imagenet")."""
    if name not in _BUILDERS:
        raise ValueError(f"cswap.models: unknown model {name!r}; available: {', '.join(_BUILDERS)}")
    return _BUILDERS[name](dataset, num_classes)
