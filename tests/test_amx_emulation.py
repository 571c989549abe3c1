"""`tools/amx_emulation.h` (the AMX tiles and oneDNN's bf16 batch-reduce GEMM, emulated for the
`avx512-bf16-amx` check of `tools/isa_check.py`) against the real ones, bit for bit, on a CPU with AMX-BF16
(skipped elsewhere): random tile shapes and bf16 values with zeros of both signs, subnormals, infinities and
NaNs (a NaN matching a NaN), and GEMMs of the kernels' shapes and odd ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
AMX = "amx_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AMX or not torch.backends.mkldnn.is_available(), reason="no AMX-BF16 here")]

SOURCE = r"""
#define GD_AMX_EMU_KEEP_INTRINSICS
#include "amx_emulation.h"
#include <ATen/native/CPUBlas.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/extension.h>

struct alignas(64) Config { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {};
                            uint8_t rows[16] = {}; };

__attribute__((target("amx-tile,amx-bf16"))) void real_tiles(const Config& cfg, const void* a, const void* b, float* c,
                                                             int64_t N) {
  _tile_loadconfig(&cfg);
  _tile_loadd(0, c, N * 4); _tile_loadd(1, a, 64); _tile_loadd(2, b, N * 4);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, N * 4);
  _tile_release();
}

// c [M, N] fp32 += a [M, 2P] bf16 x b [P, 2N] bf16 (pairs) on one tile triple, the real or the emulated one
torch::Tensor tiles(torch::Tensor c, torch::Tensor a, torch::Tensor b, bool real) {
  const int64_t M = c.size(0), N = c.size(1), P = b.size(0);
  c = c.clone();
  std::vector<uint16_t> ab(16 * 32);                 // a at a 64-byte stride
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(ab.data() + m * 32, a.data_ptr<at::BFloat16>() + m * 2 * P, 4 * P);
  Config cfg;
  cfg.rows[0] = M, cfg.colsb[0] = N * 4, cfg.rows[1] = M, cfg.colsb[1] = P * 4, cfg.rows[2] = P, cfg.colsb[2] = N * 4;
  if (real) {
    TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "no AMX tile data permission");
    real_tiles(cfg, ab.data(), b.data_ptr(), c.data_ptr<float>(), N);
  } else {
    gd_amx_emu::tile_loadconfig(&cfg);
    gd_amx_emu::tile_loadd(0, c.data_ptr(), N * 4); gd_amx_emu::tile_loadd(1, ab.data(), 64);
    gd_amx_emu::tile_loadd(2, b.data_ptr(), N * 4);
    gd_amx_emu::tile_dpbf16ps(0, 1, 2);
    gd_amx_emu::tile_stored(0, c.data_ptr(), N * 4);
    gd_amx_emu::tile_release();
  }
  return c;
}

// c [M, ldc] (+)= a [M, lda] x b [K/2, ldb, 2] through at::native::cpublas::brgemm or the emulation
torch::Tensor brgemm(torch::Tensor c, torch::Tensor a, torch::Tensor b, int64_t N, int64_t K, bool add, bool real) {
  c = c.clone();
  const auto* A = a.data_ptr<at::BFloat16>();
  const auto* B = b.data_ptr<at::BFloat16>();
  if (real) {
    at::native::cpublas::brgemm(c.size(0), N, K, a.size(1), b.size(1), c.size(1), add, A, B, c.data_ptr<float>(), true);
    at::native::cpublas::brgemm_release();
  } else {
    gd_amx_emu::brgemm(c.size(0), N, K, a.size(1), b.size(1), c.size(1), add, A, B, c.data_ptr<float>(), true);
    gd_amx_emu::brgemm_release();
  }
  return c;
}
"""


@pytest.fixture(scope="module")
def ext():
    from torch.utils import cpp_extension
    return cpp_extension.load_inline("gd_amx_emulation_check", [SOURCE], functions=["tiles", "brgemm"],
                                     extra_include_paths=[str(ROOT / "tools")],
                                     extra_cflags=["-O2", "-mavx512f", "-mavx512bf16"])


def bf16_values(shape, g: torch.Generator, special: bool) -> torch.Tensor:
    """bf16 of random magnitudes 2^-20..2^20 and signs; with `special`, some zeros, subnormals, inf, NaN."""
    bits = torch.randint(0, 1 << 16, shape, generator=g, dtype=torch.int32)
    exp = torch.randint(107, 147, shape, generator=g, dtype=torch.int32)
    bits = (bits & 0x807F) | (exp << 7)
    if special:
        pick = torch.randint(0, 24, shape, generator=g)
        bits = torch.where(pick == 0, bits & 0x8000, bits)                         # +-0
        bits = torch.where(pick == 1, (bits & 0x807F) | 1, bits)                   # subnormal
        bits = torch.where(pick == 2, (bits & 0x8000) | 0x7F80, bits)              # +-inf
        bits = torch.where(pick == 3, bits | 0x7FC0, bits)                         # NaN
        bits = torch.where(pick == 4, (bits & 0x807F) | (1 << 7), bits)           # the least normals
    return bits.to(torch.int16).view(torch.bfloat16)


def f32_values(shape, g: torch.Generator, special: bool) -> torch.Tensor:
    c = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-20, 20, shape, generator=g)
    if special:
        pick = torch.randint(0, 16, shape, generator=g)
        c = torch.where(pick == 0, torch.tensor(-0.0), c)
        c = torch.where(pick == 1, c * 2.0 ** -140, c)                             # subnormal
        c = torch.where(pick == 2, c * 2.0 ** -100, c)                             # tiny normal
    return c


def same_bits(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32) == y.view(torch.int32)) | (x.isnan() & y.isnan())


@pytest.mark.parametrize("special", [False, True])
def test_tile_products_match_the_real_tiles_bit_for_bit(ext, special):
    g = torch.Generator().manual_seed(7 + special)
    for trial in range(300):
        M, N, P = (16, 16, 16) if trial % 3 == 0 else torch.randint(1, 17, (3,), generator=g).tolist()
        c = f32_values((M, N), g, special)
        a, b = bf16_values((M, 2 * P), g, special), bf16_values((P, 2 * N), g, special)
        real, emulated = ext.tiles(c, a, b, True), ext.tiles(c, a, b, False)
        assert same_bits(real, emulated).all(), (M, N, P, (real - emulated).abs().max())


@pytest.mark.parametrize("add", [False, True])
def test_brgemm_matches_onednn_bit_for_bit(ext, add):
    g = torch.Generator().manual_seed(11 + add)
    # the kernels' GEMMs (expert strips, linear, prefill attention's scores and P·V) and odd shapes
    shapes = [(64, 32, 384), (64, 5, 3072), (17, 128, 64), (33, 64, 128), (1, 1, 2), (40, 31, 98), (16, 48, 34), (5, 9, 144), (8, 16, 1030)]
    for M, N, K in shapes:
        ldb = N + int(torch.randint(0, 3, (1,), generator=g))
        a = bf16_values((M, K + 2), g, False)
        b = bf16_values((K // 2, ldb, 2), g, False)
        c = f32_values((M, N + 1), g, False)
        real, emulated = ext.brgemm(c, a, b, N, K, add, True), ext.brgemm(c, a, b, N, K, add, False)
        assert same_bits(real, emulated).all(), (M, N, K, (real - emulated).abs().max())
