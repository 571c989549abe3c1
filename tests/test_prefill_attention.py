"""`ops.flash_sink_attention` (tiled online-softmax GQA attention with sinks, the per-layer model's
prefill attention) against the dense `ops.sink_attention` with repeated kv heads and an explicit mask."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gigadecode.ops import flash_sink_attention, sink_attention


def dense_reference(q, k, v, q_pos, k_pos, sinks, scale, window):
    """sink_attention over [nh, T, d] with kv heads repeated and the causal / window mask made dense."""
    rep = q.shape[1] // k.shape[1]
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    kh = k.transpose(0, 1).repeat_interleave(rep, 0)
    vh = v.transpose(0, 1).repeat_interleave(rep, 0)
    return sink_attention(q.transpose(0, 1), kh, vh, mask, sinks, scale).transpose(0, 1)


def make_case(T, S, nkv, rep, d, q_start, k_start=0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nh = nkv * rep
    q = torch.randn(T, nh, d, generator=g) * 2
    k = torch.randn(S, nkv, d, generator=g) * 2
    v = torch.randn(S, nkv, d, generator=g)
    sinks = torch.randn(nh, generator=g) * 2
    q_pos = torch.arange(q_start, q_start + T)
    k_pos = torch.arange(k_start, k_start + S)
    return q.to(dtype), k.to(dtype), v.to(dtype), q_pos, k_pos, sinks.to(dtype)


def check(T, S, nkv, rep, d, q_start, window, tile, q_tile, dtype, k_start=0, fp32_scores=False):
    q, k, v, q_pos, k_pos, sinks = make_case(T, S, nkv, rep, d, q_start, k_start, dtype, seed=T * 131 + S)
    scale = d ** -0.5
    ours = flash_sink_attention(q, k, v, q_pos, k_pos, sinks, scale, window, tile=tile, q_tile=q_tile,
                                fp32_scores=fp32_scores)
    assert ours.shape == q.shape and ours.dtype == dtype
    if dtype == torch.float32:
        ref = dense_reference(q, k, v, q_pos, k_pos, sinks, scale, window)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:   # bf16: against the fp32 dense result on the same (bf16-rounded) inputs (|out| ~ 1)
        ref = dense_reference(q.float(), k.float(), v.float(), q_pos, k_pos, sinks.float(), scale, window)
        err = float((ours.float() - ref).abs().max())
        # bf16 scores (as the dense bf16 path rounds them) vs fp32 scores: measured <= 0.054 / 0.015
        assert err <= (2.5e-2 if fp32_scores else 8e-2)
        dense_bf16 = dense_reference(q, k, v, q_pos, k_pos, sinks, scale, window).float()
        assert err <= 1.5 * float((dense_bf16 - ref).abs().max()) + 1e-2   # no worse than dense bf16


# The keys a chunk of T queries starting at q_start sees: everything from 0 to the chunk end (the model
# gathers whole blocks, so S may run past the last query: those keys are masked).
CASES = [
    # T, S, q_start
    (1, 1, 0),
    (1, 101, 100),
    (1, 130, 100),          # keys past the query
    (37, 37, 0),
    (37, 137, 100),
    (37, 150, 100),
    (64, 300, 200),
]


@pytest.mark.parametrize("T,S,q_start", CASES)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 1000])
@pytest.mark.parametrize("tile,q_tile", [(1, 1), (7, 5), (64, 256), (512, 16)])
@pytest.mark.parametrize("rep,d", [(1, 16), (4, 64)])
def test_fp32_matches_dense(T, S, q_start, window, tile, q_tile, rep, d):
    check(T, S, nkv=2, rep=rep, d=d, q_start=q_start, window=window, tile=tile, q_tile=q_tile,
          dtype=torch.float32)


@pytest.mark.parametrize("T,S,q_start", [(1, 101, 100), (37, 137, 100), (64, 300, 200)])
@pytest.mark.parametrize("window", [None, 16, 1000])
@pytest.mark.parametrize("tile,q_tile", [(7, 5), (64, 256)])
@pytest.mark.parametrize("rep,d", [(1, 16), (4, 64)])
@pytest.mark.parametrize("fp32_scores", [False, True])
def test_bf16_close_to_fp32(T, S, q_start, window, tile, q_tile, rep, d, fp32_scores):
    check(T, S, nkv=2, rep=rep, d=d, q_start=q_start, window=window, tile=tile, q_tile=q_tile,
          dtype=torch.bfloat16, fp32_scores=fp32_scores)


def test_window_gathered_keys_start_late():
    """A sliding layer gathers only the window's blocks: k_pos starts past 0, and before the window."""
    check(37, 60, nkv=2, rep=4, d=64, q_start=100, k_start=96, window=16, tile=7, q_tile=8,
          dtype=torch.float32)


def test_rows_without_visible_keys_are_zero():
    """Keys all in the future of some queries (and masked by the window for none): those rows give 0."""
    q, k, v, _, _, sinks = make_case(4, 6, 2, 2, 16, 0)
    q_pos = torch.tensor([0, 1, 2, 3])
    k_pos = torch.arange(2, 8)                  # queries 0 and 1 see nothing
    out = flash_sink_attention(q, k, v, q_pos, k_pos, sinks, 0.25, None, tile=4, q_tile=2)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isfinite(out).all()
    ref = dense_reference(q[2:], k, v, q_pos[2:], k_pos, sinks, 0.25, None)
    torch.testing.assert_close(out[2:], ref, rtol=1e-5, atol=1e-5)


def test_skipped_tiles_are_not_read():
    """Key tiles no query can see are skipped: NaN there must not leak (the window excludes them)."""
    q, k, v, q_pos, k_pos, sinks = make_case(8, 64, 2, 2, 16, 56)
    k[:32] = float("nan")
    v[:32] = float("nan")
    out = flash_sink_attention(q, k, v, q_pos, k_pos, sinks, 0.25, window=8, tile=16, q_tile=8)
    ref = dense_reference(q, k[32:], v[32:], q_pos, k_pos[32:], sinks, 0.25, 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_empty_chunk():
    q = torch.zeros(0, 4, 16)
    k = v = torch.zeros(5, 2, 16)
    out = flash_sink_attention(q, k, v, torch.zeros(0, dtype=torch.long), torch.arange(5), torch.zeros(4), 0.25)
    assert out.shape == (0, 4, 16)


# ---- the native kernel (bf16; the per-layer model's bf16 prefill attention). On AVX512-BF16 builds head dims
# that are multiples of 16 up to 128 run the bf16 pair kernel, every other case (and every case on AVX2 and
# AVX-512 builds) the fp32-product kernel: the cases below take both where both exist.

from gigadecode import native  # noqa: E402

needs_kernel = pytest.mark.skipif(not native.prefill_attention_supported(torch.bfloat16, 64),
                                  reason="the native kernels are not built here")


# where the CPU has AMX tiles the kernel's scores and P·V take them (chunks of 128 keys) unless told not to
AMX_MODES = ["on", "off"] if native.amx_tiles() != "unavailable" else ["unavailable"]


@contextlib.contextmanager
def amx_mode(mode: str):
    before = native.amx_tiles()
    if mode != "unavailable":
        native.amx_tiles(mode)
    try:
        yield
    finally:
        if mode != "unavailable":
            native.amx_tiles(before)


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("T,S,nkv,rep,d,q_start,k_start,window", [
    (1, 1, 1, 1, 16, 0, 0, None),          # one query, one key
    (5, 9, 2, 2, 32, 4, 0, None),          # the chunk after 4 cached tokens
    (33, 57, 1, 8, 48, 40, 16, 8),         # a window shorter than the chunk, keys from position 16 on
    (17, 17, 2, 1, 128, 0, 0, None),       # d 128, no GQA
    (64, 132, 4, 3, 80, 100, 32, 20),      # rep 3, d 80, keys past the chunk's last query
    (40, 40, 2, 4, 64, 0, 0, 1000),        # a window longer than the context
    (20, 70, 2, 2, 64, 30, 0, 1),          # window 1: each query sees only itself
    (70, 100, 1, 4, 64, 0, 30, None),      # queries before the first key see nothing: 0
    (300, 420, 4, 4, 64, 120, 0, 128),     # many query tiles and key chunks, GPT-OSS's window
    # more keys than one window of the kernels' layouts (2,048 / 4,096): the softmax state carried across them
    (40, 9000, 1, 2, 16, 8960, 0, None),   # full attention over whole windows and a partial one
    (33, 8300, 2, 1, 32, 8250, 100, 4200), # a sliding window wider than a key window, keys from 100 on
    (50, 4200, 1, 3, 16, 4150, 0, 128),    # GPT-OSS's window straddling the first key-window edge
    (300, 4400, 1, 2, 16, 4000, 0, None),  # query tiles on both sides of the edge, the first ones see keys
    (30, 2100, 2, 2, 64, 2060, 0, 40),     # a window straddling the 2,048-key edge
    # head dims the pair kernel does not take (the fp32-product kernel on every build)
    (7, 7, 1, 1, 1, 0, 0, None),           # d 1
    (9, 21, 2, 3, 2, 12, 0, 5),            # d 2, rep 3, sliding
    (33, 45, 1, 2, 24, 12, 0, None),       # d 24: a partial vector of outputs
    (19, 40, 3, 1, 34, 21, 0, 7),          # d 34, three kv heads
    (25, 60, 2, 5, 72, 30, 10, None),      # d 72, rep 5
    (12, 30, 1, 2, 130, 18, 0, None),      # d 130: past the pair kernel's 128
    (16, 40, 1, 1, 256, 24, 0, 16),        # d 256
])
def test_native_prefill_attention_matches_dense(T, S, nkv, rep, d, q_start, k_start, window, amx):
    q, k, v, q_pos, k_pos, sinks = make_case(T, S, nkv, rep, d, q_start, k_start, torch.bfloat16, seed=T + 7 * S)
    scale = d ** -0.5
    with amx_mode(amx):
        ours = native.prefill_attention(q, k, v, q_pos, k_start, sinks, scale, window or 0)
    ref = dense_reference(q.float(), k.float(), v.float(), q_pos, k_pos, sinks.float(), scale, window)
    assert ours.shape == q.shape and ours.dtype == torch.bfloat16
    # bf16 inputs, fp32 scores and softmax, probabilities rounded to bf16 for PV by the pair kernel (2^-9 of
    # each weight; the fp32-product kernel keeps them fp32), one bf16 rounding of the output
    atol = 4 * 2.0 ** -9 * v.float().abs().max().item()
    torch.testing.assert_close(ours.float(), ref, rtol=2.0 ** -7, atol=atol)
    blind = (k_pos[None, :] > q_pos[:, None]).all(1)                 # rows that see no key
    assert torch.equal(ours[blind].float(), torch.zeros_like(ref[blind]))
    # the twin (what runs where no kernel is built) agrees too
    twin = native.twins.prefill_attention(q, k, v, q_pos, k_start, sinks, scale, window or 0)
    torch.testing.assert_close(ours.float(), twin.float(), rtol=2.0 ** -7, atol=atol)


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])
def test_native_prefill_attention_window_longer_than_any_context(d, amx):
    """A window that reaches before every query's first key excludes nothing, however long: 2^31 - 1, 2^32 + 5
    and 2^40 give what no window gives (the pair kernel took the window's bound as a 32-bit lane value, so a
    window of 2^32 + 5 wrapped to 5 and hid most keys)."""
    q, k, v, q_pos, k_pos, sinks = make_case(8, 64, 1, 2, d, 56, 0, torch.bfloat16, seed=d)
    with amx_mode(amx):
        full = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0)
        for window in (2**31 - 1, 2**32 + 5, 2**40):
            assert torch.equal(native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, window), full), window
    ref = dense_reference(q.float(), k.float(), v.float(), q_pos, k_pos, sinks.float(), d ** -0.5, None)
    torch.testing.assert_close(full.float(), ref, rtol=2.0 ** -7, atol=4 * 2.0 ** -9 * v.float().abs().max().item())


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])
def test_native_prefill_attention_queries_far_from_the_first_key(d, amx):
    """Queries 2^31 or more positions from k_start, in a chunk with nearer ones: the dense reference's rows
    (the pair kernel cast the distance to a 32-bit lane bound, so a query 2^32 - 1 positions before the first
    key saw it, and one 2^31 past the keys' window saw them all)."""
    q, k, v, _, _, sinks = make_case(6, 40, 1, 2, d, 0, 0, torch.bfloat16, seed=d)
    far = 2**32
    for k_start, q_pos, window in ((far, [1, 2, far + 3, far + 7, far + 39, far + 50], 0),
                                   (0, [0, 5, 17, 39, 2**31 + 10, 2**33], 8),
                                   (5, [2**31 + 4, 2**31 + 5, 20, 30, 39, 3], 2**31)):
        q_pos = torch.tensor(q_pos)
        k_pos = torch.arange(k_start, k_start + 40)
        with amx_mode(amx):
            ours = native.prefill_attention(q, k, v, q_pos, k_start, sinks, d ** -0.5, window)
        ref = dense_reference(q.float(), k.float(), v.float(), q_pos, k_pos, sinks.float(), d ** -0.5,
                              window or None)
        seen = k_pos[None, :] <= q_pos[:, None]
        if window:
            seen &= k_pos[None, :] > q_pos[:, None] - window
        blind = ~seen.any(1)
        assert blind.any() and not blind.all()
        assert torch.equal(ours[blind].float(), torch.zeros_like(ref[blind]))
        torch.testing.assert_close(ours.float(), ref, rtol=2.0 ** -7, atol=4 * 2.0 ** -9 * v.float().abs().max().item())


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])
def test_native_prefill_attention_inputs_at_an_odd_element(d, amx):
    """Contiguous q, k, v that start at an odd bf16 element (2-byte aligned): the same output as aligned copies.
    The pair kernel read a query's and a key's dim pairs through uint32_t pointers, a misaligned access that
    x86 forgives; UBSan reports it (tools/sanitize_check.py runs this test under it)."""
    q, k, v, q_pos, _, sinks = make_case(9, 40, 2, 2, d, 31, 0, torch.bfloat16, seed=d)

    def at_odd_element(t):
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
        return flat.copy_(t.flatten()).view(t.shape)

    odd = [at_odd_element(t) for t in (q, k, v)]
    assert all(t.is_contiguous() and t.data_ptr() % 4 == 2 for t in odd)
    with amx_mode(amx):
        want = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 16)
        got = native.prefill_attention(*odd, q_pos, 0, sinks, d ** -0.5, 16)
    assert torch.equal(got, want)


@needs_kernel
def test_native_prefill_attention_refuses_what_it_cannot_do():
    q, k, v, q_pos, _, sinks = make_case(4, 4, 1, 2, 32, 0, 0)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        native.prefill_attention(q, k, v, q_pos, 0, sinks, 0.2, 0)
    q, k, v, q_pos, _, sinks = make_case(4, 4, 2, 2, 32, 0, 0, torch.bfloat16)
    with pytest.raises(RuntimeError, match="q heads over"):
        native.prefill_attention(q[:, :3].contiguous(), k, v, q_pos, 0, sinks[:3], 0.2, 0)
    with pytest.raises(RuntimeError, match="head dim 0"):
        native.prefill_attention(q[..., :0].contiguous(), k[..., :0].contiguous(), v[..., :0].contiguous(), q_pos,
                                 0, sinks, 0.2, 0)
    assert not native.prefill_attention_supported(torch.float32, 64)
    assert native.prefill_attention_supported(torch.bfloat16, 24)


# ---- in the model: bf16 prefill with the native kernel as close to the fp32 model as with the torch form ---------

F, S = "full_attention", "sliding_attention"
MODEL_CASES = {
    # name: (config overrides, experts layout, block size, prefill chunk, prompt length)
    "gqa5-d16-window6": (dict(layer_types=(F, S, F), hidden_size=64, intermediate_size=32, num_attention_heads=10,
                              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=6, vocab_size=613), "mxfp4", 16, 5, 300),
    "d72-window52": (dict(layer_types=(S, F, S), hidden_size=50, intermediate_size=40, num_attention_heads=6,
                          num_key_value_heads=2, head_dim=72, num_local_experts=3, num_experts_per_tok=3,
                          sliding_window=52, vocab_size=389), "bf16", 4, 64, 230),
}


def prefill_logits(ckpt, cfg, dtype, prompt, block, chunk, native_attention=None):
    """Logits of every prompt position, the prompt prefilled in chunks through the per-layer model."""
    from gigadecode.engine_config import EngineConfig
    from gigadecode.kv.cache import KVCache
    from gigadecode.kv.manager import KVCacheManager
    from gigadecode.model import GptOssModel, SeqChunk
    from gigadecode.weights import load_weights

    model = GptOssModel(cfg, load_weights(ckpt, cfg, dtype), dtype)
    if native_attention is not None:
        model._native_attention = native_attention
    kv = KVCache(cfg, EngineConfig(dtype=str(dtype).removeprefix("torch."), block_size=block),
                 -(-len(prompt) // block) * 4 + 64)
    mgr = KVCacheManager(kv.config, block)
    assert mgr.allocate("r", len(prompt), 0)
    return torch.cat([model.forward([SeqChunk(prompt[s: s + chunk], s, mgr.block_tables("r"), "all")], kv).logits[0]
                      .float() for s in range(0, len(prompt), chunk)])


@needs_kernel
@pytest.mark.parametrize("name", MODEL_CASES)
def test_model_prefill_with_the_native_kernel(tmp_path, name):
    import random

    from gigadecode.checkpoint import make_checkpoint, preset_config
    from gigadecode.config import GptOssConfig

    over, experts, block, chunk, n = MODEL_CASES[name]
    cfg = preset_config("tiny", experts).with_(num_hidden_layers=len(over["layer_types"]), **over)
    ckpt = make_checkpoint(tmp_path / name, cfg=cfg, seed=3, experts=experts)
    cfg = GptOssConfig.from_hf(ckpt)
    errs, errs_torch = [], []
    for i in range(5):
        rnd = random.Random(f"{name}-{i}")
        prompt = [rnd.randrange(3, cfg.vocab_size) for _ in range(n)]
        ref = prefill_logits(ckpt, cfg, torch.float32, prompt, block, chunk)
        ours = prefill_logits(ckpt, cfg, torch.bfloat16, prompt, block, chunk, native_attention=True)
        torch_form = prefill_logits(ckpt, cfg, torch.bfloat16, prompt, block, chunk, native_attention=False)
        span = float(ref.max() - ref.min())
        errs.append(float((ours - ref).abs().max()) / span)
        errs_torch.append(float((torch_form - ref).abs().max()) / span)
    # both bf16 models round the same activations; the native path differs in RoPE (fp32, rounded once into
    # q and the cache, where the torch form rounds each bf16 op) and the attention's sum order, exp and (where
    # the CPU has bf16 GEMMs) the torch form's bf16 products: bf16 noise, which the layers after them amplify
    # alike, so the native model must be as close to the fp32 model as the torch form's. One prompt's error is
    # mostly where that amplification happened to land, not which form ran (over 16 prompts of the gqa5 model
    # on the AVX2 build the native error ran 0.29-5.6x the torch form's, prompt by prompt, with medians 0.154
    # and 0.150 of the logits' span): the median over five, and no prompt far off the torch form's typical error
    med = lambda xs: sorted(xs)[len(xs) // 2]
    assert med(errs) <= 1.25 * med(errs_torch) + 2e-3, (errs, errs_torch)
    assert all(e <= 2 * max(et, med(errs_torch)) + 2e-3 for e, et in zip(errs, errs_torch)), (errs, errs_torch)


@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])        # the bf16 pair kernel (where built) and the fp32-product kernel
def test_native_prefill_attention_keys_before_the_window_are_not_read(d, amx):
    """NaN in the keys and values before every query's window must not reach the output: the kernels lay
    keys out in whole chunks from the first one any query sees, so the chunk holding the window's first key
    also holds keys before it (probability 0, but 0 · NaN = NaN)."""
    T, S, window, q_start = 8, 64, 8, 56              # queries 56..63 see keys 49..63
    q, k, v, q_pos, k_pos, sinks = make_case(T, S, 1, 2, d, q_start, 0, torch.bfloat16, seed=11)
    k[:49] = float("nan")
    v[:49] = float("nan")
    with amx_mode(amx):
        ours = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, window)
    ref = dense_reference(q.float(), k[49:].float(), v[49:].float(), q_pos, k_pos[49:], sinks.float(), d ** -0.5,
                          window)
    assert torch.isfinite(ours).all()
    atol = 4 * 2.0 ** -9 * v[49:].float().abs().max().item()
    torch.testing.assert_close(ours.float(), ref, rtol=2.0 ** -7, atol=atol)


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])        # the bf16 pair kernel (where built) and the fp32-product kernel
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_native_prefill_attention_keeps_a_nan_it_sees(d, amx, where):
    """A NaN in a query, or in a key or value a query sees, makes those rows NaN, as the dense reference's
    softmax does (so the engine fails the request, "logits hold NaN"). The kernels took a row's maximum with
    vmaxps, which drops a NaN, so a row whose visible scores were all NaN read as "no key weighs" and came out
    0: a bf16 prefill whose q projection met a NaN weight returned tokens."""
    T, S, q_start = 6, 40, 34                       # queries 34..39 see keys 0..their own
    q, k, v, q_pos, k_pos, sinks = make_case(T, S, 2, 2, d, q_start, 0, torch.bfloat16, seed=13)
    if where == "q":
        q[:, 3, 0] = float("nan")                   # head 3 (kv head 1) of every query
    elif where == "k":
        k[36, 1, 0] = float("nan")                  # a key queries 36.. see, kv head 1
    else:
        v[36, 1, 0] = float("nan")
    for window in (0, 3):                           # window 3: query 34 and 35 do not see key 36; 39 neither
        with amx_mode(amx):
            ours = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, window)
        ref = dense_reference(q.float(), k.float(), v.float(), q_pos, k_pos, sinks.float(), d ** -0.5,
                              window or None)
        nan = ref.isnan()
        assert nan.any() and nan[:, :2].logical_not().all()                # kv head 0's q heads stay clean
        assert torch.equal(ours.isnan(), nan), (window, ours.isnan().any(-1), nan.any(-1))
        atol = 4 * 2.0 ** -9 * v.float().nan_to_num().abs().max().item()
        torch.testing.assert_close(ours.float()[~nan], ref[~nan], rtol=2.0 ** -7, atol=atol)


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])        # the bf16 pair kernel (where built) and the fp32-product kernel
def test_native_prefill_attention_infinite_sink_is_nan_as_the_twin(d, amx):
    """A sink of +inf: the dense softmax subtracts its maximum (inf - inf) and gives NaN, as the native decode
    attention does; the prefill kernels applied the sink as sigmoid(lse - sink) = 0 and returned rows of 0.
    A -inf sink weighs nothing (the rows are the keys' softmax alone) on both."""
    q, k, v, q_pos, k_pos, sinks = make_case(6, 40, 2, 2, d, 34, 0, torch.bfloat16, seed=17)
    sinks[1], sinks[2] = float("inf"), float("-inf")
    with amx_mode(amx):
        ours = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0)
    ref = native.twins.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0).float()
    nan = ref.isnan()
    assert nan[:, 1].all() and nan.sum() == nan[:, 1].numel()
    assert torch.equal(ours.isnan(), nan)
    torch.testing.assert_close(ours.float()[~nan], ref[~nan], rtol=2.0 ** -7, atol=4 * 2.0 ** -9)
    # rows no key weighs (q head 2's and 3's dim 0 -inf against keys all > 0 there: every score -inf): with
    # the -inf sink of head 2 nothing weighs at all, NaN as the twin (-inf - -inf); head 3's finite sink takes
    # it all, 0. The kernels skipped such rows: 0 for both
    k[:, 1, 0] = k[:, 1, 0].float().abs().to(k.dtype) + 0.25
    q[:, 2:4, 0] = float("-inf")
    with amx_mode(amx):
        ours = native.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0)
    ref = native.twins.prefill_attention(q, k, v, q_pos, 0, sinks, d ** -0.5, 0).float()
    nan = ref.isnan()
    assert nan[:, 2].all() and not nan[:, 3].any() and (ref[:, 3] == 0).all()
    assert torch.equal(ours.isnan(), nan)
    torch.testing.assert_close(ours.float()[~nan], ref[~nan], rtol=2.0 ** -7, atol=4 * 2.0 ** -9)


@needs_kernel
@pytest.mark.parametrize("amx", AMX_MODES)
@pytest.mark.parametrize("d", [64, 24])        # the bf16 pair kernel (where built) and the fp32-product kernel
def test_native_prefill_attention_no_query_sees_a_key_rows_as_the_twin(d, amx):
    """A row no key weighs is 0, or NaN where its q head's sink is not finite, as the twin's softmax gives,
    whether or not another query of the chunk sees a key. When none did (every query before the first key, or
    past the last one by more than its window) the kernels returned all zeros, so the same query came out 0
    alone and NaN beside a query that sees a key."""
    q, k, v, _, _, sinks = make_case(5, 20, 2, 2, d, 0, 0, torch.bfloat16, seed=19)
    sinks[1], sinks[2] = float("-inf"), float("inf")
    for k_start, q_pos, window in ((30, [3, 7, 11, 12, 29], 0),          # all before the first key
                                   (0, [30, 31, 35, 36, 50], 8),         # past the last key (19) by > 8
                                   (30, [3, 7, 11, 12, 30], 0)):         # beside a query that sees key 30
        q_pos = torch.tensor(q_pos)
        with amx_mode(amx):
            ours = native.prefill_attention(q, k, v, q_pos, k_start, sinks, d ** -0.5, window)
        ref = native.twins.prefill_attention(q, k, v, q_pos, k_start, sinks, d ** -0.5, window).float()
        nan = ref.isnan()
        assert nan[:4, 1:3].all() and not nan[:4, [0, 3]].any()
        assert torch.equal(ours.isnan(), nan), (k_start, q_pos)
        torch.testing.assert_close(ours.float()[~nan], ref[~nan], rtol=2.0 ** -7, atol=4 * 2.0 ** -9)
