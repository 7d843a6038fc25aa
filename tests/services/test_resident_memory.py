"""One model copy per process: what a hot-swapped rollout model keeps resident does not grow with pushes, and
what it serves after a push equals a model freshly built with that adapter merged (bit-equal on CPU).

Resident bytes are the distinct storages of every tensor the HotSwapModel keeps (`resident_tensors`: the
served model's parameters and buffers, torchao packed weights by their components, the LoRA targets'
originals and, for a switchable explorer, its host copies). A build-aside design holds a second model while
it builds and until calls end; here the served model changes in place.

The adapter size limit is derived from the served LoRA layout: a rank-32 FP32 LoRA of Wan2.2 T2V-A14B (both
14B experts, about 840 MB, over the old fixed 512 MiB) fits the cap its server derives, and an adapter over a
server's derived cap is refused with a message naming the limit and how to set it.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from diffusers import PixArtTransformer2DModel, WanTransformer3DModel
from torch import nn
from transformers import CLIPTextModel

from services.common.metrics import ServiceMetrics
from services.explorer.dataplane import ExplorerDataPlane
from services.explorer.server import start
from services.rollout.adapter_endpoint import AdapterEndpoint
from services.rollout.hot_swap import AdapterRejected, HotSwapModel, adapter_cap, storages
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.adapters.merge import lora_layout, merge_lora, target_weights
from solrl.models.wan import WAN22_T2V_A14B, WanExperts
from solrl.precision import PrecisionConfig, build_backend
from solrl.rewards import build_reward
from solrl.rollout.passes import SamplerSpec, explore
from solrl.rollout.workers import InferenceCopy
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config

TOKEN = "resident-token"
ROOT = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_q, self.to_k, self.ff = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(torch.tanh(self.to_q(x) * self.to_k(x)))


class Toy(nn.Module):
    """Two blocks of Linears: LoRA targets (to_q, to_k) and a quantized non-target (ff)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def adapter(base: nn.Module, spec: LoraSpec, version: int) -> tuple[dict, bytes]:
    adapters = LoraAdapters(copy.deepcopy(base), spec, seed=version)
    with torch.no_grad():
        for p in adapters.parameters("default"):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    state = adapters.state_dict("default")
    return state, encode_adapter(state, version, spec)


def fresh(base: nn.Module, precision: PrecisionConfig, state: dict | None, spec: LoraSpec | None) -> nn.Module:
    """A model built from scratch with the adapter merged (the numbers a build-aside swap served)."""
    module = copy.deepcopy(base)
    if state is not None:
        for name, weight in merge_lora(target_weights(module, spec), state, spec).items():
            module.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
    return build_backend(precision).prepare(module.eval().requires_grad_(False))


def resident_bytes(hot: HotSwapModel) -> int:
    return sum(storages(hot.resident_tensors()).values())


def push(hot: HotSwapModel, data: bytes, version: int) -> None:
    hot.load(data, version=version, sha256=sha256_hex(data))


def put_adapter(http: httpx.Client, adapters: LoraAdapters, spec: LoraSpec, version: int, scale: float) -> None:
    """Move the adapter by a seeded step of `scale` and PUT it to the explorer's /v1/adapter as `version`."""
    with torch.no_grad():
        for p in adapters.parameters("default"):
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    data = encode_adapter(adapters.state_dict("default"), version, spec)
    response = http.put("/v1/adapter", content=data, headers={
        "Authorization": f"Bearer {TOKEN}", "X-Adapter-Version": str(version), "X-Adapter-Sha256": sha256_hex(data)})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("backend", ["nvfp4-emu", "fp8-e4m3-emu", "bf16"])
def test_ten_pushes_keep_the_bytes_of_one_and_serve_the_fresh_merge(backend):
    torch.manual_seed(0)
    base, precision = Toy(), PrecisionConfig(backend)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("to_q", "to_k"))
    x = torch.randn(8, 64)
    hot = HotSwapModel(copy.deepcopy(base), None, precision, targets=spec.target_modules)
    served = storages([*hot.current().module.parameters(), *hot.current().module.buffers()])
    kept = storages(hot.resident_tensors())
    targets = sum(m.weight.numel() * 4 for n, m in base.named_modules() if n.endswith(("to_q", "to_k")))
    # one copy: the served model plus only the targets' originals (none for the unmerged bf16 LoRA)
    assert sum(kept.values()) == sum(served.values()) + (targets if hot.merges else 0)
    sizes = []
    for version in range(1, 11):
        state, data = adapter(base, spec, version)
        push(hot, data, version)
        sizes.append(resident_bytes(hot))
        with hot.serving() as cur, torch.no_grad():
            assert cur.version == version
            want = fresh(base, precision, state, spec)(x) if hot.merges else None
            got = cur.module(x)
        if want is not None:
            assert torch.equal(got, want), float((got - want).abs().max())
    assert sizes == [sizes[0]] * 10, sizes


def test_a_push_with_fewer_targets_restores_the_others_and_a_bad_one_changes_nothing():
    torch.manual_seed(1)
    base, precision = Toy(), PrecisionConfig("nvfp4-emu")
    both = LoraSpec(rank=2, alpha=4.0, target_modules=("to_q", "to_k"))
    only_q = LoraSpec(rank=2, alpha=4.0, target_modules=("to_q",))
    x = torch.randn(4, 64)
    hot = HotSwapModel(copy.deepcopy(base), None, precision, targets=both.target_modules)
    _, data1 = adapter(base, both, 1)
    push(hot, data1, 1)
    state2, data2 = adapter(base, only_q, 2)
    push(hot, data2, 2)
    with torch.no_grad():
        assert torch.equal(hot.current().module(x), fresh(base, precision, state2, only_q)(x))
    ff = LoraSpec(rank=2, alpha=4.0, target_modules=("ff",))   # a layer whose original is not kept
    with pytest.raises(AdapterRejected, match="original weights"):
        push(hot, adapter(base, ff, 3)[1], 3)
    assert hot.current().version == 2
    with torch.no_grad():
        assert torch.equal(hot.current().module(x), fresh(base, precision, state2, only_q)(x))


def test_a_precision_switch_rebuilds_from_the_originals_without_growing():
    torch.manual_seed(2)
    base = Toy()
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=("to_q", "to_k"))
    x = torch.randn(4, 64)
    nvfp4, fp8 = PrecisionConfig("nvfp4-emu"), PrecisionConfig("fp8-e4m3-emu")
    hot = HotSwapModel(copy.deepcopy(base), None, nvfp4, targets=spec.target_modules, switchable=True)
    state, data = adapter(base, spec, 1)
    push(hot, data, 1)
    before = resident_bytes(hot)
    for precision in (fp8, PrecisionConfig("bf16"), nvfp4):
        hot.use(precision)
        with torch.no_grad():
            got = hot.current().module(x)
        if precision is not nvfp4:
            continue
        assert torch.equal(got, fresh(base, nvfp4, state, spec)(x))
    assert resident_bytes(hot) == before
    with pytest.raises(RuntimeError, match="serves nvfp4-emu only"):
        HotSwapModel(copy.deepcopy(base), None, nvfp4, targets=spec.target_modules).use(fp8)


def test_an_explorer_service_receiving_ten_pushes_holds_the_bytes_of_one():
    """A real explorer (gRPC + ops app) gets ten pushes over PUT /v1/adapter; its resident bytes after the
    tenth equal those after the first, and it samples exactly what the core explorer does at that version."""
    torch.manual_seed(0)
    config = {**transformer_config(), "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
              "cross_attention_dim": 32}
    model = ShapesModel(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
    precision, scorer = PrecisionConfig("nvfp4-emu"), build_reward("jpeg_compressibility")
    served = ShapesModel(copy.deepcopy(model.transformer), model.text_encoder)
    plane = ExplorerDataPlane(served, precision, None, scorer, steps=2, kept=2)
    svc = start(plane, ServiceMetrics("explorer"), adapter_token=TOKEN)
    adapters = LoraAdapters(copy.deepcopy(model.transformer), spec, seed=1)
    sizes = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{svc.http.port}", timeout=60) as http:
            for version in range(1, 11):
                put_adapter(http, adapters, spec, version, 0.2)
                sizes.append(resident_bytes(plane.hot))
            got = plane.explore(["a red circle"], [[1, 2, 3, 4]], steps=2, kept=2)
    finally:
        svc.stop(0)
    assert got.version == 10 and sizes == [sizes[0]] * 10, sizes
    ref = InferenceCopy(adapters, precision, model.spec.quant_skip, model.spec.quant_min_features)
    ref.sync(adapters.merged_weights("default"), 10)
    want = explore(model, ref.module, ["a red circle"], [[1, 2, 3, 4]], 2, SamplerSpec(), scorer, 2, "best_worst")
    np.testing.assert_array_equal(np.asarray(got.scores, dtype=np.float32), np.asarray(want.scores, np.float32))


# one expert of Wan-AI/Wan2.2-T2V-A14B-Diffusers (transformer/config.json; transformer_2 has the same shape)
A14B_EXPERT = {"patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
               "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
               "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}


def test_a_rank_32_fp32_wan22_a14b_adapter_fits_the_derived_cap():
    with torch.device("meta"):
        model = WanExperts(WanTransformer3DModel(**A14B_EXPERT), WanTransformer3DModel(**A14B_EXPERT))
    spec = LoraSpec(rank=32, alpha=64.0, target_modules=WAN22_T2V_A14B.lora_targets)
    layout = lora_layout(model, spec)
    tensors = sum(a * b for a, b in layout.values()) * 4
    assert len(layout) == 2 * 40 * 8 * 2 and 830e6 < tensors < 850e6 > 512 << 20   # A and B of 640 Linears
    cap = adapter_cap(model, WAN22_T2V_A14B.lora_targets, 32)
    assert tensors < cap < tensors + (4 << 20)   # the tensors plus header room, not a guess
    hot = HotSwapModel(model, spec, PrecisionConfig("fp32"))   # a served model on meta: derives the same cap
    assert hot.max_bytes == cap


def test_an_adapter_over_the_derived_cap_is_refused_with_the_limit():
    torch.manual_seed(0)
    base = Toy()
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=("to_q", "to_k"))
    hot = HotSwapModel(copy.deepcopy(base), spec, PrecisionConfig("nvfp4-emu"))
    endpoint = AdapterEndpoint(hot, token="t")
    assert endpoint.max_bytes == hot.max_bytes == adapter_cap(base, spec.target_modules, 2)
    fits = encode_adapter(LoraAdapters(copy.deepcopy(base), spec, seed=0).state_dict("default"), 1, spec)
    assert endpoint.load("Bearer t", fits, 1, sha256_hex(fits)).version == 1
    big = LoraSpec(rank=64, alpha=4.0, target_modules=spec.target_modules)
    data = encode_adapter(LoraAdapters(copy.deepcopy(base), big, seed=0).state_dict("default"), 2, big)
    assert len(data) > hot.max_bytes
    with pytest.raises(AdapterRejected, match=rf"over the limit of {hot.max_bytes} .*--max-adapter-bytes") as info:
        endpoint.load("Bearer t", data, 2, sha256_hex(data))
    assert info.value.reason == "too_large" and hot.current().version == 1
    assert AdapterEndpoint(hot, token="t", max_bytes=len(data)).max_bytes == len(data) == hot.max_bytes  # the flag


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.slow
def test_an_explorer_process_holds_no_second_copy_over_ten_pushes(tmp_path):
    """A real explorer process (python -m services.explorer.server, nvfp4-emu) gets ten pushes over PUT
    /v1/adapter: its RSS after the tenth is its RSS after the first, and its peak (VmHWM) over all ten stays
    below the start RSS plus one FP32 copy of the denoiser, which a copy built beside the served one takes.
    glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_): by default it rises after large frees, and the
    heap then keeps freed tensor memory (measured here: +200 MB of RSS over ten pushes with no tensor kept,
    as the storage count of the tests above shows), which would hide what the process holds."""
    model = ShapesModel.random(seed=0, layers=2, heads=32)   # width 1024: 32M parameters, 128 MB in FP32
    model.save(tmp_path / "model")
    fp32_kib = sum(p.numel() * 4 for p in model.transformer.parameters()) // 1024
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=model.spec.lora_targets)
    adapters = LoraAdapters(copy.deepcopy(model.transformer), spec, seed=1)
    env = {**os.environ, "SOLRL_ADAPTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.explorer.server", "--model-path", str(tmp_path / "model"), "--precision",
         "nvfp4-emu", "--base-precision", "fp32", "--reward", "jpeg_compressibility", "--threads", "1",
         "--grpc-port", "0", "--http-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=(tmp_path / "explorer.log").open("w"), text=True)
    rss = []
    try:
        banner = ""
        deadline = time.monotonic() + 180
        while "solrl explorer:" not in banner:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "explorer.log").read_text()
            banner = proc.stdout.readline()
        http_addr = banner.split("http ")[1].split(",")[0]
        start_kib = proc_kib(proc.pid, "VmRSS")
        with httpx.Client(base_url=f"http://{http_addr}", timeout=120) as http:
            for version in range(1, 11):
                put_adapter(http, adapters, spec, version, 0.01)
                rss.append(proc_kib(proc.pid, "VmRSS"))
            peak = proc_kib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(30)
    grown = rss[-1] - rss[0]
    print(f"start {start_kib} KiB, after push 1 {rss[0]}, after push 10 {rss[-1]}, peak {peak}, fp32 {fp32_kib}")
    assert abs(grown) < fp32_kib // 10, (start_kib, rss, peak, fp32_kib)     # ten pushes: the bytes of one (within noise)
    assert peak - start_kib < fp32_kib, (start_kib, peak, fp32_kib)   # never a second model beside the first


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fp8", "fp8-torchao", "bf16"])
def test_on_cuda_ten_pushes_allocate_what_one_does(backend):
    """On a GPU (fp8, on Transformer Engine or torchao, needs sm_89+): torch's allocated CUDA bytes after ten pushes equal those
    after one, and the served output equals a freshly merged build."""
    torch.manual_seed(0)
    base = Toy(256).cuda().to(torch.bfloat16)
    precision = PrecisionConfig(backend)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("to_q", "to_k"))
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    hot = HotSwapModel(copy.deepcopy(base), None, precision, targets=spec.target_modules)
    allocated = []
    for version in range(1, 11):
        state, data = adapter(base, spec, version)
        push(hot, data, version)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    with torch.no_grad():
        got = hot.current().module(x)
        want = fresh(base, precision, state, spec)(x) if hot.merges else None
    assert allocated == [allocated[0]] * 10, allocated
    if want is not None:
        assert torch.equal(got, want)
