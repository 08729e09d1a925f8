"""Tests for cswap.tune.timemodel: piecewise linear (de)compression time model (paper IV-C)."""

import copy
import json
import math
import sys

import numpy as np
import pytest

from cswap.tune.timemodel import (REGRESSORS, SPARSITY_RANGE, TimeModel, compare_regressors, features, rae)

# A known piecewise-linear law, one (a, b, c) per sparsity sub-range of
# [0.2, 0.8] with 3 sub-models: seconds = a*size + b*size*(1-sparsity) + c.
# Magnitudes like a sparse codec on a GPU: ~1 TB/s read, ~0.5 TB/s written,
# 10-30 us launch overhead.
LAW = np.array([
    [1.0e-12, 2.0e-12, 2e-5],   # sparsity [0.2, 0.4)
    [1.2e-12, 1.5e-12, 3e-5],   # sparsity [0.4, 0.6)
    [0.8e-12, 2.5e-12, 1e-5],   # sparsity [0.6, 0.8] (and above)
])
MB = 1e6


def law_index(sp):
    return np.clip(np.floor((np.asarray(sp) - 0.2) / 0.2).astype(int), 0, 2)


def law(sizes, sp):
    a, b, c = LAW[law_index(sp)].T
    return a * sizes + b * sizes * (1 - sp) + c


def make_data(n, noise, rng, sp_lo=0.2, sp_hi=0.8):
    """Sizes log-uniform in [20 MB, 2000 MB] (the paper's range), multiplicative Gaussian noise."""
    sizes = np.exp(rng.uniform(np.log(20 * MB), np.log(2000 * MB), n))
    sp = rng.uniform(sp_lo, sp_hi, n)
    t = law(sizes, sp) * (1 + noise * rng.standard_normal(n))
    return sizes, sp, t


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def fitted(rng):
    return TimeModel().fit(*make_data(600, 0.002, rng))


def submodel_formula(sm, size, sp):
    a, b = sm["coef"]
    return a * size + b * size * (1 - sp) + sm["intercept"]


# ---------------------------------------------------------------- features


def test_features_hand_values():
    X = features([100.0, 8.0, 0.0], [0.25, 1.0, 0.5])
    assert X.shape == (3, 2)
    np.testing.assert_array_equal(X, [[100.0, 75.0], [8.0, 0.0], [0.0, 0.0]])
    np.testing.assert_array_equal(features(40, 0.5), [[40.0, 20.0]])
    assert features([], []).shape == (0, 2)


@pytest.mark.parametrize("sizes, sparsities, match", [
    ([1.0, 2.0], [0.5], "lengths differ"),
    ([-1.0], [0.5], r"sizes\[0\] is -1"),
    ([1.0, 2.0], [0.5, 1.5], r"sparsities\[1\] is 1.5"),
    ([1.0], [-0.1], r"sparsities\[0\]"),
    ([float("nan")], [0.5], r"sizes\[0\] is nan"),
    ([1.0], [float("nan")], r"sparsities\[0\] is nan"),
    ([float("inf")], [0.5], r"sizes\[0\] is inf"),
    ([[1.0, 2.0]], [[0.1, 0.2]], "1-d"),
    (["big"], [0.5], "sizes must be numbers"),
])
def test_features_rejects_bad_input(sizes, sparsities, match):
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: .*" + match):
        features(sizes, sparsities)


# ---------------------------------------------------------------- rae


def test_rae_hand_computation():
    # y = [1, 3, 5], mean 3: sum|y - mean| = 2 + 0 + 2 = 4
    # pred = [1, 2, 4]:      sum|pred - y| = 0 + 1 + 1 = 2  -> RAE = 2/4 = 0.5
    assert rae([1, 2, 4], [1, 3, 5]) == 0.5
    # y = [2, 4, 6, 8], mean 5: 3 + 1 + 1 + 3 = 8; pred all 5 (the mean): 8 -> 1.0
    assert rae([5, 5, 5, 5], [2, 4, 6, 8]) == 1.0
    # pred = [2, 4, 6, 10]: 0 + 0 + 0 + 2 = 2 -> 2/8 = 0.25
    assert rae(np.array([2.0, 4.0, 6.0, 10.0]), [2, 4, 6, 8]) == 0.25
    assert rae([1, 3, 5], [1, 3, 5]) == 0.0
    assert isinstance(rae([1, 2], [1, 3]), float)


@pytest.mark.parametrize("pred, y, match", [
    ([1, 2], [1, 2, 3], "pred has 2 values but y has 3"),
    ([], [], "no samples"),
    ([1, 2, 3], [4, 4, 4], "y is constant"),
    ([1], [1], "y is constant"),
    ([1, float("nan")], [1, 2], r"pred\[1\] is nan"),
    ([1, 2], [float("nan"), 2], r"y\[0\] is nan"),
])
def test_rae_errors(pred, y, match):
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: .*" + match):
        rae(pred, y)


# ---------------------------------------------------------------- fitting


def test_recovers_law_exactly_without_noise(rng):
    sizes, sp, t = make_data(300, 0.0, rng)
    d = TimeModel().fit(sizes, sp, t).to_dict()
    assert len(d["submodels"]) == 3
    for sm, (a, b, c) in zip(d["submodels"], LAW):
        np.testing.assert_allclose(sm["coef"], [a, b], rtol=1e-9)
        np.testing.assert_allclose(sm["intercept"], c, rtol=1e-7)


def test_recovers_law_with_small_noise_and_predicts_held_out(rng):
    model = TimeModel().fit(*make_data(3000, 0.002, rng))
    for sm, (a, b, c) in zip(model.to_dict()["submodels"], LAW):
        np.testing.assert_allclose(sm["coef"], [a, b], rtol=1e-2)
        np.testing.assert_allclose(sm["intercept"], c, rtol=3e-2)
    sizes, sp, t = make_data(1000, 0.002, rng)
    err = rae(model.predict(sizes, sp), t)
    assert err < 0.03
    # Noise is 0.2% of each time, so the model's error must be of that order,
    # far below what ignoring the sub-ranges costs (checked against one sub-model).
    one = TimeModel(n_submodels=1).fit(*make_data(3000, 0.002, rng))
    assert err < 0.5 * rae(one.predict(sizes, sp), t)


def test_submodel_ranges_follow_paper_formula():
    # Sub-model i covers [base + R*i/n, base + R*(i+1)/n].
    rng = np.random.default_rng(0)
    sizes = rng.uniform(20 * MB, 2000 * MB, 200)
    sp = rng.uniform(0.1, 0.5, 200)
    d = TimeModel(4, (0.1, 0.5)).fit(sizes, sp, 1e-12 * sizes).to_dict()
    assert d["sparsity_range"] == [0.1, 0.5]
    np.testing.assert_allclose([(s["lo"], s["hi"]) for s in d["submodels"]],
                               [(0.1, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5)], rtol=1e-12)
    assert d["submodels"][0]["lo"] == 0.1 and d["submodels"][-1]["hi"] == 0.5
    assert SPARSITY_RANGE == (0.2, 0.8)


def test_one_submodel_is_sklearn_linear_regression(rng):
    from sklearn.linear_model import LinearRegression

    sizes, sp, t = make_data(200, 0.01, rng)
    d = TimeModel(n_submodels=1).fit(sizes, sp, t).to_dict()
    ref = LinearRegression().fit(features(sizes, sp), t)
    np.testing.assert_allclose(d["submodels"][0]["coef"], ref.coef_, rtol=1e-12)
    np.testing.assert_allclose(d["submodels"][0]["intercept"], ref.intercept_, rtol=1e-12)


def test_out_of_range_samples_train_nearest_submodel(rng):
    # The law's first piece also holds below 0.2 and its last above 0.8. With
    # zero noise the fit stays exact only if those samples land in the first
    # and last sub-models; sub-model 0 has no in-range sample at all here.
    lo = make_data(20, 0.0, rng, 0.0, 0.2)
    mid = make_data(50, 0.0, rng, 0.4, 0.6)
    hi = make_data(20, 0.0, rng, 0.8, 1.0)
    sizes, sp, t = (np.concatenate(parts) for parts in zip(lo, mid, hi))
    d = TimeModel().fit(sizes, sp, t).to_dict()
    for sm, (a, b, c) in zip(d["submodels"], LAW):
        np.testing.assert_allclose(sm["coef"], [a, b], rtol=1e-9)
        np.testing.assert_allclose(sm["intercept"], c, rtol=1e-7)


def test_too_few_samples_in_a_submodel(rng):
    sizes, sp, t = make_data(40, 0.0, rng, 0.2, 0.6)   # nothing in [0.6, 0.8]
    sizes, sp, t = np.append(sizes, [30 * MB, 40 * MB]), np.append(sp, [0.7, 0.75]), np.append(t, [1e-4, 2e-4])
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: sub-model 2 .* has 2 training samples; "
                                         r"it needs at least 3"):
        TimeModel().fit(sizes, sp, t)
    # With a third sample it fits.
    TimeModel().fit(np.append(sizes, 50 * MB), np.append(sp, 0.65), np.append(t, 3e-4))


@pytest.mark.parametrize("kwargs, match", [
    ({"n_submodels": 0}, "n_submodels is 0"),
    ({"n_submodels": -2}, "n_submodels is -2"),
    ({"n_submodels": 2.0}, "n_submodels must be an int"),
    ({"n_submodels": True}, "n_submodels must be an int"),
    ({"sparsity_range": (0.8, 0.2)}, "sparsity_range must satisfy"),
    ({"sparsity_range": (0.2, 1.5)}, "sparsity_range must satisfy"),
    ({"sparsity_range": (0.2,)}, "sparsity_range must be a pair"),
    ({"sparsity_range": ("a", "b")}, "sparsity_range must be two numbers"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: " + match):
        TimeModel(**kwargs)


@pytest.mark.parametrize("change, match", [
    (lambda s, p, t: (s[:-1], p, t), "lengths differ"),
    (lambda s, p, t: (s, p, t[:-1]), "lengths differ"),
    (lambda s, p, t: (-s, p, t), r"sizes\[0\]"),
    (lambda s, p, t: (s, p + 1.0, t), r"sparsities\[0\]"),
    (lambda s, p, t: (s, p, -t), r"seconds\[0\]"),
    (lambda s, p, t: (s, p, np.where(np.arange(len(t)) == 3, np.nan, t)), r"seconds\[3\] is nan"),
])
def test_fit_input_errors(rng, change, match):
    data = make_data(60, 0.0, rng)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: .*" + match):
        TimeModel().fit(*change(*data))


# ---------------------------------------------------------------- predict


def test_predict_scalar_array_and_broadcast(fitted):
    y = fitted.predict(500 * MB, 0.5)
    assert type(y) is float
    arr = fitted.predict([500 * MB, 100 * MB], [0.5, 0.3])
    assert isinstance(arr, np.ndarray) and arr.shape == (2,)
    assert arr[0] == y
    np.testing.assert_array_equal(fitted.predict(500 * MB, [0.5, 0.3]),
                                  [y, fitted.predict(500 * MB, 0.3)])
    assert fitted.predict([], []).shape == (0,)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: lengths differ"):
        fitted.predict([1.0, 2.0], [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: sparsities\[0\] is 2"):
        fitted.predict(1.0, 2.0)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: sizes\[0\] is nan"):
        fitted.predict(float("nan"), 0.5)


def test_predict_uses_right_submodel_in_and_out_of_range(fitted):
    subs = fitted.to_dict()["submodels"]
    size = 750 * MB
    # Outside the range: the nearest sub-model's formula.
    for sp, i in [(0.0, 0), (0.05, 0), (0.95, 2), (1.0, 2),
                  # Inside: the sub-range containing sp; an edge belongs to the upper one.
                  (0.2, 0), (0.3, 0), (0.5, 1), (0.7, 2), (0.8, 2)]:
        assert fitted.predict(size, sp) == pytest.approx(submodel_formula(subs[i], size, sp), rel=1e-12), sp
        other = subs[(i + 1) % 3]
        assert fitted.predict(size, sp) != pytest.approx(submodel_formula(other, size, sp), rel=1e-6), sp
    # At 0.4 the upper sub-model (1) applies, and differs from sub-model 0's value there.
    assert fitted.predict(size, 0.4) == pytest.approx(submodel_formula(subs[1], size, 0.4), rel=1e-12)


def test_predict_never_negative():
    d = {"kind": "piecewise_linear", "features": ["size_bytes", "nonzero_bytes"], "sparsity_range": [0.2, 0.8],
         "submodels": [{"lo": 0.2, "hi": 0.8, "coef": [1e-12, 0.0], "intercept": -1e-3}]}
    m = TimeModel.from_dict(d)
    y = m.predict([0.0, 1e8, 2e9], [0.5, 0.5, 0.5])
    np.testing.assert_allclose(y, [0.0, 0.0, 1e-3], rtol=1e-12)
    assert m.predict(0.0, 0.5) == 0.0


def test_unfitted_model_refuses():
    with pytest.raises(RuntimeError, match=r"cswap\.tune\.timemodel: predict\(\) needs a fitted model"):
        TimeModel().predict(1.0, 0.5)
    with pytest.raises(RuntimeError, match=r"cswap\.tune\.timemodel: to_dict\(\) needs a fitted model"):
        TimeModel().to_dict()


# ---------------------------------------------------------------- to_dict / from_dict


def test_round_trip_through_json_predicts_identically(fitted, rng, monkeypatch):
    d = fitted.to_dict()
    assert d["kind"] == "piecewise_linear"
    assert d["features"] == ["size_bytes", "nonzero_bytes"]
    assert d["sparsity_range"] == [0.2, 0.8]
    assert [sorted(s) for s in d["submodels"]] == [["coef", "hi", "intercept", "lo"]] * 3
    loaded_dict = json.loads(json.dumps(d))
    sizes = np.exp(rng.uniform(np.log(1 * MB), np.log(4000 * MB), 500))
    sp = rng.uniform(0.0, 1.0, 500)
    want = fitted.predict(sizes, sp)
    # Prediction after loading needs no scikit-learn at all.
    for mod in ("sklearn", "sklearn.linear_model"):
        monkeypatch.setitem(sys.modules, mod, None)
    loaded = TimeModel.from_dict(loaded_dict)
    np.testing.assert_allclose(loaded.predict(sizes, sp), want, rtol=1e-12, atol=0)
    assert loaded.predict(123 * MB, 0.61) == pytest.approx(fitted.predict(123 * MB, 0.61), rel=1e-12)
    assert loaded.to_dict() == d
    assert loaded.n_submodels == 3 and loaded.sparsity_range == (0.2, 0.8)


def _corrupt(path, value=None, delete=False):
    def apply(d):
        obj = d
        for key in path[:-1]:
            obj = obj[key]
        if delete:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
        return d
    return apply


@pytest.mark.parametrize("corrupt, field", [
    (_corrupt(["kind"], delete=True), "kind is missing"),
    (_corrupt(["kind"], "tree"), "kind is 'tree'"),
    (_corrupt(["kind"], 3), "kind must be a string"),
    (_corrupt(["features"], delete=True), "features is missing"),
    (_corrupt(["features"], ["size_bytes"]), "features is"),
    (_corrupt(["features"], "size_bytes"), "features must be a list"),
    (_corrupt(["sparsity_range"], delete=True), "sparsity_range is missing"),
    (_corrupt(["sparsity_range"], [0.2]), "sparsity_range must be"),
    (_corrupt(["sparsity_range"], "0.2-0.8"), "sparsity_range must be a list"),
    (_corrupt(["sparsity_range", 1], "0.8"), r"sparsity_range\[1\] must be a number"),
    (_corrupt(["sparsity_range"], [0.8, 0.2]), "sparsity_range must satisfy"),
    (_corrupt(["submodels"], delete=True), "submodels is missing"),
    (_corrupt(["submodels"], []), "submodels is empty"),
    (_corrupt(["submodels"], {"lo": 0.2}), "submodels must be a list"),
    (_corrupt(["submodels", 1], [1, 2]), r"submodels\[1\] must be a dict"),
    (_corrupt(["submodels", 1, "coef"], delete=True), r"submodels\[1\]\.coef is missing"),
    (_corrupt(["submodels", 1, "coef"], [1e-12]), r"submodels\[1\]\.coef must have 2 values"),
    (_corrupt(["submodels", 1, "coef"], [1e-12, 2e-12, 3e-12]), r"submodels\[1\]\.coef must have 2 values"),
    (_corrupt(["submodels", 1, "coef"], "1e-12"), r"submodels\[1\]\.coef must be a list"),
    (_corrupt(["submodels", 2, "coef", 0], "x"), r"submodels\[2\]\.coef\[0\] must be a number"),
    (_corrupt(["submodels", 2, "coef", 1], None), r"submodels\[2\]\.coef\[1\] must be a number"),
    (_corrupt(["submodels", 0, "coef", 1], float("nan")), r"submodels\[0\]\.coef\[1\] must be finite"),
    (_corrupt(["submodels", 0, "intercept"], delete=True), r"submodels\[0\]\.intercept is missing"),
    (_corrupt(["submodels", 0, "intercept"], True), r"submodels\[0\]\.intercept must be a number"),
    (_corrupt(["submodels", 0, "lo"], delete=True), r"submodels\[0\]\.lo is missing"),
    (_corrupt(["submodels", 0, "lo"], 0.3), r"submodels\[0\]\.lo is 0.3"),
    (_corrupt(["submodels", 2, "hi"], 0.9), r"submodels\[2\]\.hi is 0.9"),
])
def test_from_dict_rejects_corrupt(fitted, corrupt, field):
    d = corrupt(json.loads(json.dumps(fitted.to_dict())))
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: zvc compress: field " + field):
        TimeModel.from_dict(d, where="zvc compress")


def test_from_dict_default_where_and_non_dict(fitted):
    d = fitted.to_dict()
    del d["kind"]
    with pytest.raises(ValueError, match="time model: field kind is missing"):
        TimeModel.from_dict(d)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: time model: must be a dict"):
        TimeModel.from_dict([1, 2])


def test_from_dict_does_not_alias_input(fitted):
    d = fitted.to_dict()
    m = TimeModel.from_dict(d)
    before = m.predict(500 * MB, 0.5)
    d2 = copy.deepcopy(d)
    d["submodels"][1]["coef"][0] = 1.0
    assert m.predict(500 * MB, 0.5) == before
    assert TimeModel.from_dict(d2).predict(500 * MB, 0.5) == before


# ---------------------------------------------------------------- regressor comparison


def test_compare_regressors_linear_wins_on_piecewise_linear_data(rng):
    train = make_data(2000, 0.005, rng)
    test = make_data(500, 0.005, rng)
    res = compare_regressors(train, test, n_submodels=3, seed=0)
    assert list(res) == list(REGRESSORS) == ["linear", "bayesian_ridge", "svr", "tree"]
    for name, v in res.items():
        assert isinstance(v, float) and math.isfinite(v) and v >= 0, name
        # Every regressor learned the trend: far better than predicting the mean (RAE 1).
        assert v < 0.25, (name, v)
    assert res["linear"] < 0.03
    # The paper's result (Fig. 10): the linear model is the most accurate.
    assert res["linear"] < min(res["bayesian_ridge"], res["svr"], res["tree"])
    # "linear" is exactly the piecewise TimeModel.
    m = TimeModel(3).fit(*train)
    assert res["linear"] == rae(m.predict(test[0], test[1]), test[2])
    # The tree is seeded: the same call gives the same numbers.
    assert compare_regressors(train, test, seed=0) == res


def test_compare_regressors_input_errors(rng):
    train = make_data(100, 0.0, rng)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: train must be a tuple"):
        compare_regressors(train[:2], train)
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: lengths differ"):
        compare_regressors(train, (train[0], train[1][:-1], train[2]))
    with pytest.raises(ValueError, match=r"cswap\.tune\.timemodel: test has 1 samples"):
        compare_regressors(train, tuple(x[:1] for x in train))


def test_noise_never_makes_more_bytes_cheaper():
    """Times that fall with size (a quick run's few samples on a loaded machine) must not
    give a model that calls a larger tensor cheaper, nor a 1 MiB one free (CI saw 0 s)."""
    rng = np.random.default_rng(0)
    sizes = np.repeat([4096.0, 8192.0, 16384.0], 8)
    sparsities = np.tile(np.linspace(0.2, 0.8, 8), 3)
    seconds = 50e-6 - 1e-9 * sizes + rng.normal(0, 1e-6, sizes.size)  # falling: noise, not physics
    model = TimeModel(n_submodels=1).fit(sizes, sparsities, seconds)
    assert min(model.to_dict()["submodels"][0]["coef"]) >= 0
    small, large = model.predict(4096.0, 0.5), model.predict(float(1 << 20), 0.5)
    assert large >= small > 0
