"""Create every pipeline state of the hebrus Metal kernels on a Mac and check it (macOS workflow).

For each mps_kernels/<op>.metal the embedded source (mps_kernels/embed_metal.py, with and without
bfloat kernels, as csrc/mps/hebrus_mps.h hands it to Metal) is compiled with torch.mps.compile_shader,
every kernel the glue can launch is fetched from the library (which creates its pipeline state), and
each pipeline is checked: thread execution width 32 (the kernels' SIMD-group layouts assume it), at
least as many threads per threadgroup as the launch plan dispatches (mps_kernels/hebrus_launch.h)
and at most 32 KiB of static threadgroup memory. Exits non-zero on any failure, including no MPS
device: this is a required check, not an advisory one.

Run: python tests/metal/check_pipelines.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "mps_kernels")
sys.path.insert(0, KERNEL_DIR)

import embed_metal  # noqa: E402

TYPES = ("float", "half", "bfloat")
ATTN = tuple(f"h{h}_d{d}" for h in (1, 2, 4, 8) for d in (64, 128, 256))
# kernel -> threads per threadgroup the glue dispatches (hebrus_launch.h: HEBRUS_*_TG, HEBRUS_CHECK_TG)
KERNELS = {
    "ple_conv": {**{f"ple_conv_{t}": 256 for t in TYPES}, "ple_conv_check_cu": 256},
    "ple_ngram_ids": {"ple_ngram_ids_long": 256, "ple_ngram_ids_check_cu": 256},
    "ple_conv_slots": {**{f"ple_conv_slots_{t}": 256 for t in TYPES}, "ple_conv_slots_check": 256},
    "ple_ngram_ids_slots": {"ple_ngram_ids_slots_long": 256, "ple_ngram_ids_slots_check": 256},
    "qsa_pool": {f"qsa_pool_{t}": 256 for t in TYPES},
    "qsa_select": {f"qsa_select_{v}_{t}": 256 for v in ("k512", "k2048") for t in TYPES},
    "qsa_attention": {**{f"qsa_attention_{v}_{t}": 256 for v in ATTN for t in TYPES},
                      "qsa_attention_check_cells": 256},
    "gdn_delta_rule": {**{f"{op}_k{d}_{t}": 128 for op in ("gdn_delta_rule", "gdn_delta_rule_slots")
                          for d in (32, 64, 128, 256) for t in TYPES},
                       "gdn_delta_rule_check_cu": 256, "gdn_delta_rule_slots_check": 256},
    "gdn_chunk_delta_rule": {**{f"gdn_chunk_delta_rule_slots_{t}": 128 for t in TYPES},
                             **{f"gdn_chunk_delta_rule_slots_gf32_{t}": 128 for t in TYPES[1:]},
                             "gdn_chunk_delta_rule_slots_check": 256},
    "moe_experts": {**{f"moe_experts_{k}_{t}": 256 for k in ("act", "down", "sum", "act_grouped", "down_grouped")
                       for t in TYPES}, "moe_experts_route": 256},
    "moe_experts_quantized": {**{f"moe_experts_quantized_{k}_{q}_{t}": 256
                                 for k in ("act", "down", "act_grouped", "down_grouped")
                                 for q in ("q4", "q8") for t in TYPES},
                              **{f"{k}_{q}_{t}": 256 for k in ("quantized_linear", "quantized_linear_tiled")
                                 for q in ("q4", "q8") for t in TYPES}},
    "hc_rms_norm": {f"hc_rms_norm_{t}": 256 for t in TYPES},
    "gdn_fused": {f"{k}_{t}": 256 for k in ("gdn_gates", "gdn_gated_rms_norm") for t in TYPES},
    "hc_premix": {**{f"{k}_{t}": 256 for k in ("hc_premix_low", "hc_premix_mix", "hc_post_combine") for t in TYPES},
                  **{f"{k}_{q}_{t}": 256 for k in ("hc_premix_quantized_low", "hc_premix_quantized_mix")
                     for q in ("q4", "q8") for t in TYPES}},
    "qsa_token_cells": {"qsa_token_cells_long": 256},
    "rms_norm_rope": {f"rms_norm_rope_{t}": 256 for t in TYPES},
    "sigmoid_gate": {f"sigmoid_gate_{t}": 256 for t in TYPES},
    "moe_route": {f"moe_route_{t}": 256 for t in TYPES},
    "moe_shared_expert": {**{f"moe_shared_expert_{k}_{t}": 256 for k in ("act", "down") for t in TYPES},
                          **{f"moe_shared_expert_quantized_{k}_{q}_{t}": 256 for k in ("act", "down")
                             for q in ("q4", "q8") for t in TYPES}},
}
SIMD_WIDTH = 32
MAX_TG_MEMORY = 32768


def main() -> int:
    import torch

    if not torch.backends.mps.is_available():
        print("FAIL: no MPS device (torch.backends.mps.is_available() is False)")
        return 1
    sources = embed_metal.metal_sources(KERNEL_DIR)
    assert set(sources) == set(KERNELS), (sorted(sources), sorted(KERNELS))
    failures = 0
    for bfloat in (True, False):
        for stem, kernels in KERNELS.items():
            src = ("#define HEBRUS_METAL_BFLOAT 1\n" if bfloat else "") + sources[stem]
            try:
                lib = torch.mps.compile_shader(src)
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {stem} (bfloat={bfloat}): compile: {e}")
                failures += 1
                continue
            for name, group in kernels.items():
                if not bfloat and name.endswith("_bfloat"):
                    continue
                try:
                    fn = getattr(lib, name)  # creates the pipeline state
                    width = fn.thread_execution_width
                    max_threads = fn.max_threads_per_threadgroup
                    tg_mem = fn.static_thread_group_memory_length
                except Exception as e:  # noqa: BLE001
                    print(f"FAIL {name} (bfloat={bfloat}): pipeline: {e}")
                    failures += 1
                    continue
                ok = width == SIMD_WIDTH and max_threads >= group and tg_mem <= MAX_TG_MEMORY
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name} (bfloat={bfloat}): width {width}, max threads {max_threads} "
                      f"(launch {group}), static threadgroup memory {tg_mem} B")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
