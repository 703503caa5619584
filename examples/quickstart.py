"""Quickstart: an MLP on sklearn's digits under fp16 autocast with lossscale.GradScaler.

Runs on the CPU in well under a minute; nothing is downloaded (the digits ship inside scikit-learn).
Prints, per epoch: training loss, test accuracy, the loss scale and the skipped steps so far.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from tqdm import tqdm

import lossscale


def main(epochs: int = 8, seed: int = 0) -> float:
    """Train and return the final test accuracy."""
    torch.manual_seed(seed)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(x))
    train, test = perm[:1400], perm[1400:]
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = lossscale.GradScaler(growth_interval=50, model=model)
    for epoch in range(epochs):
        order = train[torch.randperm(len(train))]
        total = 0.0
        batches = order.split(32)
        # disable=None: no bar when stderr is not a terminal (a pipe or a log file gets no \r floods).
        for idx in tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", leave=False, disable=None):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):  # fp16 compute, FP32 master weights
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # true gradients before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)  # skipped if a gradient is inf/NaN
            scaler.update()
            total += loss.item()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        print(
            f"epoch {epoch + 1}: loss {total / len(batches):.4f}  test acc {acc:.3f}  "
            f"scale {scaler.get_scale():g}  skipped {scaler.skipped_steps}"
        )
    return acc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.epochs, args.seed)
