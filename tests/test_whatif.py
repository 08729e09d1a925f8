"""cswap-plan's prediction (cswap.plan.whatif, roofline, sparsity, cli.plan): issue 13.

Nothing here can be checked against a GPU; what is checked is that the model is
consistent with the trace it is built on and with what a real CPU step measures.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import cswap
from cswap.cli import plan as cli
from cswap.models import build
from cswap.plan import advisor as plan_advisor, fake_gpu, roofline, sparsity, whatif
from cswap.plan.advisor import HOST_S_PER_TENSOR, simulate
from cswap.plan.gpus import gpu

CIFAR = (3, 32, 32)


class InstantLink:
    """A profile whose copies and codecs take no time: offloads leave at once."""

    bw_d2h = bw_h2d = 1e30
    codecs = ("zvc",)

    def seconds(self, codec, direction, size, sparsity):
        return 0.0


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return build("small_cnn", dataset="cifar10")


@pytest.fixture(scope="module")
def prediction(small):
    return cswap.predict(small, torch.empty(16, *CIFAR), gpu="v100-sxm2-16gb", sparsity=0.5)


def test_modes_step_times_and_peaks_are_consistent(small, prediction):
    p = prediction
    assert set(p.modes) == {"none", "vdnn", "sc", "cswap", "budget"}
    trace = fake_gpu.trace_step(small, torch.empty(16, *CIFAR))
    workspaces = [op.workspace for op in trace.ops]
    assert any(workspaces)  # (its 3x3 convolutions take cuDNN workspaces: cswap.plan.workspaces)
    assert p.peak_bytes("none") == max(op.live_bytes + op.workspace for op in trace.ops) > trace.peak_bytes
    # the workspaces are in no saved figure (the emulated device and the twin count none)
    assert p.saved_peak_bytes("none") == max(op.live_bytes - b for op, b in zip(trace.ops, p.besides_saved_bytes))
    none = p.modes["none"]
    assert none.exposed_seconds == 0 and none.pcie_bytes == 0 and p.step_seconds("none") == none.compute_seconds
    for mode in ("vdnn", "sc", "cswap"):
        m = p.modes[mode]
        assert m.offloaded > 0 and m.pcie_bytes > 0
        # (the kernels' time beside compute is in the exposed time; codec_seconds says how much they took)
        assert m.step_seconds == pytest.approx(m.compute_seconds + m.exposed_seconds + m.host_seconds)
        assert (m.codec_seconds > 0) == (m.compressed > 0)
        assert m.host_seconds == pytest.approx(m.offloaded * HOST_S_PER_TENSOR)  # the host's time per tensor
        assert m.step_seconds >= p.step_seconds("none")
    assert p.modes["vdnn"].compressed == 0 and p.modes["sc"].compressed == p.modes["sc"].offloaded
    # ZVC on tensors half zeros moves fewer bytes than raw copies
    assert p.modes["sc"].pcie_bytes < p.modes["vdnn"].pcie_bytes
    assert p.fits("none") and p.capacity_bytes == gpu("v100-sxm2-16gb").memory_bytes - whatif.RESERVE_BYTES


def test_a_prediction_prints_as_cswap_plan_does(prediction):
    """print(cswap.predict(...)) shows cswap-plan's summary; its repr is one line."""
    p = prediction
    text = str(p)
    assert text == p.summary() and text.startswith("cswap-plan: 16 per step on")
    assert "PREDICTED" in text and "how each figure was obtained:" in text
    for mode, mp in p.modes.items():
        assert f"{mp.step_seconds * 1e3:.2f}" in text and mode in text
    assert len(text) < 6000 and text.count("\n") < 60  # a summary, not every tensor's record
    one = repr(p)
    assert "\n" not in one and one.startswith("Prediction(") and len(one) < 400
    assert f"batch {p.batch}" in one and "predicted" in one


def _step(model, batch: int = 16):
    """The traced step of `model` on an A100 by the roofline: trace, op starts, phase
    seconds and the saved storages (half zeros each)."""
    trace = fake_gpu.trace_step(model, torch.empty(batch, *CIFAR))
    a100, times = gpu("a100-sxm4-40gb"), roofline.OpTimeModel()
    starts = np.concatenate([[0.0], np.cumsum([roofline.op_seconds(op, a100, "fp32", times) for op in trace.ops])])
    phase = roofline.step_seconds(trace.ops, a100, "fp32", times)
    groups = whatif._groups(trace, {r.index: (0.5, 1) for r in trace.activations()},
                            {r.index: None for r in trace.activations()})
    return trace, starts[:-1], phase, groups


class SlowLink(InstantLink):
    """Copies at 2 GB/s and codecs at 50 GB/s: the step waits for the link both ways."""

    bw_d2h = bw_h2d = 2e9
    codecs = ("zvc", "lz4")

    def seconds(self, codec, direction, size, sparsity):
        return size / 5e10


def test_cswap_mode_is_decided_among_the_tensors_the_runtime_offloads(small, monkeypatch):
    """The runtime's profiler times only what it offloads (a tensor's Hidden_f runs to the next
    of those), so the plan decides cswap mode on the same iteration: the ReLU and pooling
    outputs, not every saved storage (whose gaps are shorter)."""
    calls = []
    decide = whatif.Advisor.decide

    def spy(self, iteration):
        calls.append(iteration)
        return decide(self, iteration)

    monkeypatch.setattr(whatif.Advisor, "decide", spy)
    link = SlowLink()
    link.source = "assumed: 2 GB/s both ways"
    p = cswap.predict(small, torch.empty(16, *CIFAR), gpu="v100-sxm2-16gb", sparsity=0.5, profile=link)
    everything, offloaded = calls[0], calls[1]
    assert {t.op for t in offloaded.tensors} <= {"relu", "max_pool2d_with_indices"}
    assert 0 < len(offloaded.tensors) < len(everything.tensors)
    chosen = decide(whatif.Advisor(link), offloaded)
    moved = {t.made_in: t.decisions["cswap"] for t in p.tensors if t.decisions["vdnn"] != "keep"}
    assert moved == {t.layer: chosen[t.key].codec or "raw" for t in offloaded.tensors}


def test_memory_model_meets_the_traced_offload_floor(small):
    """Offloading every saved activation over an instantaneous link, the curve the
    model builds from the kept trace reaches the peak of the trace that drops them."""
    trace, starts, phase, groups = _step(small)
    sizes = {g.storage: {} for g in groups}
    every = whatif._mode("all", trace, groups, {g.storage: None for g in groups}, InstantLink(), starts, phase,
                         sizes, room=0)  # (room=0: no workspace on top, as the traced floor has none)
    assert every.peak_bytes == trace.offloaded_peak_bytes
    assert every.exposed_seconds == 0


def test_the_curve_runs_on_the_simulated_steps_clock(small):
    """Backward's ops run later by the waits before them, so the simulation's times map to
    ops on that clock (the op starts alone put a restore that waited early by its wait);
    a use the simulation put after a later op's does not move every op after it (the
    clock never runs backwards). Each restore's times come in order: queued (its memory
    taken), started, back, used."""
    trace, starts, phase, groups = _step(small)
    sim = simulate(whatif._iteration(groups, starts, phase), {g.key: "zvc" for g in groups}, SlowLink())
    assert sim.backward_stall_s > 0  # (else the clock would be the ops' own)
    clock = whatif._step_clock(starts, whatif._op_index(starts, phase["forward"]), groups, sim)
    assert np.all(np.diff(clock) >= 0) and np.all(clock >= starts)
    uses = []
    for g in groups:
        key = g.key
        assert sim.restore_issued_s[key] <= sim.restore_start_s[key] <= sim.restored_s[key] <= sim.use_at_s[key]
        uses.append((g.used_at, sim.use_at_s[key]))
    for op, _ in uses:  # an op starts at the earliest use the simulation has at or after it
        assert clock[op] == pytest.approx(min(use for at, use in uses if at >= op), rel=1e-12)
    assert clock[max(uses)[0]] > starts[max(uses)[0]] + sim.forward_stall_s  # (backward waited too)


def test_a_compressed_payload_is_held_as_the_runtime_holds_it(small):
    """Beside the tensor's own bytes, the curve holds a compressed tensor's payload in the
    room reserved for it while it is made and sent (the runtime's footprint in a steady
    step, cswap.runtime.offload: for ZVC an eighth over its size, for LZ4 the largest
    it can write), and under a memory budget, which sizes it first, at its size."""
    from math import prod

    trace, starts, phase, groups = _step(small)
    g = max(groups, key=lambda h: h.nbytes)
    live = np.array([op.live_bytes for op in trace.ops])
    size = g.nbytes // 3
    numel, itemsize = prod(g.records[0].shape), g.records[0].dtype.itemsize
    largest = cswap.codecs.get("lz4").reserve_nbytes(numel, itemsize)
    assert largest > g.nbytes > size
    room = cswap.codecs.get("zvc").room_nbytes(numel, itemsize, size)
    assert room < largest
    for mode, codec, held in (("sc", "zvc", room), ("sc", "lz4", largest), ("budget", "zvc", size)):
        scratch = cswap.codecs.get(codec).encode_scratch_bytes(numel, itemsize)
        m = whatif._mode(mode, trace, [g], {g.storage: codec}, SlowLink(), starts, phase, {g.storage: {codec: size}},
                         room=0)  # (no workspaces: the payload alone over live)
        extra = np.array(m.curve_bytes) - live
        assert extra[g.saved_at] == held + scratch
        sent = extra[g.saved_at + 1:]
        sent = sent[: np.argmax(sent != held)]  # until its copy out ends
        assert len(sent) > 0
        # then away, and from when its restore is queued back with its payload until decoded
        assert set(extra[g.saved_at + 1 + len(sent): g.used_at].tolist()) <= {-g.nbytes, size, 0}


def test_a_restored_payload_goes_once_decoded(small, monkeypatch):
    """Back in backward, a compressed tensor's payload is held from when its restore is
    queued until it is decoded, not until the tensor's use."""
    monkeypatch.setattr(plan_advisor, "SWITCH_S", 0.0)  # (a sender that copies out at once:
    monkeypatch.setattr(plan_advisor, "SEND_S", 0.0)    # the tiny step is over in microseconds)
    trace, starts, phase, groups = _step(small)
    first, second = next((a, b) for a, b in zip(groups, groups[1:]) if a.used_at > b.used_at + 1)
    sizes = {g.storage: {"zvc": g.nbytes // 3} for g in (first, second)}
    m = whatif._mode("sc", trace, [first, second], {first.storage: "zvc", second.storage: "zvc"}, InstantLink(),
                     starts, phase, sizes, room=0)  # (no workspaces: the payloads alone over live)
    extra = np.array(m.curve_bytes) - np.array([op.live_bytes for op in trace.ops])
    # the first is restored (prefetched) as the second is used, and decoded at once
    assert extra[second.used_at] == sizes[first.storage]["zvc"]
    assert not extra[second.used_at + 1:first.used_at].any()


def test_a_tensor_served_from_the_device_never_left_and_stays_until_its_copy_ends(small):
    """The last tensor saved, its copy out not done when backward asks for it, is used
    where it is, and held after its use until that copy ends (the runtime's release)."""
    trace, starts, phase, groups = _step(small)
    last = groups[-1]
    link = SlowLink()
    ends = phase["forward"] + 0.9 * phase["backward"]  # (its copy out ends late in backward)
    link.bw_d2h = last.nbytes / (ends - starts[last.saved_at])
    m = whatif._mode("vdnn", trace, [last], {last.storage: None}, link, starts, phase, {last.storage: {}}, room=0)
    extra = np.array(m.curve_bytes) - np.array([op.live_bytes for op in trace.ops])
    after = max(r.used_at for r in last.records) + 1
    assert not extra[:after].any()
    assert extra[after] == last.nbytes and not extra[-1]


@pytest.mark.parametrize("name", ["vgg16", "resnet18"])
def test_the_saved_bytes_peak_is_what_the_emulated_device_counts(name):
    """What the emulated device (and the timed twin on it) counts, saved activations from
    their save until their storage dies, is the plan's curve less what the step holds
    beside them: the same peak, but for the batch itself (saved, but no activation) and
    the emulator's rounding of each allocation to 512 bytes."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(name, dataset="cifar10")
    x, y = torch.randn(8, *CIFAR), torch.randint(0, 10, (8,))
    with cswap.testing.emulated_device() as dev:
        F.cross_entropy(model(x), y).backward()
    counted = dev.peak_bytes - x.numel() * x.element_size()
    planned = cswap.predict(model, x, "h200", recompute=False).saved_peak_bytes("none")
    assert planned == pytest.approx(counted, rel=2e-3)


def test_an_activation_is_counted_from_the_op_that_made_it():
    """A pooling's output is saved by the next layer, an op later, and a ReLU's in place
    is the convolution's: each is on the device from the op that made it (the timed twin
    counts a pooling's output before the next save frees what waits in flight). In a
    VGG's forward every tensor made is saved, so what the step holds beside saved
    activations stays flat through it (but for the loss's few bytes)."""
    trace = fake_gpu.trace_step(build("vgg16", dataset="cifar10"), torch.empty(2, *CIFAR))
    acts = trace.activations()
    pooled = [r for r in acts if r.op == "max_pool2d" and r.dtype == torch.float32]
    relu = [r for r in acts if r.op == "relu"]
    assert pooled and all(trace.ops[r.made_at].name.startswith("max_pool2d") and r.made_at < r.saved_at for r in pooled)
    assert relu and all(trace.ops[r.made_at].name == "convolution" for r in relu if r.made_in.startswith("features"))
    groups = whatif._groups(trace, {r.index: (0.0, 1) for r in acts}, {r.index: None for r in acts})
    besides = whatif._besides_saved(trace, groups)
    forward = [i for i, op in enumerate(trace.ops) if op.phase == "forward"]
    assert np.ptp(besides[forward]) < 1024


def test_precision_changes_what_is_saved_and_how_fast(small):
    x = torch.empty(64, *CIFAR)
    fp32 = cswap.predict(small, x, gpu="a100-sxm4-80gb")
    amp = cswap.predict(small, x, gpu="a100-sxm4-80gb", precision="amp")
    assert amp.peak_bytes("none") < fp32.peak_bytes("none")
    assert {t.dtype for t in amp.tensors if t.op == "relu"} == {"float16"}
    with pytest.raises(ValueError, match="no bf16"):
        cswap.predict(small, x, gpu="v100-sxm2-16gb", precision="bf16")
    with pytest.raises(ValueError, match="precision"):
        cswap.predict(small, x, gpu="v100-sxm2-16gb", precision="int8")


def test_conv_peaks_follow_pytorch_defaults():
    conv = fake_gpu.OpRecord(0, "convolution", "forward", 10**12, 10**6, torch.float32, "", 0, channels_last=True)
    mm = fake_gpu.OpRecord(1, "mm", "forward", 10**12, 10**6, torch.float32, "", 0)
    a100, v100 = gpu("a100-sxm4-80gb"), gpu("v100-sxm2-16gb")
    half = roofline.OpTimeModel(matmul_efficiency=0.5, matmul_half_flops=0.0, conv_efficiency=0.5)
    assert roofline.op_seconds(conv, a100, "fp32", half) == pytest.approx(2e12 / a100.reachable_flops("tf32"))
    assert roofline.op_seconds(mm, a100, "fp32", half) == pytest.approx(2e12 / a100.reachable_flops("fp32"))
    assert roofline.op_seconds(mm, a100, "tf32", half) == pytest.approx(2e12 / a100.reachable_flops("tf32"))
    assert roofline.op_seconds(conv, v100, "fp32", half) == pytest.approx(2e12 / v100.reachable_flops("fp32"))


def _op(name, flops, nbytes, dtype=torch.bfloat16, channels_last=False):
    return fake_gpu.OpRecord(0, name, "forward", flops, nbytes, dtype, "", 0, channels_last=channels_last)


def test_an_nchw_convolution_on_tensor_cores_pays_its_layout_transposes():
    """cuDNN's tensor-core kernels take NHWC: an NCHW model's convolution reads and writes
    each operand once more, at the memory-bound ops' share of bandwidth; one in channels_last
    does not, nor one in float32 where tensor cores do not outrun the CUDA cores (a V100 has
    no TF32, an RTX 4090's TF32 rate is its float32 rate)."""
    a100, v100, rtx = gpu("a100-sxm4-80gb"), gpu("v100-sxm2-16gb"), gpu("rtx-4090-24gb")
    m = roofline.OpTimeModel(conv_efficiency=0.5, bandwidth_efficiency=0.6)
    flops, nbytes = 1e12, 10**9
    for g, precision, dtype in ((a100, "fp32", torch.float32), (a100, "amp", torch.float16),
                                (a100, "bf16", torch.bfloat16), (v100, "amp", torch.float16)):
        nhwc = roofline.op_seconds(_op("convolution", flops, nbytes, dtype, channels_last=True), g, precision, m)
        nchw = roofline.op_seconds(_op("convolution_backward", flops, nbytes, dtype), g, precision, m)
        assert nhwc == pytest.approx(flops / (g.reachable_flops(roofline._peak_key(_op("convolution", 1, 1, dtype),
                                                                                   g, precision)) * 0.5))
        assert nchw - nhwc == pytest.approx(2 * nbytes / (g.hbm_bytes_per_s * 0.6)), (g.name, precision)
    fp32 = _op("convolution", flops, nbytes, torch.float32)
    assert roofline.op_seconds(fp32, v100, "fp32", m) == pytest.approx(flops / (v100.reachable_flops("fp32") * 0.5))
    assert roofline.op_seconds(fp32, rtx, "fp32", m) == pytest.approx(flops / (rtx.reachable_flops("tf32") * 0.5))
    half = _op("convolution", flops, nbytes, torch.float16)
    assert roofline.op_seconds(half, rtx, "amp", m) > roofline.op_seconds(
        dataclasses.replace(half, channels_last=True), rtx, "amp", m)
    assert roofline.op_seconds(_op("mm", flops, nbytes), a100, "bf16", m) == \
        roofline.op_seconds(_op("mm", flops, nbytes, channels_last=True), a100, "bf16", m)


def test_each_op_class_is_timed_by_its_own_factor():
    """matmul by its size-dependent efficiency, attention and convolutions by theirs,
    everything else at the bandwidth's share, reinterpreting ops free, none under the launch floor."""
    h100 = gpu("h100-sxm-80gb")
    m = roofline.OpTimeModel(matmul_efficiency=0.8, matmul_half_flops=1e10, conv_efficiency=0.6,
                             attention_efficiency=0.5, bandwidth_efficiency=0.75)
    peak = h100.reachable_flops("bf16")  # (the measured matmul rate: the shares are of it)
    big, small = 1e14, 1e10
    assert roofline.op_seconds(_op("mm", big, 10**6), h100, "bf16", m) == pytest.approx(
        big / (peak * 0.8 * big / (big + 1e10)))
    # a multiply of the half size runs at half the efficiency of a large one
    assert roofline.op_seconds(_op("addmm", small, 10**3), h100, "bf16", m) == pytest.approx(small / (peak * 0.4))
    assert roofline.op_seconds(_op("_scaled_dot_product_flash_attention", big, 10**6), h100, "bf16", m) == \
        pytest.approx(big / (peak * 0.5))
    assert roofline.op_seconds(_op("convolution", big, 10**6, channels_last=True), h100, "bf16", m) == \
        pytest.approx(big / (peak * 0.6))
    # memory-bound: the bandwidth's share, whatever FLOPs an elementwise op does
    assert roofline.op_seconds(_op("mul", 10**9, 10**10), h100, "bf16", m) == pytest.approx(
        1e10 / (h100.hbm_bytes_per_s * 0.75))
    # a multiply with too little work for its bytes is bound by them
    assert roofline.op_seconds(_op("mm", 10**6, 10**10), h100, "bf16", m) == pytest.approx(
        1e10 / (h100.hbm_bytes_per_s * 0.75))
    assert roofline.op_seconds(_op("_unsafe_view", 0, 10**10), h100, "bf16", m) == 0.0
    assert roofline.op_seconds(_op("relu", 0, 8), h100, "bf16", m) == roofline.LAUNCH_FLOOR_S
    assert [roofline.op_class(n) for n in ("bmm", "convolution_backward", "_efficient_attention_backward",
                                           "_scaled_dot_product_flash_attention", "silu")] == \
        ["matmul", "conv", "memory", "attention", "memory"]


def test_the_fit_finds_the_factors_that_made_the_step_times():
    """Runs timed by a known model (within the physical bounds, Ada's compute at 0.8 of
    Ampere's share) give that model back."""
    a100, rtx = gpu("a100-sxm4-80gb"), gpu("rtx-4090-24gb")
    truth = roofline.OpTimeModel(matmul_efficiency=0.7, matmul_half_flops=3e9, conv_efficiency=0.45,
                                 attention_efficiency=0.4, bandwidth_efficiency=0.6, family_scale=(("ada", 0.8),))
    rng = np.random.default_rng(0)
    samples = []
    for i in range(12):
        ops = [_op("mm", float(10 ** rng.uniform(8, 13)), int(1e7)) for _ in range(20)]
        ops += [_op("convolution", float(10 ** rng.uniform(10, 12)), int(1e7)) for _ in range(i % 4)]
        ops += [_op("_scaled_dot_product_flash_attention", float(10 ** rng.uniform(10, 12)), int(1e6))
                for _ in range(i % 3)]
        ops += [_op("mul", 0, int(10 ** rng.uniform(7, 10))) for _ in range(20)]
        g = (a100, rtx)[i % 2]
        sample = roofline.Sample.of(f"run{i}", ops, g, "bf16", 1.0)
        sample.published_s = sample.predicted_s(truth)
        samples.append(sample)
    fitted = roofline.fit(samples)
    for name in ("matmul_efficiency", "conv_efficiency", "attention_efficiency", "bandwidth_efficiency"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert fitted.matmul_half_flops == pytest.approx(truth.matmul_half_flops, rel=0.1)
    assert fitted.scale("ada") == pytest.approx(0.8, rel=0.02) and fitted.scale("ampere") == 1.0
    assert all(s.predicted_s(fitted) == pytest.approx(s.published_s, rel=1e-3) for s in samples)


def test_fit_weighs_each_group_of_runs_alike_however_many_runs_it_holds():
    """Ten CNN runs that put memory-bound ops at 0.4 of HBM bandwidth and two transformer runs
    that put them at 0.8: the fit lands between the groups (the geometric mean, 0.57), not at
    the ten runs' 0.45 that an unweighted fit gives."""
    a100 = gpu("a100-sxm4-80gb")

    def sample(i, group, share):
        s = roofline.Sample.of(f"{group}{i}", [_op("mul", 0, int(1e10))], a100, "bf16", 1.0, group=group)
        s.published_s = 1e10 / (a100.hbm_bytes_per_s * share)
        return s

    cnn = [sample(i, "cnn", 0.4) for i in range(10)]
    transformers = [sample(i, "transformer", 0.8) for i in range(2)]
    assert roofline.fit(cnn + transformers).bandwidth_efficiency == pytest.approx((0.4 * 0.8) ** 0.5, rel=1e-3)
    ungrouped = [dataclasses.replace(s, group="") for s in cnn + transformers]
    assert roofline.fit(ungrouped).bandwidth_efficiency == pytest.approx(0.4 ** (10 / 12) * 0.8 ** (2 / 12), rel=1e-3)


def test_committed_time_model_is_what_the_fit_wrote():
    """cswap/data/time_model.json's factors predict its own calibration rows, each within the
    physical bounds; its ResNet-50 row is what cswap.predict's compute says today."""
    doc = json.loads(roofline.TIME_MODEL_FILE.read_text())
    model = roofline.OpTimeModel.from_dict(doc["model"])
    assert all(0 < a <= b for a, b in zip(model.factors(), roofline._UPPER.factors()))
    assert 0.2 <= min(dict(model.family_scale).values()) and max(dict(model.family_scale).values()) <= 2.0
    assert len(doc["calibration"]) >= 8 and all(r["source"] for r in doc["calibration"])
    row = next(r for r in doc["calibration"] if r["run"] == "resnet50-v100-sxm2-16gb-fp32-b112")
    ops = roofline.trace_for(build("resnet50", dataset="imagenet"), (112, 3, 224, 224), "fp32", drop=False).ops
    seconds = sum(roofline.step_seconds(ops, gpu("v100-sxm2-16gb"), "fp32", model).values())
    assert seconds == pytest.approx(row["predicted_step_s"], rel=1e-6)
    assert row["error"] == pytest.approx(seconds / row["published_step_s"] - 1, abs=1e-6)
    assert roofline.time_model()[0] == model


@pytest.mark.slow
def test_largest_batch_is_the_edge_of_fitting(small):
    p = cswap.predict(small, torch.empty(16, *CIFAR), gpu="l4-24gb", budget="48MiB")
    b = p.largest_batch("none")
    assert 16 < b < 4096
    assert p._at(b).fits("none") and not p._at(b + 1).fits("none")
    assert p.largest_batch("vdnn") >= 1


def test_measured_sparsity_matches_the_trace_and_survives_json(small, tmp_path):
    measured = sparsity.auto(small, torch.empty(16, *CIFAR))
    assert "measured" in measured.source
    p = cswap.predict(small, torch.empty(16, *CIFAR), gpu="h100-sxm-80gb", sparsity=measured)
    relu = [t for t in p.tensors if t.op == "relu"]
    assert relu and all(0.05 < t.sparsity < 0.95 for t in relu)  # ReLU outputs of a real step
    path = tmp_path / "p.json"
    path.write_text(p.to_json())
    again = cswap.predict(small, torch.empty(16, *CIFAR), gpu="h100-sxm-80gb", sparsity=sparsity.from_file(path))
    assert [(t.sparsity, t.runs, t.zans_bits) for t in again.tensors] == \
        [(t.sparsity, t.runs, t.zans_bits) for t in p.tensors]
    # ZANS's size per tensor, for the trace's dtype: a bf16 trace takes the values' bf16 bytes
    assert all(t.zans_bits is not None and 0 < t.zans_bits < 32 for t in relu)
    bf16 = cswap.predict(small, torch.empty(16, *CIFAR), gpu="h100-sxm-80gb", sparsity=measured, precision="bf16")
    relu16 = [t for t in bf16.tensors if t.op == "relu"]
    assert [t.zans_bits for t in relu16] == [measured.zans_bits_of((t.made_in, t.op, t.occurrence), torch.bfloat16)
                                             for t in relu16]
    assert all(a.zans_bits < b.zans_bits for a, b in zip(relu16, relu))
    assert all(t.zans_bits is None for t in cswap.predict(small, torch.empty(16, *CIFAR), gpu="h100-sxm-80gb",
                                                          sparsity=0.5).tensors)  # assumed: ZANS's bound
    with pytest.raises(ValueError, match="cswap-plan JSON"):
        sparsity.from_file(tmp_path / "missing.json")


def test_parse_bytes():
    assert whatif.parse_bytes("40GiB") == 40 * 2**30
    assert whatif.parse_bytes("1.5GB") == 1_500_000_000
    assert whatif.parse_bytes(0.5, capacity=100) == 50
    assert whatif.parse_bytes("50%", capacity=100) == whatif.parse_bytes(" 25 %", capacity=200) == 50
    assert whatif.parse_bytes(1, capacity=100) == 100 and whatif.parse_bytes(4e10, capacity=100) == 4e10
    for bad in ("lots", "150%", "0%", "50%"):  # (a share with no capacity to take it of)
        with pytest.raises(ValueError, match="not a size.*like 0.5 or 50%"):
            whatif.parse_bytes(bad, capacity=100 if bad != "50%" else None)


def test_cli_prints_every_source_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = cli.main(["--model", "small_cnn", "--dataset", "cifar10", "--batch", "16", "--gpu", "l4",
                   "--sparsity", "0.5", "--no-largest-batch", "--json", str(out_json), "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "PREDICTED" in text and "NVIDIA L4" in text
    for source in ("memory", "compute", "transfers", "sparsity", "timeline"):
        assert f"  {source}" in text
    doc = json.loads(out_json.read_text())
    assert set(doc["modes"]) == {"none", "vdnn", "sc", "cswap", "budget"} and doc["tensors"]
    assert out_png.stat().st_size > 10_000
    assert cli.main(["--list-gpus"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "990 TFLOPS datasheet,    791 measured" in listed["h100-sxm-80gb"]
    assert "fp16    125 TFLOPS datasheet,     95 measured" in listed["v100-sxm2-16gb"]
    assert "assumed (torch.matmul)" in listed["rtx-6000-ada-48gb"]


def test_cli_channels_last_takes_the_layout_transposes_off_the_step(tmp_path, capsys):
    argv = ["--model", "small_cnn", "--dataset", "cifar10", "--batch", "256", "--gpu", "a100-sxm4-80gb",
            "--sparsity", "0.5", "--no-largest-batch", "--dtype", "amp"]
    steps = []
    for extra in ([], ["--channels-last"]):
        assert cli.main(argv + extra + ["--json", str(tmp_path / "p.json")]) == 0
        steps.append(json.loads((tmp_path / "p.json").read_text())["modes"]["none"]["step_seconds"])
    assert steps[1] < steps[0]
    assert cli.main(["--hf-config", str(tmp_path), "--channels-last"]) == 2
    assert "--channels-last is for a convolutional --model" in capsys.readouterr().err


def test_cli_with_measured_sparsity_says_the_same_each_run_and_leaves_the_callers_rng(capsys):
    """--sparsity auto measures on CPU steps of the model it builds: built from one seed each
    run (cswap-plan --model printed sparsities a point apart run to run), the caller's
    random state left as it was."""
    argv = ["--model", "small_cnn", "--dataset", "cifar10", "--batch", "16", "--gpu", "l4", "--no-largest-batch"]
    torch.manual_seed(123)
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(capsys.readouterr().out)
    assert "measured: 3 SGD steps" in outs[0] and outs[0] == outs[1]
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("name", ["alexnet", "squeezenet1_0", "resnet18",
                                  *(pytest.param(n, marks=pytest.mark.slow)
                                    for n in ("mobilenet", "squeezenet1_1", "plain20"))])
def test_every_model_predicts(name):
    p = cswap.predict(build(name, dataset="cifar10"), torch.empty(8, *CIFAR), gpu="rtx-4090-24gb", sparsity=0.5)
    # raw offloads only ever take bytes off the device (compressed ones stage a buffer first)
    assert p.peak_bytes("vdnn") <= p.peak_bytes("none") and p.step_seconds("none") > 0
    assert {*whatif.MODES, "budget"} <= set(p.modes) <= {*whatif.MODES, "budget", "recompute"}
    assert p.tensors and all(set(t.decisions) == set(p.modes) for t in p.tensors)


def test_a_users_own_module():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))

        def forward(self, x):
            return self.net(x)

    p = cswap.predict(Mlp(), torch.empty(256, 512), gpu="h200", sparsity="auto")
    assert p.tensors and any(t.op == "relu" and t.sparsity > 0.2 for t in p.tensors)
    assert "random normal" in p.sources["sparsity"]
    assert cswap.gpus() == sorted(cswap.gpus()) and "h200-sxm-141gb" in cswap.gpus()


def test_measured_times_replace_the_rooflines_phase_totals(small, prediction, tmp_path):
    p = cswap.predict(small, torch.empty(16, *CIFAR), gpu="v100-sxm2-16gb", sparsity=0.5,
                      times={"forward_s": 0.010, "backward_s": 0.025})
    g = gpu("v100-sxm2-16gb")
    model_of_time = roofline.time_model()[0]
    trace = fake_gpu.trace_step(small, torch.empty(16, *CIFAR))
    optimizer_s = sum(roofline.op_seconds(op, g, "fp32", model_of_time) for op in trace.ops
                      if op.phase == "optimizer")
    assert p.modes["none"].compute_seconds == pytest.approx(0.035 + optimizer_s)
    assert prediction.modes["none"].compute_seconds - optimizer_s != pytest.approx(0.035)  # the roofline's differ
    assert p.sources["compute"].startswith("measured: forward 10.00 ms and backward 25.00 ms")
    assert p.peak_bytes("none") == prediction.peak_bytes("none")
    # at twice the batch, measured times scale with it
    assert p._at(32).modes["none"].compute_seconds > 2 * 0.035

    # from a cswap run's report: the profiled step's forward and backward seconds
    model = cswap.patch(build("small_cnn", dataset="cifar10"), report_dir=tmp_path, verbose=False)
    for _ in range(2):
        model(torch.randn(4, *CIFAR)).sum().backward()
    cswap.epoch_end(model)
    cswap.unpatch(model)
    metrics = json.loads((tmp_path / "epochs.jsonl").read_text().splitlines()[-1])["metrics"]
    assert metrics["forward_s"] > 0 and metrics["backward_s"] > 0
    q = cswap.predict(small, torch.empty(4, *CIFAR), gpu="v100-sxm2-16gb", times=tmp_path)
    assert str(tmp_path) in q.sources["compute"]
    with pytest.raises(ValueError, match="forward_s and backward_s"):
        cswap.predict(small, torch.empty(4, *CIFAR), gpu="v100-sxm2-16gb", times={"forward_s": 1})


def test_replanning_lowers_the_target_until_the_full_curve_fits():
    """The planner's choice is discrete: a target lowered by just the overshoot can give the
    same plan and the same overshoot again (ResNet-50 at batch 1070 on an H100 did, four
    times, and was called unfit while larger batches fit). Each cut is at least twice the last."""
    from types import SimpleNamespace

    capacity, gib = 100 << 30, 1 << 30
    targets = []

    def plan_at(target):  # moves one more tensor of 1 GiB for each full GiB cut off the budget
        targets.append(target)
        return SimpleNamespace(fits=True, moved=(capacity - target) // gib)

    def check(plan):  # the full curve overshoots by 20 MiB until two tensors more are moved
        return (SimpleNamespace(peak_bytes=capacity + (20 << 20) * (plan.moved < 2)),)

    plan, (mode,) = whatif._replan_until_it_fits(capacity, plan_at, check)
    assert mode.peak_bytes <= capacity and plan.moved >= 2
    cuts = [a - b for a, b in zip(targets, targets[1:])]
    assert all(b >= 2 * a for a, b in zip(cuts, cuts[1:])), cuts

    targets.clear()  # a plan the planner itself says does not fit is final: no replanning
    whatif._replan_until_it_fits(capacity, lambda t: targets.append(t) or SimpleNamespace(fits=False, moved=0), check)
    assert targets == [capacity]
