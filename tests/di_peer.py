"""A prefill engine (kv_producer) in its own process, driven over a Pipe by the DI tests.

`side_port` among its keyword arguments is where its KV side channel listens. Commands: ("prefill", prompt_ids)
-> kv_transfer_params; ("free_blocks",) -> free block count;
("leases",) -> number of leased requests; ("corrupt", request_id) flips one byte of that request's first
leased block in the producer's KV memory; ("expire", request_id) ends its lease now (its blocks are freed
and can go to the next request: the decode side's params still name them); ("exit",). Between commands
the engine keeps stepping so notifications and lease expiry are handled, as a server's engine loop does.
"""

from __future__ import annotations

import multiprocessing as mp
import time


def producer_main(conn, model_dir: str, ecfg_kw: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from gigadecode.engine_config import EngineConfig
    from gigadecode.engine import build_engine
    from gigadecode.sampling import SamplingParams

    side_port = ecfg_kw.pop("side_port", 0)          # the KV side channel's (0: any), as `serve --kv-port`
    ecfg = EngineConfig(**{"kv_role": "kv_producer", **ecfg_kw})
    eng = build_engine(model_dir, ecfg, side_port=side_port)
    conn.send(("ready", eng.connector.side_port))
    while True:
        if conn.poll(0.005):
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            if cmd == "prefill":
                rid = eng.add_request(args[0], SamplingParams(temperature=0.0, max_tokens=1),
                                      kv_transfer_params={"do_remote_decode": True})
                while not eng.requests[rid].finished:
                    eng.step()
                conn.send(eng.requests[rid].kv_transfer_params_out)
            elif cmd == "free_blocks":
                conn.send(eng.kv_manager.num_free_blocks)
            elif cmd == "leases":
                conn.send(len(eng.connector.leases))
            elif cmd == "corrupt":
                lease = eng.connector.leases[args[0]]
                block = next(b for ids in lease.block_ids for b in ids)
                raw = eng.runner.kv.group_bufs[0][0].view(torch.uint8)      # K of buffer 0
                raw[block].view(-1)[7] ^= 0x5A
                conn.send(block)
            elif cmd == "expire":
                eng.connector.leases[args[0]].expires = 0.0
                eng.step()
                conn.send(eng.kv_manager.num_free_blocks)
        eng.step()
    eng.connector.close()


def consumer_main(conn, model_dir: str, ecfg_kw: dict) -> None:
    """A decode engine (kv_consumer) in its own process: ("load", prompt, params, steps) adds the request and
    steps `steps` times (None: to the end) -> its state (finished, error, output ids)."""
    import torch

    torch.set_num_threads(1)
    from gigadecode.engine_config import EngineConfig
    from gigadecode.engine import build_engine
    from gigadecode.sampling import SamplingParams

    eng = build_engine(model_dir, EngineConfig(**{"kv_role": "kv_consumer", **ecfg_kw}))
    conn.send(("ready", None))
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "load":
            prompt, params, steps = args
            rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                  kv_transfer_params=params)
            n = 0
            while not eng.requests[rid].finished and (steps is None or n < steps):
                eng.step()
                n += 1
            r = eng.requests[rid]
            conn.send((r.finished, r.error, r.output_ids))
    eng.connector.close()


class Producer:
    target = staticmethod(producer_main)

    def __init__(self, model_dir, **ecfg_kw) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=self.target, args=(child, str(model_dir), ecfg_kw), daemon=True)
        self.proc.start()
        tag, self.side_port = self.conn.recv()
        assert tag == "ready"

    def call(self, *cmd, timeout: float = 60.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"producer did not answer {cmd[0]}")
        return self.conn.recv()

    def prefill(self, prompt):
        return self.call("prefill", list(prompt))

    def wait_free(self, expected: int, timeout: float = 10.0) -> int:
        t0 = time.monotonic()
        while True:
            n = self.call("free_blocks")
            if n == expected or time.monotonic() - t0 > timeout:
                return n
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Consumer(Producer):
    target = staticmethod(consumer_main)

    def load(self, prompt, params, steps=None, timeout: float = 60.0):
        return self.call("load", list(prompt), params, steps, timeout=timeout)
