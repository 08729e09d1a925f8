"""VGG16 (Simonyan and Zisserman, 2015), configuration D, without batch norm.

ImageNet shape: 3x224x224 input, 4096-wide classifier, 138,357,544 parameters
(the published figure). CIFAR shape: 3x32x32 input, the five pools leave 1x1,
and a 512-wide classifier, as the CIFAR ports of VGG16 use.
"""

from __future__ import annotations

from torch import nn

__all__ = ["VGG16", "vgg16"]

# Output channels of the 13 convolutions; "M" is a 2x2 max-pool.
CONFIG_D = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 1000, image_size: int = 224, width: int = 4096):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in CONFIG_D:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        side = image_size // 32
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512 * side * side, width), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(width, width), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def vgg16(dataset: str = "imagenet", num_classes: int | None = None) -> VGG16:
    if dataset == "imagenet":
        return VGG16(num_classes or 1000, 224, 4096)
    if dataset == "cifar10":
        return VGG16(num_classes or 10, 32, 512)
    raise ValueError(f"cswap.models.vgg16: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")
