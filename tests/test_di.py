"""Disaggregated inference across a real process boundary: a per-layer prefill engine (its own process)
ships KV over NIXL to a GK decode engine; output equals a single node; every fault ends in a clear
error (or a correct recomputation) with both block pools back where they started."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from gigadecode.engine_config import EngineConfig
from gigadecode.engine import build_engine
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import get_kv_spec, make_kv_cache_config
from gigadecode.checkpoint import make_checkpoint, preset_config
from gigadecode.sampling import SamplingParams

from .di_peer import Consumer, Producer
from gigadecode.connector.params import parse_kv_params, sign

from .helpers import KV_SECRET, random_prompt

BLOCK, NUM_BLOCKS = 4, 400
BASE = dict(kv_dtype="fp8", block_size=BLOCK, num_blocks=NUM_BLOCKS, kv_secret=KV_SECRET)
# tiny: window W = 16. 1, 2, block-1, block, block+1, W-1, W, W+1, N % block == block-1 with N > W, > 3 windows.
LENGTHS = [1, 2, 3, 4, 5, 15, 16, 17, 19, 23, 55, 70]


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def producer(tiny_ckpt):
    p = Producer(tiny_ckpt, **BASE)
    yield p
    p.close()


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    return build_engine(tiny_ckpt, EngineConfig(**BASE))


@pytest.fixture()
def consumer(tiny_ckpt):
    eng = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0, **BASE))
    yield eng
    eng.connector.close()


def run(eng, prompt, params=None, kv=None):
    rid = eng.add_request(prompt, params or greedy(), kv_transfer_params=kv)
    t0 = time.monotonic()
    while not eng.requests[rid].finished:
        eng.step()
        assert time.monotonic() - t0 < 60
    return eng.requests[rid]


def test_di_equals_single_node(producer, single, consumer):
    for n in LENGTHS:
        prompt = random_prompt(n, 1024, seed=900 + n)
        want = run(single, prompt).output_ids
        params = producer.prefill(prompt)
        assert params["num_computed_tokens"] == n - 1
        got = run(consumer, prompt, kv=params)
        assert got.error is None, got.error
        assert got.output_ids == want, n
    assert consumer.stats.kv_bytes_transferred > 0
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1      # freed on the READ notifications


def test_di_with_speculative_decoding_equals_single_node(tiny_ckpt, producer, single):
    """A decode server that drafts: its first step after the KV lands is a verify step (the last prompt token
    and drafts as rows over the loaded blocks); its tokens equal one node's plain ones, drafts accepted and
    rejected (a stand-in proposer: the plain tokens, a third of them changed)."""
    import random
    from gigadecode.speculative import SpeculativeConfig
    spec = SpeculativeConfig(num_speculative_tokens=3)
    consumer = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0,
                                                    speculative=spec, **BASE))
    try:
        for n in (1, 5, 17, 23):
            prompt = random_prompt(n, 1024, seed=950 + n)
            want = run(single, prompt).output_ids

            class Told:
                rng = random.Random(n)

                def propose(self, req, limit):
                    o = len(req.output_ids)
                    return [t if self.rng.random() > 0.33 else (t + 1) % 1024 for t in want[o: o + min(3, limit)]]
            consumer.scheduler.proposer = Told()
            got = run(consumer, prompt, kv=producer.prefill(prompt))
            assert got.error is None, got.error
            assert got.output_ids == want, n
        assert consumer.stats.spec_accepted_tokens > 0
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1
    finally:
        consumer.connector.close()


F, S = "full_attention", "sliding_attention"
# configs unlike tiny: head dims 2 to 258, 1 to 8 q heads a kv head, hidden sizes that are not multiples of 64 (50:
# not even of 8, bf16 experts), 1 to 17 experts with top-1 to top-all, vocabularies of 7 to 997, windows of 1 to
# longer than the context, one to five layers, all sliding, all full or mixed; FP8 KV in blocks of 2 and 64
# (the whole prompt in one block), model-dtype KV in blocks of 3 and 5, bf16 KV under fp32 compute
UNUSUAL = {
    "fp8-block2": (dict(layer_types=(S, F, S), num_hidden_layers=3, hidden_size=96, intermediate_size=64,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=12, num_local_experts=5,
                        num_experts_per_tok=2, sliding_window=5, vocab_size=997), "mxfp4", "fp8", 2),
    "auto-block3": (dict(layer_types=(F, S), num_hidden_layers=2, hidden_size=160, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_local_experts=3,
                         num_experts_per_tok=3, sliding_window=4, vocab_size=613), "mxfp4", "auto", 3),
    # window 1 over blocks of 4: with N - 1 a multiple of 4 no sliding block is live, and with every layer
    # sliding nothing at all is sent (no lease)
    "all-sliding-window1": (dict(layer_types=(S, S, S), num_hidden_layers=3, hidden_size=64, intermediate_size=32,
                                 num_attention_heads=8, num_key_value_heads=1, head_dim=2, num_local_experts=2,
                                 num_experts_per_tok=1, sliding_window=1, vocab_size=389), "mxfp4", "bf16", 4),
    "one-full-layer-block64": (dict(layer_types=(F,), num_hidden_layers=1, hidden_size=32, intermediate_size=32,
                                    num_attention_heads=2, num_key_value_heads=2, head_dim=258, num_local_experts=1,
                                    num_experts_per_tok=1, sliding_window=3, vocab_size=7), "mxfp4", "fp8", 64),
    "window-past-context": (dict(layer_types=(F, S, S, F, S), num_hidden_layers=5, hidden_size=50,
                                 intermediate_size=18, num_attention_heads=3, num_key_value_heads=3, head_dim=6,
                                 num_local_experts=17, num_experts_per_tok=17, sliding_window=200, vocab_size=1001),
                            "bf16", "auto", 5),
}
# fp32: |logprob| apart at most this (model-dtype KV: the same numbers; bf16 / FP8 KV can round a value the other
# way, the producer's prefill of N-1 rows and the single node's of N differing in the last bits)
LOGPROB_TOL = {"auto": 1e-4, "bf16": 2e-2, "fp8": 2e-2}


@pytest.mark.parametrize("name", UNUSUAL)
def test_di_equals_single_node_on_unusual_configs(tmp_path, name):
    """fp32: the decode engine's tokens from transferred KV equal a single node's, and their logprobs, for
    prompts across blocks and the window, on layouts tiny does not have (head dim, GQA ratio, block size, layer
    mix, window, experts, vocabulary)."""
    over, experts, kv_dtype, block = UNUSUAL[name]
    ckpt = make_checkpoint(tmp_path / "c", cfg=preset_config("tiny", experts).with_(**over), seed=5, experts=experts)
    base = dict(kv_dtype=kv_dtype, block_size=block, num_blocks=120, kv_secret=KV_SECRET)
    single = build_engine(ckpt, EngineConfig(**base))
    consumer = build_engine(ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=10.0, **base))
    producer = Producer(ckpt, **base)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    try:
        for n in (1, 2, block + 1, 5, 6, 9, 11, 31):
            prompt = random_prompt(n, over["vocab_size"], seed=70 + n)
            params = producer.prefill(prompt)
            assert params["num_computed_tokens"] == n - 1
            got, want = run(consumer, prompt, sp, kv=params), run(single, prompt, sp)
            assert got.error is None, got.error
            assert got.output_ids == want.output_ids, n
            worst = max(abs(a.logprob - b.logprob) for a, b in zip(got.output_logprobs, want.output_logprobs))
            assert worst < LOGPROB_TOL[kv_dtype], (n, worst)
        assert consumer.stats.kv_bytes_transferred > 0
        assert consumer.kv_manager.num_free_blocks == 119
        assert producer.wait_free(119) == 119
    finally:
        producer.close()
        consumer.connector.close()


def test_a_priority_decode_server_admits_remote_requests_by_priority(tiny_ckpt, producer, single):
    """--scheduling-policy priority on a decode server: requests whose KV comes from the prefill wait in one
    queue and are admitted (their blocks, then the load) by (priority, arrival), one at a time here; their
    tokens are one node's and every block goes back on both sides."""
    consumer = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0,
                                                    scheduling_policy="priority", max_num_seqs=1, **BASE))
    try:
        prompts = [random_prompt(n, 1024, seed=970 + n) for n in (5, 17, 9, 23)]
        want = [run(single, p).output_ids for p in prompts]
        ids = [consumer.add_request(p, greedy(), kv_transfer_params=producer.prefill(p), priority=q)
               for p, q in zip(prompts, (2, 0, 3, 1))]
        first: list[str] = []
        t0 = time.monotonic()
        while consumer.has_unfinished():
            first += [o.request_id for o in consumer.step() if o.new_token_ids and o.request_id not in first]
            assert time.monotonic() - t0 < 60
        assert first == [ids[1], ids[3], ids[0], ids[2]]
        assert [consumer.requests[r].error for r in ids] == [None] * 4
        assert [consumer.requests[r].output_ids for r in ids] == want
        assert consumer.stats.kv_bytes_transferred > 0
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        consumer.connector.close()
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1


def test_sliding_list_is_clipped_to_the_window(producer, consumer):
    prompt = random_prompt(70, 1024, seed=1)
    params = producer.prefill(prompt)
    sliding, full = params["remote_block_ids"]
    assert len(sliding) <= -(-(16 - 1) // BLOCK) + 1 and params["remote_first_block"][0] > 0
    assert len(full) == -(-69 // BLOCK) and params["remote_first_block"][1] == 0
    assert producer.call("leases") == 1                # held for the decode side
    assert run(consumer, prompt, kv=params).error is None
    _pools_back(consumer, producer)


def test_n_minus_1_rule_keeps_the_boundary_block():
    """With the skip computed at N, a prompt with N % block == block-1 (N > W) loses exactly one block the
    decode side needs; computing at N-1 (both nodes) keeps it."""
    cfg = preset_config("tiny")                                       # W = 16
    kvc = make_kv_cache_config(get_kv_spec(cfg, BLOCK, 1), 64)
    for n in (19, 23, 27, 20, 21, 22):
        buggy, fixed, decode = (KVCacheManager(kvc, BLOCK) for _ in range(3))
        buggy.allocate("r", n, 0)
        buggy.remove_skipped_blocks("r", n)                           # prefill computed all N
        fixed.allocate("r", n - 1, 0)
        fixed.remove_skipped_blocks("r", n - 1)                       # the N-1 rule
        decode.allocate("r", n, n - 1)                                # decode: N-1 computed, room for token N-1
        need = {j for j, b in enumerate(decode.block_tables("r")[0][: (n - 2) // BLOCK + 1]) if b}
        have_buggy = {j for j, b in enumerate(buggy.block_tables("r")[0]) if b}
        have_fixed = {j for j, b in enumerate(fixed.block_tables("r")[0]) if b}
        lost = need - have_buggy
        assert len(lost) == (1 if n % BLOCK == BLOCK - 1 else 0), (n, lost)
        assert need <= have_fixed


def _pools_back(consumer, producer):
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    assert producer.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1


def resign(params: dict, **changes) -> dict:
    """`params` changed and signed again with the deployment key: what a producer holding the key (buggy or
    compromised) could send; a client without the key cannot."""
    return sign(parse_kv_params({**params, **changes}), KV_SECRET.encode()).to_dict()


def test_forged_params_are_refused_before_any_read(producer, consumer):
    from gigadecode.engine import RequestError
    prompt = random_prompt(30, 1024, seed=2)
    params = producer.prefill(prompt)
    forged = dict(params, remote_block_ids=[ids[:-1] + [1] for ids in params["remote_block_ids"]])
    for bad, what in ((forged, "signature"), (dict(params, kv_crc32=params["kv_crc32"] ^ 1), "signature"),
                      ({k: v for k, v in params.items() if k != "signature"}, "not signed"),
                      (dict(params, remote_host="10.0.0.1"), "signature")):
        with pytest.raises(RequestError, match=what) as e:
            consumer.add_request(prompt, greedy(), kv_transfer_params=bad)
        assert e.value.param.startswith("kv_transfer_params")
    assert not consumer.connector.agent.remotes and consumer.stats.kv_bytes_transferred == 0   # read nothing
    ok = run(consumer, prompt, kv=params)
    assert ok.error is None
    _pools_back(consumer, producer)


def test_prompt_swap_and_replay_are_refused(producer, consumer, single):
    from gigadecode.engine import RequestError
    a, b = random_prompt(26, 1024, seed=21), random_prompt(26, 1024, seed=22)
    params = producer.prefill(a)
    with pytest.raises(RequestError, match="another prompt"):
        consumer.add_request(b, greedy(), kv_transfer_params=params)      # B with A's KV: never decoded
    assert run(consumer, a, kv=params).output_ids == run(single, a).output_ids
    with pytest.raises(RequestError, match="used already"):
        consumer.add_request(a, greedy(), kv_transfer_params=params)      # the same KV read twice
    _pools_back(consumer, producer)


def test_signed_bad_block_id_fails_only_that_request(producer, consumer):
    prompt = random_prompt(30, 1024, seed=2)
    params = producer.prefill(prompt)
    bad = resign(params, remote_block_ids=[ids[:-1] + [NUM_BLOCKS + 5] for ids in params["remote_block_ids"]],
                 remote_request_id=params["remote_request_id"] + "-x")
    r = run(consumer, prompt, kv=bad)
    assert r.finish_reason == "error" and "out of range" in r.error and not r.output_ids
    assert run(consumer, prompt, kv=params).error is None                # the untouched lease is read properly
    _pools_back(consumer, producer)
    assert consumer.stats.transfer_failures >= 1


def test_bytes_flipped_in_producer_memory_are_caught(producer, consumer):
    prompt = random_prompt(30, 1024, seed=3)
    params = producer.prefill(prompt)
    producer.call("corrupt", params["remote_request_id"])               # after the prefill, before the READ
    r = run(consumer, prompt, kv=params)
    assert r.finish_reason == "error" and "CRC32" in r.error and not r.output_ids
    _pools_back(consumer, producer)                   # the READ did complete: the producer was notified


def test_blocks_reused_after_lease_before_read_are_refused(tiny_ckpt, consumer, single):
    small = Producer(tiny_ckpt, **{**BASE, "num_blocks": 20})     # a small pool: freed blocks are reused soon
    try:
        a, b = random_prompt(29, 1024, seed=31), random_prompt(29, 1024, seed=32)
        pa = small.prefill(a)
        small.call("expire", pa["remote_request_id"])   # the lease ends (producer clock), A's blocks are free
        pb = small.prefill(b)                           # ... and B's prefill takes some of them
        assert set(sum(pa["remote_block_ids"], [])) & set(sum(pb["remote_block_ids"], []))
        r = run(consumer, a, kv=pa)                      # A's params still look live to the decode side
        assert r.finish_reason == "error" and "CRC32" in r.error and not r.output_ids
        assert run(consumer, b, kv=pb).output_ids == run(single, b).output_ids   # B's own KV is intact
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert small.wait_free(19) == 19
    finally:
        small.close()


def test_other_layout_is_refused_at_the_door(tiny_ckpt, consumer):
    from gigadecode.engine import RequestError
    other = Producer(tiny_ckpt, kv_dtype="fp8", block_size=8, num_blocks=NUM_BLOCKS, kv_secret=KV_SECRET)
    try:
        prompt = random_prompt(20, 1024, seed=4)
        params = other.prefill(prompt)
        with pytest.raises(RequestError, match="KV layout"):
            consumer.add_request(prompt, greedy(), kv_transfer_params=params)
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        other.close()


def test_fp8_scales_are_part_of_the_kv_layout(tiny_ckpt, single):
    """FP8 KV bytes are x / scale: a decode engine whose k_scale / v_scale differ from the prefill's would read
    every key and value rescaled and decode wrong tokens without an error (it did). Such params are refused at
    the door and the handshake names the field; with the same scales (not 1) DI is the single node's."""
    from gigadecode.connector.base import HandshakeError, check_compatible
    from gigadecode.engine import RequestError
    scaled = dict(BASE, k_scale=4.0, v_scale=0.25)
    prod = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_producer", **scaled))
    plain = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", **BASE))
    same = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", **scaled))
    try:
        prompt = random_prompt(30, 1024, seed=81)
        params = run(prod, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out
        with pytest.raises(RequestError, match="FP8 scales") as e:
            plain.add_request(prompt, greedy(), kv_transfer_params=params)
        assert e.value.param == "kv_transfer_params.kv_layout_id" and not plain.requests
        with pytest.raises(HandshakeError, match="k_scale: local 1.0, remote 4.0"):
            check_compatible(plain.connector.agent.layout(), prod.connector.agent.layout())
        want = run(build_engine(tiny_ckpt, EngineConfig(**scaled)), prompt).output_ids
        assert want != run(single, prompt).output_ids             # the scales change the numbers here
        got = run(same, prompt, kv=params)
        assert got.error is None and got.output_ids == want
        assert plain.kv_manager.num_free_blocks == same.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        for eng in (prod, plain, same):
            eng.connector.close()



@pytest.mark.parametrize("tensor", ["down_proj", "gate_up_proj", "gate_up_proj_bias"])
def test_a_fine_tune_of_the_experts_alone_changes_the_fingerprint(tmp_path, tensor):
    """A fine-tune that changed only the experts (one expert's matrix, or the expert biases) is another model:
    its fingerprint differs, in the MXFP4 form (the last expert's first group changed) and in the bf16-expert
    form (a value of the last expert's first column); the two forms of each still agree."""
    from safetensors.torch import load_file, save_file
    from gigadecode.checkpoint import copy_trained
    from gigadecode.safetensors_files import weights_fingerprint
    base = {form: copy_trained(tmp_path / form, "demo", **({} if form == "mxfp4" else {"experts": "bf16"}))
            for form in ("mxfp4", "bf16")}
    prints = {form: weights_fingerprint(d) for form, d in base.items()}
    assert prints["mxfp4"] == prints["bf16"]
    layer = f"model.layers.{preset_config('demo').num_hidden_layers - 1}.mlp.experts."
    for form, d in base.items():
        f = next(f for f in d.glob("*.safetensors") if any(k.startswith(layer) for k in load_file(f)))
        t = load_file(f)
        if tensor.endswith("_bias"):
            t[layer + tensor][-1, 0] += 1.0
        elif form == "mxfp4":
            t[layer + tensor + "_blocks"][-1, 0, 0, 0] ^= 0x11            # two values of the last expert's group
        else:
            t[layer + tensor][-1, 0, 0] += 0.5
        save_file(t, str(f), metadata={"format": "pt"})
        assert weights_fingerprint(d) != prints[form], (form, tensor)


def test_other_weights_of_the_same_config_are_refused(tiny_ckpt, tmp_path):
    """Two checkpoints of one config.json but other weights (two fine-tunes; a prefill fleet left on the old
    one during an upgrade) computed KV the other could not use, and paired without a word: the weights'
    fingerprint is part of the KV layout, so such params are refused at the door and the handshake names
    model_id. The same values written otherwise (MXFP4 or bf16 experts) still pair."""
    from gigadecode.checkpoint import copy_trained
    from gigadecode.connector.base import HandshakeError, check_compatible
    from gigadecode.engine import RequestError
    from gigadecode.safetensors_files import weights_fingerprint
    other = make_checkpoint(tmp_path / "other", "tiny", seed=1)
    assert (other / "config.json").read_text() == (tiny_ckpt / "config.json").read_text()
    assert weights_fingerprint(other) != weights_fingerprint(tiny_ckpt)
    assert weights_fingerprint(copy_trained(tmp_path / "d4", "demo")) == \
        weights_fingerprint(copy_trained(tmp_path / "d16", "demo", experts="bf16"))
    prod = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE))
    cons = build_engine(other, EngineConfig(kv_role="kv_consumer", **BASE))
    try:
        prompt = random_prompt(30, 1024, seed=82)
        params = run(prod, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out
        with pytest.raises(RequestError, match=r"another model \(config or weights\)") as e:
            cons.add_request(prompt, greedy(), kv_transfer_params=params)
        assert e.value.param == "kv_transfer_params.kv_layout_id" and not cons.requests
        with pytest.raises(HandshakeError, match="model_id: local"):
            check_compatible(cons.connector.agent.layout(), prod.connector.agent.layout())
        assert run(cons, prompt).error is None                   # it serves its own requests
    finally:
        for eng in (prod, cons):
            eng.connector.close()


def test_the_same_values_written_otherwise_pair(tmp_path):
    """One model's values written with MXFP4 experts (quantization_config in its config.json) and with dense
    bf16 experts (none) are one model: a prefill on the one and a decode on the other pair and decode. The
    config's storage keys (quantization_config, torch_dtype) are not its identity; the weights' values are."""
    from gigadecode.checkpoint import copy_trained
    from gigadecode.connector.base import check_compatible
    mxfp4, dense = copy_trained(tmp_path / "d4", "demo"), copy_trained(tmp_path / "d16", "demo", experts="bf16")
    assert (mxfp4 / "config.json").read_text() != (dense / "config.json").read_text()
    prod = build_engine(mxfp4, EngineConfig(kv_role="kv_producer", **BASE))
    cons = build_engine(dense, EngineConfig(kv_role="kv_consumer", **BASE))
    try:
        check_compatible(cons.connector.agent.layout(), prod.connector.agent.layout())
        prompt = random_prompt(30, 100, seed=83)
        params = run(prod, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out
        r = run(cons, prompt, greedy(4), kv=params)
        assert r.error is None and len(r.output_ids) == 4
        assert cons.connector.stats["kv_bytes_transferred"] > 0
    finally:
        for eng in (prod, cons):
            eng.connector.close()


def test_a_load_given_up_tells_the_producer_to_free(producer, consumer, single):
    """A decode request aborted while its READ is posted frees the prefill's blocks at once: the consumer
    tells the producer it gave the KV up, not only when a READ lands (a read that carries no notification,
    as a TP group's ranks post, or one cut off mid-flight, used to leave them leased until the lease ran out)."""
    warm = random_prompt(20, 1024, seed=60)                # the handshake, so the next READ posts at once
    assert run(consumer, warm, kv=producer.prefill(warm)).error is None
    _pools_back(consumer, producer)
    consumer.connector.notify_on_read = False             # the READ itself will not tell the producer
    prompt = random_prompt(40, 1024, seed=61)
    rid = consumer.add_request(prompt, greedy(), kv_transfer_params=producer.prefill(prompt))
    t0 = time.monotonic()
    while not (rid in consumer.connector.loads and consumer.connector.loads[rid].posted):
        consumer.step()
        assert time.monotonic() - t0 < 10
    assert producer.call("leases") == 1
    assert consumer.abort(rid)
    assert producer.wait_free(NUM_BLOCKS - 1, timeout=5.0) == NUM_BLOCKS - 1     # the lease is 30 s
    assert producer.call("leases") == 0 and consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    consumer.connector.notify_on_read = True
    assert run(consumer, prompt, kv=producer.prefill(prompt)).output_ids == run(single, prompt).output_ids



def test_a_give_up_notice_that_cannot_be_sent_is_left_to_the_lease(producer, consumer, single, monkeypatch):
    """Telling the producer to free a given-up load is best effort: when the notification cannot be sent, the
    abort still succeeds and frees the consumer's blocks, the producer keeps its lease until it runs out, and
    the next request is served as before."""
    warm = random_prompt(20, 1024, seed=62)
    assert run(consumer, warm, kv=producer.prefill(warm)).error is None
    _pools_back(consumer, producer)
    consumer.connector.notify_on_read = False
    prompt = random_prompt(40, 1024, seed=63)
    kv = producer.prefill(prompt)
    rid = consumer.add_request(prompt, greedy(), kv_transfer_params=kv)
    t0 = time.monotonic()
    while not (rid in consumer.connector.loads and consumer.connector.loads[rid].posted):
        consumer.step()
        assert time.monotonic() - t0 < 10

    def peer_gone(*args, **kwargs):
        raise RuntimeError("the producer's agent is gone")

    monkeypatch.setattr(consumer.connector.agent, "send_notif", peer_gone)
    assert consumer.abort(rid)
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    assert producer.call("leases") == 1                                   # never told: still leased
    assert producer.call("expire", kv["remote_request_id"]) == NUM_BLOCKS - 1   # the lease running out frees it
    monkeypatch.undo()
    consumer.connector.notify_on_read = True
    assert run(consumer, prompt, kv=producer.prefill(prompt)).output_ids == run(single, prompt).output_ids

@pytest.mark.parametrize("how", ["abort-in-handshake", "preempt-in-handshake", "abort-just-posted"])
def test_a_load_given_up_before_any_read_landed_tells_the_producer_to_free(tiny_ckpt, single, how):
    """A decode request given up while the handshake with a new prefill engine still runs (nothing posted, so
    no READ to cancel), or right after its first READ to it was posted (the agents not connected yet): the
    producer is told to free the blocks (once paired), not left holding them to the end of its 30 s lease
    (the message once waited for a READ to carry it). Preempted, the request is computed here instead."""
    prod = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE))
    cons = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=5.0, **BASE))
    try:
        prompt = random_prompt(26, 1024, seed=83)
        params = run(prod, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out
        rid = cons.add_request(prompt, greedy(), kv_transfer_params=params)
        cons.step()                                     # admitted; the first handshake with prod is running
        assert not cons.connector.loads[rid].posted and prod.num_leases() == 1
        t0 = time.monotonic()
        while how.endswith("posted") and not cons.connector.loads[rid].posted:
            cons.step()                                 # (the producer is not stepped: its READ is not served)
            assert time.monotonic() - t0 < 5
        if how.startswith("abort"):
            assert cons.abort(rid)
        else:
            cons.scheduler.preempt(cons.requests[rid])
        t0 = time.monotonic()
        while prod.num_leases() or cons.has_unfinished():
            cons.step()
            prod.step()
            time.sleep(0.01)
            assert time.monotonic() - t0 < 10, "the producer still holds the lease"
        assert prod.kv_manager.num_free_blocks == cons.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        if how.startswith("preempt"):
            assert cons.requests[rid].output_ids == run(single, prompt).output_ids
        assert run(cons, prompt, kv=run(prod, prompt, greedy(1), kv={"do_remote_decode": True}
                                        ).kv_transfer_params_out).output_ids == run(single, prompt).output_ids
    finally:
        prod.connector.close()
        cons.connector.close()


def test_lease_expired_before_read(tiny_ckpt, consumer):
    from gigadecode.engine import RequestError
    short = Producer(tiny_ckpt, **{**BASE, "kv_lease_s": 0.3})
    try:
        prompt = random_prompt(25, 1024, seed=5)
        params = short.prefill(prompt)
        assert short.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1      # lease expired: producer freed
        with pytest.raises(RequestError, match="lease"):
            consumer.add_request(prompt, greedy(), kv_transfer_params=params)
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        short.close()


def test_a_lease_is_judged_at_the_clock_given(producer, consumer):
    """`now` (what a parallel engine's ranks pass: rank 0's clock as it sent the step, so a TP group's ranks
    cannot split on a lease running out between their clocks) is the time a lease is judged at, through
    `add_request` to the connector: the same live params are refused at a clock past their lease."""
    from gigadecode.connector.params import parse_kv_params
    from gigadecode.engine import RequestError
    prompt = random_prompt(25, 1024, seed=6)
    params = producer.prefill(prompt)
    expires = parse_kv_params(params).lease_expires
    with pytest.raises(RequestError, match="lease"):
        consumer.add_request(prompt, greedy(), kv_transfer_params=params, now=expires + 1.0)
    assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1 and not consumer.requests
    assert consumer.connector.validate_remote(parse_kv_params(params), prompt, 2, now=expires - 1.0) == len(prompt) - 1
    assert producer.call("expire", parse_kv_params(params).remote_request_id) == NUM_BLOCKS - 1   # never read


def test_handshake_needs_the_key(producer):
    import urllib.error
    import urllib.request

    from gigadecode.connector.params import AUTH_HEADER, handshake_token
    from gigadecode.connector.side_channel import fetch_handshake
    url = f"http://127.0.0.1:{producer.side_port}/kv/handshake"
    for headers in ({}, {AUTH_HEADER: handshake_token(b"another-key-0123456789")},
                    {AUTH_HEADER: handshake_token(KV_SECRET.encode(), now=time.time() - 3600)}):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
        assert e.value.code == 403
    info = fetch_handshake("127.0.0.1", producer.side_port, KV_SECRET.encode())
    assert info["layout"]["block_size"] == BLOCK


def test_stalled_prefill_times_out(tiny_ckpt, consumer, single):
    stalled = Producer(tiny_ckpt, **{**BASE, "kv_lease_s": 4.0})
    try:
        prompt = random_prompt(40, 1024, seed=6)
        params = stalled.prefill(prompt)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            r = run(consumer, prompt, kv=params)
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        assert r.finish_reason == "error" and "timed out" in r.error
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert stalled.wait_free(NUM_BLOCKS - 1, timeout=10) == NUM_BLOCKS - 1   # via lease expiry
        # the consumer keeps serving
        assert run(consumer, prompt).output_ids == run(single, prompt).output_ids
    finally:
        stalled.close()


def test_hanging_handshake_stalls_only_its_request(producer, consumer, single):
    """A prefill side channel that accepts the connection and never answers: the handshake runs off the step
    loop (the engine keeps stepping at its normal pace), the request fails after the time-out, and for the
    back-off the next request to that producer fails at once instead of waiting again."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)                                       # the kernel accepts; nobody ever answers
    try:
        prompt = random_prompt(30, 1024, seed=41)
        params = producer.prefill(prompt)
        stuck = resign(params, remote_engine_id="hung-prefill", remote_port=hung.getsockname()[1])
        rid = consumer.add_request(prompt, greedy(), kv_transfer_params=stuck)
        local = random_prompt(10, 1024, seed=42)
        lid = consumer.add_request(local, greedy(24))
        worst, t_start = 0.0, time.monotonic()
        while not (consumer.requests[rid].finished and consumer.requests[lid].finished):
            t = time.monotonic()
            consumer.step()
            worst = max(worst, time.monotonic() - t)
            assert t - t_start < 30
        assert consumer.requests[lid].output_ids == run(single, local, greedy(24)).output_ids
        assert worst < 1.0, worst                         # the 3 s handshake never ran on the step loop
        r = consumer.requests[rid]
        assert r.finish_reason == "error" and "timed out" in r.error and not r.output_ids
        again = resign(params, remote_engine_id="hung-prefill", remote_port=hung.getsockname()[1],
                       remote_request_id=params["remote_request_id"] + "-again")
        t = time.monotonic()
        r2 = run(consumer, prompt, kv=again)
        assert r2.finish_reason == "error" and "not retried" in r2.error and time.monotonic() - t < 1.0
        assert run(consumer, prompt, kv=params).error is None      # the real producer is unaffected
        _pools_back(consumer, producer)
    finally:
        hung.close()


def test_producer_killed_mid_read(tiny_ckpt, consumer, single):
    doomed = Producer(tiny_ckpt, **BASE)
    try:
        warm = random_prompt(12, 1024, seed=51)
        assert run(consumer, warm, kv=doomed.prefill(warm)).error is None       # paired (handshake done)
        prompts = [random_prompt(40, 1024, seed=52 + i) for i in range(3)]
        params = [doomed.prefill(p) for p in prompts]
        rids = [consumer.add_request(p, greedy(), kv_transfer_params=kv) for p, kv in zip(prompts, params)]
        consumer.step()                                      # posts the READs (polled from the next step on)
        in_flight = [rid for rid in rids if rid in consumer.connector.loads]
        os.kill(doomed.proc.pid, signal.SIGKILL)             # before any of them is known to have landed
        assert in_flight == rids
        t0 = time.monotonic()
        while any(not consumer.requests[rid].finished for rid in rids):
            consumer.step()
            assert time.monotonic() - t0 < 30
        for rid, p in zip(rids, prompts):
            r = consumer.requests[rid]
            if r.error is not None:                          # the READ died with the producer
                assert r.finish_reason == "error" and not r.output_ids, rid
            else:                                            # the bytes landed before the kill (CRC checked)
                assert r.output_ids == run(single, p).output_ids
        assert consumer.kv_manager.num_free_blocks == NUM_BLOCKS - 1
        assert run(consumer, prompts[0]).output_ids == run(single, prompts[0]).output_ids    # still serving
    finally:
        doomed.close()


def test_decode_killed_with_reads_in_flight(tiny_ckpt, single):
    """The producer frees the blocks on lease expiry when the decode engine dies before its READ lands, and a
    new decode engine (a restarted server) pairs with it and reads."""
    prod = Producer(tiny_ckpt, **{**BASE, "kv_lease_s": 2.0})
    cons = Consumer(tiny_ckpt, **BASE)
    try:
        warm = random_prompt(12, 1024, seed=61)
        assert cons.load(warm, prod.prefill(warm))[1] is None                  # paired
        assert prod.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1
        prompt = random_prompt(40, 1024, seed=62)
        params = prod.prefill(prompt)
        assert prod.call("free_blocks") < NUM_BLOCKS - 1                       # leased
        os.kill(prod.proc.pid, signal.SIGSTOP)
        finished, _, _ = cons.load(prompt, params, steps=2)                    # the READ is posted ...
        assert not finished
        cons.proc.kill()                                                       # ... and the decode engine dies
        cons.proc.join(5)
        os.kill(prod.proc.pid, signal.SIGCONT)
        assert prod.wait_free(NUM_BLOCKS - 1, timeout=15) == NUM_BLOCKS - 1    # lease expiry frees them
        again = random_prompt(20, 1024, seed=63)
        params = prod.prefill(again)
        assert params["num_computed_tokens"] == 19                             # and the producer keeps serving
        restarted = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", **BASE))
        try:
            assert run(restarted, again, kv=params).output_ids == run(single, again).output_ids
            assert prod.wait_free(NUM_BLOCKS - 1) == NUM_BLOCKS - 1            # its pool is whole again
        finally:
            restarted.connector.close()
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed(tiny_ckpt, single, policy):
    eng = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0,
                                               kv_failure_policy=policy, **BASE))
    dead = Producer(tiny_ckpt, **BASE)
    try:
        prompt = random_prompt(33, 1024, seed=7)
        params = dead.prefill(prompt)
        dead.proc.kill()
        dead.proc.join(5)
        r = run(eng, prompt, kv=params)
        if policy == "fail":
            assert r.finish_reason == "error" and r.error and not r.output_ids
        else:
            assert r.error is None and r.output_ids == run(single, prompt).output_ids
            assert eng.stats.recomputed_after_failure == 1
        assert eng.kv_manager.num_free_blocks == NUM_BLOCKS - 1
    finally:
        dead.close()
        eng.connector.close()


def test_bad_params_are_refused(consumer):
    from gigadecode.engine import RequestError
    for kv, what in (({"do_remote_prefill": True}, "not signed"),
                     ({"do_remote_prefill": True, "remote_first_block": ["a", "b"]}, r"remote_first_block\.0"),
                     ({"do_remote_prefill": True, "remote_ranks": "x"}, "remote_ranks"),
                     ({"do_remote_prefill": True, "kv_crc32": "x"}, "kv_crc32"),
                     ({"do_remote_prefill": True, "remote_block_ids": [[-1]]}, r"remote_block_ids\.0\.0"),
                     ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
                     ({"do_remote_prefill": True, "bogus": 1}, "bogus"),
                     ({"do_remote_decode": True}, "prefill engine")):
        with pytest.raises(RequestError, match=what):
            consumer.add_request([5, 6, 7], greedy(), kv_transfer_params=kv)
    assert not consumer.requests and not consumer.waiting


def test_wildcard_host_binds_the_side_channel_everywhere(tiny_ckpt):
    """`--host 0.0.0.0`: the side channel listens on every interface too, and answers advertise a reachable
    name (the machine's by default, `advertise_host` when given, or the per-request host the API layer sets
    from the address the client reached it on) instead of 127.0.0.1."""
    from gigadecode.engine import build_engine as build
    eng = build(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE), host="0.0.0.0")
    try:
        assert eng.connector.side.httpd.server_address[0] == "0.0.0.0"
        prompt = random_prompt(9, 1024, seed=71)
        assert run(eng, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out[
            "remote_host"] == socket.gethostname()
        reached = run(eng, prompt, greedy(1), kv={"do_remote_decode": True, "remote_host": "10.9.8.7"})
        assert reached.kv_transfer_params_out["remote_host"] == "10.9.8.7"
    finally:
        eng.connector.close()
    eng = build(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE), host="0.0.0.0",
                advertise_host="prefill-0.internal")
    try:
        assert run(eng, random_prompt(9, 1024, seed=72), greedy(1),
                   kv={"do_remote_decode": True}).kv_transfer_params_out["remote_host"] == "prefill-0.internal"
    finally:
        eng.connector.close()


def test_an_ipv6_host_serves_the_side_channel(tiny_ckpt, single):
    """`--host ::1`: the prefill's side channel listens on IPv6 (an IPv4 socket cannot bind it: the prefill
    server died at start with a gaierror traceback) and a decode engine reaches it there (the address bracketed
    in its URL); a side-channel port already taken is an error naming the address (the CLI's one-line kind)."""
    prod = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE), host="::1")
    cons = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=5.0, **BASE))
    try:
        assert prod.connector.side.httpd.server_address[0] == "::1"
        prompt = random_prompt(21, 1024, seed=91)
        params = run(prod, prompt, greedy(1), kv={"do_remote_decode": True}).kv_transfer_params_out
        assert params["remote_host"] == "::1"
        got = run(cons, prompt, kv=params)
        assert got.error is None and got.output_ids == run(single, prompt).output_ids
        with pytest.raises(ValueError, match=rf"KV side channel cannot listen on ::1:{prod.connector.side_port}"):
            build_engine(tiny_ckpt, EngineConfig(kv_role="kv_producer", **BASE), host="::1",
                         side_port=prod.connector.side_port)
    finally:
        prod.connector.close()
        cons.connector.close()


def test_roles_refuse_to_start_without_a_secret(tiny_ckpt):
    from gigadecode.engine import build_engine as build
    for role in ("kv_producer", "kv_consumer"):
        with pytest.raises(ValueError, match="GIGADECODE_KV_SECRET"):
            build(tiny_ckpt, EngineConfig(kv_role=role, **{**BASE, "kv_secret": None}))


def test_readme_recipe_runs_as_written(tiny_ckpt):
    # the README's "Disaggregated inference by hand" block, executed as it stands (both engines in this
    # process, NIXL over loopback): its imports exist and the decode engine generates from the shipped KV
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "kv_producer" in b]
    prompt = random_prompt(21, 1024, seed=4)
    ns = {"DIR": str(tiny_ckpt), "prompt_ids": prompt}
    exec(compile(code, "README.md", "exec"), ns)
    req = ns["decode"].requests[ns["rid"]]
    assert req.error is None and req.finish_reason in ("length", "stop") and len(req.output_ids) >= 1  # KV read
    for eng in (ns["prefill"], ns["decode"]):
        eng.connector.close()
    single = build_engine(tiny_ckpt, EngineConfig(kv_dtype="fp8"))
    want = single.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].output_ids
    assert req.output_ids[:4] == want[:4]               # bf16: near-ties may part the two later (README)


_FREE_ORDER = """
import json, sys
from types import SimpleNamespace
from gigadecode.checkpoint import preset_config
from gigadecode.kv.manager import KVCacheManager
from gigadecode.kv.spec import get_kv_spec, make_kv_cache_config
from gigadecode.kv_transfers import KVTransfers
km = KVCacheManager(make_kv_cache_config(get_kv_spec(preset_config("tiny"), 4, 1), 200), 4)
rids = [f"cmpl-{i:x}{'ab' * i}" for i in range(24)]
for r in rids:
    km.allocate(r, 9, 0)
class Connector:
    stats = {"kv_bytes_transferred": 0, "transfer_failures": 0}
    def get_finished(self):
        return set(rids), set(), {}
eng = SimpleNamespace(scheduler=SimpleNamespace(kv_manager=km), requests={}, stats=SimpleNamespace())
KVTransfers(eng, Connector()).poll({})
print(json.dumps(list(km.pool._free)))
"""


def test_leases_end_in_the_same_block_order_in_every_process():
    """The ranks of a TP prefill group free the same ended leases in one step; the order they free them in
    is the order the blocks are handed out again, so it must not depend on the process. It was a set's
    iteration order (string hashes differ per process): after leases ended together, rank 1 held other tokens
    in the blocks rank 0's answer named, and every later transfer failed its CRC check."""
    import json
    import subprocess
    import sys
    orders = [json.loads(subprocess.run([sys.executable, "-c", _FREE_ORDER], capture_output=True, text=True,
                                        check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
              for seed in ("1", "2", "3")]
    assert orders[0] == orders[1] == orders[2]


def test_di_decode_under_an_engine_seed_equals_single_node(tiny_ckpt, producer):
    """--seed on the decode server: an unseeded sampled request draws its seed there, as a single node of that
    --seed does in the same arrival order; the prefill server (no --seed here) samples nothing the answer keeps
    (it computes N-1 tokens), so the two servers need not agree on seeds. A request's own seed: as a single node."""
    sp = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=41, max_tokens=10, ignore_eos=True)]
    single = build_engine(tiny_ckpt, EngineConfig(seed=7, **BASE))
    consumer = build_engine(tiny_ckpt, EngineConfig(kv_role="kv_consumer", kv_transfer_timeout_s=3.0, seed=7, **BASE))
    try:
        for n, params in ((9, sp[0]), (17, sp[1]), (23, sp[0])):
            prompt = random_prompt(n, 1024, seed=990 + n)
            want = run(single, prompt, params).output_ids
            got = run(consumer, prompt, params, kv=producer.prefill(prompt))
            assert got.error is None and got.output_ids == want, n
    finally:
        consumer.connector.close()
