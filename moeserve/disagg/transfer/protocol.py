"""What a prefill rank and a decode rank agree on: the side channel's messages, the identity both
must share, the keys and token derived from the deployment's secret, and the first-token record
that rides with the KV (a row of the aux buffer).

```
decode rank                                  prefill rank (ROUTER, registered at the bootstrap server)
  route lookup (bootstrap GET /route) ───────>
  Hello(descriptor, page size, dtype, layers, model)  ─>  check both sides match, backend.connect
                                           <─ HelloReply(ok | message naming both values)
  RoomRequest(room, page indices, aux slot)  ─>   the room's sender waits for one per decode TP rank
                                                  prefill runs; each chunk: backend.write(pieces)
                                           <─ RoomDone(room, ok) when every write of the room landed
  RoomAbort(room)                            ─>   the sender fails; writes in flight finish
```
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from moeserve.config import PD_MAX_DRAFTS
from moeserve.core import Req, TokenLogprob
from moeserve.scheduler.channel import ChannelKeys

Address = tuple[str, int]  # a prefill server's bootstrap server (host, port)
LOOKUP_TIMEOUT_S = 5.0  # a route lookup at a bootstrap server; the longest a health check waits


# ---- identity ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankIdentity:
    """What both sides of a pair must agree on, and where a rank sits in its server's layout."""

    page_size: int
    kv_dtype: str
    num_layers: int  # of the KV cache (the model's, and the MTP module's with speculative decoding)
    model: str  # a fingerprint of the model (config and weight files)
    num_drafts: int = 0  # speculative decoding's draft tokens per step (0: off)
    dp_rank: int = 0
    tp_rank: int = 0
    attn_tp_size: int = 1
    attn_dp_size: int = 1

    def mismatches(self, other: RankIdentity) -> list[str]:
        names = ("page_size", "kv_dtype", "num_layers", "model", "num_drafts")
        return [f"{n}: prefill {getattr(self, n)!r} vs decode {getattr(other, n)!r}"
                for n in names if getattr(self, n) != getattr(other, n)]


# ---- messages ------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    decode_id: str
    identity: dict[str, Any]
    descriptor: dict[str, Any]
    kv_slots: int  # the decode rank's KV slots per layer (its layer stride)


class HelloReply(msgspec.Struct, tag="hello_reply"):
    ok: bool
    message: str = ""


class RoomRequest(msgspec.Struct, tag="room"):
    room: int
    decode_id: str
    tp_rank: int
    tp_size: int
    page_indices: list[int]
    aux_index: int


class RoomAbort(msgspec.Struct, tag="room_abort"):
    room: int
    decode_id: str


class RoomDone(msgspec.Struct, tag="room_done"):
    room: int
    ok: bool
    message: str = ""


SideMessage = Hello | HelloReply | RoomRequest | RoomAbort | RoomDone
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SideMessage)


def encode(msg: SideMessage) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes) -> SideMessage | None:
    """The message, or None for bytes that are not one (a peer's garbage must not stop a rank)."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# ---- keys and addresses ------------------------------------------------------------------------
def pd_keys(secret: bytes) -> ChannelKeys:
    """The side channel's CURVE keys: every PD server of a deployment derives the same from the
    secret the operator shares (one file, as for multi-node ranks)."""
    return ChannelKeys.from_secret(hmac.new(secret, b"moeserve-pd", hashlib.sha256).digest())


def bootstrap_token(secret: bytes) -> str:
    """The token prefill ranks present to register at their bootstrap server."""
    return hmac.new(secret, b"moeserve-bootstrap", hashlib.sha256).hexdigest()


def bootstrap_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def address_text(bootstrap: Address) -> str:
    """``host:port`` of a bootstrap server, for messages."""
    return bootstrap_url(*bootstrap).removeprefix("http://")


# ---- the first-token record (a row of the aux buffer) -------------------------------------------
MAX_TOP_LOGPROBS = 20
AUX_DRAFTS = 3 + 2 * MAX_TOP_LOGPROBS  # after: token id, its logprob, how many alternatives, their ids, their logprobs
AUX_WIDTH = AUX_DRAFTS + 1 + PD_MAX_DRAFTS  # then how many drafts, the drafts


def write_aux(aux: torch.Tensor, slot: int, req: Req, drafts: list[int] = ()) -> None:
    """The first token (and its logprobs, when asked) and the draft chain after it into
    ``aux[slot]`` (``aux``: [slots, AUX_WIDTH] float64, exact for ids)."""
    row = torch.full((AUX_WIDTH,), math.nan, dtype=torch.float64)
    row[0] = req.output_ids[0]
    row[2] = 0
    if req.output_logprobs:
        lp = req.output_logprobs[0]
        row[1], row[2] = lp.logprob, len(lp.top)
        for i, (token, value) in enumerate(lp.top[:MAX_TOP_LOGPROBS]):
            row[3 + i], row[3 + MAX_TOP_LOGPROBS + i] = token, value
    row[AUX_DRAFTS] = len(drafts)
    row[AUX_DRAFTS + 1:AUX_DRAFTS + 1 + len(drafts)] = torch.tensor(drafts, dtype=torch.float64)
    aux[slot].copy_(row)


def read_aux(aux: torch.Tensor, slot: int, want_logprobs: bool) -> tuple[int, TokenLogprob | None, list[int]]:
    """The first token, its logprobs (when asked) and the drafts of ``aux[slot]``."""
    row = aux[slot].cpu().tolist()
    token = int(row[0])
    drafts = [int(t) for t in row[AUX_DRAFTS + 1:AUX_DRAFTS + 1 + int(row[AUX_DRAFTS])]]
    if not want_logprobs or math.isnan(row[1]):
        return token, None, drafts
    n = int(row[2])
    top = [(int(row[3 + i]), row[3 + MAX_TOP_LOGPROBS + i]) for i in range(n)]
    return token, TokenLogprob(token, row[1], top), drafts
