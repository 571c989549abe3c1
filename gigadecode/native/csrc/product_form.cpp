// How bf16 activations meet bf16-exact weights on AVX512-BF16 builds (the MoE's experts, the dense
// projections' bf16 weights), chosen once a process:
// as exact bf16 dot products (`vdpbf16ps`, 32 products an instruction) or as fp32 FMAs on the same values
// (`expert_rows_f32` in moe.cpp: the same exact products, 16 an instruction, summed in another order). CPUs
// with AVX512-BF16 differ by 4x in the ratio of the two: a Zen 4 issues one 512-bit vdpbf16ps and one 512-bit
// FMA a cycle (bf16: 2x the products), an Intel Xeon (Emerald Rapids) ran 1.3 vdpbf16ps against 5.3 FMAs a
// nanosecond (fp32: 2x). So it is measured at first use: both instructions' throughput over independent
// chains, alternated, best of five (~1 ms), and fp32 chosen when its products come 1.25x faster.
// GIGADECODE_BF16_PRODUCTS=bf16|fp32 (or the `product_form` op) sets it; moe.cpp says which experts take it,
// linear.cpp from how many inputs the projections do.
// Also here, the other forms chosen once a process: whether our own AMX tile code and oneDNN's AMX GEMMs run
// (`amx_tiles`), and how decode attention reads FP8 KV (`fp8_reads`: by byte table where the CPU has
// AVX512-VBMI, else through fp16).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/native/CPUBlas.h>

#include "amx_tiles.h"
#include "bf16dot.h"
#include "common.h"
#include "decode_span.h"
#include "kernels.h"
#include "mxfp4_vnni.h"

namespace gd {

namespace {
// A form on or off for the whole process, decided at first use: `state` -1 until then, 0 / 1 after (the ops set
// it as well); the environment variable `env` set to `off` turns it off, else `present()` says
template <typename Present>
[[maybe_unused]] bool decided_once(std::atomic<int>& state, const char* env, const char* off, Present present) {
  int s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    const char* e = std::getenv(env);
    s = e != nullptr && std::strcmp(e, off) == 0 ? 0 : int(present());
    state.store(s, std::memory_order_relaxed);
  }
  return s == 1;
}
}  // namespace

#ifdef GD_BF16DOT
namespace {

// seconds for `iters` rounds of eight independent vdpbf16ps (or FMA) chains
__attribute__((noinline)) double seconds_of(bool bf16_dot, int64_t iters) {
  volatile uint16_t one_bf16 = 0x3F80;                  // opaque operands: nothing folds at compile time
  volatile float tiny = 1e-9f;
  const __m512i a = _mm512_set1_epi16(int16_t(one_bf16));
  const __m512 f = _mm512_set1_ps(tiny);
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iters; ++n)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      acc[i] = bf16_dot ? _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)a) : _mm512_fmadd_ps(f, f, acc[i]);
  const auto t1 = std::chrono::steady_clock::now();
  volatile float sink = 0;
  for (int i = 0; i < 8; ++i) sink = sink + _mm512_reduce_add_ps(acc[i]);
  return std::chrono::duration<double>(t1 - t0).count();
}

ProductForm measured_product_form() {
  if (const char* env = std::getenv("GIGADECODE_BF16_PRODUCTS")) {
    if (std::strcmp(env, "bf16") == 0) return PRODUCTS_BF16;
    if (std::strcmp(env, "fp32") == 0) return PRODUCTS_F32;
  }
  double dot = 1e9, fma = 1e9;
  for (int round = 0; round < 5; ++round) {
    dot = std::min(dot, seconds_of(true, 4096));      // 32 products per instruction
    fma = std::min(fma, seconds_of(false, 4096));     // 16
  }
  return fma * 2 * 1.25 < dot ? PRODUCTS_F32 : PRODUCTS_BF16;
}

std::atomic<int> chosen_form{PRODUCTS_AUTO};
}  // namespace

ProductForm bf16_products() {
  int f = chosen_form.load(std::memory_order_relaxed);
  if (f == PRODUCTS_AUTO) {
    f = measured_product_form();
    chosen_form.store(f, std::memory_order_relaxed);
  }
  return ProductForm(f);
}
#endif

#ifdef GD_BF16DOT
namespace {
// Linux lets a process use the AMX tile data only once it has asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA; oneDNN asks too, but our own tile code may run first). Asking again is harmless.
bool tile_data_permitted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// PyTorch packs bf16 GEMM operands for its batch-reduce GEMM exactly where that GEMM runs on AMX tiles. Our tile
// code also takes AVX512-VBMI's byte permutes (decode attention's FP8 -> bf16, attention_tiles.cpp), which every
// CPU with AMX has; a CPU (or VM) that hid them gets the forms without tiles.
bool amx_present() {
  return at::native::cpublas::could_pack(at::kBFloat16) && tile_data_permitted() &&
         __builtin_cpu_supports("avx512vbmi");
}

std::atomic<int> amx_state{-1};                   // -1: not decided yet; 0 / 1: off / on
}  // namespace

bool amx_tiles_on() { return decided_once(amx_state, "GIGADECODE_AMX", "0", amx_present); }
#endif

std::string amx_tiles_mode(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "auto" || mode == "on" || mode == "off",
              "amx_tiles: expected '', 'auto', 'on' or 'off', got '", mode, "'");
#ifdef GD_BF16DOT
  if (mode == "on") TORCH_CHECK(amx_present(), "amx_tiles: this CPU has no AMX-BF16 tiles");
  if (!mode.empty()) amx_state.store(mode == "auto" ? -1 : mode == "on" ? 1 : 0);
  if (!amx_present()) return "unavailable";
  return amx_tiles_on() ? "on" : "off";
#else
  TORCH_CHECK(mode != "on", "amx_tiles: this build (", GD_ISA, ") has no AMX form");
  return "unavailable";
#endif
}

#ifdef GD_FP8_TABLE_READS
namespace {
std::atomic<int> fp8_table_state{-1};             // -1: not decided yet; 0 / 1: through fp16 / by table
bool fp8_table_present() { return __builtin_cpu_supports("avx512vbmi"); }
}  // namespace

bool fp8_table_reads() { return decided_once(fp8_table_state, "GIGADECODE_FP8_READS", "fp16", fp8_table_present); }
#endif

std::string fp8_reads_mode(const std::string& mode) {
  TORCH_CHECK(mode.empty() || mode == "auto" || mode == "table" || mode == "fp16",
              "fp8_reads: expected '', 'auto', 'table' or 'fp16', got '", mode, "'");
#ifdef GD_FP8_TABLE_READS
  if (mode == "table") TORCH_CHECK(fp8_table_present(), "fp8_reads: this CPU has no AVX512-VBMI byte permutes");
  if (!mode.empty()) fp8_table_state.store(mode == "auto" ? -1 : mode == "table" ? 1 : 0);
  return fp8_table_reads() ? "table" : "fp16";
#else
  TORCH_CHECK(mode != "table", "fp8_reads: this build (", GD_ISA, ") has no byte-table form");
  return "fp16";
#endif
}

#ifdef GD_VNNI_FORM
namespace {
std::atomic<int> int16_state{-1};                 // -1: not decided yet; 0 / 1: fp32 / int16
}  // namespace

// 'int16' where the CPU has AVX512-VNNI (GIGADECODE_BF16_PRODUCTS=fp32 keeps the fp32 tiles)
bool int16_products() {
  return decided_once(int16_state, "GIGADECODE_BF16_PRODUCTS", "fp32",
                      [] { return __builtin_cpu_supports("avx512vnni") != 0; });
}
#endif

std::string product_form(const std::string& form) {
#ifdef GD_VNNI_FORM
  TORCH_CHECK(form != "bf16", "product_form: this build (", GD_ISA, ") has no bf16 dot products; its forms are "
              "'fp32' and, on CPUs with AVX512-VNNI, 'int16'");
  TORCH_CHECK(form.empty() || form == "auto" || form == "fp32" || form == "int16",
              "product_form: expected '', 'auto', 'fp32' or 'int16', got '", form, "'");
  if (form == "int16") TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "product_form: this CPU has no AVX512-VNNI");
  if (!form.empty()) int16_state.store(form == "auto" ? -1 : form == "int16" ? 1 : 0);
  return int16_products() ? "int16" : "fp32";
#elif defined(GD_BF16DOT)
  TORCH_CHECK(form.empty() || form == "auto" || form == "bf16" || form == "fp32",
              "product_form: expected '', 'auto', 'bf16' or 'fp32', got '", form, "'");
  if (!form.empty())
    chosen_form.store(form == "auto" ? PRODUCTS_AUTO : form == "bf16" ? PRODUCTS_BF16 : PRODUCTS_F32);
  return bf16_products() == PRODUCTS_F32 ? "fp32" : "bf16";
#else
  TORCH_CHECK(form.empty() || form == "auto" || form == "fp32",
              "product_form: this build (", GD_ISA, ") has no bf16 dot products; its products are fp32");
  return "fp32";
#endif
}

}  // namespace gd
