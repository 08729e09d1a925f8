"""Device profiles: written, read back, validated field by field; the default ships."""

import copy
import json

import numpy as np
import pytest

import cswap
from cswap.tune.profile import DEFAULT_PROFILE, SCHEMA_VERSION, load_profile, profile_path, read_profile, save_profile
from cswap.tune.timemodel import TimeModel


def _model(a=2e-12, b=1e-12, c=1e-5):
    rng = np.random.default_rng(0)
    sizes = rng.uniform(1e6, 1e9, 40)
    sparsities = rng.uniform(0.2, 0.8, 40)
    return TimeModel(2).fit(sizes, sparsities, a * sizes + b * sizes * (1 - sparsities) + c)


def make_doc():
    entry = {"backend": "triton", "config": {"grid": 528, "block": 128},
             "compress": _model().to_dict(), "decompress": _model(1e-12).to_dict(),
             "rae": {"compress": {"linear": 0.01, "svr": 0.2}, "decompress": {"linear": 0.02, "svr": 0.3}}}
    return {
        "schema_version": SCHEMA_VERSION,
        "device": {"name": "Test GPU", "type": "cuda", "compute_capability": [9, 0], "sm_count": 132},
        "versions": {"torch": "2.13.0", "triton": "3.6.0", "cswap": cswap.__version__},
        "created": "2026-11-23T00:00:00+00:00",
        "quick": False,
        "bandwidth": {"d2h_gbps": 50.0, "h2d_gbps": 52.5, "pinned": True, "samples": []},
        "codecs": {"zvc": entry, "rle": copy.deepcopy(entry)},
        "tuning": {"wall_s": 12.5, "method": "bayes", "per_codec": {}, "comparison": None},
    }


def test_round_trip(tmp_path):
    doc = make_doc()
    path = save_profile(doc, tmp_path / "p.json")
    profile = read_profile(path)
    assert profile.doc == doc and not profile.is_default and profile.path == path
    assert profile.codecs == ("zvc", "rle")
    assert profile.config("zvc") == cswap.LaunchConfig(528, 128)
    assert profile.bw_d2h == 50e9 and profile.bw_h2d == 52.5e9
    expected = TimeModel.from_dict(doc["codecs"]["zvc"]["compress"]).predict(3e8, 0.4)
    assert profile.seconds("zvc", "compress", 3e8, 0.4) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(KeyError, match="no codec 'lz4'"):
        profile.seconds("lz4", "compress", 1e6, 0.5)


def _corrupt(tmp_path, edit):
    doc = make_doc()
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["bandwidth"].pop("d2h_gbps"), "bandwidth.d2h_gbps"),
    (lambda d: d["bandwidth"].update(h2d_gbps=-1), "bandwidth.h2d_gbps"),
    (lambda d: d["codecs"]["zvc"]["config"].update(grid="528"), "codecs.zvc.config.grid"),
    (lambda d: d["codecs"]["zvc"]["config"].update(block=100), "codecs.zvc.config"),
    (lambda d: d["codecs"]["rle"].pop("decompress"), "codecs.rle.decompress"),
    (lambda d: d["codecs"]["rle"]["compress"].pop("submodels"), "codecs.rle.compress"),
    (lambda d: d["device"].update(type="tpu"), "device.type"),
    (lambda d: d["device"].update(sm_count=True), "device.sm_count"),
    (lambda d: d.update(quick="no"), "quick"),
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d.pop("tuning"), "tuning"),
])
def test_corrupt_profiles_name_file_and_field(tmp_path, edit, field):
    path = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError) as info:
        read_profile(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_not_json_and_missing_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_profile(path)
    with pytest.raises(FileNotFoundError, match="cswap-tune"):
        load_profile(tmp_path / "absent.json")


def test_save_refuses_an_invalid_document(tmp_path):
    doc = make_doc()
    del doc["codecs"]["zvc"]["rae"]
    with pytest.raises(ValueError, match="codecs.zvc.rae"):
        save_profile(doc, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_default_profile_ships_and_is_used_when_none_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("CSWAP_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="generic default profile"):
        profile = load_profile()
    assert profile.is_default and profile.path == DEFAULT_PROFILE
    assert set(profile.codecs) == set(cswap.codecs.names())
    for name in profile.codecs:
        for direction in ("compress", "decompress"):
            small = profile.seconds(name, direction, 1e6, 0.5)
            large = profile.seconds(name, direction, 1e9, 0.5)
            assert 0 < small < large  # bigger tensors take longer


def test_profile_of_this_device_is_found_in_cswap_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CSWAP_HOME", str(tmp_path))
    save_profile(make_doc(), profile_path())
    profile = load_profile()
    assert not profile.is_default and profile.path == profile_path()
    assert profile_path().parent == tmp_path
