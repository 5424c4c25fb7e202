#!/usr/bin/env python3
"""PyTorch comparator for `fl bench`: every model of fl-models, the same loop, side by side.

Defines the same architectures as fl-models (parameter counts checked against `fl bench`'s),
trains one client with the same settings as `fl bench` (synthetic images, 10 classes, batch 50,
SGD lr 0.01 momentum 0.5, three timed epochs after a warm-up one) on 1 and on T intra-op
threads, times evaluation (batch 500) on T threads and, with `--round KxE`, a FedMR round (K
clients x E epochs one after another, then FedMR's per-tensor recombination). Given `--fl PATH`
(the release binary) it runs `fl bench` with the same settings per model and input shape and
prints the ratios in one Markdown table. Every row also gives the training cost in GFLOP per
sample (three times the forward pass's multiply-adds, 2 FLOPs each, counting only kernel taps
that read the input rather than its zero padding) and, given `--peak` (per thread, GFLOP/s: the first line of `fl bench --kernels`),
each side's share of the T threads' multiply-add peak: the fastest any implementation doing the
same arithmetic could train is 100%.

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch numpy
    cargo build --release
    /tmp/torchenv/bin/python bench/torch_reference.py --fl target/release/fl --threads 2 \
        --inputs 3x32x32,1x28x28
    target/release/fl bench --kernels --threads 1 | head -1     # the peak per thread
    /tmp/torchenv/bin/python bench/torch_reference.py --fl target/release/fl --threads 2 \
        --peak 116
    /tmp/torchenv/bin/python bench/torch_reference.py --models cnn --samples 500 --round 10x5 \
        --fl target/release/fl
    /tmp/torchenv/bin/python bench/torch_reference.py --fl target/release/fl --repeat 3 \
        --inputs 3x32x32,1x28x28 --peak 117    # medians of three alternating runs per side,
                                                # each ratio the median of the three pairs' ones

Models: `cnn`, `cnn-fedavg`, `resnet20`, `resnet20-ref`, `vgg16`, `mobilenet-v1/v2/v3`,
`cnn1`-`cnn4` (see fl-models for each one's definition).
"""

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Cnn(nn.Module):
    """The FedMR authors' CNN. 3 channels: conv 5x5 6 -> pool -> conv 5x5 16 -> pool -> FC 120 ->
    84 -> C; 1 channel: conv 5x5 16 -> pool -> conv 5x5 32 -> pool -> FC 256 -> C (ReLU)."""

    def __init__(self, shape, classes=10):
        super().__init__()
        ch1, ch2, hidden = (16, 32, [256]) if shape[0] == 1 else (6, 16, [120, 84])
        self.conv1 = nn.Conv2d(shape[0], ch1, 5)
        self.conv2 = nn.Conv2d(ch1, ch2, 5)
        widths = [flat_size(self.convs, shape)] + hidden + [classes]
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def convs(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        return F.relu(F.max_pool2d(self.conv2(x), 2)).flatten(1)

    def forward(self, x):
        x = self.convs(x)
        for i, fc in enumerate(self.fc):
            x = fc(x)
            if i < len(self.fc) - 1:
                x = F.relu(x)
        return x


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.pad = cout - cin
        self.stride = stride

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.stride != 1 or self.pad:
            # Option A: subsample and zero-pad the channels (no parameters).
            shortcut = x[:, :, :: self.stride, :: self.stride]
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    def __init__(self, shape, classes=10):
        super().__init__()
        self.conv = nn.Conv2d(shape[0], 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in [(16, 1), (32, 2), (64, 2)]:
            for i in range(3):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class CnnFedAvg(nn.Module):
    """McMahan et al.'s CNN: conv 5x5 32 -> pool -> conv 5x5 64 -> pool -> FC 512 -> C."""

    def __init__(self, shape, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(shape[0], 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(flat_size(self.convs, shape), 512)
        self.fc2 = nn.Linear(512, classes)

    def convs(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.max_pool2d(F.relu(self.conv2(x)), 2).flatten(1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.convs(x))))


class PreActBottleneck(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        out = planes * 4
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm2d(planes), nn.Conv2d(planes, out, 1, bias=False)
        self.shortcut = (nn.Conv2d(cin, out, 1, stride, bias=False)
                         if stride != 1 or cin != out else None)

    def forward(self, x):
        pre = F.relu(self.bn1(x))
        shortcut = self.shortcut(pre) if self.shortcut is not None else x
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + shortcut


class ResNet20Ref(nn.Module):
    """The FedMR authors' ResNet-20: pre-activation bottlenecks (2 per stage, expansion 4); their
    final BatchNorm(256) is a parameter the forward pass never uses."""

    def __init__(self, shape, classes=10):
        super().__init__()
        self.conv = nn.Conv2d(shape[0], 16, 3, 1, 1, bias=False)
        units, cin = [], 16
        for stage, planes in enumerate([16, 32, 64]):
            for i in range(2):
                units.append(PreActBottleneck(cin, planes, 2 if stage > 0 and i == 0 else 1))
                cin = planes * 4
        self.units = nn.Sequential(*units)
        self.final_bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.units(self.conv(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


VGG_LAYOUT = [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0]


class Vgg16(nn.Module):
    """VGG-16 with BatchNorm (conv bias kept), pools skipped once the map is 1 pixel, FC 4096 x 2
    with dropout 0.5."""

    def __init__(self, shape, classes=10):
        super().__init__()
        layers, cin, h, w = [], shape[0], shape[1], shape[2]
        for i, width in enumerate(VGG_LAYOUT):
            if width == 0:
                continue
            layers += [nn.Conv2d(cin, width, 3, 1, 1), nn.BatchNorm2d(width), nn.ReLU()]
            if i + 1 < len(VGG_LAYOUT) and VGG_LAYOUT[i + 1] == 0 and h >= 2 and w >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            cin = width
        self.features = nn.Sequential(*layers)
        self.fc1, self.fc2 = nn.Linear(cin * h * w, 4096), nn.Linear(4096, 4096)
        self.fc3 = nn.Linear(4096, classes)

    def forward(self, x):
        x = self.features(x).flatten(1)
        x = F.dropout(F.relu(self.fc1(x)), 0.5, self.training)
        x = F.dropout(F.relu(self.fc2(x)), 0.5, self.training)
        return self.fc3(x)


def conv_bn_act(cin, cout, k, stride, groups, act):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), act())


def make_divisible(v):
    rounded = max((v + 4) // 8 * 8, 8)
    return rounded + 8 if rounded < 0.9 * v else rounded


class SqueezeExcite(nn.Module):
    def __init__(self, channels):
        super().__init__()
        squeezed = make_divisible(channels // 4)
        self.down, self.up = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        scale = F.relu(self.down(F.adaptive_avg_pool2d(x, 1)))
        return x * F.hardsigmoid(self.up(scale))


class MobileUnit(nn.Module):
    def __init__(self, cin, hidden, out, k, stride, se, act, v1):
        super().__init__()
        self.expand = conv_bn_act(cin, hidden, 1, 1, 1, act) if hidden != cin else None
        self.depthwise = conv_bn_act(hidden, hidden, k, stride, hidden, act)
        self.se = SqueezeExcite(hidden) if se else None
        self.project = conv_bn_act(hidden, out, 1, 1, 1, act if v1 else nn.Identity)
        self.residual = not v1 and stride == 1 and cin == out

    def forward(self, x):
        out = self.expand(x) if self.expand is not None else x
        out = self.depthwise(out)
        if self.se is not None:
            out = self.se(out)
        out = self.project(out)
        return out + x if self.residual else out


class MobileNet(nn.Module):
    """MobileNetV1/V2/V3-Small with CIFAR strides, as fl-models builds them."""

    def __init__(self, shape, classes, version):
        super().__init__()
        R, R6, HS = nn.ReLU, nn.ReLU6, nn.Hardswish
        if version == 1:
            widths = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 \
                + [(1024, 2), (1024, 1)]
            stem, head, hidden_fc, p = (32, R), None, [], 0.0
            units = [(3, 0, out, False, R, s) for out, s in widths]
        elif version == 2:
            stem, head, hidden_fc, p = (32, R6), (1280, R6), [], 0.2
            units, cin = [], 32
            for t, out, n, s in [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2),
                                 (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
                for i in range(n):
                    units.append((3, cin * t, out, False, R6, s if i == 0 else 1))
                    cin = out
        else:
            stem, head, hidden_fc, p = (16, HS), (576, HS), [1024], 0.2
            units = [(3, 16, 16, True, R, 2), (3, 72, 24, False, R, 2), (3, 88, 24, False, R, 1),
                     (5, 96, 40, True, HS, 2), (5, 240, 40, True, HS, 1),
                     (5, 240, 40, True, HS, 1), (5, 120, 48, True, HS, 1),
                     (5, 144, 48, True, HS, 1), (5, 288, 96, True, HS, 2),
                     (5, 576, 96, True, HS, 1), (5, 576, 96, True, HS, 1)]
        self.stem = conv_bn_act(shape[0], stem[0], 3, 1, 1, stem[1])
        layers, cin = [], stem[0]
        for k, expanded, out, se, act, s in units:
            hidden = expanded if expanded else cin
            layers.append(MobileUnit(cin, hidden, out, k, s, se, act, version == 1))
            cin = out
        self.units = nn.Sequential(*layers)
        self.head = conv_bn_act(cin, head[0], 1, 1, 1, head[1]) if head else None
        cin = head[0] if head else cin
        widths = [cin] + hidden_fc + [classes]
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.hidden_act, self.p = stem[1](), p

    def forward(self, x):
        x = self.units(self.stem(x))
        if self.head is not None:
            x = self.head(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        for i, fc in enumerate(self.fc):
            if i == len(self.fc) - 1:
                x = F.dropout(x, self.p, self.training)
            x = fc(x)
            if i < len(self.fc) - 1:
                x = self.hidden_act(x)
        return x


# pFedClub's CNN1-CNN4: (channels, kernel, batch norm, pool, dropout) per conv, hidden FC widths.
CLUB = {
    "cnn1": ([(32, 5, 0, 1, 0), (64, 5, 0, 1, 0)], [512]),
    "cnn2": ([(32, 5, 0, 1, 0), (64, 5, 0, 1, 0), (128, 5, 0, 0, 0)], [512]),
    "cnn3": ([(32, 5, 0, 1, 0), (64, 5, 0, 1, 0), (128, 5, 0, 0, 0), (128, 5, 0, 1, 0),
              (256, 5, 0, 0, 0)], [512, 256, 128]),
    "cnn4": ([(32, 5, 1, 0, 0), (32, 3, 0, 1, 0), (64, 3, 1, 0, 0), (64, 5, 0, 1, 1),
              (128, 3, 1, 0, 0), (128, 3, 0, 1, 0)], [512, 256, 128]),
}


class StackedCnn(nn.Module):
    """pFedClub's CNNs: conv (+BN) + ReLU (+pool, +dropout) layers, then an FC stack with ReLU
    and dropout 0.5 after the first hidden layer."""

    def __init__(self, shape, classes, name):
        super().__init__()
        convs, hidden = CLUB[name]
        layers, cin = [], shape[0]
        for ch, k, norm, pool, drop in convs:
            layers.append(nn.Conv2d(cin, ch, k, 1, k // 2))
            layers += [nn.BatchNorm2d(ch)] if norm else []
            layers.append(nn.ReLU())
            layers += [nn.MaxPool2d(2)] if pool else []
            layers += [nn.Dropout(0.5)] if drop else []
            cin = ch
        self.convs = nn.Sequential(*layers)
        widths = [flat_size(lambda x: self.convs(x).flatten(1), shape)] + hidden + [classes]
        self.fc = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        x = self.convs(x).flatten(1)
        last = len(self.fc) - 1
        for i, fc in enumerate(self.fc):
            x = fc(x)
            if i < last:
                x = F.relu(x)
            if i == 0 and last > 0:
                x = F.dropout(x, 0.5, self.training)
        return x


def flat_size(features, shape):
    with torch.no_grad():
        return features(torch.zeros(1, *shape)).shape[1]


MODELS = {
    "cnn": lambda s: Cnn(s),
    "cnn-fedavg": lambda s: CnnFedAvg(s),
    "resnet20": lambda s: ResNet20(s),
    "resnet20-ref": lambda s: ResNet20Ref(s),
    "vgg16": lambda s: Vgg16(s),
    "mobilenet-v1": lambda s: MobileNet(s, 10, 1),
    "mobilenet-v2": lambda s: MobileNet(s, 10, 2),
    "mobilenet-v3": lambda s: MobileNet(s, 10, 3),
    **{name: (lambda n: lambda s: StackedCnn(s, 10, n))(name) for name in CLUB},
}


def valid_taps(size, kernel, stride, pad, dilation):
    """Kernel taps over all outputs of one axis that read the input, not its zero padding."""
    out = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    return sum(1 for o in range(out) for k in range(kernel)
               if 0 <= o * stride + k * dilation - pad < size)


def forward_macs(model, shape):
    """Multiply-adds of one sample's forward pass through the convolutions and linear layers,
    counting only kernel taps that read the input: a product with a padding zero is no work
    (oneDNN skips it; on VGG-16's 2x2 maps that is 56% of the taps). Training costs three
    times this (forward, input and weight gradients; the first layer's input gradient, which
    neither side computes, is a small overcount)."""
    total = [0]

    def conv(m, inp, _):
        (_, c, h, w) = inp[0].shape
        taps = (valid_taps(h, m.kernel_size[0], m.stride[0], m.padding[0], m.dilation[0])
                * valid_taps(w, m.kernel_size[1], m.stride[1], m.padding[1], m.dilation[1]))
        total[0] += m.out_channels * (c // m.groups) * taps

    def linear(m, _, __):
        total[0] += m.in_features * m.out_features

    hooks = [m.register_forward_hook(conv) for m in model.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_hook(linear) for m in model.modules()
              if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *shape))
    for h in hooks:
        h.remove()
    return total[0]


def train(model, images, labels, epochs, batch=50):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    n = images.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n)
        for i in range(0, n, batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            loss.backward()
            opt.step()
    return model


def recombine(states):
    """FedMR: every tensor is permuted independently among the K models."""
    k = len(states)
    out = [dict() for _ in range(k)]
    for name in states[0]:
        perm = torch.randperm(k)
        for i in range(k):
            out[i][name] = states[perm[i]][name]
    return out


# Samples per timed client by default: enough for a stable time, small enough for the big models.
DEFAULT_SAMPLES = {"cnn": 500, "vgg16": 100, "mobilenet-v1": 100, "mobilenet-v2": 100,
                   "mobilenet-v3": 100}


def measure(name, shape, samples, threads, rounds):
    """Train samples/s of one client at each thread count, eval samples/s (batch 500) at the
    last, and, with `rounds = (clients, epochs)`, the wall time of one FedMR round."""
    torch.manual_seed(1)
    make = lambda: MODELS[name](shape)
    params = sum(p.numel() for p in make().parameters())
    clients = rounds[0] if rounds else 1
    images = torch.randn(samples * clients, *shape)
    labels = torch.randint(0, 10, (samples * clients,))
    start = make().state_dict()

    def client(c, e):
        model = make()
        model.load_state_dict(start)
        sl = slice(c * samples, (c + 1) * samples)
        return train(model, images[sl], labels[sl], e)

    out = {"model": name, "params": params, "train": {}}
    out["gflop"] = 3 * 2 * forward_macs(make(), shape) / 1e9
    for t in threads:
        torch.set_num_threads(t)
        client(0, 1)  # warm-up
        begin = time.perf_counter()
        client(0, 3)
        out["train"][t] = 3 * samples / (time.perf_counter() - begin)

    model = make().eval()
    with torch.no_grad():
        model(images[:min(samples, 500)])  # warm-up
        begin = time.perf_counter()
        for b in range(0, samples, 500):
            model(images[b:b + 500])
    out["eval"] = samples / (time.perf_counter() - begin)

    if rounds:
        begin = time.perf_counter()
        uploads = [client(c, rounds[1]).state_dict() for c in range(clients)]
        recombine(uploads)
        out["round_s"] = time.perf_counter() - begin
    return out


def fl_bench(binary, model, shape, samples, clients, epochs, threads):
    """Runs `fl bench` for one model and reads its row back by column name: params, train/s on
    1 thread and on `threads` (one client; the pool's threads split each op, as PyTorch's
    intra-op threads do), eval/s, FedMR round seconds."""
    out = subprocess.run(
        [binary, "bench", "--models", model, "--input", "x".join(map(str, shape)),
         "--samples", str(samples), "--clients", str(clients), "--epochs", str(epochs),
         "--threads", str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout
    header = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "model":
            header = cells
        elif header and len(cells) == len(header) and cells[0] == model:
            col = dict(zip(header, cells))
            train = [float(v) for k, v in col.items() if k.startswith("train samples/s (1 client,")]
            return {"params": int(col["params"]), "train": {1: train[0], threads: train[-1]},
                    "eval": float(col["eval samples/s"]),
                    "round_s": float(col["FedMR round (s)"])}
    raise RuntimeError(f"no row for {model} in fl bench's output:\n{out}")


def paired_ratio(fl_runs, torch_runs, get):
    """fl/torch of `get(run)` per repetition, each pair timed back to back (so a drift of the
    machine's speed between repetitions cancels out of each ratio): their median, and with
    several repetitions their range, e.g. `1.25x (1.18-1.31)`. For times, pass `get` the rate's
    reciprocal."""
    ratios = [get(f) / get(t) for f, t in zip(fl_runs, torch_runs)]
    text = f"{statistics.median(ratios):.2f}x"
    return text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def medians(runs):
    """One side's figures over repeated runs: the median of each rate and time (the parameter
    count and the GFLOP per sample are the same in every run)."""
    out = dict(runs[0])
    out["train"] = {t: statistics.median(r["train"][t] for r in runs) for t in runs[0]["train"]}
    for key in ("eval", "round_s"):
        if key in out:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="all", help="comma-separated, or 'all'")
    p.add_argument("--inputs", default="3x32x32", help="comma-separated CxHxW, e.g. 3x32x32,1x28x28")
    p.add_argument("--samples", type=int, help="samples per timed client (default: per model)")
    p.add_argument("--threads", type=int, default=2, help="the pool size compared besides 1 thread")
    p.add_argument("--round", metavar="KxE", help="also time a FedMR round of K clients x E epochs")
    p.add_argument("--fl", help="path of the fl binary: also run `fl bench` and print ratios")
    p.add_argument("--peak", type=float, metavar="GFLOPS",
                   help="multiply-add peak per thread: adds each side's share of the --threads peak")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="time each side N times per model, alternating: the medians of the "
                        "rates, and of the N paired fl/torch ratios with their range (single "
                        "runs move by 10-20%%)")
    a = p.parse_args()
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat}: must be at least 1")
    models = list(MODELS) if a.models == "all" else a.models.split(",")
    inputs = [tuple(int(d) for d in s.split("x")) for s in a.inputs.split(",")]
    rounds = tuple(int(v) for v in a.round.split("x")) if a.round else None
    threads = sorted({1, a.threads})
    print(f"PyTorch {torch.__version__}; batch 50, SGD lr 0.01 momentum 0.5; train = one client, "
          f"3 epochs; eval batch 500" + (f"; round = {rounds[0]} clients x {rounds[1]} epochs"
                                         if rounds else "")
          + (f"; medians of {a.repeat} alternating runs per side, ratios the median (and "
             f"range) of the {a.repeat} back-to-back pairs' ratios" if a.repeat > 1 else ""))
    cols = ["model", "input", "samples", "params"]
    for t in threads:
        cols += [f"torch train/s ({t}t)", f"fl train/s ({t}t)", f"fl/torch ({t}t)"]
    cols += [f"torch eval/s ({threads[-1]}t)", "fl eval/s", "fl/torch eval"]
    if rounds:
        cols += ["torch round (s)", "fl round (s)", "torch/fl round"]
    cols += ["train GFLOP/sample"]
    if a.peak:
        t = threads[-1]
        cols += [f"torch % of peak ({t}t)", f"fl % of peak ({t}t)", f"bound fl/torch ({t}t)"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for shape in inputs:
        for m in models:
            samples = a.samples or DEFAULT_SAMPLES.get(m, 200)
            torch_runs, fl_runs = [], []
            for _ in range(a.repeat):
                torch_runs.append(measure(m, shape, samples, threads, rounds))
                if a.fl:
                    fl_runs.append(fl_bench(a.fl, m, shape, samples, *(rounds or (1, 1)),
                                            threads[-1]))
            r = medians(torch_runs)
            ours = medians(fl_runs) if a.fl else None
            params = f"{r['params']:,}"
            if ours and ours["params"] != r["params"]:
                params += f" (fl: {ours['params']:,}!)"
            row = [m, "x".join(map(str, shape)), str(samples), params]
            ratio = lambda get: paired_ratio(fl_runs, torch_runs, get)
            for t in threads:
                row += [f"{r['train'][t]:,.0f}"]
                row += ([f"{ours['train'][t]:,.0f}", ratio(lambda x, t=t: x["train"][t])]
                        if ours else ["-", "-"])
            row += [f"{r['eval']:,.0f}"]
            row += ([f"{ours['eval']:,.0f}", ratio(lambda x: x["eval"])] if ours
                    else ["-", "-"])
            if rounds:
                row += [f"{r['round_s']:.2f}"]
                row += ([f"{ours['round_s']:.2f}", ratio(lambda x: 1 / x["round_s"])]
                        if ours else ["-", "-"])
            row += [f"{r['gflop']:.3f}"]
            if a.peak:
                t, peak = threads[-1], a.peak * threads[-1]
                share = lambda rate: f"{100 * rate * r['gflop'] / peak:.0f}%"
                row += [share(r["train"][t]), share(ours["train"][t]) if ours else "-",
                        f"{peak / r['gflop'] / r['train'][t]:.2f}x"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
