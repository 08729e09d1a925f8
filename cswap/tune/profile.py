"""The device profile: what cswap-tune measured, as one validated JSON document.

Schema (version 1); every field is required unless marked optional:

    schema_version   1
    device           {name: str, type: "cuda" | "cpu", compute_capability: [int, int] | null,
                      sm_count: int | null}
    versions         {torch: str, triton: str, cswap: str}
    created          ISO 8601 date-time (UTC)
    quick            bool: sizes and budgets were scaled down (--quick)
    bandwidth        {d2h_gbps: number > 0, h2d_gbps: number > 0, pinned: bool,
                      samples: [{bytes, d2h_gbps, h2d_gbps}, ...]}
    codecs           {name: {backend: "triton" | "torch", config: {grid: int, block: int},
                             compress: time model, decompress: time model,
                             rae: {compress: {regressor: number}, decompress: {...}}}}
    tuning           {wall_s: number, method: str, per_codec: {name: {...}}, comparison: object | null}

A time model is cswap.tune.timemodel.TimeModel.to_dict(). JSON only, never pickle:
a profile is data, and loading it runs no code.

`load_profile()` finds the profile of the current device in $CSWAP_HOME
(default ~/.cache/cswap/), else returns the generic default that ships in the
package (`profile.is_default` is True and a warning says so).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kernels.launch import LaunchConfig
from .timemodel import TimeModel

__all__ = ["SCHEMA_VERSION", "Profile", "load_profile", "save_profile", "profile_dir", "profile_path",
           "DEFAULT_PROFILE"]

SCHEMA_VERSION = 1
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "data" / "default_profile.json"
DIRECTIONS = ("compress", "decompress")


def profile_dir() -> Path:
    return Path(os.environ.get("CSWAP_HOME") or Path.home() / ".cache" / "cswap")


def device_slug(device=None) -> str:
    """'nvidia-h100-80gb-hbm3', or 'cpu': the file name of a device's profile."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-").lower()


def profile_path(device=None) -> Path:
    """Where cswap-tune writes, and load_profile looks for, the current device's profile."""
    return profile_dir() / f"profile-{device_slug(device)}.json"


@dataclass
class Profile:
    """A loaded profile: the validated document plus time models ready to predict."""

    doc: dict
    path: Path | None = None
    is_default: bool = False
    models: dict[str, dict[str, TimeModel]] = field(default_factory=dict, repr=False)

    @property
    def codecs(self) -> tuple[str, ...]:
        return tuple(self.doc["codecs"])

    @property
    def bw_d2h(self) -> float:
        """Bytes per second, device to host."""
        return self.doc["bandwidth"]["d2h_gbps"] * 1e9

    @property
    def bw_h2d(self) -> float:
        return self.doc["bandwidth"]["h2d_gbps"] * 1e9

    @property
    def host_s_per_tensor(self) -> float | None:
        """The training thread's seconds per offloaded tensor on this machine (runtime.host_us_per_tensor),
        or None: the planners then use cswap.plan.advisor.HOST_S_PER_TENSOR."""
        value = self.doc.get("runtime", {}).get("host_us_per_tensor")
        return None if value is None else value * 1e-6

    def config(self, codec: str) -> LaunchConfig:
        c = self._codec(codec)["config"]
        return LaunchConfig(grid=c["grid"], block=c["block"])

    def seconds(self, codec: str, direction: str, size: float, sparsity: float) -> float:
        """Predicted time to compress or decompress `size` bytes at `sparsity`."""
        if direction not in DIRECTIONS:
            raise ValueError(f"cswap.Profile: direction must be one of {DIRECTIONS}, got {direction!r}")
        self._codec(codec)
        return float(self.models[codec][direction].predict(size, sparsity))

    def _codec(self, codec: str) -> dict:
        if codec not in self.doc["codecs"]:
            raise KeyError(f"cswap.Profile: no codec {codec!r} in {self.path or 'this profile'}; "
                           f"it has {', '.join(self.doc['codecs'])}")
        return self.doc["codecs"][codec]

    def to_json(self) -> str:
        return json.dumps(self.doc, indent=1, sort_keys=False)


# -- validation ---------------------------------------------------------------------------


class _Checker:
    """Field-by-field checks that name the file and the dotted field path."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, what: str):
        raise ValueError(f"cswap.load_profile: {self.where}: field '{path}' {what}")

    def get(self, obj: dict, key: str, path: str, kinds, optional_null: bool = False):
        if not isinstance(obj, dict):
            self.fail(path.rsplit(".", 1)[0] if "." in path else path, "must be an object")
        if key not in obj:
            self.fail(path, "is missing")
        value = obj[key]
        if value is None and optional_null:
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
            names = "/".join(k.__name__ for k in _tuple(kinds))
            self.fail(path, f"must be {names}, got {type(value).__name__} {value!r:.40}")
        return value

    def number(self, obj, key, path, positive=False):
        value = self.get(obj, key, path, (int, float))
        if value != value or (positive and value <= 0) or value < 0:
            self.fail(path, f"must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
        return value


def _tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


def validate(doc, where: str = "profile") -> dict[str, dict[str, TimeModel]]:
    """Check every field of `doc`; returns its time models. ValueError names file and field."""
    c = _Checker(where)
    if not isinstance(doc, dict):
        raise ValueError(f"cswap.load_profile: {where}: the document must be a JSON object")
    version = c.get(doc, "schema_version", "schema_version", int)
    if version != SCHEMA_VERSION:
        c.fail("schema_version", f"is {version}; this cswap reads version {SCHEMA_VERSION} (re-run cswap-tune)")
    device = c.get(doc, "device", "device", dict)
    c.get(device, "name", "device.name", str)
    if c.get(device, "type", "device.type", str) not in ("cuda", "cpu"):
        c.fail("device.type", f"must be 'cuda' or 'cpu', got {device['type']!r}")
    cc = c.get(device, "compute_capability", "device.compute_capability", list, optional_null=True)
    if cc is not None and (len(cc) != 2 or not all(isinstance(v, int) for v in cc)):
        c.fail("device.compute_capability", f"must be [major, minor], got {cc!r}")
    c.get(device, "sm_count", "device.sm_count", int, optional_null=True)
    versions = c.get(doc, "versions", "versions", dict)
    for key in ("torch", "triton", "cswap"):
        c.get(versions, key, f"versions.{key}", str)
    c.get(doc, "created", "created", str)
    c.get(doc, "quick", "quick", bool)
    if "runtime" in doc:  # optional: the runtime's own cost on this machine (microseconds per offloaded tensor)
        c.number(c.get(doc, "runtime", "runtime", dict), "host_us_per_tensor", "runtime.host_us_per_tensor")
    bw = c.get(doc, "bandwidth", "bandwidth", dict)
    c.number(bw, "d2h_gbps", "bandwidth.d2h_gbps", positive=True)
    c.number(bw, "h2d_gbps", "bandwidth.h2d_gbps", positive=True)
    c.get(bw, "pinned", "bandwidth.pinned", bool)
    c.get(bw, "samples", "bandwidth.samples", list)
    codecs = c.get(doc, "codecs", "codecs", dict)
    if not codecs:
        c.fail("codecs", "must name at least one codec")
    models = {}
    for name, entry in codecs.items():
        p = f"codecs.{name}"
        if c.get(entry, "backend", f"{p}.backend", str) not in ("triton", "torch"):
            c.fail(f"{p}.backend", f"must be 'triton' or 'torch', got {entry['backend']!r}")
        cfg = c.get(entry, "config", f"{p}.config", dict)
        grid = c.get(cfg, "grid", f"{p}.config.grid", int)
        block = c.get(cfg, "block", f"{p}.config.block", int)
        try:
            LaunchConfig(grid=grid, block=block)
        except ValueError as exc:
            c.fail(f"{p}.config", str(exc))
        models[name] = {}
        for direction in DIRECTIONS:
            tm = c.get(entry, direction, f"{p}.{direction}", dict)
            models[name][direction] = TimeModel.from_dict(tm, where=f"cswap.load_profile: {where}: field "
                                                                    f"'{p}.{direction}'")
        rae = c.get(entry, "rae", f"{p}.rae", dict)
        for direction in DIRECTIONS:
            scores = c.get(rae, direction, f"{p}.rae.{direction}", dict)
            for reg in scores:
                c.number(scores, reg, f"{p}.rae.{direction}.{reg}")
    tuning = c.get(doc, "tuning", "tuning", dict)
    c.number(tuning, "wall_s", "tuning.wall_s")
    c.get(tuning, "method", "tuning.method", str)
    c.get(tuning, "per_codec", "tuning.per_codec", dict)
    c.get(tuning, "comparison", "tuning.comparison", dict, optional_null=True)
    return models


# -- files ----------------------------------------------------------------------------------


def read_profile(path) -> Profile:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"cswap.load_profile: {path} does not exist; run cswap-tune to create it") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"cswap.load_profile: {path}: not valid JSON ({exc})") from None
    models = validate(doc, str(path))
    return Profile(doc, path, path.resolve() == DEFAULT_PROFILE, models)


def load_profile(path=None) -> Profile:
    """The profile at `path`; else the current device's in $CSWAP_HOME (default
    ~/.cache/cswap/); else the generic default shipped with cswap (is_default)."""
    if path is not None:
        return read_profile(path)
    mine = profile_path()
    if mine.exists():
        return read_profile(mine)
    warnings.warn(f"cswap: no profile for this device at {mine}; using the generic default profile "
                  f"(run cswap-tune to measure this machine)", RuntimeWarning, stacklevel=2)
    return read_profile(DEFAULT_PROFILE)


def save_profile(doc: dict, path) -> Path:
    """Validate `doc` and write it as JSON (atomically: a reader never sees half a file)."""
    validate(doc, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    return path
