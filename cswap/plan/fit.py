"""cswap-plan --fit: the fastest combination of techniques that fits, and the ranking.

A setup is what a user combines before cswap: activation checkpointing and a chunked
loss (Hugging Face causal LMs), the optimizer (bitsandbytes' 8-bit and paged AdamW
beside the one asked for), optimizer-in-backward, and torch.compile (a setup whose model
torch.compile cannot capture as one graph is left out, and said so). Each setup is predicted once
(cswap.predict), which gives every cswap mode of it (none, vdnn, sc, cswap, budget,
recompute); the ranking is every (setup, mode) that fits, fastest first.

Not every setup trains the same numbers: 8-bit optimizer states round the moments
(`Choice.exact` is False for them); checkpointing, a chunked loss, optimizer-in-
backward, compile and cswap's modes compute what the plain step computes (compile and
a chunked loss up to the order of floating-point sums).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["Choice", "Setup", "fit", "setups"]

CHUNKS = 8  # the chunked loss tried (torchtune's default num_output_chunks)


@dataclass(frozen=True)
class Setup:
    gradient_checkpointing: bool = False
    chunked_loss: int | None = None
    optimizer: str = "sgd"
    optimizer_in_backward: bool = False
    compile: bool = False

    @property
    def exact(self) -> bool:
        """Trains the numbers the plain step would (8-bit states do not)."""
        return not self.optimizer.endswith("8bit")

    def techniques(self, asked: str) -> int:
        """How many techniques it adds to the plain step with the optimizer `asked` for."""
        return sum((self.gradient_checkpointing, bool(self.chunked_loss), self.optimizer_in_backward,
                    self.optimizer != asked, self.compile))

    def label(self) -> str:
        parts = [self.optimizer + (" in backward" if self.optimizer_in_backward else "")]
        if self.gradient_checkpointing:
            parts.append("checkpointing")
        if self.chunked_loss:
            parts.append(f"chunked loss {self.chunked_loss}")
        if self.compile:
            parts.append("compile")
        return ", ".join(parts)


@dataclass(frozen=True)
class Choice:
    """One setup in one cswap mode, as predicted."""

    setup: Setup
    mode: str
    peak_bytes: int
    step_seconds: float
    fits: bool
    paged_bytes: int = 0

    @property
    def exact(self) -> bool:
        return self.setup.exact


def setups(optimizer: str, hf_causal_lm: bool, compile: bool = True) -> list[Setup]:
    """Every setup to try: checkpointing and a chunked loss where the model is a Hugging
    Face causal LM; the optimizer asked for and, for the Adam family, bitsandbytes'
    8-bit and paged 8-bit AdamW; optimizer-in-backward on and off; with `compile`,
    each eager and compiled."""
    optimizers = [optimizer]
    if optimizer in ("adam", "adamw", "paged_adamw"):
        optimizers += ["adamw8bit", "paged_adamw8bit"]
    flags = (False, True) if hf_causal_lm else (False,)
    chunks = (None, CHUNKS) if hf_causal_lm else (None,)
    return [Setup(ckpt, chunk, opt, in_bwd, comp)
            for comp, ckpt, chunk, opt, in_bwd in itertools.product((False, True) if compile else (False,), flags,
                                                                    chunks, optimizers, (False, True))]


_MODES = ("none", "vdnn", "sc", "cswap", "budget", "recompute")  # simplest first


def fit(build, gpu, candidates: list[Setup], progress=None, **predict_kwargs) -> list[Choice]:
    """Predict each setup (`build(setup) -> (model, inputs)`) on `gpu` and return the
    (setup, mode) combinations, those that fit first, fastest first; of combinations
    predicted alike (the same step time and peak), only the simplest (fewest techniques,
    then the simplest mode). predict_kwargs go to cswap.predict (precision, budget,
    sparsity, ...). candidates[0] is the plain setup (setups() puts it first)."""
    from .compiled import CompileUnsupported
    from .whatif import predict

    choices = []
    for i, setup in enumerate(candidates):
        if progress is not None:
            progress(i, len(candidates), setup)
        model, inputs = build(setup)
        try:
            p = predict(model, inputs, gpu, optimizer=setup.optimizer,
                        optimizer_in_backward=setup.optimizer_in_backward, compile=setup.compile, **predict_kwargs)
        except CompileUnsupported as exc:
            if progress is not None:
                progress(i, len(candidates), setup, skipped=str(exc))
            continue
        choices += [Choice(setup, mode, p.peak_bytes(mode), p.step_seconds(mode), p.fits(mode), p.paged_bytes)
                    for mode in p.modes]
    asked = candidates[0].optimizer

    def simplicity(c: Choice):
        return c.setup.techniques(asked), _MODES.index(c.mode) if c.mode in _MODES else len(_MODES)

    ranked, seen = [], set()
    for c in sorted(choices, key=lambda c: (not c.fits, round(c.step_seconds, 9), c.peak_bytes, simplicity(c))):
        alike = (round(c.step_seconds, 9), c.peak_bytes)
        if alike not in seen:
            seen.add(alike)
            ranked.append(c)
    return ranked
