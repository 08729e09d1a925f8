"""cswap.plan.gpus: the GPU table cswap-plan predicts with, and the published throughputs."""

from __future__ import annotations

import dataclasses

import pytest

from cswap.plan import gpus as G
from cswap.plan.gpus import GPU, GPUS, PUBLISHED_RESNET50, Throughput, gpu, gpus

REQUIRED = (
    "v100-sxm2-16gb", "v100-sxm2-32gb", "v100-pcie-16gb", "a100-sxm4-40gb", "a100-sxm4-80gb",
    "h100-pcie-80gb", "h100-sxm-80gb", "h200-sxm-141gb", "l4-24gb", "l40s-48gb",
    "rtx-4090-24gb", "rtx-3090-24gb", "rtx-a6000-48gb", "rtx-6000-ada-48gb", "b200-180gb", "gh200-96gb",
)
FAMILIES = {"volta": 70, "ampere": (80, 86), "ada": 89, "hopper": 90, "blackwell": 100}


def test_every_required_gpu_is_in_the_table():
    assert set(REQUIRED) <= set(GPUS)
    for name, g in GPUS.items():
        assert g.name == name


@pytest.mark.parametrize("name", sorted(GPUS))
def test_entry_is_complete_and_sane(name):
    g = GPUS[name]
    assert isinstance(g, GPU)
    assert g.family in FAMILIES
    assert g.arch in (FAMILIES[g.family] if isinstance(FAMILIES[g.family], tuple) else (FAMILIES[g.family],))
    # Between 15 GiB and 200 GiB: catches GB/GiB/MiB slips.
    assert 15 * 2**30 < g.memory_bytes < 200 * 2**30
    assert isinstance(g.memory_bytes, int)
    assert 100e9 < g.hbm_bytes_per_s < 10e12
    assert (g.link.startswith("PCIe ") and g.link.endswith(" x16")) or g.link == "NVLink-C2C"
    assert g.link_bytes_per_s > 0
    assert g.hbm_bytes_per_s > g.link_bytes_per_s
    assert g.flops["fp32"] > 0 and g.flops["fp16"] > 0
    assert set(g.flops) <= {"fp32", "tf32", "fp16", "bf16"}
    # Tensor-core fp16 beats the CUDA cores everywhere; all figures dense (< 2.5 PFLOP/s).
    assert g.flops["fp16"] > g.flops["fp32"]
    assert all(0 < v < 2.5e15 for v in g.flops.values())
    assert g.sources and all(isinstance(s, str) and s for s in g.sources)
    assert any("http" in s for s in g.sources)
    assert any(s.startswith("memory_bytes") for s in g.sources), "say where memory_bytes comes from"


def test_volta_has_no_tf32_or_bf16_and_the_rest_have_both():
    for g in GPUS.values():
        if g.family == "volta":
            assert "tf32" not in g.flops and "bf16" not in g.flops
        else:
            assert g.flops["tf32"] > 0 and g.flops["bf16"] == g.flops["fp16"]


def test_known_figures():
    h100 = gpu("h100-sxm-80gb")
    assert h100.peak_flops("fp16") == pytest.approx(989.5e12)
    assert h100.peak_flops("tf32") == pytest.approx(494.5e12)
    assert h100.hbm_bytes_per_s == pytest.approx(3.35e12)
    # H200 is an H100 SXM with more and faster memory.
    h200 = gpu("h200")
    assert h200.flops == h100.flops
    assert h200.memory_bytes > h100.memory_bytes and h200.hbm_bytes_per_s > h100.hbm_bytes_per_s
    assert gpu("a100-sxm4-40gb").flops == gpu("a100-sxm4-80gb").flops
    assert gpu("v100").peak_flops("amp") == pytest.approx(125e12)
    # The workstation cards run FP16 with FP32 accumulate at full rate, unlike GeForce.
    assert gpu("rtx-a6000").peak_flops("bf16") == pytest.approx(154.8e12)
    assert gpu("rtx-6000-ada").peak_flops("fp16") == pytest.approx(364.25e12)
    assert gpu("b200").peak_flops("bf16") == pytest.approx(2.25e15)
    # GH200 is an H100 whose host link is NVLink-C2C: 450 GB/s each way, 7x PCIe 5.0.
    gh200 = gpu("gh200")
    assert gh200.flops == h100.flops and gh200.link_bytes_per_s == pytest.approx(450e9)


def test_pcie_rates_are_per_direction_after_128b130b():
    rates = {g.link: g.link_bytes_per_s for g in GPUS.values()}
    assert rates["PCIe 3.0 x16"] == pytest.approx(15.754e9, rel=1e-4)
    assert rates["PCIe 4.0 x16"] == pytest.approx(31.508e9, rel=1e-4)
    assert rates["PCIe 5.0 x16"] == pytest.approx(63.015e9, rel=1e-4)


def test_cswap_plan_takes_the_link_as_measured_where_it_was_and_assumes_it_elsewhere():
    from cswap.plan.whatif import LINK_EFFICIENCY, AssumedProfile

    h200, h100 = gpu("h200"), gpu("h100-sxm-80gb")
    assert h200.measured_link == pytest.approx((55.27e9, 55.42e9))
    assert any("codecs.csv" in s for s in h200.sources)  # (where it was measured)
    measured, assumed = AssumedProfile(h200), AssumedProfile(h100)
    assert (measured.bw_d2h, measured.bw_h2d) == h200.measured_link
    assert "as measured" in measured.source
    assert h100.measured_link is None
    assert assumed.bw_d2h == assumed.bw_h2d == pytest.approx(h100.link_bytes_per_s * LINK_EFFICIENCY)
    assert "assumed" in assumed.source


def test_lookup_exact_and_case_insensitive():
    assert gpu("h100-sxm-80gb") is GPUS["h100-sxm-80gb"]
    assert gpu("H100-SXM-80GB") is GPUS["h100-sxm-80gb"]
    assert gpu("  L40S-48GB ") is GPUS["l40s-48gb"]
    assert gpu("rtx_4090_24gb") is GPUS["rtx-4090-24gb"]


@pytest.mark.parametrize("alias, name", [
    ("h100", "h100-sxm-80gb"), ("a100", "a100-sxm4-80gb"), ("v100", "v100-sxm2-16gb"),
    ("h200", "h200-sxm-141gb"), ("l4", "l4-24gb"), ("L40S", "l40s-48gb"),
    ("4090", "rtx-4090-24gb"), ("3090", "rtx-3090-24gb"), ("h100-pcie", "h100-pcie-80gb"),
    ("a100-40gb", "a100-sxm4-40gb"), ("v100-pcie", "v100-pcie-16gb"),
    # Names CUDA reports (torch.cuda.get_device_name).
    ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"), ("NVIDIA H200", "h200-sxm-141gb"),
    ("NVIDIA H100 PCIe", "h100-pcie-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
    ("A100-SXM4-40GB", "a100-sxm4-40gb"), ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
    ("Tesla V100-PCIE-16GB", "v100-pcie-16gb"), ("NVIDIA GeForce RTX 4090", "rtx-4090-24gb"),
    ("GeForce RTX 3090", "rtx-3090-24gb"), ("NVIDIA L40S", "l40s-48gb"), ("NVIDIA L4", "l4-24gb"),
    ("NVIDIA RTX A6000", "rtx-a6000-48gb"), ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada-48gb"),
    ("NVIDIA B200", "b200-180gb"), ("NVIDIA GH200 480GB", "gh200-96gb"),
    ("a6000", "rtx-a6000-48gb"), ("b200", "b200-180gb"), ("gh200", "gh200-96gb"),
])
def test_lookup_aliases(alias, name):
    assert gpu(alias) is GPUS[name]


def test_every_label_looks_up_its_gpu():
    for g in GPUS.values():
        assert gpu(g.label) is g


def test_lookup_passes_a_gpu_through():
    g = GPUS["l4-24gb"]
    assert gpu(g) is g
    custom = dataclasses.replace(g, name="my-l4", memory_bytes=g.memory_bytes // 2)
    assert gpu(custom) is custom


def test_unknown_gpu_names_the_known_and_the_closest():
    with pytest.raises(ValueError, match="unknown GPU 'a100-sxm4-80'") as e:
        gpu("a100-sxm4-80")
    msg = str(e.value)
    assert "did you mean 'a100-sxm4-80gb'" in msg
    assert all(n in msg for n in REQUIRED)
    with pytest.raises(ValueError, match="did you mean 'h100-sxm-80gb'"):
        gpu("h1000")
    with pytest.raises(ValueError, match="unknown GPU 'tpu-v5'"):
        gpu("tpu-v5")
    with pytest.raises(TypeError):
        gpu(100)


def test_peak_flops_dtypes():
    for g in GPUS.values():
        assert g.peak_flops("amp") == g.peak_flops("fp16") == g.flops["fp16"]
        assert g.peak_flops("FP32") == g.flops["fp32"]
    a100 = gpu("a100")
    assert a100.peak_flops("bf16") == a100.peak_flops("fp16")
    assert a100.peak_flops("tf32") == pytest.approx(156e12)


def test_peak_flops_without_the_tensor_cores_says_what_to_use():
    v100 = gpu("v100")
    with pytest.raises(ValueError, match="no bf16 tensor cores.*'fp16' or 'amp'"):
        v100.peak_flops("bf16")
    with pytest.raises(ValueError, match="no tf32 tensor cores.*'fp32'"):
        gpu("v100-pcie-16gb").peak_flops("tf32")
    with pytest.raises(ValueError, match="unknown compute dtype 'fp8'"):
        gpu("h100").peak_flops("fp8")


def test_measured_matmul_rates_are_the_published_medians_with_their_source():
    """Where MATMUL_DB has rows of the model, reachable_flops is their median, and the entry cites
    them; a GeForce card reaches its datasheet's rate (its clocks run above the rated boost), a
    power-held data-centre part about 80% of it."""
    rtx, h100 = gpu("rtx-4090"), gpu("h100")
    assert rtx.reachable_flops("bf16") == pytest.approx((164.81e12 + 165.71e12) / 2)  # the median of 6 rows
    assert rtx.reachable_flops("tf32") == pytest.approx(85.65e12)  # one row has it
    assert rtx.reachable_flops("amp") == rtx.reachable_flops("fp16")
    assert h100.reachable_flops("bf16") == pytest.approx((797.51e12 + 783.66e12) / 2)
    assert 0.95 < rtx.reachable_flops("bf16") / rtx.peak_flops("bf16") < 1.05
    assert 0.75 < h100.reachable_flops("bf16") / h100.peak_flops("bf16") < 0.85
    for name in ("rtx-4090-24gb", "h100-sxm-80gb", "v100-sxm2-16gb", "rtx-3090-24gb"):
        assert any(G.MATMUL_DB in s and "rows '" in s for s in GPUS[name].sources), name
    # the same chip's measurement, said so
    assert gpu("a100-sxm4-40gb").matmul_flops == gpu("a100-sxm4-80gb").matmul_flops
    assert any("as a100-sxm4-80gb's" in s for s in gpu("a100-sxm4-40gb").sources)


def test_reachable_flops_without_a_measurement():
    """A dtype the rows lack takes the GPU's own measured share of its datasheet on the same
    units; a GPU without rows the median share of those measured; never above what the rows
    or the datasheet allow."""
    ada6000 = gpu("rtx-6000-ada")
    h200 = gpu("h200")  # no tf32 row: its fp16 and bf16 rows' share
    assert h200.reachable_flops("tf32") == pytest.approx(
        h200.flops["tf32"] * (h200.matmul_flops["fp16"] / h200.flops["fp16"]
                              + h200.matmul_flops["bf16"] / h200.flops["bf16"]) / 2)
    assert not ada6000.matmul_flops
    assert ada6000.reachable_flops("bf16") == pytest.approx(ada6000.flops["bf16"] * G._MEDIAN_SHARE["tensor cores"])
    assert ada6000.reachable_flops("fp32") == pytest.approx(ada6000.flops["fp32"] * G._MEDIAN_SHARE["cuda cores"])
    assert 0.6 < G._MEDIAN_SHARE["tensor cores"] < 0.9 and 0.5 < G._MEDIAN_SHARE["cuda cores"] < 0.9
    for g in GPUS.values():
        for key in g.flops:
            assert 0.4 * g.flops[key] < g.reachable_flops(key) < 1.1 * g.flops[key], (g.name, key)
    with pytest.raises(ValueError, match="no bf16 tensor cores"):
        gpu("v100").reachable_flops("bf16")


def test_gpus_is_sorted_table_names():
    assert gpus() == sorted(GPUS)
    assert gpus() == sorted(gpus())


def test_gpu_is_hashable_and_frozen():
    g = gpu("h100")
    assert hash(g) == hash(gpu("h100-sxm-80gb"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.memory_bytes = 1


def test_published_throughputs_are_usable_for_calibration():
    assert len(PUBLISHED_RESNET50) >= 6
    families, precisions = set(), set()
    for t in PUBLISHED_RESNET50:
        assert isinstance(t, Throughput)
        assert t.gpu in GPUS, t.gpu
        g = GPUS[t.gpu]
        assert t.precision in ("fp32", "tf32", "amp", "bf16")
        assert g.peak_flops(t.precision) > 0  # "amp" -> fp16; tf32 must exist on that GPU
        if t.precision == "fp32":
            # Ampere and later run fp32 convolutions in TF32 by default; fp32 points are Volta only.
            assert g.family == "volta"
        assert isinstance(t.batch, int) and t.batch > 0
        assert 100 < t.images_per_s < 10_000
        assert "resnet" in t.source.lower() and t.source.strip()
        families.add(g.family)
        precisions.add(t.precision)
    assert {"volta", "ampere", "hopper"} <= families
    assert len(precisions) >= 2
    # Mixed precision beats fp32/tf32 for every GPU and source that has both.
    by = {(t.gpu, t.source.split(",")[0], t.precision): t.images_per_s for t in PUBLISHED_RESNET50}
    for (name, src, prec), ips in by.items():
        if prec != "amp":
            assert by[(name, src, "amp")] > ips


def test_module_exports():
    assert set(G.__all__) == {"GPU", "Throughput", "GPUS", "MATMUL_DB", "PUBLISHED_RESNET50", "gpu", "gpus"}
