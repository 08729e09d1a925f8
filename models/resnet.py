"""ResNet-18 and ResNet-50 (He, Zhang, Ren and Sun, "Deep Residual Learning
for Image Recognition", CVPR 2016), as torchvision builds them: BasicBlock
(two 3x3 convs) for ResNet-18, Bottleneck (1x1, 3x3, 1x1 with 4x expansion;
the stride on the 3x3, "ResNet v1.5") for ResNet-50, BatchNorm after every
convolution, 1x1-conv + BatchNorm projection shortcuts where the shape changes,
identity shortcuts elsewhere.

ImageNet shape: 3x224x224 input, 7x7/2 stem and 3x3/2 max-pool, stages of
64/128/256/512 base channels, global average pool, 1000-way FC:
ResNet-18 11,689,512 and ResNet-50 25,557,032 parameters (torchvision's figures).

CIFAR shape: the usual CIFAR adaptation of these networks: a 3x3/1 stem and no
max-pool, so 3x32x32 runs the same four stages at 32, 16, 8 and 4 pixels;
10-way FC. ResNet-18 11,173,962 and ResNet-50 23,520,842 parameters.
"""

from __future__ import annotations

from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50"]


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(*_conv_bn(cin, cout, 1, stride))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.conv2, self.bn2 = _conv_bn(width, cout, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock | Bottleneck], blocks: tuple[int, int, int, int],
                 num_classes: int = 1000, small_input: bool = False):
        super().__init__()
        if small_input:
            self.conv1, self.bn1 = _conv_bn(3, 64, 3)
            self.maxpool = nn.Identity()
        else:
            self.conv1, self.bn1 = _conv_bn(3, 64, 7, stride=2)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.relu = nn.ReLU(inplace=True)
        channels = 64
        stages = []
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            layers = []
            for j in range(n):
                layers.append(block(channels, width, stride=2 if (i > 0 and j == 0) else 1))
                channels = width * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, num_classes)
        # torchvision's initialisation.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def _resnet(name: str, block, blocks, dataset: str, num_classes: int | None) -> ResNet:
    if dataset == "imagenet":
        return ResNet(block, blocks, num_classes or 1000, small_input=False)
    if dataset == "cifar10":
        return ResNet(block, blocks, num_classes or 10, small_input=True)
    raise ValueError(f"cswap.models.{name}: dataset must be 'imagenet' or 'cifar10', got {dataset!r}")


def resnet18(dataset: str = "imagenet", num_classes: int | None = None) -> ResNet:
    return _resnet("resnet18", BasicBlock, (2, 2, 2, 2), dataset, num_classes)


def resnet50(dataset: str = "imagenet", num_classes: int | None = None) -> ResNet:
    return _resnet("resnet50", Bottleneck, (3, 4, 6, 3), dataset, num_classes)
