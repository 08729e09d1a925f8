"""cswap-plan --fit: setups searched, ranked fastest first among those that fit."""

from __future__ import annotations

import pytest

from cswap.plan.fit import Setup, fit, setups

transformers = pytest.importorskip("transformers")


def _config(tmp_path):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=8000,
                                      max_position_embeddings=256, architectures=["LlamaForCausalLM"])
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    return path


def test_the_setups_tried_start_with_the_plain_one_and_add_8bit_only_to_adam():
    llm = setups("adamw", hf_causal_lm=True)
    assert llm[0] == Setup(False, None, "adamw", False)
    assert len(llm) == 2 * 2 * 2 * 3 * 2 and len(set(llm)) == len(llm)
    assert {s.optimizer for s in llm} == {"adamw", "adamw8bit", "paged_adamw8bit"}
    assert sum(s.compile for s in llm) == len(llm) // 2
    cnn = setups("sgd", hf_causal_lm=False)
    assert cnn == [Setup(optimizer="sgd"), Setup(optimizer="sgd", optimizer_in_backward=True),
                   Setup(optimizer="sgd", compile=True),
                   Setup(optimizer="sgd", optimizer_in_backward=True, compile=True)]
    assert setups("sgd", hf_causal_lm=False, compile=False) == cnn[:2]
    assert not Setup(optimizer="adamw8bit").exact and Setup(True, 8, "adamw", True).exact


def test_fit_ranks_what_fits_fastest_first_and_keeps_the_simplest_of_alike_ones(tmp_path):
    from cswap.plan.hf import from_config

    path = _config(tmp_path)
    candidates = [Setup(optimizer="adamw"), Setup(chunked_loss=8, optimizer="adamw"),
                  Setup(optimizer="adamw", optimizer_in_backward=True)]

    def build(setup):
        return from_config(path, batch=2, seq_len=128, gradient_checkpointing=setup.gradient_checkpointing,
                           chunked_loss=setup.chunked_loss)

    plain = fit(build, "l4", candidates[:1], precision="bf16")
    smallest = min(c.peak_bytes for c in plain)
    choices = fit(build, "l4", candidates, precision="bf16", budget=smallest)  # only the smaller setups fit
    fits = [c.fits for c in choices]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    fitting = [c.step_seconds for c in choices if c.fits]
    assert fitting == sorted(fitting)
    alike = {(round(c.step_seconds, 9), c.peak_bytes) for c in choices}
    assert len(alike) == len(choices)  # (no two alike: only the simplest of each kept)
    assert all(c.peak_bytes <= smallest for c in choices if c.fits)


@pytest.mark.slow  # (8 setups predicted: the slowest test of the quick set otherwise)
def test_cswap_plan_fit_prints_the_ranking(tmp_path, capsys):
    from cswap.cli.plan import main

    path = _config(tmp_path)
    assert main(["--hf-config", str(path), "--seq-len", "16", "--gpu", "rtx-6000-ada", "--dtype", "bf16",
                 "--fit"]) == 0
    out = capsys.readouterr().out
    assert "cswap-plan --fit: 16 setups" in out and "the fastest first" in out
    assert any("compile" in line for line in out.splitlines() if line[:4].strip().isdigit())
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    steps = [float(r[1]) for r in rows]
    assert rows and steps == sorted(steps)


def test_cswap_plan_fit_on_a_cnn_says_when_nothing_fits_and_what_it_ignored(capsys):
    from cswap.cli.plan import main

    # a CNN: the optimizer in backward or not, compiled or not, nothing else to search
    assert main(["--model", "small_cnn", "--dataset", "cifar10", "--batch", "4", "--sparsity", "0",
                 "--budget", "1KiB", "--fit", "--optimizer-in-backward"]) == 0
    out, err = capsys.readouterr()
    assert "cswap-plan --fit: 4 setups" in out and "none does: the five smallest peaks" in out
    assert "--optimizer-in-backward ignored: --fit tries with and without" in err
