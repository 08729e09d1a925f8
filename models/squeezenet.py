"""SqueezeNet 1.0 and 1.1 (Iandola et al., "SqueezeNet: AlexNet-level accuracy
with 50x fewer parameters and <0.5MB model size", 2016; 1.1 from the authors'
repository), as torchvision builds them.

Fire modules (1x1 squeeze conv, ReLU, then 1x1 and 3x3 expand convs, each with
ReLU, concatenated), 3x3/2 max-pools with ceil_mode, and a convolutional
classifier: dropout, 1x1 conv to the classes, ReLU, global average pool.
ImageNet shape: 3x224x224 input; 1.0 has a 7x7/2 stem with 96 channels and
pools after fire 3 and 7, 1.1 a 3x3/2 stem with 64 channels and pools after
fire 2 and 4: 1,248,424 and 1,235,496 parameters (torchvision's figures).

CIFAR shape (our adaptation for 3x32x32): the stem becomes a 3x3/1 conv with
padding 1 (same channel count), so the three max-pools take 32 to 16, 8 and 4
pixels before the global pool; everything else is unchanged, 10-way classifier
conv: 1.0 has 729,034 and 1.1 727,626 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Fire", "SqueezeNet", "squeezenet1_0", "squeezenet1_1"]


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand1x1: int, expand3x3: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand1x1, 1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand3x3, 3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)


class SqueezeNet(nn.Module):
    def __init__(self, version: str = "1_0", num_classes: int = 1000, small_input: bool = False):
        super().__init__()

        def pool():
            return nn.MaxPool2d(3, stride=2, ceil_mode=True)

        if version == "1_0":
            stem = nn.Conv2d(3, 96, 3, padding=1) if small_input else nn.Conv2d(3, 96, 7, stride=2)
            self.features = nn.Sequential(
                stem, nn.ReLU(inplace=True), pool(),
                Fire(96, 16, 64, 64), Fire(128, 16, 64, 64), Fire(128, 32, 128, 128), pool(),
                Fire(256, 32, 128, 128), Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256), pool(),
                Fire(512, 64, 256, 256),
            )
        elif version == "1_1":
            stem = nn.Conv2d(3, 64, 3, padding=1) if small_input else nn.Conv2d(3, 64, 3, stride=2)
            self.features = nn.Sequential(
                stem, nn.ReLU(inplace=True), pool(),
                Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
                Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(),
                Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
                Fire(384, 64, 256, 256), Fire(512, 64, 256, 256),
            )
        else:
            raise ValueError(f"cswap.models.squeezenet: version must be '1_0' or '1_1', got {version!r}")
        final_conv = nn.Conv2d(512, num_classes, 1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.5), final_conv, nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(),
        )
        # torchvision's initialisation.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is final_conv:
                    nn.init.normal_(m.weight, mean=0.0, std=0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.features(x))


def _squeezenet(version: str, dataset: str, num_classes: int | None) -> SqueezeNet:
    if dataset == "imagenet":
        return SqueezeNet(version, num_classes or 1000, small_input=False)
    if dataset == "cifar10":
        return SqueezeNet(version, num_classes or 10, small_input=True)
    raise ValueError(f"cswap.models.squeezenet{version}: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")


def squeezenet1_0(dataset: str = "imagenet", num_classes: int | None = None) -> SqueezeNet:
    return _squeezenet("1_0", dataset, num_classes)


def squeezenet1_1(dataset: str = "imagenet", num_classes: int | None = None) -> SqueezeNet:
    return _squeezenet("1_1", dataset, num_classes)
