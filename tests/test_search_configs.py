"""scripts/search_configs.py: the random search for configurations in which cswap trains
differently from stock autograd (it found the faults fixed on 2026-11-26)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "search_configs.py"

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore:.*saves no memory:RuntimeWarning",
                                        "ignore:.*no profile for this device:RuntimeWarning")


@pytest.fixture
def search():
    spec = importlib.util.spec_from_file_location("search_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_seed_draws_the_same_configuration_each_time_and_seeds_differ(search):
    assert search.describe(search.draw(5)) == search.describe(search.draw(5))
    drawn = [search.draw(seed) for seed in range(40)]
    assert len({search.describe(c) for c in drawn}) == 40
    assert {c["device"] for c in drawn} == {"cpu", "emulated", "emulated slow", "emulated lagging"}
    assert any(c["budget"] is not None for c in drawn) and any(c["autocast"] for c in drawn)


def test_seeds_of_each_kind_train_as_stock_autograd(search, capsys):
    # budget="auto" with recompute, channels_last with retain_graph, T5 with compute behind (vdnnpp);
    # and a budget on a slow device with bf16 autocast, accumulation and a gradient penalty,
    # which cswap refuses (its backward keeps the graph: issue 39 §3.3), counted apart
    assert search.main(["42", "251", "140", "338"]) == 0
    out = capsys.readouterr().out
    assert "4 seeds: 0 failed" in out and sum(line.startswith("ok ") for line in out.splitlines()) == 3
    refused = [line for line in out.splitlines() if line.startswith("n/a  seed 42:")]
    assert refused and "'penalty': True" in refused[0] and "'budget': 'auto'" in out


def test_gradients_that_differ_fail_the_run_naming_the_seed(search, monkeypatch, capsys):
    train = search.train

    def off_by_one(model, inputs, c, device, capacity=None, patched=False):
        grads = train(model, inputs, c, device, capacity, patched)
        if patched:
            grads[-1][0] = grads[-1][0] + 1
        return grads

    monkeypatch.setattr(search, "train", off_by_one)
    assert search.main(["74"]) == 1
    out = capsys.readouterr().out
    assert "FAIL seed 74:" in out and "step 2: gradients differ from stock autograd's" in out
    assert "1 seeds: 1 failed (74)" in out


def test_what_stock_autograd_cannot_train_the_same_way_twice_is_counted_apart(search, monkeypatch):
    c = search.draw(477)  # (the first seed that draws Llama with a gradient penalty)
    assert c["penalty"] and c["name"] == "llama"
    assert search.run(c).startswith("n/a: derivative for")  # (no double backward through SDPA on the CPU)
    # (resnet18's double backward on this CPU varies from its second step, as memory is laid out)
    train, calls = search.train, []

    def varying(model, inputs, c, device, capacity=None, patched=False):
        grads = train(model, inputs, c, device, capacity, patched)
        calls.append(patched)
        if len(calls) == 2:  # stock's second run
            grads[1][0] = grads[1][0] + 1
        return grads

    monkeypatch.setattr(search, "train", varying)
    assert search.run(search.draw(74)) == "n/a: stock autograd's own gradients differ from run to run at step 1"
    assert calls == [False, False]  # (not patched at all)
