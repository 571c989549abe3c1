"""The engine's side of disaggregated inference: admitting DI requests, starting KV loads, answering a
prefill's params, and turning the connector's events into request state.

- at the door (`admit`): a producer request (`do_remote_decode`) computes only N-1 tokens
  (`compute_limit`); a consumer request (`do_remote_prefill`) is checked by the connector
  (`validate_remote`) and arrives with `remote_tokens` = N-1 whose KV comes over NIXL;
- after scheduling (`start_loads`, `hand_off`): the scheduler admitted consumers with their blocks
  allocated (their load starts now) and producers with nothing left to compute (their params are answered);
- each step (`poll`): producer blocks the consumer read (or whose lease ended) are freed; a consumer whose
  KV landed intact becomes RUNNING; one whose load failed fails (or, `kv_failure_policy=recompute`, is
  prefilled here from scratch: never decoded from KV that did not arrive intact).
"""

from __future__ import annotations

import logging

from .connector.params import KVParamsError, KVTransferParams
from .request import Request, RequestError, RequestOutput, Status

log = logging.getLogger("gigadecode.engine")


class KVTransfers:
    """DI bookkeeping of one `LLMEngine` (which it holds to reach its scheduler, runner and outputs)."""

    def __init__(self, engine, connector) -> None:
        self.engine, self.connector = engine, connector

    # -- at the door ---------------------------------------------------------------------------------
    def admit(self, req: Request, params: KVTransferParams, lease_margin_s: float = 0.0,
              now: float | None = None) -> None:
        """Set the request's DI fields from its params; RequestError when this engine cannot serve them. `now`:
        the wall clock a lease is judged at (`validate_remote`)."""
        conn, eng = self.connector, self.engine
        if params.do_remote_decode and params.do_remote_prefill:
            raise RequestError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
                               param="kv_transfer_params", code="invalid_kv_transfer_params")
        req.kv_transfer_params = params
        if params.do_remote_decode:
            if conn.role != "kv_producer":
                raise RequestError("do_remote_decode needs a prefill engine (--role prefill)",
                                   param="kv_transfer_params.do_remote_decode",
                                   code="invalid_kv_transfer_params")
            req.compute_limit = conn.prefill_target(len(req.prompt_ids))
        elif params.do_remote_prefill:
            if conn.role != "kv_consumer":
                raise RequestError("do_remote_prefill needs a decode engine (--role decode)",
                                   param="kv_transfer_params.do_remote_prefill",
                                   code="invalid_kv_transfer_params")
            if len(req.prompt_ids) == 1:       # 1-token prompt: nothing was prefilled remotely
                req.kv_transfer_params = None
                return
            try:
                req.remote_tokens = conn.validate_remote(params, req.prompt_ids, len(eng.runner.kv.config.groups),
                                                         lease_margin_s, now)
            except KVParamsError as e:
                if eng.ecfg.kv_failure_policy != "recompute":
                    raise RequestError(str(e), param=e.param, code="invalid_kv_transfer_params") from None
                # Never use KV we cannot vouch for: prefill the prompt actually sent, here.
                req.kv_transfer_params, req.remote_tokens = None, 0
                if req.request_id != "check":
                    eng.stats.recomputed_after_failure += 1
        else:
            req.kv_transfer_params = None

    # -- after scheduling ----------------------------------------------------------------------------
    def start_loads(self, reqs: list[Request], outputs: dict[str, RequestOutput]) -> None:
        """Consumers the scheduler admitted (blocks allocated as if N-1 tokens were computed): post their loads
        (a failure there is that request's; the connector reports most of them through `get_finished`)."""
        tables = self.engine.scheduler.kv_manager.block_tables
        for req in reqs:
            try:
                self.connector.start_load(req.request_id, req.kv_transfer_params, tables(req.request_id))
            except Exception as e:  # noqa: BLE001
                self.engine.fail(req, f"KV transfer failed: {type(e).__name__}: {e}", outputs)

    def hand_off(self, req: Request, outputs: dict[str, RequestOutput]) -> None:
        """Producer: the first N-1 tokens are computed; lease the blocks and answer the signed params."""
        eng = self.engine
        km = eng.scheduler.kv_manager
        tables = km.block_tables(req.request_id) if km.has_request(req.request_id) else \
            [[] for _ in eng.runner.kv.config.groups]
        host = req.kv_transfer_params.remote_host if req.kv_transfer_params is not None else None
        try:
            out = self.connector.request_finished(req.request_id, tables, req.num_computed, advertise_host=host)
            req.kv_transfer_params_out = self.connector.seal(out, req.prompt_ids).to_dict()
        except Exception as e:  # noqa: BLE001 - this request's failure only
            log.exception("answering the KV params of %s failed", req.request_id)
            eng.fail(req, f"KV handoff failed: {type(e).__name__}: {e}", outputs)
            return
        eng.scheduler.finish(req, "length", keep_blocks=True)
        outputs[req.request_id] = RequestOutput(req.request_id, [], True, "length")

    def cancel(self, req: Request) -> None:
        """A consumer that stops waiting for its KV (preempted, aborted, failed): stop its load."""
        if req.status == Status.WAITING_FOR_REMOTE_KV:
            self.connector.cancel(req.request_id)

    # -- each step -------------------------------------------------------------------------------------
    def poll(self, outputs: dict[str, RequestOutput]) -> None:
        eng = self.engine
        sending, done, failed = self.connector.get_finished()
        # in request-id order, never a set's: the ranks of a TP group run this step alike, and the order blocks
        # are freed in is the order they are handed out again (a set of strings iterates in each process's
        # own hash order: the ranks' pools would hold the same requests in different blocks)
        for rid in sorted(sending):            # producer: the consumer read them (or the lease expired)
            eng.scheduler.kv_manager.free(rid)
        for rid in sorted(done):
            req = eng.requests.get(rid)
            if req is not None and req.status == Status.WAITING_FOR_REMOTE_KV:
                req.status = Status.RUNNING
        for rid, err in sorted(failed.items()):
            req = eng.requests.get(rid)
            if req is None or req.finished:
                continue
            if eng.ecfg.kv_failure_policy == "recompute":
                eng.scheduler.requeue(req)
                eng.stats.recomputed_after_failure += 1
            else:
                eng.scheduler.kv_manager.free(rid)
                req.status = Status.RUNNING    # its load is over: nothing to cancel
                eng.fail(req, f"KV transfer failed: {err}", outputs)
        eng.stats.kv_bytes_transferred = self.connector.stats["kv_bytes_transferred"]
        eng.stats.transfer_failures = self.connector.stats["transfer_failures"]
