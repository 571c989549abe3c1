"""Shared by the native kernels' tests (tests/test_native_*.py): the loaded ops, seeded random inputs, and the
product forms (bf16 dot products, fp32 FMAs, AMX tiles) a kernel can be switched between."""

from __future__ import annotations

import contextlib
import zlib

import torch

from gigadecode import native
from gigadecode.kv.cache import FP8, pack_k_view
from gigadecode.mxfp4 import encode_mxfp4

OPS = native.load()     # None where the kernels cannot be built here: each test module skips then

F32, BF16 = torch.float32, torch.bfloat16
NAMES = {F32: "f32", BF16: "bf16"}
BF16_RTOL = 2.0 ** -8          # bf16 round-to-nearest: at most half an ulp = 2^-8 of the value


def gen(*key) -> torch.Generator:
    """A generator seeded from `key` (stable across runs, unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(g: torch.Generator, *shape, dtype=F32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@contextlib.contextmanager
def num_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def assert_rounded(out: torch.Tensor, ref32: torch.Tensor, atol: float) -> None:
    """A bf16 result against the fp32 reference it rounds: within bf16 rounding (+ atol for fp32 order)."""
    assert out.dtype == BF16 and ref32.dtype == F32
    torch.testing.assert_close(out.float(), ref32, rtol=BF16_RTOL, atol=atol)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (so -0.0 != +0.0)."""
    return t.view({F32: torch.int32, BF16: torch.int16, FP8: torch.uint8}[t.dtype])


# the forms the products of bf16 inputs and bf16-exact weights (experts, dense bf16 weights) can take on this
# build (`native.product_form`): the AVX-512 build's 'int16' (the MoE's experts on int16-quantized inputs) where
# the CPU has AVX512-VNNI, which is its default there
PRODUCT_FORMS = (["bf16", "fp32"] if native.isa() == "avx512-bf16" else
                 ["int16", "fp32"] if native.isa() == "avx512" and native.product_form() == "int16" else ["fp32"])


# ... those, each with AMX tiles off, plus 'amx' where the CPU has AMX-BF16 (`native.amx_tiles`): the MoE's
# experts with 5+ inputs and linear's bf16 weights at 5+ rows on AMX tiles, the rest in the measured form
AMX = native.amx_tiles() != "unavailable"
ALL_FORMS = PRODUCT_FORMS + (["amx"] if AMX else [])


@contextlib.contextmanager
def products(form: str):
    """moe_mxfp4 and linear multiplying bf16 inputs in `form` ('bf16' dot products or 'fp32' FMAs, AMX tiles
    off; 'amx': AMX tiles on), restored after."""
    before, amx_before = native.product_form(), native.amx_tiles()
    if form != "amx":
        native.product_form(form)
    if AMX:
        native.amx_tiles("on" if form == "amx" else "off")
    try:
        yield
    finally:
        native.product_form(before)
        if AMX:
            native.amx_tiles(amx_before)


@contextlib.contextmanager
def switched(setting, mode: str):
    """A process-wide kernel setting (`native.amx_tiles`, `native.fp8_reads`, ...) set to `mode`, restored after."""
    before = setting()
    setting(mode)
    try:
        yield
    finally:
        setting(before)


def moe_weights(g, E, H, I, bdt):
    """(gate_up blocks, scales, bias, down blocks, scales, bias) of E random MXFP4 experts (H hidden, I inner)."""
    gu_b, gu_s = encode_mxfp4(randn(g, E, 2 * I, H, scale=0.1))
    dn_b, dn_s = encode_mxfp4(randn(g, E, H, I, scale=0.1))
    return gu_b, gu_s, randn(g, E, 2 * I, dtype=bdt, scale=0.1), dn_b, dn_s, randn(g, E, H, dtype=bdt, scale=0.1)


KV_FORMS = ("fp8-packed", "fp8", "bf16", "fp32")


def make_kv(g, form: str, nb: int, kv: int, B: int, d: int):
    """(buf [2, nb, kv, B, d] filled with random values, K view, V view)."""
    dtype = {"fp8-packed": FP8, "fp8": FP8, "bf16": BF16, "fp32": F32}[form]
    buf = torch.zeros(2, nb, kv, B, d, dtype=dtype)
    buf.copy_(torch.randn(2, nb, kv, B, d, generator=g).to(dtype))
    return buf, *kv_views(buf, form)


def kv_views(buf, form):
    return (pack_k_view(buf[0]) if form == "fp8-packed" else buf[0]), buf[1]
