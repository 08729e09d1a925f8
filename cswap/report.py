"""Per-epoch reports: what was offloaded, what was compressed and why, as a table,
JSON lines, a CSV and three plots.

Each epoch the controller builds one `EpochReport`: one `TensorRow` per
candidate tensor (its layer, shape, sampled sparsity, the codec chosen or
None, and the cost model's predicted swap times) plus free-form metrics
(loss, step time, profiling overhead...). `EpochReport.table()` is what
`epoch_end` prints. `ReportWriter` keeps a folder up to date, one call per
epoch:

    epochs.jsonl           one JSON object per epoch (`EpochReport.to_dict()`), in write order
    tensors.csv            every row of every epoch so far (columns: the TensorRow fields)
    sparsity.png           sparsity of each tensor across epochs (CSWAP paper, Fig. 1)
    decisions.png          tensor x epoch map coloured by codec (paper, Fig. 9)
    compressed_layers.png  number of compressed tensors per epoch (paper, Fig. 8)

Every file is replaced atomically, and all of one epoch's files are staged
before any is replaced, so a run killed mid-write (or a write that raises)
leaves the files of the finished epochs whole. The plots need matplotlib
(`pip install matplotlib`, or the `plots` extra); without it they are skipped
with one warning and the JSON and CSV are still written.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .runtime.candidates import KEEP

__all__ = ["EpochReport", "ReportWriter", "TensorRow"]

_MIB = 2**20
TABLE_WIDTH = 110  # the widest line table() prints (metrics wrap onto further lines)


# -- rows and epochs ------------------------------------------------------------------------


@dataclass
class TensorRow:
    """One candidate tensor in one epoch.

    `decision` is the codec the tensor is compressed with from now on, None
    (offloaded uncompressed), or "keep" (left on the device by a budget's plan). `t_prime_s` is the cost model's predicted exposed
    swap time without compression (T', paper eq. 1-2) and `t_best_s` the
    predicted time with `decision` (T, eq. 3-4; equal to T' when there is no
    codec). `compressed_bytes` is what crosses PCIe for this tensor when it is
    compressed (predicted or measured); None when unknown.
    """

    epoch: int
    key: str                      # stable id across iterations, e.g. "3:features.2"
    layer: str                    # path of the module that produced it, e.g. "features.2" ("" = root module)
    layer_type: str               # its class, e.g. "MaxPool2d"
    op: str                       # producing op, e.g. "max_pool2d"
    shape: tuple[int, ...]
    nbytes: int
    sparsity: float               # fraction of zero elements, 0..1
    decision: str | None          # codec name, None: offloaded uncompressed, or "keep" (a budget's plan)
    t_prime_s: float | None       # predicted exposed swap time without compression
    t_best_s: float | None        # predicted exposed swap time with `decision`
    compressed_bytes: int | None  # bytes moved when compressed (predicted or measured)
    measured_swap_s: float | None = None
    saved_in: str = ""            # the module running when autograd saved it, e.g. "features.3" (a Conv2d)

    @property
    def where(self) -> str:
        """'features.3 (ReLU)', as the table and plots print it."""
        return f"{self.layer or '<root>'} ({self.layer_type})"

    @property
    def bytes_moved(self) -> int:
        """Bytes this tensor moves to the host: compressed size if compressed and known, else nbytes."""
        if self.decision == KEEP:
            return 0
        if self.decision is not None and self.compressed_bytes is not None:
            return self.compressed_bytes
        return self.nbytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = [int(s) for s in self.shape]
        for name in ("epoch", "nbytes", "compressed_bytes"):
            d[name] = _plain(d[name], int, name)
        for name in ("sparsity", "t_prime_s", "t_best_s", "measured_swap_s"):
            d[name] = _plain(d[name], float, name)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorRow":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"cswap.report: unknown tensor row field(s) {', '.join(sorted(unknown))}; "
                             f"fields are {', '.join(f.name for f in fields(cls))}")
        required = {f.name for f in fields(cls) if f.name not in ("measured_swap_s", "saved_in")}
        missing = required - set(d)
        if missing:
            raise ValueError(f"cswap.report: tensor row is missing field(s) {', '.join(sorted(missing))}")
        d = dict(d)
        d["shape"] = tuple(int(s) for s in d["shape"])
        return cls(**d)


def _plain(value, kind, name):
    """`value` as a plain Python int/float for JSON (accepts numpy and 0-d torch scalars); None stays None."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"cswap.report: {name} must be a number, not {type(value).__name__} ({value!r})")
    return kind(value)


@dataclass
class EpochReport:
    """All candidate tensors of one epoch, with the epoch's metrics."""

    epoch: int
    rows: list[TensorRow] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def totals(self) -> dict:
        """bytes_offloaded (sum of nbytes), bytes_moved (compressed size for compressed rows, where
        known, else nbytes), swap_time_saved_s (sum of T' - T over compressed rows that have both
        predictions; negative when a forced codec is slower), compressed_layers (rows with a
        decision) and tensors (rows)."""
        saved = 0.0
        moved = [r for r in self.rows if r.decision != KEEP]  # a budget's plan keeps some on the device
        for r in moved:
            if r.decision is not None and r.t_prime_s is not None and r.t_best_s is not None:
                saved += r.t_prime_s - r.t_best_s
        return {
            "bytes_offloaded": sum(r.nbytes for r in moved),
            "bytes_moved": sum(r.bytes_moved for r in moved),
            "swap_time_saved_s": saved,
            "compressed_layers": sum(1 for r in moved if r.decision is not None),
            "tensors": len(self.rows),
        }

    def table(self) -> str:
        """A fixed-width table, one line per tensor, then totals and metrics; no line is
        wider than 110 characters (long layer names and shapes are cut with an ellipsis)."""
        lines = [f"cswap epoch {self.epoch}: {len(self.rows)} candidate tensor{'s' * (len(self.rows) != 1)}"]
        header = _row_line("made in (type)", "op", "saved in", "shape", "MiB", "sparsity", "codec", "T' ms",
                           "T ms")
        lines += [header, "-" * len(header)]
        if not self.rows:
            lines.append("(no candidate tensors)")
        for r in self.rows:
            lines.append(_row_line(_where_cell(r, _COLS[0]), r.op, r.saved_in or "-",
                                   "x".join(str(s) for s in r.shape), f"{r.nbytes / _MIB:.2f}",
                                   f"{100 * r.sparsity:.1f}%", r.decision or "-", _ms(r.t_prime_s), _ms(r.t_best_s)))
        lines.append("-" * len(header))
        t = self.totals
        moved_pct = f" ({100 * t['bytes_moved'] / t['bytes_offloaded']:.1f}%)" if t["bytes_offloaded"] else ""
        lines += _wrap("total:", [f"{t['tensors']} tensors", f"{t['bytes_offloaded'] / _MIB:.2f} MiB offloaded",
                                  f"{t['bytes_moved'] / _MIB:.2f} MiB moved{moved_pct}",
                                  f"{t['compressed_layers']} compressed",
                                  f"predicted saving {1e3 * t['swap_time_saved_s']:.3f} ms"], sep=",")
        lines += _wrap("metrics:", [f"{k}={_fmt_metric(v)}" for k, v in self.metrics.items()] or ["-"], sep=",")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: tuples become lists, numpy/torch scalars plain numbers."""
        metrics = {}
        for k, v in self.metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if v is not None and not isinstance(v, (int, float, str)):
                raise TypeError(f"cswap.report: metric {k!r} must be a number or a string, "
                                f"not {type(v).__name__}")
            metrics[str(k)] = v
        return {"epoch": int(self.epoch), "metrics": metrics, "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict) -> "EpochReport":
        missing = {"epoch", "rows"} - set(d)
        if missing:
            raise ValueError(f"cswap.report: epoch report is missing field(s) {', '.join(sorted(missing))}")
        return cls(epoch=int(d["epoch"]), rows=[TensorRow.from_dict(r) for r in d["rows"]],
                   metrics=dict(d.get("metrics", {})))


# Column widths of table(): made in (type), op, saved in, shape, MiB, sparsity, codec, T' ms, T ms.
# 100 characters of cells and 10 of gaps: every row is exactly TABLE_WIDTH (110) wide.
_COLS = (29, 11, 12, 14, 7, 8, 5, 7, 7)
_RIGHT = (False, False, False, False, True, True, False, True, True)
_GAPS = ("  ", " ", " ", " ", " ", "  ", " ", " ")


def _row_line(*cells) -> str:
    line = ""
    for i, (cell, width, right) in enumerate(zip(cells, _COLS, _RIGHT)):
        cell = _cut(str(cell), width)
        line += (_GAPS[i - 1] if i else "") + (cell.rjust(width) if right else cell.ljust(width))
    return line.rstrip()


def _cut(text: str, width: int) -> str:
    """`text` cut in the middle with an ellipsis when wider than `width`."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _where_cell(r: TensorRow, width: int) -> str:
    """'layer (Type)', cutting the layer name (not the type) when it is too long."""
    where = r.where
    if len(where) <= width:
        return where
    suffix = f" ({r.layer_type})"
    if len(suffix) > width // 2:
        return _cut(where, width)
    return _cut(r.layer or "<root>", width - len(suffix)) + suffix


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


def _fmt_metric(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _wrap(prefix: str, items: list[str], sep: str = "  ") -> list[str]:
    """`prefix` and `items` joined by `sep`, wrapped onto indented lines of at most TABLE_WIDTH."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        item = _cut(item, TABLE_WIDTH - 4)
        tail = sep.rstrip() if i < len(items) - 1 else ""
        candidate = f"{line} {item}{tail}"
        if i and len(candidate) > TABLE_WIDTH:
            lines.append(line)
            line = f"   {item}{tail}"
        else:
            line = candidate
    lines.append(line)
    return lines


# -- files ----------------------------------------------------------------------------------


_JSONL = "epochs.jsonl"
_CSV = "tensors.csv"
_PNGS = ("sparsity.png", "decisions.png", "compressed_layers.png")
_CSV_FIELDS = tuple(f.name for f in fields(TensorRow))


class ReportWriter:
    """Keeps `report_dir` up to date with one `write(report)` per epoch (files listed in the module doc).

    epochs.jsonl is a log: every report written is kept, in order. tensors.csv and the plots
    show the run's history: when a report's epoch is not after the last one (a run resumed from
    a checkpoint, or a new run into the same folder) it supersedes the earlier reports of that
    epoch and later, with a warning. With `plots=False`, or without matplotlib, no PNG is written.
    """

    def __init__(self, report_dir, plots: bool = True):
        self.report_dir = Path(report_dir)
        self.plots = plots
        self._log: list[str] | None = None          # epochs.jsonl lines, loaded on first write
        self._history: list[EpochReport] = []       # the reports tensors.csv and the plots show
        self._warned_matplotlib = False

    def write(self, report: EpochReport) -> list[Path]:
        """Add `report`; rewrite epochs.jsonl, tensors.csv and the plots. Returns the paths written.

        Everything is rendered and staged in temporary files beside the targets first, then
        moved into place with os.replace: if rendering or staging raises (a plot fails, the disk
        is full), no file changes and the report is not recorded, so write() can be called again;
        whatever happens, each file is always a whole one from some finished write. Errors
        propagate (a caller that must not stop training for a report should catch them)."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._load()
        line = json.dumps(report.to_dict(), separators=(",", ":"))
        history = self._supersede(self._history, report)
        history.append(report)

        outputs: list[tuple[Path, bytes]] = [
            (self.report_dir / _JSONL, "".join(s + "\n" for s in self._log + [line]).encode()),
            (self.report_dir / _CSV, _csv_bytes(history)),
        ]
        if self.plots:
            mpl = self._matplotlib()
            if mpl is not None:
                for name, draw in zip(_PNGS, (_plot_sparsity, _plot_decisions, _plot_compressed)):
                    outputs.append((self.report_dir / name, _render(mpl, draw, history)))

        staged = []
        try:
            for path, data in outputs:
                staged.append((_stage(path, data), path))
        except BaseException:
            for tmp, _ in staged:
                _unlink(tmp)
            raise
        for i, (tmp, path) in enumerate(staged):
            try:
                os.replace(tmp, path)
            except BaseException:
                for later, _ in staged[i:]:
                    _unlink(later)
                raise
        self._log.append(line)
        self._history = history
        return [path for _, path in staged]

    @staticmethod
    def read(report_dir) -> list[EpochReport]:
        """The reports in report_dir/epochs.jsonl, in write order. A corrupt last line (a write
        interrupted outside ReportWriter) is ignored with a warning; a corrupt earlier line raises."""
        return [r for r, _ in _read_log(Path(report_dir) / _JSONL)]

    # -- private ------------------------------------------------------------------------------

    def _load(self) -> None:
        """Pick up an existing epochs.jsonl in the folder, so a resumed run appends to it."""
        path = self.report_dir / _JSONL
        self._log, self._history = [], []
        if path.exists():
            for report, text in _read_log(path):
                self._log.append(text)
                self._history = self._supersede(self._history, report, warn=False)
                self._history.append(report)

    def _supersede(self, history: list[EpochReport], report: EpochReport, warn: bool = True) -> list[EpochReport]:
        kept = [r for r in history if r.epoch < report.epoch]
        if warn and len(kept) < len(history):
            warnings.warn(f"cswap.report: epoch {report.epoch} written after epoch {history[-1].epoch} in "
                          f"{self.report_dir}; tensors.csv and the plots now show epochs up to "
                          f"{report.epoch} of this run ({_JSONL} keeps every report)", RuntimeWarning, stacklevel=3)
        return kept

    def _matplotlib(self):
        try:
            import matplotlib  # noqa: F401  (first, so a blocked matplotlib fails here)
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            if not self._warned_matplotlib:
                self._warned_matplotlib = True
                warnings.warn("cswap.report: matplotlib is not installed, so no plots are written to "
                              f"{self.report_dir} (epochs.jsonl and tensors.csv are); "
                              "pip install matplotlib (or cswap[plots]) to get them", RuntimeWarning, stacklevel=3)
            return None
        return Figure, FigureCanvasAgg


def _read_log(path: Path) -> list[tuple[EpochReport, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"cswap.report: {path} does not exist; ReportWriter.write creates it") from None
    lines = [(i + 1, s) for i, s in enumerate(text.splitlines()) if s.strip()]
    out = []
    for n, (lineno, s) in enumerate(lines):
        try:
            out.append((EpochReport.from_dict(json.loads(s)), s))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            if n == len(lines) - 1:
                warnings.warn(f"cswap.report: ignoring the corrupt last line ({lineno}) of {path}, "
                              f"probably an interrupted write ({exc})", RuntimeWarning, stacklevel=3)
                break
            raise ValueError(f"cswap.report: {path} line {lineno} is not an epoch report ({exc}); "
                             f"only a corrupt last line is skipped") from None
    return out


def _csv_bytes(history: list[EpochReport]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for report in history:
        for r in report.rows:
            d = r.to_dict()
            d["shape"] = "x".join(str(s) for s in r.shape)   # 64x3x32x32
            w.writerow({k: "" if v is None else v for k, v in d.items()})
    return buf.getvalue().encode("utf-8")


def _stage(path: Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path` (same filesystem, so os.replace is atomic)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink(Path(tmp))
        raise
    return Path(tmp)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# -- plots ----------------------------------------------------------------------------------
# Drawn on matplotlib.figure.Figure with the Agg canvas: never pyplot, so the user's backend
# and open figures are untouched and nothing needs a display.

_CODEC_COLOURS = {"zvc": "#1f77b4", "rle": "#ff7f0e", "csr": "#2ca02c", "lz4": "#d62728", "zans": "#6a3d9a", "keep": "#bbbbbb"}
_EXTRA_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
_NONE_COLOUR = "#ffffff"
_ABSENT_COLOUR = "#d9d9d9"
_LABEL_CHARS = 48       # longest tensor label in a plot; longer ones are cut in the middle
_CHAR_IN = 0.065        # inches per label character at font size 8, to size figures to their labels


def _render(mpl, draw, history: list[EpochReport]) -> bytes:
    Figure, FigureCanvasAgg = mpl
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # Very long labels can leave tight_layout no room; the plot is still drawn, only cramped.
        warnings.filterwarnings("ignore", message="Tight layout not applied", category=UserWarning)
        fig = draw(Figure, history)
        FigureCanvasAgg(fig)
        fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _tensors(history: list[EpochReport]) -> tuple[list[str], dict[str, str]]:
    """Tensor keys in order of first appearance (forward order), and a label for each:
    'features.3 (ReLU)', with '#index' added where one layer saves several tensors."""
    keys, where = [], {}
    for report in history:
        for r in report.rows:
            if r.key not in where:
                keys.append(r.key)
                where[r.key] = r.where
    count: dict[str, int] = {}
    for k in keys:
        count[where[k]] = count.get(where[k], 0) + 1
    labels = {k: (f"{where[k]} #{k.split(':', 1)[0]}" if count[where[k]] > 1 else where[k]) for k in keys}
    labels = {k: _cut(v, _LABEL_CHARS) for k, v in labels.items()}
    return keys, labels


def _empty(ax, text="no candidate tensors") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def _epoch_axis(ax, epochs: list[int]) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(epochs) == 1:
        ax.set_xlim(epochs[0] - 1, epochs[0] + 1)


def _plot_sparsity(Figure, history):
    keys, labels = _tensors(history)
    epochs = [r.epoch for r in history]
    ncol = max(1, math.ceil(len(keys) / 28))
    legend_in = ncol * (0.6 + _CHAR_IN * max([len(v) for v in labels.values()] + [0]))
    fig = Figure(figsize=(min(7 + legend_in, 30), 5.5))
    ax = fig.add_subplot()
    ax.set_title("Sparsity of offloaded tensors per epoch (cf. CSWAP Fig. 1)")
    if not keys:
        _empty(ax)
        return fig
    from matplotlib import colormaps
    cmap = colormaps["tab20"]
    styles = ("-", "--", ":", "-.")
    for i, key in enumerate(keys):
        xs, ys = [], []
        for report in history:
            for r in report.rows:
                if r.key == key:
                    xs.append(report.epoch)
                    ys.append(100 * r.sparsity)
                    break
        ax.plot(xs, ys, styles[(i // 20) % len(styles)], color=cmap(i % 20), marker="o", markersize=3,
                linewidth=1.2, label=labels[key])
    ax.set_ylabel("sparsity (% zeros)")
    ax.set_ylim(0, 100)
    _epoch_axis(ax, epochs)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7 if len(keys) > 12 else 8,
              ncol=ncol, frameon=False)
    fig.tight_layout()
    return fig


def _plot_decisions(Figure, history):
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    keys, labels = _tensors(history)
    epochs = [r.epoch for r in history]
    label_in = _CHAR_IN * max([len(v) for v in labels.values()] + [0])
    width = label_in + max(3.0, 0.2 * len(epochs)) + 2.0                 # labels, cells, legend
    fig = Figure(figsize=(min(width, 30), min(2 + 0.22 * max(len(keys), 1), 30)))
    ax = fig.add_subplot()
    ax.set_title("Compression decision per tensor and epoch (cf. CSWAP Fig. 9)")
    if not keys:
        _empty(ax)
        return fig
    codecs = []
    for report in history:
        for r in report.rows:
            if r.decision is not None and r.decision not in codecs:
                codecs.append(r.decision)
    known = [c for c in _CODEC_COLOURS if c in codecs]
    codecs = known + sorted(c for c in codecs if c not in _CODEC_COLOURS)
    extra = iter(_EXTRA_COLOURS * (1 + len(codecs) // len(_EXTRA_COLOURS)))
    colours = [_ABSENT_COLOUR, _NONE_COLOUR] + [_CODEC_COLOURS.get(c) or next(extra) for c in codecs]
    value = {None: 1, **{c: i + 2 for i, c in enumerate(codecs)}}
    row_of = {k: i for i, k in enumerate(keys)}
    grid = np.zeros((len(keys), len(history)), dtype=int)       # 0 = tensor absent that epoch
    for j, report in enumerate(history):
        for r in report.rows:
            grid[row_of[r.key], j] = value[r.decision]
    cmap = ListedColormap(colours)
    norm = BoundaryNorm(np.arange(len(colours) + 1) - 0.5, len(colours))
    ax.pcolormesh(np.arange(len(history) + 1) - 0.5, np.arange(len(keys) + 1) - 0.5, grid, cmap=cmap, norm=norm,
                  edgecolors="#999999", linewidth=0.3 if len(history) * len(keys) < 5000 else 0)
    ax.set_xlim(-0.5, len(history) - 0.5)
    ax.set_ylim(len(keys) - 0.5, -0.5)                          # first layer on top, as in the paper
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([labels[k] for k in keys], fontsize=8 if len(keys) <= 30 else 6)
    step = max(1, math.ceil(len(epochs) / 20))
    ax.set_xticks(range(0, len(epochs), step))
    ax.set_xticklabels([str(epochs[j]) for j in range(0, len(epochs), step)])
    ax.set_xlabel("epoch")
    handles = [Patch(facecolor=_NONE_COLOUR, edgecolor="#999999", label="uncompressed")]
    handles += [Patch(facecolor=colours[value[c]], edgecolor="#999999", label=c) for c in codecs]
    if (grid == 0).any():
        handles.append(Patch(facecolor=_ABSENT_COLOUR, edgecolor="#999999", label="not seen"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _plot_compressed(Figure, history):
    from matplotlib.ticker import MaxNLocator
    epochs = [r.epoch for r in history]
    totals = [r.totals for r in history]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    ax.set_title("Layers whose tensors are compressed, per epoch (cf. CSWAP Fig. 8)")
    ax.plot(epochs, [t["compressed_layers"] for t in totals], "-o", markersize=4, color="#1f77b4",
            label="compressed")
    ax.plot(epochs, [t["tensors"] for t in totals], "--", color="#999999", linewidth=1, label="candidates")
    ax.set_ylabel("tensors")
    ax.set_ylim(bottom=0, top=max([t["tensors"] for t in totals] + [1]) * 1.1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _epoch_axis(ax, epochs)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
