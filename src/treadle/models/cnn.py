"""Convolutional networks in plain PyTorch, for profiling, planning and training CNNs without torchvision: the
bottleneck ResNet of He et al. (2016) and its wide variant (Zagoruyko & Komodakis, 2016, as torchvision builds
``wide_resnet50_2``: the 3x3 convolution of every bottleneck `width` times wider).

Each builder returns ``(model, example_inputs)`` as `treadle.models.zoo.load_model` expects, so any entry point
takes them by name: ``treadle profile treadle.models.cnn:wide_resnet50_2 --batch 32``. The model takes
``pixel_values`` (N, 3, H, W) and optional ``labels`` (N,) and returns a `ClassifierOutput` (``.loss``,
``.logits``: the loss convention of `treadle.loss`) with labels, the logits without.

    model, inputs = wide_resnet50_2(batch=8)          # 68.9M parameters, 224 x 224 images
    model, inputs = tiny_wide_resnet(batch=4)         # 2 stages, 32 x 32 images: small enough to run in tests
    model, inputs = resnet((2, 2), width=4, base=32, image=32, num_classes=10)   # any other shape
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import torch
from torch import nn


class ClassifierOutput(NamedTuple):
    """What a model given labels returns: the mean cross-entropy and the logits (N, classes)."""

    loss: torch.Tensor
    logits: torch.Tensor


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand (x4); batch norm after each; the shortcut
    a strided 1x1 convolution + batch norm where the shape changes."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, width: int):
        super().__init__()
        mid = planes * width
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = (nn.Sequential(nn.Conv2d(cin, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                           if stride != 1 or cin != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """Stem (7x7 convolution stride 2, batch norm, ReLU, 3x3 max pool stride 2), stages of bottlenecks
    (`layers[i]` blocks of `64 * 2**i` planes, stride 2 from the second stage on), global average pool, linear
    head. `width` scales every bottleneck's inner width (1: ResNet, 2: wide_resnet50_2)."""

    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), *, width: int = 1, num_classes: int = 1000,
                 base: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], base
        for i, n in enumerate(layers):
            planes = base * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, planes, 2 if (i > 0 and j == 0) else 1, width))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.ModuleList(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        for stage in self.layers:
            x = stage(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        if labels is None:
            return logits
        return ClassifierOutput(nn.functional.cross_entropy(logits, labels), logits)


def resnet(layers: Sequence[int] = (3, 4, 6, 3), *, width: int = 1, batch: int = 8, image: int = 224,
           num_classes: int = 1000, base: int = 64, fake: bool = False,
           seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Any `ResNet` (stages `layers`, inner `width`, `base` channels) in training mode with example inputs
    (`batch` images of `image` x `image`, labels of `num_classes`); `fake=True` under one FakeTensorMode."""
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        ctx = FakeTensorMode(allow_non_fake_inputs=True)
    with ctx:
        torch.manual_seed(seed)
        model = ResNet(layers, width=width, num_classes=num_classes, base=base).train()
        g = None if fake else torch.Generator().manual_seed(seed + 1)
        inputs = {"pixel_values": torch.randn(batch, 3, image, image, generator=g),
                  "labels": torch.randint(0, num_classes, (batch,), generator=g)}
    return model, inputs


def wide_resnet50_2(batch: int = 8, image: int = 224, fake: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """torchvision's ``wide_resnet50_2`` shape (68.9M parameters), ImageNet-sized inputs."""
    return resnet((3, 4, 6, 3), width=2, batch=batch, image=image, num_classes=1000, base=64, fake=fake)


def wide_resnet101_2(batch: int = 8, image: int = 224, fake: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """torchvision's ``wide_resnet101_2`` shape (126.9M parameters)."""
    return resnet((3, 4, 23, 3), width=2, batch=batch, image=image, num_classes=1000, base=64, fake=fake)


def resnet50(batch: int = 8, image: int = 224, fake: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """torchvision's ``resnet50`` shape (25.6M parameters)."""
    return resnet((3, 4, 6, 3), width=1, batch=batch, image=image, num_classes=1000, base=64, fake=fake)


def tiny_wide_resnet(batch: int = 4, image: int = 32, fake: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Two stages of two wide bottlenecks, 8 base channels, 10 classes, 32 x 32 images: runs in tests."""
    return resnet((2, 2), width=2, batch=batch, image=image, num_classes=10, base=8, fake=fake)
