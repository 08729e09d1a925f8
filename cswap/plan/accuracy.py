"""Decision accuracy (paper Fig. 11): were the advisor's choices right, measured?

For a sample of profiled tensors, build a tensor of the same shape, dtype size
and sparsity (zeros in runs, as ReLU outputs have), and measure on this
device the real swap with and without compression: pinned D2H and H2D copies
of the raw bytes, and the codec's compress, copies of the compressed bytes
and decompress. With the tensor's measured hidden times, the exposed costs
are eq. 1-4 with measured rather than predicted terms. A decision is right
when "compress" (T < T') agrees between prediction and measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tune.bandwidth import copy_seconds
from ..tune.synthetic import make_tensor
from ..tune.timing import time_codec
from .advisor import Decision, IterationProfile

__all__ = ["DecisionCheck", "check_decisions"]

_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class DecisionCheck:
    key: str
    predicted_codec: str | None
    codec_tested: str
    t_prime_s: float          # measured exposed swap time, uncompressed
    t_s: float                # measured swap cost with codec_tested
    right: bool


def check_decisions(iteration: IterationProfile, decisions: dict[str, Decision], device=None,
                    sample: int = 16, repeats: int = 5, configs: dict | None = None) -> list[DecisionCheck]:
    """Measure the sampled tensors' swaps; returns one DecisionCheck per tensor.

    The codec tested for a tensor left uncompressed is the one the advisor
    found cheapest (least predicted T), so "not compressing" is checked
    against the best alternative."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = "triton" if device.type == "cuda" else "torch"
    configs = configs or {}
    tensors = [t for t in iteration.tensors if t.key in decisions][: max(sample, 0)]
    checks = []
    for t in tensors:
        d = decisions[t.key]
        codec = d.codec or min(d.t_codec, key=d.t_codec.get)
        x = make_tensor(t.nbytes, t.sparsity, _DTYPES[t.itemsize], "blocky", device).reshape(-1)
        compress_s, decompress_s, small = time_codec(codec, x, configs.get(codec), backend, repeats)
        raw_d2h, raw_h2d = copy_seconds(t.nbytes, device, repeats)
        small_d2h, small_h2d = copy_seconds(small, device, repeats)
        t_prime = max(raw_d2h - t.hidden_f, 0.0) + max(raw_h2d - t.hidden_b, 0.0)
        t_codec = compress_s + decompress_s + max(small_d2h - t.hidden_f, 0.0) + max(small_h2d - t.hidden_b, 0.0)
        right = (d.codec is not None) == (t_codec < t_prime)
        checks.append(DecisionCheck(t.key, d.codec, codec, t_prime, t_codec, right))
    return checks
