"""A prefill engine (kv_producer) in its own process, driven over a Pipe by the DI tests.

Commands: ("prefill", prompt_ids) -> kv_transfer_params; ("free_blocks",) -> free block count;
("leases",) -> number of leased requests; ("exit",). Between commands the engine keeps stepping so
notifications and lease expiry are handled, as a server's engine loop does.
"""

from __future__ import annotations

import multiprocessing as mp
import time


def producer_main(conn, model_dir: str, ecfg_kw: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from gigadecode.config import EngineConfig
    from gigadecode.connector.nixl_connector import build_engine
    from gigadecode.sampling import SamplingParams

    ecfg = EngineConfig(**{"kv_role": "kv_producer", **ecfg_kw})
    eng = build_engine(model_dir, ecfg)
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
        eng.step()
    eng.connector.close()


class Producer:
    def __init__(self, model_dir, **ecfg_kw) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, str(model_dir), ecfg_kw), daemon=True)
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
