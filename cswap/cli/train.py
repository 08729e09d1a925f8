"""cswap-train: train a model from cswap.models with cswap and watch its decisions.

    cswap-train                                  # small CNN on scikit-learn's digits, 3 epochs, any machine
    cswap-train --model vgg16 --data synthetic --epochs 2 --batch-size 32 --device cuda
    cswap-train --data my_images.npz --mode sc --report-dir reports/

Each epoch shows a progress bar, then loss and accuracy on held-out data and
cswap's report: every offloaded activation with its sparsity, the decision
(codec or none) and the predicted swap times; reports also go to
--report-dir as JSON lines, CSV and PNG plots. Data: "digits" (the 8x8
handwritten digits shipped with scikit-learn, resized to 3x32x32: no
download), "synthetic" (random images whose class sets a pattern), an .npz
file with arrays x (N, C, H, W or N, H, W) and y (N,), or a folder with one
sub-folder of images per class (needs Pillow).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cswap
from cswap import models
from cswap.models.data import load_data

__all__ = ["main", "select_device"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cswap-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small_cnn", choices=models.names())
    p.add_argument("--data", default="digits", help="digits, synthetic, an .npz file, or a folder of images")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--mode", default="cswap", choices=["none", "vdnn", "sc", "cswap", "vdnnpp", "save_on_cpu"])
    p.add_argument("--advisor", default="independent", choices=["independent", "timeline"])
    p.add_argument("--profile", type=Path, help="device profile from cswap-tune (default: this device's, "
                                                "or the generic default)")
    p.add_argument("--report-dir", type=Path, default=Path("cswap-reports"))
    p.add_argument("--checksum", action="store_true",
                   help="end-to-end checksum of every offloaded buffer (cswap.integrity)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=None, help="synthetic data: number of images (default 2048)")
    p.add_argument("--check-decisions", type=int, default=0, metavar="N",
                   help="after training, measure N tensors' real swap costs and report the advisor's accuracy")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.profile is not None and not args.profile.exists():
        p.error(f"--profile {args.profile} does not exist (run cswap-tune to create one)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; use --device cpu")
    return args


# -- training --------------------------------------------------------------------------------


def evaluate(model, x, y, device, batch_size) -> tuple[float, float]:
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            out = model(xb)
            loss += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return loss / len(y), correct / len(y)


def select_device(device: torch.device) -> None:
    """Make a CUDA device current, so that work cswap and PyTorch start without naming
    a device (the caching allocator's streams, pinned memory's context) lands there."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def cpu_note(args) -> str:
    """On a CPU the swap times are ~0 and no decision is a real one: point to the prediction."""
    return (f"cswap-train: on a {args.device.type} the copies cost nothing and nothing is worth compressing, so "
            f"these decisions are trivial. To see what cswap would do on a GPU, predict it:\n"
            f"  cswap-plan --model {args.model} --dataset cifar10 --batch {args.batch_size} --gpu h100-sxm-80gb")


def run(args) -> list:
    from tqdm.auto import tqdm

    select_device(args.device)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test, classes = load_data(args.data, 32, args.seed, args.samples)
    model = models.build(args.model, dataset="cifar10", num_classes=classes).to(args.device)
    print(f"cswap-train: {args.model} on {args.data} ({len(y_train)} train / {len(y_test)} test images, "
          f"{classes} classes), mode {args.mode}, device {args.device}", flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cswap: offloading CPU tensors")
        cswap.patch(model, mode=args.mode, profile=args.profile, advisor=args.advisor, report_dir=args.report_dir,
                    checksum=args.checksum)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        gen = torch.Generator().manual_seed(args.seed)
        reports = []
        for epoch in range(args.epochs):
            order = torch.randperm(len(y_train), generator=gen)
            batches = range(0, len(y_train), args.batch_size)
            bar = tqdm(batches, desc=f"epoch {epoch}", leave=False, file=sys.stderr, disable=args.no_progress)
            start, seen, total = time.perf_counter(), 0, 0.0
            for i in bar:
                idx = order[i:i + args.batch_size]
                xb, yb = x_train[idx].to(args.device), y_train[idx].to(args.device)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(idx)
                seen += len(idx)
                bar.set_postfix(loss=f"{total / seen:.3f}")
            bar.close()
            test_loss, accuracy = evaluate(model, x_test, y_test, args.device, args.batch_size)
            metrics = {"train_loss": total / seen, "test_loss": test_loss, "accuracy": accuracy,
                       "epoch_s": time.perf_counter() - start}
            print(f"epoch {epoch}: train loss {metrics['train_loss']:.4f}, test loss {test_loss:.4f}, "
                  f"accuracy {100 * accuracy:.1f}%", flush=True)
            reports.append(cswap.epoch_end(model, metrics))
        if args.check_decisions and args.mode == "cswap":
            checks = cswap.check_decisions(model, sample=args.check_decisions)
            right = sum(c.right for c in checks)
            print(f"decision accuracy: {right}/{len(checks)} right "
                  f"({100 * right / max(len(checks), 1):.1f}%; paper Fig. 11: 94.2%)", flush=True)
        s = cswap.stats(model)
        print(f"cswap: {s['offloaded_tensors']} tensors offloaded ({s['offloaded_bytes'] / 2**20:.1f} MiB), "
              f"{s['transferred_bytes'] / 2**20:.1f} MiB moved, {s['compressed_tensors']} compressed; "
              f"reports in {args.report_dir}", flush=True)
        if args.device.type != "cuda":
            print(cpu_note(args), flush=True)
        cswap.unpatch(model)
    return reports


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        print(f"cswap-train: interrupted; reports of finished epochs are in {args.report_dir}", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"cswap-train: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
