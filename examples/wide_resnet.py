"""A Wide-ResNet (bottleneck ResNet with widened 3×3 convolutions) for the benchmarks and the tests.

    python examples/wide_resnet.py      # builds the tiny config and prints its loss on random images

Structure (He et al. 2016; Zagoruyko & Komodakis 2016), as in Alpa's benchmark model (Flax's ImageNet
ResNet with a width factor): a 7×7 stride-2 stem convolution and 3×3 max pooling, four stages of bottleneck
blocks (1×1 conv to ``planes``, 3×3 conv to ``planes · width_factor``, 1×1 conv to ``4 · planes``; the first
block of stages 2-4 strides by 2 and projects its shortcut), global average pooling, a linear classifier and
the cross-entropy loss, returned by ``forward(images, labels)``. ``planes`` doubles per stage from
``base_channels``.

Normalization is group normalization written with view + mean (``GroupNorm2d``), not BatchNorm:
its statistics are per sample and per group, so a batch split, and a channel split that keeps whole groups
on each device, compute exactly what one device does, with the existing view/reduction/elementwise rules
(ATen's fused ``group_norm`` would take the local channel count with the global group count).
Batch-split BatchNorm computes per-shard statistics: what DDP without SyncBatchNorm does, not the same
training.

``WRN_SUITE`` follows Alpa's Wide-ResNet benchmark (Zheng et al., OSDI'22, §8.1, Table 4: 250M to 13B
parameters; 50 or 101 layers, base channels 160-320, width factor 2-16, 224×224 images, batch 1536); the
parameter counts of this GroupNorm variant are ``WideResNetConfig.n_params`` (BatchNorm has the same).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

STAGE_BLOCKS = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WideResNetConfig:
    """depth: 26, 50 or 101 (bottleneck blocks per stage, see STAGE_BLOCKS); base_channels: planes of stage 1;
    width_factor: the 3×3 convolutions' width over planes; groups: GroupNorm groups (divides every width);
    image_size, num_classes: input resolution and classifier width."""

    depth: int = 26
    base_channels: int = 16
    width_factor: int = 2
    groups: int = 8
    image_size: int = 32
    num_classes: int = 10

    def __post_init__(self):
        if self.depth not in STAGE_BLOCKS:
            raise ValueError(f"depth must be one of {sorted(STAGE_BLOCKS)}, got {self.depth}")
        if self.base_channels % self.groups:
            raise ValueError(f"base_channels ({self.base_channels}) must be divisible by groups ({self.groups})")

    @property
    def n_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in WideResNet(self).parameters())


# Alpa's Wide-ResNet suite (OSDI'22 Table 4; benchmark/alpa/suite_wresnet.py): name -> (depth, base channels,
# width factor); 224×224 images, fp32, global batch 1536 (weak scaling: 250M on 1 GPU ... 13B on 64).
WRN_SUITE = {
    "250M": (50, 160, 2),
    "500M": (50, 224, 2),
    "1B": (50, 320, 2),
    "2B": (50, 448, 2),
    "4B": (50, 640, 2),
    "6.8B": (50, 320, 16),
    "13B": (101, 320, 16),
}


def suite_config(name: str, *, image_size: int = 224, num_classes: int = 1024) -> WideResNetConfig:
    depth, base, width = WRN_SUITE[name]
    return WideResNetConfig(depth=depth, base_channels=base, width_factor=width, groups=32,
                            image_size=image_size, num_classes=num_classes)


class GroupNorm2d(nn.Module):
    """y = (x - mean) / sqrt(var + eps) · weight + bias, statistics over each sample's group of C/G channels
    and all positions (torch.nn.GroupNorm's math), written as view + mean so every dim it keeps shards."""

    def __init__(self, groups: int, channels: int, eps: float = 1e-5):
        super().__init__()
        if channels % groups:
            raise ValueError(f"GroupNorm2d: {channels} channels do not split into {groups} groups")
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        g = x.view(n, self.groups, c // self.groups, h, w)
        centered = g - g.mean(dim=(2, 3, 4), keepdim=True)
        var = (centered * centered).mean(dim=(2, 3, 4), keepdim=True)
        y = (centered * torch.rsqrt(var + self.eps)).view(n, c, h, w)
        return y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


def norm(cfg: WideResNetConfig, channels: int) -> GroupNorm2d:
    return GroupNorm2d(cfg.groups, channels)


class Bottleneck(nn.Module):
    """1×1 conv to planes -> 3×3 (stride) to planes·width -> 1×1 to 4·planes, each normalized; ReLU after the
    residual sum (Alpa's BottleneckResNetBlock)."""

    def __init__(self, cfg: WideResNetConfig, in_channels: int, planes: int, stride: int):
        super().__init__()
        width, out_channels = planes * cfg.width_factor, planes * 4
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.norm1 = norm(cfg, planes)
        self.conv2 = nn.Conv2d(planes, width, 3, stride=stride, padding=1, bias=False)
        self.norm2 = norm(cfg, width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.norm3 = norm(cfg, out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          norm(cfg, out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class WideResNet(nn.Module):
    """``forward(images [N, 3, S, S], labels [N])`` returns the mean cross-entropy of the classifier."""

    def __init__(self, cfg: WideResNetConfig):
        super().__init__()
        self.cfg = cfg
        base = cfg.base_channels
        self.stem = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.stem_norm = norm(cfg, base)
        blocks, in_channels = [], base
        for stage, count in enumerate(STAGE_BLOCKS[cfg.depth]):
            planes = base * 2 ** stage
            for i in range(count):
                blocks.append(Bottleneck(cfg, in_channels, planes, stride=2 if i == 0 and stage > 0 else 1))
                in_channels = planes * 4
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(in_channels, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem_norm(self.stem(images))), 3, stride=2, padding=1)
        for block in self.blocks:
            x = block(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.cross_entropy(self.fc(x), labels)


def make_batch(cfg: WideResNetConfig, batch_size: int, *, seed: int = 0, device: str | torch.device = "cpu"):
    """Random (images, labels); deterministic for a seed; empty tensors on the meta device."""
    shape = (batch_size, 3, cfg.image_size, cfg.image_size)
    if str(device) == "meta":
        return (torch.empty(shape, device="meta"), torch.empty(batch_size, dtype=torch.long, device="meta"))
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(shape, generator=g)
    labels = torch.randint(0, cfg.num_classes, (batch_size,), generator=g)
    return images.to(device), labels.to(device)


def make_wide_resnet(cfg: WideResNetConfig | None = None, *, batch_size: int = 8, seed: int = 0):
    """Factory for the CLI and the tests: (model, (images, labels)) with deterministic weights."""
    cfg = cfg or WideResNetConfig()
    torch.manual_seed(seed)
    return WideResNet(cfg), make_batch(cfg, batch_size, seed=seed)


if __name__ == "__main__":
    model, batch = make_wide_resnet()
    print(f"WideResNet {model.cfg}: {model.cfg.n_params} parameters, loss {model(*batch).item():.4f}")
