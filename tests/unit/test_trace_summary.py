"""bench/trace_summary.py's account of device kernels (the part a CPU run cannot exercise): NCCL
time hidden by concurrent compute is not exposed, idle gaps are what no kernel covers, copies are
recognized by name; a saved trace's device gaps are laid to the host ops whose launches came late."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from trace_summary import host_late_gaps, is_copy, kernel_account, kernel_kind, kernel_kinds  # noqa: E402


def test_exposed_nccl_idle_and_copies_per_step():
    kernels = [("ampere_bf16_gemm", 0.0, 100.0), ("ncclDevKernel_AllGather_RING_LL", 50.0, 150.0),
               # torch._grouped_mm's CUTLASS kernel, its mangled name cut as the profiler gives it: a GEMM
               ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13"
                "GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collective13"
                "CollectiveMmaINS_4arch9SM90_TMA_LOAD_MULTICASTENS_10SM90_U32x4_STSM_NENS_4copy", 150.0, 200.0),
               ("void at::native::direct_copy_kernel_cuda", 200.0, 220.0),
               ("ncclDevKernel_ReduceScatter_RING_LL", 230.0, 240.0)]
    got = kernel_account(kernels, steps=2)  # microseconds over 2 steps -> ms per step
    assert got["window_ms"] == 0.12  # 0..240 us
    assert got["busy_ms"] == 0.115  # 0-220, 230-240: 230 us
    assert got["idle_ms"] == 0.005
    assert got["nccl_ms"] == 0.055
    assert got["nccl_exposed_ms"] == 0.03  # 100-150 and 230-240 run alone
    assert got["copy_ms"] == 0.01  # the direct copy only, not the GEMM with "copy" in its name
    assert got["nccl_kernels_per_step"] == 1 and got["kernels_per_step"] == 2  # 5 kernels over 2 steps
    assert got["top_copy_kernels"] == [{"kernel": "void at::native::direct_copy_kernel_cuda", "ms": 0.01,
                                        "per_step": 0.5}]
    assert got["longest_gaps"] == [{"ms": 0.01, "after": "void at::native::direct_copy_kernel_cuda",
                                    "before": "ncclDevKernel_ReduceScatter_RING_LL"}]  # 220-230: the only gap


def test_fsdp2_gradient_copy_in_is_a_copy():
    # FSDP2 casts its bf16 gradients into its fp32 reduce-scatter input with this kernel: no "copy" in its name
    assert is_copy("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>(c10::BFloat16**, float*)")
    assert not is_copy("void at::native::vectorized_elementwise_kernel<4, at::native::FusedAdamMathFunctor>")


def test_kernel_kinds_by_name():
    names = {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
             "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
             "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": "gemm",
             "triton_tem_fused_mm_0": "gemm",
             # inductor names its fused kernels after the ops they hold, attention's too: elementwise
             "triton_poi_fused__scaled_dot_product_cudnn_attention_transpose_3": "elementwise",
             "triton_red_fused__fused_rms_norm_backward_add_7": "elementwise",
             "triton_poi_fused__to_copy_26": "copy",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<CopyFunctor<c10::BFloat16>>": "copy",
             "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "nccl",
             "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "elementwise"}
    assert {n: kernel_kind(n) for n in names} == names
    kinds = kernel_kinds([("nvjet_a", 0.0, 30.0), ("nvjet_b", 40.0, 50.0), ("triton_poi_fused_mul_0", 50.0, 60.0)],
                         steps=2)
    assert kinds["gemm"]["ms"] == 0.02 and kinds["gemm"]["kernels"] == 1 and kinds["gemm"]["share"] == 0.8
    assert kinds["elementwise"]["ms"] == 0.005 and set(kinds) == {"gemm", "elementwise"}


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    """One Chrome-trace event as torch.profiler exports it."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": {} if corr is None else {"correlation": corr}}


def test_host_late_gaps_are_laid_to_the_ops_launching_after_the_device_ran_dry():
    """Kernel 2 waits 30 us after kernel 1 and was launched inside aten::index (inside _Dispatch) after
    kernel 1 ended: host-late. Kernel 3 waits 20 us but was launched long before (the device, not the
    host, left the gap: a dependency). A 2 us gap is under the 5 us floor."""
    events = [_x("cpu_op", "_Dispatch", 0, 200), _x("cpu_op", "aten::index", 90, 30),
              _x("cuda_runtime", "cudaLaunchKernel", 0, 5, corr=1), _x("kernel", "k1", 10, 90, tid=7, corr=1),
              _x("cuda_runtime", "cudaLaunchKernel", 100, 20, corr=2), _x("kernel", "k2", 130, 20, tid=7, corr=2),
              _x("cuda_runtime", "cudaLaunchKernel", 125, 5, corr=3), _x("kernel", "k3", 170, 10, tid=7, corr=3),
              _x("cuda_runtime", "cudaLaunchKernel", 131, 5, corr=4), _x("kernel", "k4", 182, 10, tid=7, corr=4)]
    got = host_late_gaps(events, steps=1)
    assert got["gaps_ms"] == 0.05 and got["host_late_ms"] == 0.03  # 30 + 20 us of gaps, 30 host-late
    assert got["by_op"] == [{"ops": ["_Dispatch", "aten::index"], "ms": 0.03, "gaps": 1.0}]
