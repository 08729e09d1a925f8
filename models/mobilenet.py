"""MobileNet v1 (Howard et al., "MobileNets: Efficient Convolutional Neural
Networks for Mobile Vision Applications", 2017), width multiplier 1.0.

A 3x3/2 stem convolution, then 13 depthwise-separable blocks (3x3 depthwise
conv, BN, ReLU, 1x1 pointwise conv, BN, ReLU; table 1 of the paper), a global
average pool and a 1000-way FC. Convolutions have no bias (BatchNorm follows).
ImageNet shape: 3x224x224 input, 7x7 before the pool: 4,231,976 parameters
(the paper's 4.2 million; exactly this figure with a 1000-way FC).

CIFAR shape (our adaptation, as the CIFAR ports of MobileNet do): the stem has
stride 1, so 3x32x32 leaves 2x2 after the four remaining stride-2 blocks, then
the global average pool; 10-way FC: 3,217,226 parameters.
"""

from __future__ import annotations

from torch import nn

__all__ = ["MobileNetV1", "mobilenet"]

# (output channels, stride) of the 13 depthwise-separable blocks (paper, table 1).
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
          (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


def _conv_bn_relu(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    ]


class MobileNetV1(nn.Module):
    def __init__(self, num_classes: int = 1000, small_input: bool = False):
        super().__init__()
        layers = _conv_bn_relu(3, 32, 3, stride=1 if small_input else 2)
        channels = 32
        for cout, stride in BLOCKS:
            layers += _conv_bn_relu(channels, channels, 3, stride, groups=channels)  # depthwise
            layers += _conv_bn_relu(channels, cout, 1)                               # pointwise
            channels = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


def mobilenet(dataset: str = "imagenet", num_classes: int | None = None) -> MobileNetV1:
    if dataset == "imagenet":
        return MobileNetV1(num_classes or 1000, small_input=False)
    if dataset == "cifar10":
        return MobileNetV1(num_classes or 10, small_input=True)
    raise ValueError(f"cswap.models.mobilenet: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")
