"""(De)compression time model: seconds = f(tensor size, sparsity) per codec (paper IV-C).

What is modelled
    How long one codec takes to compress (or, with a second model, decompress)
    a tensor of ``size`` bytes whose fraction ``sparsity`` of elements are zero,
    at the codec's tuned launch config. The execution advisor uses these
    predictions (Tc, Tdc in the paper's eq. 1-4) to decide whether compressing
    a tensor before swapping it pays. One ``TimeModel`` is fitted per codec and
    direction, offline, from measured samples; its coefficients go into the
    device profile as JSON (``to_dict`` / ``from_dict``).

Features
    ``features(sizes, sparsities)`` gives two columns per sample::

        size_bytes       = size                       bytes read (every element is scanned)
        nonzero_bytes    = size * (1 - sparsity)      bytes of non-zero values written / read

    This is the physics of the sparse codecs: ZVC, RLE and CSR scan the whole
    input and write (on decompression: read) the non-zero values, so their
    time is, to first order, linear in these two byte counts plus a constant
    launch overhead (the intercept). The paper observes exactly this linear
    dependence on size and sparsity. The fraction of non-zero *bytes* equals
    the fraction of non-zero *elements* for any dtype, so no dtype is needed.

Sub-models
    The sparsity range ``SPARSITY_RANGE`` = [0.2, 0.8] (where the paper finds
    most activation sparsities, its Fig. 1) is cut into ``n_submodels`` equal
    sub-ranges; sub-model i is a scikit-learn ``LinearRegression`` (with
    intercept, coefficients constrained >= 0: more bytes never take less
    time) trained on the samples whose sparsity falls in
    [lo + R*i/n, lo + R*(i+1)/n) (the last one closed on the right). A sample
    below the range belongs to the first sub-model, above it to the last
    (the nearest one), both in training and in prediction. Predictions are
    clipped at 0 seconds.

    Prediction always uses the stored coefficients (``coef``, ``intercept``)
    with numpy, never a scikit-learn object, so a model loaded with
    ``from_dict`` predicts exactly what the fitted one does.

Error metric
    ``rae(pred, y)`` is the paper's relative absolute error
    RAE = sum|pred_i - y_i| / sum|y_i - mean(y)|: 0 is perfect, 1 is no better
    than always predicting the mean. ``compare_regressors`` reports it on a
    held-out set for the piecewise linear model and for Bayesian ridge, SVR
    and a decision tree (the paper's Fig. 10).
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np

__all__ = ["SPARSITY_RANGE", "REGRESSORS", "TimeModel", "compare_regressors", "features", "rae"]

SPARSITY_RANGE = (0.2, 0.8)
"""Sparsities the sub-models cover (paper IV-C: most activations fall between 20% and 80%)."""

REGRESSORS = ("linear", "bayesian_ridge", "svr", "tree")
"""Names ``compare_regressors`` reports, in this order."""

_PREFIX = "cswap.tune.timemodel"
_FEATURE_NAMES = ("size_bytes", "nonzero_bytes")
_KIND = "piecewise_linear"
# Each sub-model fits 2 coefficients and an intercept: fewer than 3 samples
# leave it under-determined.
_MIN_SAMPLES = 3


# --------------------------------------------------------------------------
# input checks


def _as_1d(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{_PREFIX}: {name} must be numbers, got {type(x).__name__} ({e})") from None
    if a.ndim > 1:
        raise ValueError(f"{_PREFIX}: {name} must be a number or a 1-d sequence, got shape {a.shape}")
    a = a.reshape(-1)
    bad = ~np.isfinite(a)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{_PREFIX}: {name}[{i}] is {a[i]}; every value must be finite (no NaN or inf)")
    return a


def _check_inputs(sizes, sparsities, *more):
    """Validate sizes (>= 0), sparsities (in [0, 1]) and any (values, name) pairs in *more.

    Returns (sizes, sparsities, *values) as 1-d float64 arrays and whether
    every input was a scalar. A scalar is broadcast against 1-d arrays; two
    1-d arrays must have the same length.
    """
    named = [(sizes, "sizes"), (sparsities, "sparsities"), *more]
    scalar = all(np.ndim(v) == 0 for v, _ in named)
    arrays = [_as_1d(v, name) for v, name in named]
    lengths = {name: len(a) for a, (v, name) in zip(arrays, named) if np.ndim(v) != 0}
    if len(set(lengths.values())) > 1:
        desc = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(f"{_PREFIX}: lengths differ ({desc}); pass one value per sample")
    n = next(iter(lengths.values())) if lengths else 1
    arrays = [np.broadcast_to(a, (n,)) if np.ndim(v) == 0 else a for a, (v, _) in zip(arrays, named)]
    s, p = arrays[0], arrays[1]
    if (s < 0).any():
        i = int(np.flatnonzero(s < 0)[0])
        raise ValueError(f"{_PREFIX}: sizes[{i}] is {s[i]}; sizes are byte counts and must be >= 0")
    bad = (p < 0) | (p > 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{_PREFIX}: sparsities[{i}] is {p[i]}; sparsity is the fraction of zero "
                         "elements and must be in [0, 1]")
    return (*arrays, scalar)


def _check_range(sparsity_range) -> tuple[float, float]:
    try:
        lo, hi = sparsity_range
    except (TypeError, ValueError):
        raise ValueError(f"{_PREFIX}: sparsity_range must be a pair (lo, hi), got {sparsity_range!r}") from None
    if not all(isinstance(v, Real) and not isinstance(v, bool) for v in (lo, hi)):
        raise ValueError(f"{_PREFIX}: sparsity_range must be two numbers, got {sparsity_range!r}")
    lo, hi = float(lo), float(hi)
    if not (0.0 <= lo < hi <= 1.0):
        raise ValueError(f"{_PREFIX}: sparsity_range must satisfy 0 <= lo < hi <= 1, got ({lo}, {hi})")
    return lo, hi


# --------------------------------------------------------------------------
# public functions


def features(sizes, sparsities) -> np.ndarray:
    """Regression features, shape (n, 2): ``[size_bytes, size_bytes * (1 - sparsity)]``.

    Column 0 is the bytes every sparse codec reads; column 1 the bytes of
    non-zero values it writes (compression) or reads (decompression). ZVC,
    RLE and CSR time is close to linear in these two plus a launch constant,
    which the models fit as their intercept. A scalar pair gives one row.
    """
    s, p, _ = _check_inputs(sizes, sparsities)
    return np.column_stack([s, s * (1.0 - p)])


def rae(pred, y) -> float:
    """Relative absolute error ``sum|pred - y| / sum|y - mean(y)|`` (the paper's metric).

    0 means exact; 1 means no better than predicting mean(y) for every sample.
    Raises ValueError when the lengths differ, when there is no sample, when a
    value is not finite, or when y is constant (the denominator is 0).
    """
    p = _as_1d(pred, "pred")
    t = _as_1d(y, "y")
    if len(p) != len(t):
        raise ValueError(f"{_PREFIX}: pred has {len(p)} values but y has {len(t)}; pass one prediction per sample")
    if len(t) == 0:
        raise ValueError(f"{_PREFIX}: rae of no samples is undefined; pass at least two")
    denom = float(np.abs(t - t.mean()).sum())
    if denom == 0.0:
        raise ValueError(f"{_PREFIX}: y is constant ({t[0]} for all {len(t)} samples), so rae is undefined "
                         "(its denominator sum|y - mean(y)| is 0)")
    return float(np.abs(p - t).sum()) / denom


# --------------------------------------------------------------------------
# the model


class TimeModel:
    """n linear sub-models over equal sparsity sub-ranges of SPARSITY_RANGE (paper IV-C); outside the range the nearest sub-model.

    Sub-model i covers sparsities [lo + (hi-lo)*i/n, lo + (hi-lo)*(i+1)/n)
    (the last one includes hi) and predicts
    ``coef[0] * size + coef[1] * size * (1 - sparsity) + intercept`` seconds,
    clipped at 0. Fit with ``fit`` or load with ``from_dict``.
    """

    def __init__(self, n_submodels: int = 3, sparsity_range=SPARSITY_RANGE):
        if isinstance(n_submodels, bool) or not isinstance(n_submodels, (int, np.integer)):
            raise ValueError(f"{_PREFIX}: n_submodels must be an int, got {type(n_submodels).__name__}")
        if n_submodels < 1:
            raise ValueError(f"{_PREFIX}: n_submodels is {n_submodels}; it must be >= 1")
        self.n_submodels = int(n_submodels)
        self.sparsity_range = _check_range(sparsity_range)
        lo, hi = self.sparsity_range
        n = self.n_submodels
        self._edges = np.array([lo + (hi - lo) * i / n for i in range(n)] + [hi])
        self._coef: np.ndarray | None = None       # (n, 2)
        self._intercept: np.ndarray | None = None  # (n,)

    def __repr__(self) -> str:
        state = "fitted" if self._coef is not None else "not fitted"
        return f"TimeModel(n_submodels={self.n_submodels}, sparsity_range={self.sparsity_range}, {state})"

    def _submodel_index(self, sparsities: np.ndarray) -> np.ndarray:
        # Interior edges only: below the first edge -> 0, at/after the last
        # interior edge -> n-1, so out-of-range samples get the nearest one.
        return np.searchsorted(self._edges[1:-1], sparsities, side="right")

    def fit(self, sizes, sparsities, seconds) -> "TimeModel":
        """Fit one scikit-learn LinearRegression (with intercept) per sub-model; returns self.

        Samples outside the sparsity range train the nearest sub-model. Raises
        ValueError when a sub-model gets fewer than 3 samples (2 coefficients
        and an intercept), or on bad input (see ``features``; seconds must be
        finite and >= 0).
        """
        from sklearn.linear_model import LinearRegression

        s, p, t, _ = _check_inputs(sizes, sparsities, (seconds, "seconds"))
        if (t < 0).any():
            i = int(np.flatnonzero(t < 0)[0])
            raise ValueError(f"{_PREFIX}: seconds[{i}] is {t[i]}; measured times must be >= 0")
        X = np.column_stack([s, s * (1.0 - p)])
        idx = self._submodel_index(p)
        coef = np.empty((self.n_submodels, 2))
        intercept = np.empty(self.n_submodels)
        for i in range(self.n_submodels):
            mask = idx == i
            count = int(mask.sum())
            if count < _MIN_SAMPLES:
                raise ValueError(
                    f"{_PREFIX}: sub-model {i} (sparsity [{self._edges[i]:g}, {self._edges[i + 1]:g}]) has "
                    f"{count} training samples; it needs at least {_MIN_SAMPLES} (2 coefficients and an "
                    "intercept). Measure more samples in that sparsity range or use fewer sub-models.")
            # positive: a byte more never costs less time (noise on a loaded machine made slopes
            # negative, and a quick profile then called a 1 MiB compression free)
            reg = LinearRegression(fit_intercept=True, positive=True).fit(X[mask], t[mask])
            coef[i] = reg.coef_
            intercept[i] = reg.intercept_
        self._coef, self._intercept = coef, intercept
        return self

    def _require_fitted(self, what: str) -> None:
        if self._coef is None:
            raise RuntimeError(f"{_PREFIX}: {what} needs a fitted model; call fit() first or load one with "
                               "TimeModel.from_dict()")

    def predict(self, sizes, sparsities) -> np.ndarray | float:
        """Predicted seconds, never negative. Scalars in -> float out; arrays in -> 1-d array out.

        A scalar is broadcast against an array (one size at many sparsities,
        or the reverse). Sparsities outside the range use the nearest sub-model.
        """
        self._require_fitted("predict()")
        s, p, scalar = _check_inputs(sizes, sparsities)
        i = self._submodel_index(p)
        c = self._coef[i]
        y = c[:, 0] * s + c[:, 1] * (s * (1.0 - p)) + self._intercept[i]
        y = np.maximum(y, 0.0)
        return float(y[0]) if scalar else y

    def to_dict(self) -> dict:
        """JSON-ready description: kind, feature names, sparsity range and each sub-model's range and coefficients."""
        self._require_fitted("to_dict()")
        return {
            "kind": _KIND,
            "features": list(_FEATURE_NAMES),
            "sparsity_range": [float(v) for v in self.sparsity_range],
            "submodels": [
                {"lo": float(self._edges[i]), "hi": float(self._edges[i + 1]),
                 "coef": [float(v) for v in self._coef[i]], "intercept": float(self._intercept[i])}
                for i in range(self.n_submodels)
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "time model") -> "TimeModel":
        """Rebuild a model from ``to_dict()`` output (e.g. after a JSON round trip).

        Every field is checked: a missing or wrongly typed field, an unknown
        kind or feature list, a wrong number of coefficients, or sub-model
        ranges that are not the equal, contiguous sub-ranges of
        ``sparsity_range`` raise ValueError naming ``f"{where}: field ..."``.
        """

        def fail(field: str, msg: str):
            raise ValueError(f"{_PREFIX}: {where}: field {field} {msg}")

        def number(v, field: str) -> float:
            if isinstance(v, bool) or not isinstance(v, Real):
                fail(field, f"must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                fail(field, f"must be finite, got {v!r}")
            return float(v)

        def get(obj: dict, key: str, field: str, typ, tname: str):
            if key not in obj:
                fail(field, "is missing")
            v = obj[key]
            if not isinstance(v, typ):
                fail(field, f"must be {tname}, got {type(v).__name__} {v!r}")
            return v

        if not isinstance(d, dict):
            raise ValueError(f"{_PREFIX}: {where}: must be a dict, got {type(d).__name__}")
        kind = get(d, "kind", "kind", str, "a string")
        if kind != _KIND:
            fail("kind", f"is {kind!r}; this loader reads {_KIND!r}")
        feats = get(d, "features", "features", list, "a list")
        if feats != list(_FEATURE_NAMES):
            fail("features", f"is {feats!r}; expected {list(_FEATURE_NAMES)!r}")
        rng = get(d, "sparsity_range", "sparsity_range", list, "a list")
        if len(rng) != 2:
            fail("sparsity_range", f"must be [lo, hi], got {len(rng)} values")
        lo = number(rng[0], "sparsity_range[0]")
        hi = number(rng[1], "sparsity_range[1]")
        if not (0.0 <= lo < hi <= 1.0):
            fail("sparsity_range", f"must satisfy 0 <= lo < hi <= 1, got [{lo}, {hi}]")
        subs = get(d, "submodels", "submodels", list, "a list")
        if not subs:
            fail("submodels", "is empty; a model needs at least one sub-model")
        n = len(subs)
        edges, coef, intercept = [], np.empty((n, 2)), np.empty(n)
        width = (hi - lo) / n
        for i, sm in enumerate(subs):
            f = f"submodels[{i}]"
            if not isinstance(sm, dict):
                fail(f, f"must be a dict, got {type(sm).__name__}")
            if "lo" not in sm:
                fail(f"{f}.lo", "is missing")
            if "hi" not in sm:
                fail(f"{f}.hi", "is missing")
            s_lo, s_hi = number(sm["lo"], f"{f}.lo"), number(sm["hi"], f"{f}.hi")
            want_lo = lo + width * i
            if not math.isclose(s_lo, want_lo, rel_tol=1e-9, abs_tol=1e-12):
                fail(f"{f}.lo", f"is {s_lo}; sub-model {i} of {n} over [{lo}, {hi}] starts at {want_lo}")
            if not math.isclose(s_hi, want_lo + width, rel_tol=1e-9, abs_tol=1e-12):
                fail(f"{f}.hi", f"is {s_hi}; sub-model {i} of {n} over [{lo}, {hi}] ends at {want_lo + width}")
            c = get(sm, "coef", f"{f}.coef", list, "a list")
            if len(c) != len(_FEATURE_NAMES):
                fail(f"{f}.coef", f"must have {len(_FEATURE_NAMES)} values (one per feature), got {len(c)}")
            coef[i] = [number(v, f"{f}.coef[{j}]") for j, v in enumerate(c)]
            if "intercept" not in sm:
                fail(f"{f}.intercept", "is missing")
            intercept[i] = number(sm["intercept"], f"{f}.intercept")
            edges.append(s_lo)
        edges.append(number(subs[-1]["hi"], f"submodels[{n - 1}].hi"))

        model = cls(n, (lo, hi))
        # Keep the stored edges bit for bit, so routing matches the saved model.
        model._edges = np.array(edges)
        model._coef, model._intercept = coef, intercept
        return model


# --------------------------------------------------------------------------
# comparison with other regressors (paper Fig. 10)


def _split(data, name: str):
    try:
        sizes, sparsities, seconds = data
    except (TypeError, ValueError):
        raise ValueError(f"{_PREFIX}: {name} must be a tuple (sizes, sparsities, seconds)") from None
    s, p, t, _ = _check_inputs(sizes, sparsities, (seconds, f"{name} seconds"))
    if (t < 0).any():
        raise ValueError(f"{_PREFIX}: {name} seconds must be >= 0")
    return s, p, t


def compare_regressors(train, test, n_submodels: int = 3, seed: int = 0) -> dict[str, float]:
    """RAE on ``test`` of four regressors fitted on ``train``; each is a tuple (sizes, sparsities, seconds).

    - ``"linear"``: the piecewise ``TimeModel(n_submodels)``.
    - ``"bayesian_ridge"``: one global ``BayesianRidge`` on the same two
      features (it is linear too; what differs is the prior and the single
      model over all sparsities).
    - ``"svr"``: ``SVR`` (RBF kernel, defaults) on the two features plus
      sparsity as a third column, inside ``StandardScaler`` with the target
      standardised too (``TransformedTargetRegressor``): raw seconds (~1e-4)
      and sizes (~1e8) are far outside the scale SVR's defaults assume.
    - ``"tree"``: ``DecisionTreeRegressor(random_state=seed)`` on the same
      three columns (scale-free, so no scaling).

    The non-linear models get sparsity as its own column so they can split or
    bend on it the way the piecewise model's sub-ranges do. BayesianRidge is
    also standardised (X and y), for the same numerical reason as SVR.
    Returns ``{name: rae}`` in ``REGRESSORS`` order.
    """
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.linear_model import BayesianRidge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR
    from sklearn.tree import DecisionTreeRegressor

    s_tr, p_tr, t_tr = _split(train, "train")
    s_te, p_te, t_te = _split(test, "test")
    if len(t_te) < 2:
        raise ValueError(f"{_PREFIX}: test has {len(t_te)} samples; rae needs at least 2 with different times")

    def scaled(reg):
        return TransformedTargetRegressor(regressor=make_pipeline(StandardScaler(), reg),
                                          transformer=StandardScaler())

    X2_tr, X2_te = features(s_tr, p_tr), features(s_te, p_te)
    X3_tr, X3_te = np.column_stack([X2_tr, p_tr]), np.column_stack([X2_te, p_te])

    out = {}
    lin = TimeModel(n_submodels).fit(s_tr, p_tr, t_tr)
    out["linear"] = rae(lin.predict(s_te, p_te), t_te)
    br = scaled(BayesianRidge()).fit(X2_tr, t_tr)
    out["bayesian_ridge"] = rae(br.predict(X2_te), t_te)
    svr = scaled(SVR()).fit(X3_tr, t_tr)
    out["svr"] = rae(svr.predict(X3_te), t_te)
    tree = DecisionTreeRegressor(random_state=seed).fit(X3_tr, t_tr)
    out["tree"] = rae(tree.predict(X3_te), t_te)
    return {name: out[name] for name in REGRESSORS}
