"""What cswap runs on, for a bug report: `python -m cswap.env` (or `cswap-env`).

Prints cswap, Python, torch (and its CUDA build), Triton and the libraries
cswap uses, whether each is inside the range cswap is tested on (the ranges
pyproject.toml declares, read from the installed package's metadata), the
GPUs with their compute capability, which codec backend will run (Triton
kernels, Triton's CPU interpreter or the PyTorch reference), and the device
profile in use.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from importlib import metadata

import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

__all__ = ["report", "tested_ranges", "main"]

# The archs cswap's kernels are compiled and gated for ahead of time (cswap.kernels.aot.ARCHS).
CHECKED_ARCHS = (80, 90)
_LIBRARIES = ("numpy", "scikit-learn", "bayesian-optimization", "tqdm", "matplotlib", "lz4")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tested_ranges() -> dict[str, SpecifierSet]:
    """{"torch": SpecifierSet(">=2.11,<2.16"), "python": ...}: the ranges cswap's
    installed metadata declares (pyproject.toml, which claims what CI tests);
    empty when cswap runs from a source tree that was never installed."""
    try:
        requires = metadata.requires("cswap") or []
        python = metadata.metadata("cswap").get("Requires-Python")
    except metadata.PackageNotFoundError:
        return {}
    ranges = {"python": SpecifierSet(python)} if python else {}
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is None or "extra" not in str(requirement.marker):
            ranges[canonicalize_name(requirement.name)] = requirement.specifier
    return ranges


def _range_note(name: str, version: str | None, ranges: dict[str, SpecifierSet]) -> str:
    spec = ranges.get(name)
    if version is None or not spec:
        return ""
    inside = spec.contains(Version(version).base_version)
    shown = ",".join(sorted(map(str, spec), key=lambda clause: not clause.startswith(">")))  # ">=2.11,<2.16"
    return f"  (tested: {shown}: {'yes' if inside else 'NO, outside what cswap is tested on'})"


def _gpus() -> list[str]:
    if not torch.cuda.is_available():
        return ["none (torch.cuda.is_available() is False)"]
    lines = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        arch = p.major * 10 + p.minor
        checked = "" if arch in CHECKED_ARCHS else (f"; cswap's kernels are checked for sm_"
                                                     f"{' and sm_'.join(map(str, CHECKED_ARCHS))} only")
        lines.append(f"cuda:{index} {p.name}, compute capability {p.major}.{p.minor} (sm_{arch}), "
                     f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs{checked}")
    return lines


def _codec_backend() -> str:
    from .kernels.launch import interpreting

    if torch.cuda.is_available():
        return (f"Triton kernels on CUDA tensors (cuda:{torch.cuda.current_device()}); the PyTorch reference "
                f"on other devices")
    if interpreting():
        return ("PyTorch reference (backend='auto'); Triton kernels only when asked for (backend='triton'), in "
                "Triton's CPU interpreter (TRITON_INTERPRET=1)")
    return "PyTorch reference (no CUDA device; backend='triton' needs CUDA or TRITON_INTERPRET=1)"


def _profile() -> str:
    from .tune.profile import load_profile, profile_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            profile = load_profile()
        except (OSError, ValueError) as exc:
            return f"unreadable: {exc}"
    if profile.is_default:
        return f"the generic default shipped with cswap (no profile at {profile_path()}; run cswap-tune)"
    device = profile.doc.get("device", {}).get("name", "?")
    made = profile.doc.get("created", "")
    return f"{profile.path} (device {device}{', made ' + made if made else ''})"


def report() -> str:
    """The report `python -m cswap.env` prints."""
    import cswap

    ranges = tested_ranges()
    where = os.path.dirname(cswap.__file__)
    lines = [f"cswap {cswap.__version__} at {where}",
             f"Python {platform.python_version()} ({platform.python_implementation()}) on {platform.platform()}"
             + _range_note("python", platform.python_version(), ranges)]
    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else ("ROCm build" if torch.version.hip else "CPU build")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch {torch.__version__} ({build}{f', cuDNN {cudnn}' if cudnn else ''})"
                 + _range_note("torch", torch.__version__, ranges))
    triton = _version("triton")
    lines.append(f"triton {triton or 'not installed'}" + _range_note("triton", triton, ranges))
    lines.append("libraries: " + ", ".join(f"{name} {_version(name) or 'not installed'}" for name in _LIBRARIES))
    lines += [f"GPU: {gpu}" for gpu in _gpus()]
    lines.append(f"codecs run: {_codec_backend()}")
    lines.append(f"profile: {_profile()}")
    lines.append(f"CSWAP_HOME: {os.environ.get('CSWAP_HOME', '(unset: ~/.cache/cswap)')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
