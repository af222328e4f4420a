"""The step profiler's timeline arithmetic (pure functions) and its CPU smoke run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from run_helpers import run_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from profile_step import analyse_timeline, kernel_kind, union_length  # noqa: E402


def kernel(name: str, start: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur}


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0.0
    assert union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25.0
    assert union_length([(20, 30), (0, 10)]) == 20.0


@pytest.mark.parametrize(
    ("name", "cat", "kind"),
    [
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "kernel",
            "communication",
        ),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>",
            "kernel",
            "attention",
        ),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "kernel", "matmul_fp8"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "kernel", "matmul"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "kernel", "matmul"),
        ("nvjet_sm90_qrtst_128x160_128x5_1x2_h_bz_coopA_algo2_TNT", "kernel", "matmul_fp8"),
        ("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN", "kernel", "matmul_fp8"),
        (
            "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "kernel",
            "optimizer",
        ),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "kernel", "compiled"),
        ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", "copy"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
            "kernel",
            "other",
        ),
    ],
)
def test_kernels_are_sorted_into_kinds(name, cat, kind):
    assert kernel_kind(name, cat) == kind


def test_exposed_communication_is_what_no_compute_kernel_overlaps():
    # two steps; µs timeline: matmul 0-600, nccl 400-900 (300 hidden, 200 exposed),
    # optimizer 1000-1200, idle gap 900-1000 and 1200-2000
    events = [
        kernel("nvjet_tst_gemm", 0, 600),
        kernel("ncclDevKernel_ReduceScatter", 400, 500),
        kernel("multi_tensor_apply_kernel<FusedAdam>", 1000, 200),
    ]
    report = analyse_timeline(events, steps=2, step_ms=1.0)
    assert report["kernel_ms"] == {"communication": 0.25, "matmul": 0.3, "optimizer": 0.1}
    assert report["busy_ms"] == pytest.approx(0.55)  # (900 + 200) µs over two steps
    assert report["idle_ms"] == pytest.approx(0.45)
    assert report["comm_ms"] == pytest.approx(0.25)
    assert report["exposed_comm_ms"] == pytest.approx(0.15)
    assert [k["kind"] for k in report["top_kernels"]] == ["matmul", "communication", "optimizer"]
    assert report["top_kernels"][0]["calls_per_step"] == 0.5


@pytest.mark.slow
def test_profile_smoke_runs_on_cpu(tmp_path):
    out = tmp_path / "profile.json"
    proc = run_script(BENCHMARKS / "profile_step.py", "--smoke", "--out", str(out), cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    (rank,) = report["ranks"]
    assert rank["rank"] == 0 and rank["step_ms"] > 0
    assert report["model"] == "tiny" and report["steps"] == 2
