"""Small image datasets for the CLI's training runs and the planners' sparsity samples:
sklearn's digits, a synthetic set, an .npz file or a folder of images per class, as
standardised 3-channel tensors on the CPU. Below both cswap.cli and cswap.plan, which
import it from here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["load_data"]


def _to_images(x: np.ndarray, size: int) -> torch.Tensor:
    """(N, C, H, W) or (N, H, W) numbers -> float (N, 3, size, size), standardised."""
    t = torch.as_tensor(x, dtype=torch.float32)
    if t.dim() == 3:
        t = t[:, None]
    if t.dim() != 4:
        raise ValueError(f"images must be (N, H, W) or (N, C, H, W), got shape {tuple(t.shape)}")
    if t.shape[1] not in (1, 3):
        raise ValueError(f"images must have 1 or 3 channels, got {t.shape[1]}")
    t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
    t = t.expand(-1, 3, -1, -1) if t.shape[1] == 1 else t
    return ((t - t.mean()) / (t.std() + 1e-6)).contiguous()


def load_data(spec: str, size: int, seed: int, samples: int | None = None):
    """(x_train, y_train, x_test, y_test, num_classes) on the CPU."""
    rng = np.random.default_rng(seed)
    if spec == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = digits.images, digits.target
    elif spec == "synthetic":
        n, classes = samples or 2048, 10
        y = rng.integers(0, classes, n)
        grid = np.linspace(0, 1, 16)
        base = np.stack([np.sin(2 * np.pi * (k + 1) * grid[:, None] * grid[None, :]) for k in range(classes)])
        x = base[y] + 0.5 * rng.standard_normal((n, 16, 16))
    else:
        path = Path(spec)
        if path.suffix == ".npz" and path.is_file():
            with np.load(path) as f:
                if "x" not in f or "y" not in f:
                    raise ValueError(f"{path}: an .npz dataset needs arrays 'x' and 'y', found {sorted(f.files)}")
                x, y = f["x"], f["y"]
        elif path.is_dir():
            x, y = _load_folder(path, size)
        else:
            raise ValueError(f"--data {spec!r}: not 'digits', 'synthetic', an existing .npz file or a folder")
    y = np.asarray(y).astype(np.int64)
    if len(x) != len(y) or len(y) < 10:
        raise ValueError(f"--data {spec}: need as many labels as images and at least 10 of them "
                         f"(got {len(x)} images, {len(y)} labels)")
    order = rng.permutation(len(y))
    split = int(0.8 * len(y))
    images = _to_images(np.asarray(x)[order], size)
    labels = torch.as_tensor(y[order])
    classes = int(labels.max()) + 1
    return images[:split], labels[:split], images[split:], labels[split:], classes


def _load_folder(path: Path, size: int):
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("reading a folder of images needs Pillow (pip install pillow); or pass an .npz file") \
            from None
    classes = sorted(d for d in path.iterdir() if d.is_dir())
    if not classes:
        raise ValueError(f"{path}: expected one sub-folder of images per class")
    xs, ys = [], []
    for label, folder in enumerate(classes):
        for file in sorted(folder.iterdir()):
            try:
                with Image.open(file) as img:
                    xs.append(np.asarray(img.convert("RGB").resize((size, size)), dtype=np.float32)
                              .transpose(2, 0, 1))
                    ys.append(label)
            except OSError:
                continue  # not an image
    return np.stack(xs), np.asarray(ys)
