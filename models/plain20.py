"""Plain20: ResNet-20 without its shortcuts, the "plain" baseline network of
He, Zhang, Ren and Sun ("Deep Residual Learning for Image Recognition", CVPR
2016, section 4.2, CIFAR-10).

20 weight layers: a 3x3 stem conv with 16 channels, then three stages of
2n = 6 3x3 convs (n = 3) with 16, 32 and 64 channels (the first conv of
stages 2 and 3 has stride 2), each conv followed by BatchNorm and ReLU, then
global average pool and an FC: 19 conv + 1 fc. No shortcut connections.
CIFAR shape: 3x32x32 input, stages at 32, 16 and 8 pixels, 10-way FC:
269,722 parameters (the same as ResNet-20, whose option-A identity shortcuts
have none; the paper's "0.27M").

ImageNet shape (our own; the paper has no ImageNet Plain20): the same 20
layers, with stride 2 on the stem conv so 3x224x224 runs the stages at 112, 56
and 28 pixels, and a 1000-way FC: 334,072 parameters (our figure, not a
published one).
"""

from __future__ import annotations

from torch import nn

__all__ = ["Plain20", "plain20"]


def _conv_bn_relu(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class Plain20(nn.Module):
    def __init__(self, num_classes: int = 10, small_input: bool = True, n: int = 3):
        super().__init__()
        layers = _conv_bn_relu(3, 16, stride=1 if small_input else 2)
        channels = 16
        for i, width in enumerate((16, 32, 64)):
            for j in range(2 * n):
                layers += _conv_bn_relu(channels, width, stride=2 if (i > 0 and j == 0) else 1)
                channels = width
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.fc(self.avgpool(self.features(x)).flatten(1))


def plain20(dataset: str = "imagenet", num_classes: int | None = None) -> Plain20:
    if dataset == "imagenet":
        return Plain20(num_classes or 1000, small_input=False)
    if dataset == "cifar10":
        return Plain20(num_classes or 10, small_input=True)
    raise ValueError(f"cswap.models.plain20: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")
