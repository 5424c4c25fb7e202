#!/usr/bin/env python3
"""PyTorch comparator for `fl bench`: the same models, local-training loop and FedMR round.

Runs on CPU with the same settings as `fl bench` (3x32x32 synthetic images, 10 classes, batch 50,
SGD lr 0.01 momentum 0.5, a round = K clients x E epochs x S samples trained one after another
with T intra-op threads, then FedMR's per-tensor recombination), prints a Markdown table, and,
given `--fl PATH` (the release binary), runs `fl bench` with the same settings and prints the
ratios.

    python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch numpy
    cargo build --release
    /tmp/torchenv/bin/python bench/torch_reference.py --fl target/release/fl --threads 2

Models: `cnn` (the FedMR authors' CNN, 62,006 parameters) and `resnet20` (He et al.'s CIFAR
ResNet-20 with option-A shortcuts, 269,722 parameters), written here to match fl-models.
"""

import argparse
import re
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Cnn(nn.Module):
    """conv 5x5 6 -> pool -> conv 5x5 16 -> pool -> FC 120 -> 84 -> 10 (ReLU)."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


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
    def __init__(self, classes=10):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
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


MODELS = {"cnn": Cnn, "resnet20": ResNet20}


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


def measure(name, samples, clients, epochs):
    torch.manual_seed(1)
    make = MODELS[name]
    params = sum(p.numel() for p in make().parameters())
    images = torch.randn(samples * clients, 3, 32, 32)
    labels = torch.randint(0, 10, (samples * clients,))
    start = make().state_dict()

    def client(c, e):
        model = make()
        model.load_state_dict(start)
        sl = slice(c * samples, (c + 1) * samples)
        return train(model, images[sl], labels[sl], e)

    client(0, 1)  # warm-up
    t = time.perf_counter()
    client(0, 3)
    train_per_s = 3 * samples / (time.perf_counter() - t)

    model = make().eval()
    with torch.no_grad():
        model(images[:50])  # warm-up
        t = time.perf_counter()
        for b in range(0, samples, 50):
            model(images[b:b + 50])
    eval_per_s = samples / (time.perf_counter() - t)

    t = time.perf_counter()
    uploads = [client(c, epochs).state_dict() for c in range(clients)]
    recombine(uploads)
    round_s = time.perf_counter() - t
    return {
        "model": name,
        "params": params,
        "train": train_per_s,
        "eval": eval_per_s,
        "round_s": round_s,
        "round_per_s": clients * epochs * samples / round_s,
    }


def fl_bench(binary, models, samples, clients, epochs, threads):
    """Runs `fl bench` and reads its table back by column name: {model: (train/s, eval/s, round s)}.

    Training speed is the column for one client on the whole thread pool, which is what PyTorch
    with `threads` intra-op threads measures.
    """
    out = subprocess.run(
        [binary, "bench", "--models", ",".join(models), "--samples", str(samples),
         "--clients", str(clients), "--epochs", str(epochs), "--threads", str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout
    header, rows = None, {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "model":
            header = cells
        elif header and len(cells) == len(header) and cells[0] in models:
            col = dict(zip(header, cells))
            train = [v for k, v in col.items() if k.startswith("train samples/s (1 client,")][-1]
            rows[cells[0]] = (float(train), float(col["eval samples/s"]), float(col["FedMR round (s)"]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,resnet20")
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fl", help="path of the fl binary: also run `fl bench` and print ratios")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    models = a.models.split(",")
    print(f"PyTorch {torch.__version__}, {a.threads} threads; round = {a.clients} clients x "
          f"{a.epochs} epochs x {a.samples} samples")
    ours = fl_bench(a.fl, models, a.samples, a.clients, a.epochs, a.threads) if a.fl else {}
    print("\n| model | params | torch train/s | torch eval/s | torch round (s) | fl train/s | fl round (s) | fl/torch train | torch/fl round time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in models:
        r = measure(m, a.samples, a.clients, a.epochs)
        if m in ours:
            tr, _, rs = ours[m]
            extra = f"{tr:.0f} | {rs:.2f} | {tr / r['train']:.2f}x | {r['round_s'] / rs:.2f}x"
        else:
            extra = "- | - | - | -"
        print(f"| {m} | {r['params']} | {r['train']:.0f} | {r['eval']:.0f} | {r['round_s']:.2f} | {extra} |")


if __name__ == "__main__":
    main()
